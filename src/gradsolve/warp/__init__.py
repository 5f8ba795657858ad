"""The Warp side of gradsolve: fused kernels that run whole trajectories per thread.

Layers, each importing only those above it in this list (and the recorder core,
control, methods, mesh, problem, status, config, fields._systems):

- `_runtime`: the one (lazy) `import warp`, the device, generated-module loading,
  the CPU thread pool.
- `_translate`: JAX right-hand side -> Warp `field`/`jac` source (a primitive table).
- `_registry`: hand-written fused forms, `register_field`, `fused_form`.
- `_steps`: step bodies generated from a method's tableau and the control rules.
- `_kernels`: kernel skeletons (lanes, header) around those step bodies.
- `_launch`: one launch driver over kernel signatures described as data.
- `_fused`: the fused solve and recorder (`run_fused`).
- `_adjoint`: the in-kernel adjoint's forward-over-a-mesh and backward kernels.

Nothing here imports the router, the engines or the user-facing entry points; nothing
in `gradsolve.fields` imports this package. docs/internals.md has the details.

Public: `register_field` (also `gs.register_field`), a hand-written fused form for a
field; everything else is private.
"""

from ._registry import register_field as register_field
