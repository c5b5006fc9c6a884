#!/usr/bin/env bash
# Set up and run the tests, by tier (docs/testing.md):
#
#   bash scripts/test.sh                 setup, ruff, the whole suite, then the container tier (what CI runs)
#   bash scripts/test.sh --fast [ARGS]   setup, ruff, the fast tier: -m "not integration and not slow" (no server
#                                        processes, no lm-eval, no containers; tests/conftest.py fails a test of it
#                                        that starts a process), ARGS passed on to pytest
#   bash scripts/test.sh ARGS...         setup, ruff, then pytest ARGS (one file, -m integration, ...)
#
# Each tier's wall time is printed at the end; when the container tier did not run, the last line says so.
# DLLM_TEST_WORKERS=N runs pytest in N pytest-xdist workers, each taking whole files (--dist loadfile); the
# default is one per core for the fast tier and the whole suite, one process for ARGS (docs/testing.md says why).
# The suite starts its own redis-server on a free port in a temporary directory (tests/conftest.py) and never
# touches a Redis you run; this script only makes sure redis-server is installed.
set -euo pipefail
cd "$(dirname "$0")/.."

TIMES=()
LAST_LINE=""
started=$SECONDS
tier_done() {  # $1 = the tier's name: its wall time since the previous tier ended
  TIMES+=("$1 $((SECONDS - started)) s")
  started=$SECONDS
}
tier() {  # $1 = the tier's name, then its command: run it, note its time (also when it fails), keep its status
  local name=$1 status=0
  shift
  "$@" || status=$?
  tier_done "$name"
  return "$status"
}
report() {
  status=$?
  [ "${#TIMES[@]}" -gt 0 ] && echo "test.sh: wall time by tier: $(IFS=,; echo "${TIMES[*]}" | sed 's/,/, /g')" >&2
  [ -n "$LAST_LINE" ] && echo "$LAST_LINE" >&2
  exit "$status"
}
trap report EXIT

bash scripts/setup.sh
if ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server >/dev/null
  else
    echo "test.sh: redis-server is not installed; install it (e.g. sudo apt-get install redis-server)" >&2
    exit 1
  fi
fi
# Debian's prometheus (promtool and the server) for tests/deploy, installed only when absent; that needs root
# or sudo and apt. Where it cannot be installed, those tests are skipped with this reason (CI runs as root).
if ! bash scripts/install_tools.sh prometheus; then
  export DLLM_TEST_MISSING_PROMETHEUS="scripts/install_tools.sh could not install prometheus/promtool here"
  echo "test.sh: $DLLM_TEST_MISSING_PROMETHEUS; the tests that need them are skipped" >&2
fi
tier_done setup
# Lint first (ruff's version is pinned in pyproject's test extra, its rules and line length configured there).
tier ruff .venv/bin/ruff check .
# pytest exits 5 when it collects nothing; that fails this script as any other non-zero exit does.
workers() {  # $1 = the default worker count: pytest-xdist's options for DLLM_TEST_WORKERS (none for 0 or 1)
  local n=${DLLM_TEST_WORKERS:-$1}
  [ "$n" = auto ] && n=$(nproc)
  if [ "$n" -gt 1 ]; then echo "-n $n --dist loadfile"; fi
}
if [ "${1:-}" = --fast ]; then
  shift
  # shellcheck disable=SC2046  # the options are words
  tier "fast tier" .venv/bin/python -m pytest -m "not integration and not slow" $(workers auto) "$@"
  exit 0
fi
if [ "$#" -gt 0 ]; then
  # shellcheck disable=SC2046
  tier pytest .venv/bin/python -m pytest $(workers 1) "$@"
  exit 0
fi
# shellcheck disable=SC2046
tier suite .venv/bin/python -m pytest $(workers auto)
# The container tier, after the suite and only for the whole suite: scripts/container_smoke.sh builds the CPU
# image and runs it and the compose stack (tests/deploy/test_container_smoke.py; minutes when the layer cache
# holds the dependencies, tens of minutes cold). Unless a docker daemon answers, podman (with runc and
# debootstrap) is installed when absent; where it cannot be, the tier is skipped with this reason.
# DLLM_CONTAINER_SMOKE=0 leaves the tier out.
if [ "${DLLM_CONTAINER_SMOKE:-1}" = 0 ]; then
  LAST_LINE="test.sh: the container tier did NOT run: DLLM_CONTAINER_SMOKE=0 leaves it out"
  exit 0
fi
if ! docker info >/dev/null 2>&1; then
  # apt fails now and then for a moment (a mirror hiccup, another apt holding the dpkg lock): three tries.
  for try in 1 2 3; do
    bash scripts/install_tools.sh containers && break
    if [ "$try" = 3 ]; then
      export DLLM_TEST_MISSING_CONTAINER_ENGINE="scripts/install_tools.sh could not install podman here (3 tries)"
    else
      sleep $((30 * try))
    fi
  done
fi
# The image's torch is the wheel the setup installed (scripts/container_smoke.sh takes a torch-*+cpu wheel from
# a find-links directory): pip copies it out of its cache or find-links, so a cold machine fetches torch once.
wheels=.dllm-kvq/wheels
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__)")
if .venv/bin/python -m pip download -q --no-deps -d "$wheels" "torch==$torch_version" >/dev/null 2>&1; then
  export PIP_FIND_LINKS="$PWD/$wheels${PIP_FIND_LINKS:+ $PIP_FIND_LINKS}"
else
  echo "test.sh: no wheel of torch $torch_version to reuse; the image build fetches its own" >&2
fi
export DLLM_CONTAINER_SMOKE=1
log=$(mktemp)
set +e
.venv/bin/python -m pytest tests/deploy/test_container_smoke.py -s -rs 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
tier_done "container tier"
if grep -q " 1 skipped" "$log"; then
  LAST_LINE="test.sh: the container tier did NOT run: $(grep -m1 '^SKIPPED' "$log" | sed 's/^SKIPPED \[[0-9]*\] [^ ]* //')"
fi
rm -f "$log"
exit "$status"
