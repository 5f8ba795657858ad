#!/usr/bin/env bash
# The main run of `make test`: pytest over worker processes (the arguments after the
# interpreter are pytest's, the last the tests' folder). When a worker dies of a native
# fault and every failure is such a death, the tests that neither passed nor were
# skipped -- the one the worker was running and those its file still had queued, which
# never ran -- run again in one process, and that run decides. Seen in the suite: XLA's
# CPU backend segfaulting or aborting in a compile or a persistent-cache read or write
# once a worker held Linux's 65530 memory maps ("LLVM compilation error: Cannot
# allocate memory"; tests/conftest.py now releases each file's compiled programs, which
# keeps a worker under ~17,000). The crash and its stack stay in the output above the
# second run.
set -uo pipefail
py=$1
shift
done_file=$(mktemp)
log=$(mktemp)
trap 'rm -f "$done_file" "$log"' EXIT
PYTHONUNBUFFERED=1 GRADSOLVE_TEST_DONE=$done_file "$py" -m pytest "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
crashed=$(grep -cE "^worker 'gw[0-9]+' crashed while running" "$log")
summary=$(grep -E "^=* ?[0-9]+ (passed|failed)" "$log" | tail -n 1)
failed=$(grep -oE "[0-9]+ failed" <<< "$summary" | grep -oE "[0-9]+" || echo 0)
errors=$(grep -oE "[0-9]+ errors?" <<< "$summary" | grep -oE "[0-9]+" || echo 0)
if [ "$rc" -ne 0 ] && [ "$crashed" -gt 0 ] && [ "$failed" -eq "$crashed" ] \
        && [ "$errors" -eq 0 ]; then
    echo "-- $crashed pytest worker(s) died of a native fault (the stack is above): the" \
         "tests that did not pass or skip run again, in one process"
    GRADSOLVE_TEST_AGAIN=$done_file "$py" -m pytest -q -p no:cacheprovider "${@: -1}"
    rc=$?
fi
exit "$rc"
