#!/usr/bin/env bash
# Line coverage of service/, calibration/ and evaluation/ over the suite, the server and CLI subprocesses it starts
# included (.coveragerc; docs/testing.md, "Coverage"). No setup, no ruff, no container tier (DLLM_CONTAINER_SMOKE=0):
#
#   bash scripts/coverage.sh             the whole suite, one pytest-xdist worker per core (--dist loadfile)
#   bash scripts/coverage.sh ARGS...     pytest ARGS instead (a file, -m "not integration and not slow", ...)
#
# DLLM_TEST_WORKERS=N sets the worker count (0 or 1: one process). The data goes to .dllm-kvq/coverage/ (or
# COVERAGE_FILE); the report is coverage's per-file table, then each package's line coverage.
set -euo pipefail
cd "$(dirname "$0")/.."
export COVERAGE_FILE=${COVERAGE_FILE:-$PWD/.dllm-kvq/coverage/.coverage}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DLLM_CONTAINER_SMOKE=${DLLM_CONTAINER_SMOKE:-0}
data_dir=$(dirname "$COVERAGE_FILE")
mkdir -p "$data_dir"
rm -f "$COVERAGE_FILE" "$COVERAGE_FILE".*
n=${DLLM_TEST_WORKERS:-$(nproc)}
workers=()
if [ "$n" -gt 1 ]; then workers=(-n "$n" --dist loadfile); fi
status=0
.venv/bin/python -m pytest "${workers[@]}" --cov --cov-config=.coveragerc --cov-report= "$@" || status=$?
# A subprocess that outlived pytest-cov's own combine (a server stopped last) left a file of its own: add it.
if compgen -G "$COVERAGE_FILE.*" >/dev/null; then
  .venv/bin/coverage combine --rcfile=.coveragerc --append -q "$data_dir"
fi
.venv/bin/coverage report --rcfile=.coveragerc
# Per package, then the three together, counting this checkout's files only (a test's copy of the tree is not).
for part in service/ calibration/ evaluation/ "service/ calibration/ evaluation/"; do
  include=$(for package in $part; do printf '%s,' "$PWD/$package*"; done)
  lines=$(.venv/bin/coverage report --rcfile=.coveragerc --include="${include%,}" --format=total 2>/dev/null) \
    && lines="$lines% of the lines" || lines="no data"
  echo "coverage.sh: $part: $lines"
done
exit "$status"
