# `make demo` and `make test` set up .venv on first use, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench setup clean

# Installs the exact versions the tests last passed with (constraints.txt; its header
# says how to refresh it); pyproject.toml keeps the ranges the library supports.
# Every package's bytecode is compiled here: without it an environment with
# PYTHONDONTWRITEBYTECODE=1, as this machine's is, compiles jax's sources again in every
# interpreter the tests start (the fresh-clone suite measured 8 min 54 s and 10 min 42 s
# without, 7 min 52 s to 8 min 16 s with). compileall on every core rather than pip's
# one file at a time: the setup took 35 s against 41-48 s (the same 9468 .pyc files);
# like pip, a file that does not compile is left to the interpreter.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e ".[test,plot,petab]" -c constraints.txt
	$(PY) -m pip install --quiet --no-compile --no-deps petabtests -c constraints.txt
	$(PY) -m compileall -q -j 0 $(VENV)/lib src > /dev/null || true
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) recipes/lorenz_rho.py

# One pytest worker per core, a test file per worker, the heaviest files first (the
# order tests/conftest.py gives): the suite is bound by XLA and Warp compiles, which
# are single-threaded (measured per test at 5274247, 1078 of 1365 worker-seconds were
# XLA/Warp compiles, tracing and lowering, and ~213 the subprocess tests' imports and
# compiles), so it compiles at optimization level 0 (tests/conftest.py). A fresh clone
# on 2 cores, setup and .ci/run: 549 s at 38651f3, 587 s at 6eff4ab (1023
# worker-seconds; a new 23 s test), 509 s with XLA at level 0, 490 s with Warp at 0
# and three tests trimmed, 471 s at b379565 (setup 35 s, .ci/run 436 s: 432 passed in
# 398 s, float32 16 in 20 s; 753 worker-seconds) and 512 s for the same code at 3168f39
# (.ci/run 477 s); 499 s with the float32 run beside the main one (.ci/run 464 s): at
# the 8-minute budget, within the noise. Earlier: 706-839 s on 2026-12-03. Later on
# 2026-12-04, no test changed: 729 s at 4a2dfa8, 701 s at bfb1d37, 613 s at 24a78a6
# (setup 45-50 s; every slow test 1.2-2x its time of the runs above, neural_robertson
# 41-47 s against 22 s): the 8-minute budget was missed each time. At d7b9e9b, a new
# session, no test changed: 609 s and 694 s (1192 worker-seconds against 753). On
# 2026-12-05: 469 s at 53d5bee (800 worker-seconds), 496 s at 3182737 an hour later
# (851: a faster PEtab load and two trimmed tests, on a slower machine).
# On 2026-12-07: 10 min 38 s at cadfe3e (1202 worker-seconds), 6 min 31 s with the
# legacy emitters below (840), 7 min 21 s and 7 min 17 s later the same day (941, 928);
# on the evening's machine 7 min 41 s at 87869b0 and again at ed7a3f6 (four new tests,
# the refresh_tol one 16.6 s of a worker), 7 min 29 s at 74eb8f7, 7 min 19 s at
# 04293dd (the guarded replay's loops compile faster than its branches).
# The main run and the float32 run compile on XLA's legacy CPU emitters
# (GRADSOLVE_TEST_EMITTERS=legacy: half the compile time, tests/conftest.py says how
# measured), which leave out the tests marked exact_across_shapes: those run in a third
# pytest on XLA's default emitters, where their bit-for-bit comparisons hold.
# Beside the main run, in the background, tests/float32 in a pytest of its own with
# jax_enable_x64 off (one switch per process; float32 is how most JAX users run), then
# the exact_across_shapes tests: they fill the core the main run leaves idle at its
# end; their output follows the main run's, and any failing fails the target. Then,
# where nvidia-smi finds a GPU, tests/gpu with Warp on CUDA (the runs before pin JAX
# and Warp to the CPU).
# A worker that dies (a segfault) is not replaced, --max-worker-restart=0: with a
# replacement worker, a fresh clone's run on 2026-12-04 (XLA segfaulted compiling
# test_workflow.py's minibatch fit, in the second of that day's two) hung with every
# process idle. tests/suite.sh then runs what had not passed again, in one process.
# The crashes seen were XLA's LLVM failing to map memory once a worker held 65530
# memory maps (tests/conftest.py now releases each file's compiled programs). To see
# what native code prints as it dies, run pytest with --capture=sys (fd capture keeps
# it in the dead worker; sys capture also shows the checkpoint writer's logs).
F32 := GRADSOLVE_TEST_X64=0 GRADSOLVE_TEST_EMITTERS=legacy $(PY) -m pytest -q -p no:cacheprovider tests/float32
EXACT := $(PY) -m pytest -q -p no:cacheprovider -m exact_across_shapes tests
test: $(STAMP)
	@echo "$(F32); $(EXACT)   (in the background)"
	@log=$$(mktemp); ($(F32) > $$log 2>&1; echo $$? > $$log.rc; \
	 $(EXACT) > $$log.x 2>&1; echo $$? > $$log.xrc) & \
	GRADSOLVE_TEST_EMITTERS=legacy tests/suite.sh $(PY) -q -n auto --dist loadfile \
	    --no-loadscope-reorder --max-worker-restart=0 tests; main=$$?; \
	wait; echo "-- tests/float32, jax_enable_x64 off:"; cat $$log; f32=$$(cat $$log.rc); \
	echo "-- the tests marked exact_across_shapes, on XLA's default emitters:"; cat $$log.x; \
	exact=$$(cat $$log.xrc); rm -f $$log $$log.rc $$log.x $$log.xrc; \
	test $$main -eq 0 && test $$f32 -eq 0 && test $$exact -eq 0
	if nvidia-smi > /dev/null 2>&1; then GRADSOLVE_TEST_GPU=1 $(PY) -m pytest -q tests/gpu; \
	else echo "tests/gpu not run: nvidia-smi finds no GPU"; fi

# Every script under benchmarks/ (their stored sections measured 40 min in all on the
# 2-core machine); each refuses to store a result from uncommitted code.
bench: $(STAMP)
	for script in benchmarks/[!_]*.py; do $(PY) $$script || exit 1; done

clean:
	rm -rf $(VENV) build src/*.egg-info
