"""tests/gpu: the GPU side of the Warp engines, in a pytest of its own.

`make test` runs it where `nvidia-smi` finds a GPU, as
`GRADSOLVE_TEST_GPU=1 pytest tests/gpu`: tests/conftest.py then leaves JAX unpinned and
sets `GRADSOLVE_WARP_DEVICE=cuda` (Warp must find the GPU), and collects this folder
alone. Warp runs on CUDA; JAX runs where its install puts it (the GPU with a
`jax[cuda12]` install, else the CPU): either way the kernels are reached through
`jax.pure_callback`. The last line of the run says which.
"""


def pytest_terminal_summary(terminalreporter):
    import jax

    from gradsolve.warp import _jax, _runtime
    try:
        where = f"Warp on {_runtime.device()}, bridge {_jax.default_bridge()!r}"
    except ValueError as err:  # GRADSOLVE_WARP_DEVICE=cuda and no GPU seen
        where = f"no Warp device: {err}"
    terminalreporter.write_line(f"tests/gpu ran with {where}, JAX on {jax.default_backend()}")
