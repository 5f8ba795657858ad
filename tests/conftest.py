"""Tests run in float64 on the CPU, with strict dtype promotion off (the library's
own steps cast coefficients to the state dtype).

`tests/float32/` holds the tests of the way most JAX users run: `jax_enable_x64` off,
float32 throughout. x64 is one switch per process, so `make test` runs that folder in a
second pytest with `GRADSOLVE_TEST_X64=0`; the float64 run leaves it out.

JAX and Warp are both pinned to the CPU (`JAX_PLATFORMS`, `GRADSOLVE_WARP_DEVICE`): the
router's table and the JAX-Warp bridge differ on a GPU, and the suite checks the CPU
ones on every machine. `tests/gpu/` checks the GPU side: `GRADSOLVE_TEST_GPU=1` leaves
both unpinned (Warp then must find a GPU) and collects that folder only; `make test`
runs it where `nvidia-smi` finds a GPU, other runs leave it out and say so.

`GRADSOLVE_TEST_EMITTERS=legacy` (make test's float64 and float32 runs) compiles on
XLA's legacy CPU emitters and leaves out the tests marked `exact_across_shapes`, which
`make test` runs in a third pytest on the default emitters (see below).
"""

import os

GPU = os.environ.get("GRADSOLVE_TEST_GPU", "0") == "1"
EMITTERS = os.environ.get("GRADSOLVE_TEST_EMITTERS", "default")
if EMITTERS not in ("default", "legacy"):
    raise ValueError(f"GRADSOLVE_TEST_EMITTERS must be 'default' or 'legacy', "
                     f"got {EMITTERS!r}")
if GPU:
    os.environ.setdefault("GRADSOLVE_WARP_DEVICE", "cuda")
else:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("GRADSOLVE_WARP_DEVICE", "cpu")
    # The suite is bound by compiles (tiny ensembles, many programs): on the CPU it
    # compiles at optimization level 0, XLA's backend (LLVM's codegen) and Warp's
    # generated modules. Measured on a fresh cache: XLA, test_kernel_adjoint, _stiff,
    # _replay and _grad 242 -> 197 CPU s; Warp, a HIRES fused solve and a Lorenz
    # in-kernel adjoint 6.9 -> 5.2 s. Warp's results are the same bit for bit (no
    # fast-math, no contraction at any level); XLA's differ in last bits (LLVM fuses
    # multiplies and adds otherwise: a Lorenz record's outputs by 1.1e-12 relative, a
    # last bit amplified by the step control), far inside every test's bound.
    # GRADSOLVE_TEST_OPT=default runs the suite at the libraries' defaults; the
    # benchmarks always do, and check their results against Diffrax.
    if os.environ.get("GRADSOLVE_TEST_OPT", "0") != "default":
        os.environ["XLA_FLAGS"] = " ".join(filter(None, (
            os.environ.get("XLA_FLAGS"), "--xla_backend_optimization_level=0")))
        os.environ.setdefault("GRADSOLVE_WARP_OPT_LEVEL", "0")
    # `make test` runs most of the suite (GRADSOLVE_TEST_EMITTERS=legacy) on XLA's
    # older CPU code generator, which compiles in about half the time of its default
    # fusion emitters: a Lorenz Calibrator's update 1.17 -> 0.59 s, test_replay.py's
    # programs 17.6 -> 7.6 s; a fresh clone's .ci/run, setup included, took 6 min 31 s
    # (user CPU 11.1 min) against 10 min 38 s (18.4 min) the same hour. Its arithmetic
    # differs in last bits between programs of different shapes (one slot against
    # eight, one device against four, outputs at ts against the end state: 1e-16 to
    # 2e-14 relative, measured on 2026-12-07), where the default emitters give the same
    # bits and the library promises them. So the tests marked `exact_across_shapes`,
    # which compare such programs bit for bit, are left out of a legacy run and run
    # in a pytest of their own on the default emitters (make test's third run).
    if EMITTERS == "legacy":
        os.environ["XLA_FLAGS"] = " ".join(filter(None, (
            os.environ.get("XLA_FLAGS"), "--xla_cpu_use_fusion_emitters=false")))

import jax  # noqa: E402
import pytest  # noqa: E402

X64 = os.environ.get("GRADSOLVE_TEST_X64", "1") != "0"
jax.config.update("jax_enable_x64", X64)

collect_ignore = ["float32"] if X64 else []
if GPU:  # the GPU run: tests/gpu alone (the rest expects the CPU pins)
    collect_ignore.append("float32")
    collect_ignore_glob = ["test_*.py"]
else:
    collect_ignore.append("gpu")


# A worker's memory maps past which the end of a test releases the compiled programs.
MAPS_CLEAR = 32768


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """JAX's caches keep every compiled program of the process, and each XLA CPU
    program holds its own memory mappings: a worker passed Linux's limit of 65530 maps
    (`vm.max_map_count`) late in the suite, and XLA crashed there ("LLVM compilation
    error: Cannot allocate memory", then a segfault or an abort, in a compile or a
    persistent-cache read or write; 4 runs of 2026-12-04..06). Measured: one process
    running test_calibrator, test_workflow and test_kernel_adjoint reached 33,000 maps
    in 2 minutes; in a fresh clone's suite a worker reached 45,000 within test_petab.py
    alone; 15 small Calibrator fits add ~320 maps each, released only by
    `jax.clear_caches()` (5934 -> 1085). So a test that ends with the worker above
    MAPS_CLEAR maps releases them (where /proc tells; elsewhere never: the crash was
    seen on Linux only). Not after every test or file: the programs later tests share
    are kept. Fresh clones on 2026-12-06, one machine: clearing after every file 11 min
    41 s (user CPU 20.0 min), at this threshold 14 min 54 s (20.1 min), the commit
    before any clearing 11 min 27 s (19.5 min) -- and that one crashed as above."""
    yield
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = f.read().count(b"\n")
    except OSError:
        return
    if maps >= MAPS_CLEAR:
        jax.clear_caches()


def pytest_terminal_summary(terminalreporter):
    if EMITTERS == "legacy" and not GPU and X64:  # (tests/float32 marks none)
        terminalreporter.write_line("the tests marked exact_across_shapes were left out of "
                                    "this run on XLA's legacy CPU emitters: they run with "
                                    "GRADSOLVE_TEST_EMITTERS=default -m exact_across_shapes "
                                    "(make test's third run)")
    if not GPU and X64 and not terminalreporter.config.option.markexpr:  # once per
        # make test (the float32 and exact_across_shapes runs would repeat it)
        terminalreporter.write_line("tests/gpu not run: it needs a GPU and "
                                    "GRADSOLVE_TEST_GPU=1 (make test does both where "
                                    "nvidia-smi finds a GPU)")


# The heaviest test files first: with one file per pytest-xdist worker (`make test`),
# starting the long ones first keeps one worker from running a long file alone at the
# end. Ordered by the seconds each took in a fresh clone's suite on the 2-core machine
# (pytest --durations=0, summed per file, at 2610153): petab 88, recipes 75,
# scale 71, calibrator 65, petab_collection 59, checkpoints 55, stiff 51, fused 45,
# grad 39, translate 37; every other file < 31 but the in-kernel adjoint's (62), which
# measured faster left in collection order (fresh clone: 5 min 44 s) than started
# second (7 min 12 s), earlier.
_HEAVIEST_FIRST = ("test_petab.py", "test_recipes.py", "test_scale.py", "test_calibrator.py",
                   "test_petab_collection.py", "test_checkpoints.py", "test_stiff.py",
                   "test_fused.py", "test_grad.py", "test_translate.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "exact_across_shapes: compares programs of "
                            "different shapes bit for bit; needs XLA's default CPU "
                            "emitters (left out of a GRADSOLVE_TEST_EMITTERS=legacy run)")


def pytest_collection_modifyitems(config, items):
    if EMITTERS == "legacy" and not GPU:
        exact = [x for x in items if x.get_closest_marker("exact_across_shapes")]
        config.hook.pytest_deselected(items=exact)
        items[:] = [x for x in items if not x.get_closest_marker("exact_across_shapes")]
    rank = {name: i for i, name in enumerate(_HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: keeps
    # each file's own order
    if os.environ.get(_AGAIN):  # tests/suite.sh's second run: what did not pass
        with open(os.environ[_AGAIN]) as f:
            done = set(f.read().split())
        config.hook.pytest_deselected(items=[x for x in items if x.nodeid in done])
        items[:] = [x for x in items if x.nodeid not in done]


# tests/suite.sh: the node ids of the tests that passed or were skipped, one per line,
# written by the controlling process (xdist hands it every worker's reports), and the
# same file read back to leave those tests out of a second run.
_DONE, _AGAIN = "GRADSOLVE_TEST_DONE", "GRADSOLVE_TEST_AGAIN"


def pytest_runtest_logreport(report):
    if (os.environ.get(_DONE) and "PYTEST_XDIST_WORKER" not in os.environ
            and (report.skipped or (report.when == "call" and report.passed))):
        with open(os.environ[_DONE], "a") as f:
            f.write(report.nodeid + "\n")
