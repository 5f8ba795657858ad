"""JAX's persistent compilation cache, switched on for gradsolve's users.

A fit compiles its update once per process. With the cache, a second run of the same
script in a new process compiles little: on the galactic-halo recipe (B = 8, K = 4) the
first `fit(steps=1)` took 8.5 s in a fresh process and 3.0 s in the next one
(benchmarks/results/fit_vs_diffrax.json, section "compile"; docs/benchmarks.md,
"Compile times").

The cache lives in `$XDG_CACHE_HOME/gradsolve/jax` (default `~/.cache/gradsolve/jax`);
it is not bounded (JAX's size limit needs the `filelock` package) and may be deleted
at any time. Opt out with the
environment variable `GRADSOLVE_COMPILATION_CACHE=0`, or choose the directory with
`GRADSOLVE_COMPILATION_CACHE=/some/dir`. A cache directory set through JAX itself
(`jax_compilation_cache_dir`, `JAX_COMPILATION_CACHE_DIR`) is left as it is.
"""

import os
import pathlib

import jax


ENV = "GRADSOLVE_COMPILATION_CACHE"
# Small compiles are cached too: a fit makes dozens of 0.1-0.5 s ones (eager ops,
# records), which together cost as much as its update.
MIN_COMPILE_SECONDS = 0.1


def default_directory() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "gradsolve" / "jax"


def enable() -> str | None:
    """Point JAX's persistent cache at gradsolve's directory (see the module
    docstring); returns the directory in use, or None when switched off."""

    setting = os.environ.get(ENV, "").strip()
    if setting.lower() in ("0", "off", "false", "no"):
        return None
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    directory = pathlib.Path(setting).expanduser() if setting else default_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache rather than fail
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    return str(directory)
