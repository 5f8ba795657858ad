"""`gs.value_and_grad`: record once, then exact gradients of a loss of the ensemble.

Reverse mode is `jax.grad` through the padded replay. Forward mode is `jax.jvp`:
trajectories are independent, so one pass that perturbs component j of EVERY
trajectory's parameters at once returns each trajectory's own derivative; the number
of passes is the parameter count of one trajectory (plus that of `Shared`
parameters), not n times it. Both return the derivative on the recorded mesh.
"""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import layout
from .config import DEFAULT_MAX_STEPS
from .engines import recorder_of
from .mesh import Mesh
from .record import record_rows
from .problem import _is_shared, as_problem
from .router import plan
from .status import TrajectoryFailure, summarize


WRT = ("params", "y0", "both")
MODES = ("reverse", "forward")
ON_FAILURE = ("raise", "mask")


def _split(wrt, params, y0):
    """The differentiated input `x` and how to rebuild `(params, y0)` from it."""
    if wrt == "params":
        return params, lambda x: (x, y0)
    if wrt == "y0":
        return y0, lambda x: (params, x)
    return (params, y0), lambda x: x


def _per_trajectory(wrt, params, y0):
    """Same structure as `x`: True for leaves with an ensemble axis."""
    def mark(tree):
        return jax.tree.map(lambda s: jax.tree.map(lambda _: False, s) if _is_shared(s)
                            else True, tree, is_leaf=_is_shared)
    if wrt == "params":
        return mark(params)
    if wrt == "y0":
        return True
    return (mark(params), True)


def _forward(ys_of, loss_of, x, per_traj):
    """Value and gradient by forward mode, one batched `jvp` over a basis of one
    trajectory's inputs (and of the shared inputs)."""
    diff, static = eqx.partition(x, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(diff)
    mask = jax.tree.leaves(jax.tree.map(lambda a, m: m if eqx.is_inexact_array(a) else None,
                                        x, per_traj, is_leaf=lambda v: v is None))
    sizes = [math.prod(a.shape[1:]) if m else a.size for a, m in zip(leaves, mask)]
    total = sum(sizes)
    offsets = np.cumsum([0] + sizes)
    tangents = []
    for a, m, size, off in zip(leaves, mask, sizes, offsets):
        block = jnp.zeros((total, size), a.dtype).at[off:off + size].set(jnp.eye(size, dtype=a.dtype))
        if m:  # the same basis vector in every trajectory
            block = jnp.broadcast_to(block[:, None, :], (total, a.shape[0], size))
        tangents.append(block.reshape((total,) + a.shape))

    def ys_fn(d):
        return ys_of(eqx.combine(d, static))

    def push(t):
        return jax.jvp(ys_fn, (diff,), (jax.tree.unflatten(treedef, t),))

    ys, dys = jax.vmap(push, out_axes=(None, 0))(tangents)
    value, (ct, direct) = loss_of(ys, x)
    grads = []
    for a, m, size, off in zip(leaves, mask, sizes, offsets):
        contrib = dys[off:off + size] * ct[None]                 # (size, n, ...)
        if m:
            g = contrib.reshape(size, ct.shape[0], -1).sum(-1).T   # (n, size)
        else:
            g = contrib.reshape(size, -1).sum(-1)                  # (size,)
        grads.append(g.reshape(a.shape).astype(a.dtype))
    grads = jax.tree.unflatten(treedef, grads)
    if direct is not None:
        grads = jax.tree.map(lambda g, d: g if d is None else g + d, grads, direct,
                             is_leaf=lambda v: v is None)
    return value, grads


def _value_and_grad(ys_function, loss, wrt, mode, mesh, params, y0, arr=None):
    return layout.replicated(_value_and_grad_of(ys_function, loss, wrt, mode, mesh, params,
                                                y0, arr), arr)


def _value_and_grad_of(ys_function, loss, wrt, mode, mesh, params, y0, arr):
    x, merge = _split(wrt, params, y0)

    def ys_of(x):
        if arr is None:
            return ys_function(mesh, *merge(x))
        return layout.run(ys_function, arr, mesh, *merge(x))

    if mode == "reverse":
        def objective(x):
            p, _ = merge(x)
            return loss(ys_of(x), p)
        return eqx.filter_value_and_grad(objective)(x)

    def loss_of(ys, x):
        def direct_part(x):
            return loss(ys, merge(x)[0])
        value, ct = jax.value_and_grad(lambda ys: loss(ys, merge(x)[0]))(ys)
        direct = eqx.filter_grad(direct_part)(x) if wrt != "y0" else None
        return value, (ct, direct)
    return _forward(ys_of, loss_of, x, _per_trajectory(wrt, params, y0))


class ValueAndGrad:
    """A recorded gradient function; see `gs.value_and_grad`.

    Attributes:
        mesh: the recorded `gs.Mesh` (None for the Diffrax baseline).
        engine: name of the engine that computes the gradient.
        passed_over: engines the router did not choose, with reasons.
    """

    def __init__(self, prob, loss, *, wrt, mode, engine, passed, cfg, mesh, on_failure):
        self.problem = prob
        self.loss = loss
        self.wrt, self.mode, self.on_failure = wrt, mode, on_failure
        self.config = cfg
        self._engine = engine
        self.engine = engine.name
        self.passed_over = tuple(passed.items())
        ys_function = self._engine.ys_function(prob, cfg, mode)
        self._call = eqx.filter_jit(functools.partial(_value_and_grad, ys_function, loss,
                                                      wrt, mode))
        if mesh is not None:
            self.mesh = self._check_mesh(mesh)
        else:
            self.mesh = record_rows(self._engine, prob, cfg) \
                if self._engine.serves("record") else None
        self._check_status()
        self._arrange()

    def _arrange(self):
        """Where each trajectory is replayed: devices, buckets, chunks (`layout/`); None
        for an engine that does not split (it runs the whole ensemble itself)."""
        self.arrangement = None if not self._engine.splits else layout.for_replay(
            self.mesh, self.problem.n, self.config, self.problem.d,
            self.problem.y0.dtype.itemsize)

    def _check_mesh(self, mesh):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a gs.Mesh, got {type(mesh).__name__}")
        if recorder_of(self._engine) is None:
            raise ValueError(f"engine {self.engine!r} does not replay a mesh")
        if mesh.n != self.problem.n:
            raise ValueError(f"mesh has {mesh.n} trajectories, the problem {self.problem.n}")
        if mesh.method != self.config.method:
            raise ValueError(f"mesh was recorded with {mesh.method!r}, the gradient uses "
                             f"{self.config.method!r}")
        return mesh

    def _check_status(self):
        if self.mesh is not None and not self.mesh.ok and self.on_failure == "raise":
            raise TrajectoryFailure(
                summarize(self.mesh.status) + " (pass on_failure='mask' to differentiate "
                "the others)")

    def __call__(self, params=None, y0=None):
        """`(value, grads)` at `params`, `y0` (default: the problem's own); grads has
        the structure of params, of y0, or is the pair `(g_params, g_y0)`."""
        params = self.problem.params if params is None else params
        y0 = self.problem.y0 if y0 is None else y0
        return self._call(self.mesh, params, y0, self.arrangement)

    def rerecord(self, params=None, y0=None) -> "ValueAndGrad":
        """Record a fresh mesh at `params`, `y0` (in place; returns self). It is padded
        as the Calibrator pads a refreshed mesh (`Mesh.widened`): to the current width
        if it fits, else to the next of a few fixed widths, so the compiled gradient is
        reused unless the mesh outgrows its width."""
        if self._engine.serves("record"):
            mesh = record_rows(self._engine, self.problem, self.config, params=params, y0=y0)
            self.mesh = mesh.widened(self.mesh.columns if self.mesh is not None else 0)
            self._check_status()
            self._arrange()
        return self


def value_and_grad(prob, loss, *, wrt="params", mode="reverse", rtol=1e-6, atol=1e-9,
                   method=None, engine=None, ts=None, remat=None, mesh=None, fused=None,
                   dt0=None, max_steps=DEFAULT_MAX_STEPS, on_failure="raise",
                   interpolate=None, devices=None, buckets=None, memory_budget=None):
    """Record once; return a function computing `loss` and its exact gradient.

    The gradient is that of the replay on the recorded mesh, `d Psi(theta;
    sg[R(theta_0)]) / d theta`: exact for that mesh, the same convention as Diffrax's
    `RecursiveCheckpointAdjoint` on the same mesh.

    Args:
        prob: an ensemble problem.
        loss: `loss(ys, params) -> scalar`, `ys` shaped `(n, d)` or `(n, len(ts), d)`.
        wrt: `"params"`, `"y0"` or `"both"`.
        mode: `"reverse"` (`jax.grad`) or `"forward"` (`jax.jvp`, as many passes as
            one trajectory has inputs).
        rtol, atol, method, dt0, max_steps: the record's settings.
        engine: None (router), an engine name (`"general_replay"`, `"diffrax"` for
            the baseline) or an engine object such as `gs.engines.Diffrax(checkpoints=)`.
        ts: output times (see `interpolate`).
        remat: recompute steps in the backward sweep (default on for non-stiff
            methods unless the field carries a network of 64 numbers or more per
            trajectory, `gs.Shared` or its own;
            for stiff ones from 16 variables on: `config.default_remat`).
        interpolate: how `ts` is served. None (default): from the method's
            continuous extension where it has one of order >= 3 (Tsit5, Rodas5P) and
            the engine serves it (the JAX replay, Diffrax, the Warp kernels for Tsit5;
            no evaluation of the field beyond the mesh's steps), else by one extra
            integrated step per output (Rosenbrock23, Vern7). True asks for the
            extension (any method with one), False for the integrated step
            (docs/gradients.md compares their accuracy).
        mesh: differentiate on this mesh instead of recording one.
        fused: None lets the router choose; True asks for a Warp engine
            (`fused_replay`), with an error saying why if none can serve; False keeps
            the request off every Warp engine (the JAX recorder and replay).
        on_failure: `"raise"` if a trajectory failed to record, or `"mask"` to
            differentiate the others. The loss then sees exact zeros in place of a
            failed trajectory's states (at every `ts`): they carry no gradient to
            anything, its own inputs or `Shared` ones, and add `loss`'s value at
            zero states (nothing, for a sum of squared states). Which trajectories
            failed is in `vg.mesh.status`.
        devices: the devices to split the ensemble over (None: every device of the
            default backend from `layout.MIN_ROWS_PER_DEVICE` trajectories per device,
            else one; a number, a sequence of `jax.Device` or a 1-D
            `jax.sharding.Mesh`): each records and replays its own rows, `gs.Shared`
            gradients are summed over them (docs/scale.md).
        buckets: replay the trajectories in this many groups by recorded step count,
            each at its own width (None: `layout.arrange`'s rule; 1: none).
        memory_budget: bytes each device may use (`"2GB"`; None: half the memory
            available); a larger ensemble is recorded and replayed in chunks.

    Returns:
        A `gs.ValueAndGrad`: call it as `value, grads = vg(params=..., y0=...)`.

    Examples:
        >>> import jax.numpy as jnp, gradsolve as gs
        >>> prob = gs.problems.lorenz(n=8)
        >>> loss = lambda ys, p: jnp.sum(ys[:, 0] ** 2)
        >>> vg = gs.value_and_grad(prob, loss, wrt="params")
        >>> value, grads = vg()
        >>> vg.engine, vg.mesh.recorder, grads["rho"].shape
        ('fused_replay', 'fused', (8,))
    """
    prob = as_problem(prob)
    if not callable(loss):
        raise TypeError(f"loss must be callable as loss(ys, params), got {type(loss).__name__}")
    for name, value, allowed in (("wrt", wrt, WRT), ("mode", mode, MODES),
                                 ("on_failure", on_failure, ON_FAILURE)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if mesh is not None and method is None:
        method = getattr(mesh, "method", None)
    chosen, passed, cfg = plan(prob, gradient=True, engine=engine, method=method,
                               fused=fused, mode=mode, rtol=rtol,
                               atol=atol, dt0=dt0, max_steps=max_steps, ts=ts, remat=remat,
                               interpolate=interpolate, devices=devices, buckets=buckets,
                               memory_budget=memory_budget)
    return ValueAndGrad(prob, loss, wrt=wrt, mode=mode, engine=chosen, passed=passed,
                        cfg=cfg, mesh=mesh, on_failure=on_failure)
