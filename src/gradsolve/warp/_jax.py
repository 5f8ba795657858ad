"""Host functions that launch Warp kernels, called from inside JAX programs.

The one module that uses Warp's JAX interop (`wp.jax_callable`, marked experimental
by Warp). `call(fn, results, *args)` has `jax.pure_callback`'s contract: `fn` takes
NumPy arrays and returns a tuple of NumPy arrays with the shapes and dtypes that
`results` lists (`jax.ShapeDtypeStruct`s); XLA treats the call as pure, and it
works under `jit`, inside a `jax.custom_vjp`, and under `vmap` (one call per batch
element).

On the CPU the call goes through XLA's FFI: `fn` reads XLA's input buffers in place
(Warp arrays wrapping their pointers, seen as NumPy views) and its results are
copied into XLA's output buffers -- or, for a host function that takes `out=` (NumPy
views of those buffers, `writes_into`), written there by `fn` itself, once: the
in-kernel adjoint's stored states live in XLA's buffer only, not also in a host
array they are copied from. `jax.pure_callback` costs ~110 us more per call
and a `device_put` of every result: the Lorenz gradient through it took 0.5-5 ms
longer, n = 8 to 8192 (benchmarks/kernel_adjoint.py, column "ka via pure_callback").
Elsewhere (a GPU, where `fn` copies to and from the device itself) it is
`jax.pure_callback`: Warp's FFI would hand `fn` device buffers, which the host
functions here do not take.
"""

import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from . import _runtime


_FUNCTIONS: dict = {}  # key -> (host function, argument shapes), see `call`


def call(fn, results, *args, name: str, bridge: str | None = None):
    """`fn(*args)` as NumPy arrays, its results as JAX arrays of the `results` types.

    Args:
        fn: host function; returns one array per entry of `results`.
        results: sequence of `jax.ShapeDtypeStruct`.
        args: JAX arrays (no bools: pass them as integers).
        name: what `fn` computes; calls with the same name and argument shapes must
            compute the same function. A hash of both is the call's key in the traced
            program, so a trace is the same in every process (the Calibrator's
            checkpoint fingerprint hashes the traced loss).
        bridge: `"ffi"` or `"callback"`; default: `default_bridge()`.
    """
    results = tuple(results)
    bridge = bridge or default_bridge()
    if bridge == "callback":
        return jax.pure_callback(fn, results, *args, vmap_method="sequential")
    if bridge != "ffi":
        raise ValueError(f"bridge must be 'ffi' or 'callback', got {bridge!r}")
    # The key: what fn computes and on which shapes (one traced program may hold the
    # same kernels at two ensemble sizes; each compiled call must find its own shapes).
    signature = [(np.shape(a), np.dtype(a.dtype).name) for a in args] + \
        [(tuple(r.shape), np.dtype(r.dtype).name) for r in results]
    key = _key(f"{name}|{signature}")
    _FUNCTIONS[key] = fn, [np.shape(a) for a in args], [tuple(r.shape) for r in results]
    # Warp arrays have at least one axis: scalars travel as one-element arrays.
    args = [jnp.reshape(a, (1,)) if np.ndim(a) == 0 else a for a in args]
    target = _target(tuple((np.ndim(a), np.dtype(a.dtype).name) for a in args),
                     tuple((len(r.shape), np.dtype(r.dtype).name) for r in results))
    out = target(key, *args,
                 output_dims={f"r{k}": r.shape or (1,) for k, r in enumerate(results)})
    return tuple(jnp.reshape(o, r.shape) for o, r in zip(out, results))


_KEYED: dict = {}  # key -> the text it was made from, to catch a collision


def _key(text: str) -> int:
    """A call key from `text`: 31 bits of its SHA-256, so it fits the int32 that JAX
    makes of a Python int without `jax_enable_x64` (60 bits overflowed there). The same
    text gives the same key in every process; two texts meeting on one key (about one
    chance in 10^7 for a hundred distinct calls) raise instead of calling the wrong
    function."""
    key = int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) & 0x7FFFFFFF
    if _KEYED.setdefault(key, text) != text:
        raise RuntimeError(f"two host calls share the key {key}: {_KEYED[key]!r} and "
                           f"{text!r}; rename one")
    return key


def default_bridge() -> str:
    """`"ffi"` when Warp and JAX both run on the CPU, else `"callback"` (JAX on a GPU
    hands an FFI call device buffers, whatever Warp's device)."""
    both_cpu = _runtime.device() == "cpu" and jax.default_backend() == "cpu"
    return "ffi" if both_cpu else "callback"


def writes_into(fn):
    """Mark the host function `fn(*args, out=None)` as one that, given `out` (one
    writable NumPy array per result, in XLA's output buffers on the FFI bridge), writes
    its results there and returns them; without `out` (the callback bridge) it
    returns new arrays."""
    fn.writes_into = True
    return fn


def _run(key, args, outs):
    """The body of every FFI target: run the host function on views of XLA's buffers
    and copy its results into XLA's output buffers (or have it write them there,
    `writes_into`)."""
    fn, shapes, result_shapes = _FUNCTIONS[key]
    inputs = [a.numpy().reshape(shape) for a, shape in zip(args, shapes)]
    try:
        if getattr(fn, "writes_into", False):
            fn(*inputs, out=[o.numpy().reshape(shape) for o, shape in
                             zip(outs, result_shapes, strict=True)])
            return
        values = fn(*inputs)
    except Exception:
        raise  # Warp returns it to XLA as the call's error
    except BaseException as err:
        # A Ctrl-C here would escape the ctypes callback, be printed and dropped, and
        # XLA would take the unwritten outputs as the result: an Exception reaches JAX
        # as an error naming the KeyboardInterrupt (the Calibrator saves on it).
        raise RuntimeError(f"{type(err).__name__} in a host callback") from err
    for out, value in zip(outs, values, strict=True):
        if out.size:
            out.numpy().reshape(np.shape(value))[...] = value


@functools.cache
def _target(args: tuple, results: tuple):
    """A `wp.jax_callable` for arguments and results of these (ndim, dtype)s: a Python
    function whose parameters carry the Warp array annotations jax_callable reads."""
    wp = _runtime.warp()
    element = {"float64": wp.float64, "float32": wp.float32, "int32": wp.int32,
               "int64": wp.int64}

    def annotation(ndim, dtype):
        if dtype not in element:
            raise TypeError(f"no Warp array type for dtype {dtype}")
        return wp.array(dtype=element[dtype], ndim=max(ndim, 1))

    names = [f"a{k}" for k in range(len(args))]
    outs = [f"r{k}" for k in range(len(results))]
    text = (f"def target(key, {', '.join(names + outs)}):\n"
            f"    _run(key, ({''.join(x + ', ' for x in names)}), "
            f"({''.join(x + ', ' for x in outs)}))\n")
    scope = {"_run": _run, "__name__": __name__}
    exec(text, scope)  # noqa: S102 - parameter names for jax_callable to read
    target = scope["target"]
    target.__annotations__ = {"key": int,
                              **{x: annotation(*a) for x, a in zip(names, args)},
                              **{x: annotation(*r) for x, r in zip(outs, results)}}
    return wp.jax_callable(target, num_outputs=len(results),
                           graph_mode=wp.JaxCallableGraphMode.NONE, vmap_method="sequential")
