#!/usr/bin/env bash
# Run the whole test suite: install what is missing, then ruff, mypy, unit tests, integration tests (these include
# the TypeScript SDK's tests, node --test against real servers: tests/integration/test_sdk_typescript.py).
#
#   bash scripts/test.sh [extra pytest arguments, e.g. -k name or -x]   (as root)
#
# Both test runs use parallel workers (pytest-xdist): SBX_TEST_UNIT_WORKERS (default 4) for the unit tests, one
# test at a time to each; SBX_TEST_WORKERS (default 4) for the integration tests, which mostly wait (sandbox
# boots, servers, timeouts) so more workers than cores pay, each taking whole modules (they share module-scoped
# servers), the longest first, with ports and sandbox subnets of its own (tests/integration/sandboxd_harness.py).
# 0 runs a suite in this one process. One file or test alone: docs/contributing.md.
#
# Runs scripts/install.sh --no-start --test-deps first (idempotent; sandboxd is not started: integration tests start
# their own servers). Every step runs even when an earlier one fails, then a summary is printed. Logs and
# failure evidence (server logs, state files of failed integration tests, junit XML) go to test-artifacts/.
# Exit status: pytest's (the first failing run's) when a test run fails, else 1 when ruff or mypy failed,
# else 0. "No tests collected" (pytest exit 5) in one of the two runs is fine; in both it is a failure, as
# is an integration run where every test was skipped (its prerequisites are missing).
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"
ART=$REPO/test-artifacts
VENV=$REPO/.venv
# Per test (pytest-timeout: the test fails, the run goes on) and per run (a backstop: the run is interrupted).
UNIT_TEST_TIMEOUT_SECS=120
INTEGRATION_TEST_TIMEOUT_SECS=600
UNIT_TIMEOUT=15m
INTEGRATION_TIMEOUT=45m
UNIT_WORKERS=${SBX_TEST_UNIT_WORKERS:-4}
INTEGRATION_WORKERS=${SBX_TEST_WORKERS:-4}
# How many of the slowest tests a run prints at its end (and keeps in test-artifacts/slowest.txt).
SLOWEST=30
T0=$SECONDS

declare -a SUMMARY=()
record() { SUMMARY+=("$(printf '%-12s %-6s %5ss  %s' "$1" "$2" "$3" "$4")"); }
banner() { printf '\n==== %s ====\n' "$*"; }

banner "install (scripts/install.sh --no-start --test-deps)"
t=$SECONDS
if ! bash "$REPO/scripts/install.sh" --no-start --test-deps; then
    echo "test.sh: installation failed (see above); no tests were run" >&2
    exit 1
fi
record install ok $((SECONDS - t)) ""

rm -rf "$ART"
mkdir -p "$ART"
{
    echo "commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
    uname -a
    runsc --version 2>&1 | head -n 1
    "$VENV/bin/python" -V
} >"$ART/environment.txt" 2>&1

lint_failed=0
run_check() {  # name, log file, command...
    local name=$1 log=$2 t=$SECONDS
    shift 2
    banner "$name"
    if "$@" 2>&1 | tee "$ART/$log"; then
        record "$name" ok $((SECONDS - t)) ""
    else
        record "$name" FAIL $((SECONDS - t)) "see test-artifacts/$log"
        lint_failed=1
    fi
}
run_check "ruff check" ruff.log "$VENV/bin/ruff" check src tests
run_check "ruff format" ruff-format.log "$VENV/bin/ruff" format --check --diff src tests
run_check mypy mypy.log "$VENV/bin/mypy" src

declare -A RC=()
run_pytest() {  # name, directory, per-test timeout (s), run timeout, extra args...
    local name=$1 dir=$2 per_test=$3 limit=$4 t=$SECONDS
    shift 4
    banner "pytest $dir"
    if [ ! -d "$dir" ]; then
        RC[$name]=5
        record "$name" none 0 "$dir does not exist"
        return
    fi
    timeout --signal=INT --kill-after=60 "$limit" \
        "$VENV/bin/pytest" "$dir" -ra --timeout="$per_test" --junitxml="$ART/$name.xml" "$@" 2>&1 |
        tee "$ART/$name.log"
    local rc=${PIPESTATUS[0]}
    RC[$name]=$rc
    local counts
    counts=$(junit_counts "$ART/$name.xml")
    case $rc in
        0) record "$name" ok $((SECONDS - t)) "$counts" ;;
        5) record "$name" none $((SECONDS - t)) "no tests collected" ;;
        124) record "$name" FAIL $((SECONDS - t)) "timed out after $limit; see test-artifacts/$name.log" ;;
        *) record "$name" FAIL $((SECONDS - t)) "exit $rc, $counts; see test-artifacts/$name.log" ;;
    esac
}

junit_counts() {  # prints "N passed, F failed, E errors, S skipped" from a junit XML file
    "$VENV/bin/python" - "$1" <<'EOF' 2>/dev/null || echo "no junit report"
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
n, f, e, s = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
print(f"{n - f - e - s} passed, {f} failed, {e} errors, {s} skipped")
EOF
}

run_pytest unit tests/unit "$UNIT_TEST_TIMEOUT_SECS" "$UNIT_TIMEOUT" -n "$UNIT_WORKERS" --dist load "$@"
run_pytest integration tests/integration "$INTEGRATION_TEST_TIMEOUT_SECS" "$INTEGRATION_TIMEOUT" \
    -n "$INTEGRATION_WORKERS" --dist loadfile --no-loadscope-reorder "$@"

# An integration run where everything was skipped tested nothing: its prerequisites (root, runsc, the agent,
# an image) are missing although install.sh just ran. Say so rather than pass.
if [ "${RC[integration]}" -eq 0 ] && [[ $(junit_counts "$ART/integration.xml") == "0 passed, 0 failed, 0 errors, "* ]]; then
    echo "test.sh: every integration test was skipped; the skip reasons are in test-artifacts/integration.log" >&2
    RC[integration]=1
    SUMMARY+=("integration: every test skipped (prerequisites missing), counted as a failure")
fi

status=0
if [ "${RC[unit]}" -eq 5 ] && [ "${RC[integration]}" -eq 5 ]; then
    status=5
else
    for name in unit integration; do
        rc=${RC[$name]}
        if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
            status=$rc
            break
        fi
    done
fi
[ "$status" -eq 0 ] && [ "$lint_failed" -ne 0 ] && status=1

# The slowest tests of both runs (setup and teardown included) and the slowest modules: where to look first
# when the suite gets slower.
"$VENV/bin/python" - "$SLOWEST" "$ART/unit.xml" "$ART/integration.xml" <<'EOF' 2>/dev/null | tee "$ART/slowest.txt"
import collections
import sys
import xml.etree.ElementTree as ET

count, reports = int(sys.argv[1]), sys.argv[2:]
tests, modules = [], collections.Counter()
for report in reports:
    try:
        root = ET.parse(report).getroot()
    except (OSError, ET.ParseError):
        continue
    for case in root.iter("testcase"):
        secs = float(case.get("time") or 0)
        tests.append((secs, f"{case.get('classname')}::{case.get('name')}"))
        modules[case.get("classname") or "?"] += secs
print(f"\n==== the {count} slowest tests (s, setup and teardown included) ====")
for secs, name in sorted(tests, reverse=True)[:count]:
    print(f"{secs:8.1f}  {name}")
print("\n==== the 10 slowest modules (s, their tests added up) ====")
for name, secs in modules.most_common(10):
    print(f"{secs:8.1f}  {name}")
EOF

banner "summary ($((SECONDS - T0)) s)"
printf '%s\n' "${SUMMARY[@]}"
if [ "$status" -eq 0 ]; then
    echo "ALL PASSED"
else
    echo "FAILED (exit $status); evidence in $ART"
fi
exit "$status"
