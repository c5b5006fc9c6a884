#!/usr/bin/env bash
# Build the image and use it as an operator would, with podman or docker (whichever is here):
#   1. build the CPU image (TORCH_VARIANT=cpu) from the base given (default: the Dockerfile's CUDA_BASE);
#   2. run it with its default entrypoint and command (`dllm-kvq serve`), wait for GET /health/ready, list the
#      models (DLLM_SERVED_MODEL_NAME), send one chat completion with the openai client;
#   3. SIGTERM while a streamed completion is mid-way: the stream finishes whole and the container exits 0;
#   4. the CPU compose stack (api + redis; podman-compose or docker compose): one chat completion and an admin
#      activation that the api applies (the next request decodes with it);
#   5. tear everything down (containers, the stack's network and volumes; images stay, for the layer cache).
# With --gpu VARIANT it also builds the GPU image (TORCH_VARIANT=VARIANT); that one is not run.
#
#   bash scripts/container_smoke.sh [--engine podman|docker] [--base IMAGE | --debootstrap]
#                                   [--wheels DIR] [--extra-ca PEM] [--build-arg K=V]... [--gpu VARIANT]
#
# --debootstrap     base = localhost/debian:bookworm, made with debootstrap when absent (no registry needed)
# --wheels DIR      torch wheels for the build (copied into deploy/docker/wheels for the build, removed after);
#                   default: a directory of pip's find-links here (PIP_FIND_LINKS, pip.conf) holding a torch
#                   wheel for the variant
# --extra-ca PEM    a CA bundle pip in the build trusts besides its own (the build secret extra_ca); default:
#                   DLLM_BUILD_EXTRA_CA, else the bundle this host's pip trusts (PIP_CERT, pip.conf's cert,
#                   REQUESTS_CA_BUNDLE)
# Exit status: 0 passed; 1 a check failed (the output says which); 3 no container engine here (nothing ran).
# docs/deployment.md ("The container smoke test") has what it covers and how long it takes.
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE=${DLLM_CONTAINER_ENGINE:-}
BASE=""
DEBOOTSTRAP=0
WHEELS=""
EXTRA_CA=${DLLM_BUILD_EXTRA_CA:-}
GPU_VARIANT=""
BUILD_ARGS=()
IMAGE_CPU=${DLLM_IMAGE_CPU:-dllm-kvq:cpu}
IMAGE_GPU=${DLLM_IMAGE:-dllm-kvq:latest}
DEBIAN_BASE=localhost/debian:bookworm
PROJECT=dllm-kvq-smoke
PY=${DLLM_SMOKE_PYTHON:-}

log() { printf 'container_smoke: %s\n' "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

while [ "$#" -gt 0 ]; do
  case "$1" in
    --engine) ENGINE=$2; shift 2 ;;
    --base) BASE=$2; shift 2 ;;
    --debootstrap) DEBOOTSTRAP=1; shift ;;
    --wheels) WHEELS=$2; shift 2 ;;
    --extra-ca) EXTRA_CA=$2; shift 2 ;;
    --build-arg) BUILD_ARGS+=(--build-arg "$2"); shift 2 ;;
    --gpu) GPU_VARIANT=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "container_smoke.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

# ---- the engine ---------------------------------------------------------------------------------------------
if [ -z "$ENGINE" ]; then
  if command -v podman >/dev/null; then
    ENGINE=podman
  elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then
    ENGINE=docker
  else
    log "SKIP: no container engine here (podman not installed; docker absent or its daemon not reachable)"
    exit 3
  fi
fi
command -v "$ENGINE" >/dev/null || { log "SKIP: --engine $ENGINE is not installed"; exit 3; }
if [ "$ENGINE" = podman ]; then
  COMPOSE=(podman-compose)
  [ -x .venv/bin/podman-compose ] && COMPOSE=(.venv/bin/podman-compose)
  command -v "${COMPOSE[0]}" >/dev/null || die "podman-compose is not installed (bash scripts/install_tools.sh)"
  # Docker-format images keep HEALTHCHECK (podman's default OCI format drops it, with a warning).
  FORMAT=(--format docker)
else
  COMPOSE=(docker compose)
  FORMAT=()
  export DOCKER_BUILDKIT=1  # RUN --mount (the wheel directory, the CA secret) needs BuildKit
fi
if [ -z "$PY" ]; then
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
fi
"$PY" -c "import openai" 2>/dev/null || die "$PY has no openai client (pip install -e '.[test]')"

WORK=$(mktemp -d)
COPIED=()
CONTAINER="$PROJECT-serve-$$"
cleanup() {
  status=$?
  "$ENGINE" rm -f -v "$CONTAINER" >/dev/null 2>&1 || true
  if [ -f "$WORK/compose.yml" ]; then
    "${COMPOSE[@]}" "${COMPOSE_FILES[@]}" down -v >/dev/null 2>&1 || true
  fi
  for f in "${COPIED[@]}"; do rm -f "$f"; done
  rm -rf "$WORK"
  exit "$status"
}
trap cleanup EXIT

# ---- the base -----------------------------------------------------------------------------------------------
dockerfile_base=$(sed -n 's/^ARG CUDA_BASE=//p' Dockerfile)
if [ "$DEBOOTSTRAP" = 1 ]; then
  BASE=$DEBIAN_BASE
  if ! "$ENGINE" image exists "$BASE" 2>/dev/null && ! "$ENGINE" image inspect "$BASE" >/dev/null 2>&1; then
    command -v debootstrap >/dev/null || die "--debootstrap: debootstrap is not installed (apt-get install debootstrap)"
    # The Debian mirror apt uses here (deb822 .sources or a one-line sources.list), else Debian's CDN.
    # Either file may be absent (a missing one is no error: `|| true`, or set -e and pipefail end the script).
    mirror=${DLLM_DEBIAN_MIRROR:-$( (sed -n 's|^URIs: *\([^ ]*/debian\)/*$|\1|p' /etc/apt/sources.list.d/*.sources
      sed -n 's|^deb  *\(http[^ ]*/debian\)/* .*|\1|p' /etc/apt/sources.list) 2>/dev/null | head -1 || true)}
    mirror=${mirror:-http://deb.debian.org/debian}
    log "making $BASE with debootstrap from $mirror"
    debootstrap --variant=minbase bookworm "$WORK/rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
      || { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed"; }
    tar -C "$WORK/rootfs" -c . | "$ENGINE" import - "$BASE" >/dev/null
    rm -rf "$WORK/rootfs"
  fi
fi
BASE=${BASE:-$dockerfile_base}

# Some hosts cannot start a container with the engine's defaults: crun refuses hybrid cgroups, and where the
# host lacks CAP_SYS_RESOURCE (a sandboxed VM) runc may not set podman's default rlimits. Probe once; for podman
# retry with runc and rlimits this host can grant, through a containers.conf of this run only.
probe() { "$ENGINE" run --rm --entrypoint true "$BASE" >"$WORK/probe.log" 2>&1; }
if ! probe; then
  if [ "$ENGINE" = podman ]; then
    nproc_limit=$(ulimit -Hu)
    if [ "$nproc_limit" = unlimited ] || [ "$nproc_limit" -gt 32768 ]; then nproc_limit=32768; fi
    {
      printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n' \
        "$(ulimit -Hn)" "$(ulimit -Hn)" "$nproc_limit" "$nproc_limit"
      command -v runc >/dev/null && printf '[engine]\nruntime = "runc"\n'
    } >"$WORK/containers.conf"
    export CONTAINERS_CONF="$WORK/containers.conf"
    log "containers do not start with podman's defaults ($(grep -v '^time=' "$WORK/probe.log" | tail -1));" \
        "using runc and explicit rlimits: $(tr '\n' ' ' <"$WORK/containers.conf")"
  fi
  probe || { cat "$WORK/probe.log" >&2; die "$ENGINE cannot run a container from $BASE"; }
fi

# ---- the build ----------------------------------------------------------------------------------------------
pip_config() {  # $1 = a pip option: its values in this host's pip configuration files (pip.conf), space-separated
  "$PY" -m pip config list 2>/dev/null | sed -n "s/^[a-z]*\.$1='\(.*\)'\$/\1/p" | tr '\n' ' '
}
copy_wheels() {  # $1 = variant: this variant's torch wheels into deploy/docker/wheels (nothing if none found)
  local variant=$1 dir found=""
  local dirs=("$WHEELS")
  [ -z "$WHEELS" ] && read -r -a dirs <<<"${PIP_FIND_LINKS:-} $(pip_config find-links)"
  for dir in "${dirs[@]}"; do
    [ -d "$dir" ] || continue
    for wheel in "$dir"/torch-*+"$variant"-*.whl; do
      [ -f "$wheel" ] || continue
      target=deploy/docker/wheels/$(basename "$wheel")
      if [ ! -e "$target" ]; then
        ln "$wheel" "$target" 2>/dev/null || cp "$wheel" "$target"
        COPIED+=("$target")
      fi
      found=$wheel
    done
  done
  if [ -n "$found" ]; then log "torch ($variant) from $found"; else log "torch ($variant) from the index"; fi
}
if [ -z "$EXTRA_CA" ]; then
  for candidate in "${PIP_CERT:-}" $(pip_config cert) "${REQUESTS_CA_BUNDLE:-}"; do
    [ -n "$candidate" ] && [ -s "$candidate" ] && { EXTRA_CA=$candidate; break; }
  done
fi
SECRET=()
if [ -n "$EXTRA_CA" ]; then
  [ -s "$EXTRA_CA" ] || die "--extra-ca $EXTRA_CA: no such file"
  SECRET=(--secret "id=extra_ca,src=$EXTRA_CA")
  log "pip in the build also trusts $EXTRA_CA (build secret extra_ca)"
fi
build() {  # $1 = tag, $2 = variant, $3 = base
  local start=$SECONDS
  copy_wheels "$2"
  log "building $1 (TORCH_VARIANT=$2, CUDA_BASE=$3) with $ENGINE"
  if ! "$ENGINE" build "${FORMAT[@]}" "${SECRET[@]}" --build-arg "CUDA_BASE=$3" --build-arg "TORCH_VARIANT=$2" \
      "${BUILD_ARGS[@]}" -t "$1" . >"$WORK/build-$2.log" 2>&1; then
    grep -v '^time=' "$WORK/build-$2.log" | tail -40 >&2
    die "building $1 failed"
  fi
  local size
  size=$("$ENGINE" image inspect --format '{{.Size}}' "$1")
  log "built $1 in $((SECONDS - start)) s: $((size / 1000000)) MB"
}
build "$IMAGE_CPU" cpu "$BASE"
"$ENGINE" image inspect "$IMAGE_CPU" | grep -q healthcheck.py \
  || die "$IMAGE_CPU has no HEALTHCHECK (an OCI-format build drops it: podman build --format docker)"
# The image runs this checkout's code, not a layer cached from an older one: one digest over every .py file of
# the four packages, in the image's site-packages and here.
SOURCE_DIGEST='import hashlib, importlib.util, pathlib
h = hashlib.sha256()
for name in ("dllm_kvq", "service", "calibration", "evaluation"):
    root = pathlib.Path(importlib.util.find_spec(name).submodule_search_locations[0])
    for f in sorted(root.rglob("*.py")):
        h.update(f"{name}/{f.relative_to(root)}".encode() + b"\0" + f.read_bytes())
print(h.hexdigest())'
here=$(PYTHONPATH=. "$PY" -c "$SOURCE_DIGEST")
inside=$("$ENGINE" run --rm --entrypoint python "$IMAGE_CPU" -c "$SOURCE_DIGEST" 2>"$WORK/digest.log") \
  || { cat "$WORK/digest.log" >&2; die "$IMAGE_CPU cannot run python"; }
[ "$here" = "$inside" ] || die "$IMAGE_CPU does not hold this checkout's code (digest $inside, here $here): a stale layer"
log "the image holds this checkout's code (sources digest ${here:0:12})"
if [ -n "$GPU_VARIANT" ]; then
  build "$IMAGE_GPU" "$GPU_VARIANT" "${DLLM_GPU_BASE:-$dockerfile_base}"
fi

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
API_KEY=smoke-user-key-$$
ADMIN_KEY=smoke-admin-key-0123456789-$$

# ---- the image with its default entrypoint ------------------------------------------------------------------
PORT=$(free_port)
log "running $IMAGE_CPU as $CONTAINER (default entrypoint and command) on 127.0.0.1:$PORT"
"$ENGINE" run -d --name "$CONTAINER" -p "127.0.0.1:$PORT:8000" \
  -e DLLM_API_KEYS="$API_KEY" -e DLLM_SERVED_MODEL_NAME=smoke-model -e DLLM_THREADS=1 \
  -e DLLM_DRAIN_TIMEOUT_S=120 --stop-timeout 150 "$IMAGE_CPU" >/dev/null 2>"$WORK/run.log" \
  || { cat "$WORK/run.log" >&2; die "$ENGINE run failed"; }
if ! seconds=$("$PY" scripts/container_smoke_client.py ready "http://127.0.0.1:$PORT" --timeout 600 \
    --alive sh -c "$ENGINE inspect --format '{{.State.Running}}' $CONTAINER | grep -qx true"); then
  "$ENGINE" logs "$CONTAINER" 2>&1 | tail -40 >&2
  die "the container never became ready"
fi
log "ready $seconds s after start"
"$PY" scripts/container_smoke_client.py serve "http://127.0.0.1:$PORT" --model smoke-model --api-key "$API_KEY" \
  --stop "$ENGINE" kill --signal TERM "$CONTAINER" || { "$ENGINE" logs "$CONTAINER" 2>&1 | tail -40 >&2; exit 1; }
code=$("$ENGINE" wait "$CONTAINER")
if [ "$code" != 0 ]; then
  "$ENGINE" logs "$CONTAINER" 2>&1 | tail -40 >&2
  die "after SIGTERM the container exited $code (expected 0: a clean drain)"
fi
log "the container drained and exited 0"
"$ENGINE" rm -f -v "$CONTAINER" >/dev/null

# ---- the CPU compose stack ----------------------------------------------------------------------------------
# Redis: the compose file's image where the engine has it; else one built from the same base (Debian's
# redis-server), so no registry is needed.
REDIS_IMAGE=${DLLM_REDIS_IMAGE:-}
if [ -z "$REDIS_IMAGE" ]; then
  REDIS_IMAGE=$(sed -n 's/.*image: \${DLLM_REDIS_IMAGE:-\(.*\)}$/\1/p' docker-compose.yml)
  if ! "$ENGINE" image inspect "$REDIS_IMAGE" >/dev/null 2>&1; then
    REDIS_IMAGE=dllm-kvq-redis:smoke
    "$ENGINE" build "${FORMAT[@]}" --build-arg "BASE=$BASE" -t "$REDIS_IMAGE" deploy/docker/redis \
      >"$WORK/build-redis.log" 2>&1 || { tail -20 "$WORK/build-redis.log" >&2; die "building $REDIS_IMAGE failed"; }
    log "redis from $REDIS_IMAGE (built from $BASE)"
  fi
fi
STACK_PORT=$(free_port)
COMPOSE_FILES=(-p "$PROJECT" -f docker-compose.yml -f docker-compose.cpu.yml -f "$WORK/compose.yml")
cat >"$WORK/compose.yml" <<EOF
# scripts/container_smoke.sh: the keys of this run (the api refuses an open API on 0.0.0.0).
services:
  api:
    environment:
      DLLM_API_KEYS: $API_KEY
      DLLM_ADMIN_KEY: $ADMIN_KEY
      DLLM_THREADS: "1"
    volumes:
      - store:/data/store  # named, so that down -v removes it (the image's VOLUME would leave an anonymous one)
volumes:
  store:
EOF
export DLLM_IMAGE_CPU="$IMAGE_CPU" DLLM_REDIS_IMAGE="$REDIS_IMAGE" DLLM_PUBLISH_PORT="$STACK_PORT"
log "compose stack (api + redis) with ${COMPOSE[*]} on 127.0.0.1:$STACK_PORT"
"${COMPOSE[@]}" "${COMPOSE_FILES[@]}" up -d --no-build api redis >"$WORK/compose-up.log" 2>&1 \
  || { tail -30 "$WORK/compose-up.log" >&2; die "compose up failed"; }
stack_logs() { "${COMPOSE[@]}" "${COMPOSE_FILES[@]}" logs 2>&1 | tail -40 >&2; }
if ! seconds=$("$PY" scripts/container_smoke_client.py ready "http://127.0.0.1:$STACK_PORT" --timeout 600); then
  stack_logs
  die "the stack's api never became ready"
fi
log "stack api ready $seconds s after up"
"$PY" scripts/container_smoke_client.py stack "http://127.0.0.1:$STACK_PORT" --model embedded \
  --api-key "$API_KEY" --admin-key "$ADMIN_KEY" || { stack_logs; exit 1; }
# The activation lives in the redis service (the api's store there), not in the api's memory.
active_key=$("${COMPOSE[@]}" "${COMPOSE_FILES[@]}" exec -T redis redis-cli --scan --pattern '*:active' 2>/dev/null \
  | grep -v '^time=' || true)
[ -n "$active_key" ] || die "no active-configuration key in the stack's redis after the activation"
log "redis holds the activation ($active_key)"
"${COMPOSE[@]}" "${COMPOSE_FILES[@]}" down -v >"$WORK/compose-down.log" 2>&1 \
  || { tail -20 "$WORK/compose-down.log" >&2; die "compose down failed"; }
rm -f "$WORK/compose.yml"
log "PASS ($SECONDS s)"
