# syntax=docker/dockerfile:1
# One image for the server, the calibration job and the evaluation job: the entrypoint is the project's console
# command `dllm-kvq` (pyproject's [project.scripts]), so `docker run IMAGE calibrate ...` is `dllm-kvq calibrate ...`.
#
#   docker build -t dllm-kvq .                                  # CUDA build of torch (GPU hosts)
#   docker build --build-arg TORCH_VARIANT=cpu -t dllm-kvq:cpu . # CPU build (docker-compose.cpu.yml)
#   podman build --format docker ...                            # the same; docker format keeps HEALTHCHECK
#
# Where torch comes from (docs/deployment.md, "Building without the torch index"): TORCH_INDEX_URL (default the
# variant's index on download.pytorch.org), or a wheel placed in deploy/docker/wheels (mounted, never a layer).
# PIP_INDEX_URL points every other dependency at a mirror. A TLS-intercepting proxy's CA goes in as the build
# secret `extra_ca` (deploy/docker/pip.sh). scripts/container_smoke.sh builds and runs all of this.
#
# The base is NVIDIA's CUDA runtime image so the container sees the driver through the NVIDIA Container
# Toolkit; torch's CUDA wheels bring their own cuBLAS/cuDNN, so the runtime flavour (not cudnn/devel) is enough.
# Any Debian/Ubuntu base with python3 >= 3.11 in its archive works for the CPU image (CUDA_BASE=debian:bookworm).
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# Stage 1: torch and the project's dependencies. Nothing here depends on the project's source, so a change to
# service/, calibration/, evaluation/ or dllm_kvq/ rebuilds only the small stages below.
FROM ${CUDA_BASE} AS torch
# TORCH_VARIANT selects the wheel index: cu128 (default), cu126, cu130, ... or cpu.
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cu128
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY --chmod=0755 deploy/docker/pip.sh /usr/local/bin/pip.sh
# torch first, so the project's `torch>=...` requirement is already met and pip never pulls a second build from
# PyPI. A wheel in deploy/docker/wheels wins (installed without its dependencies, which the deps stage resolves
# from PIP_INDEX_URL); otherwise the variant's index.
RUN --mount=type=secret,id=extra_ca \
    --mount=type=bind,source=deploy/docker/wheels,target=/wheels \
    if ls /wheels/torch-"${TORCH_VERSION}"[+-]*.whl >/dev/null 2>&1; then \
      pip.sh install --no-index --no-deps --find-links /wheels "torch==${TORCH_VERSION}"; \
    else \
      pip.sh install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; \
    fi

# The dependency list and the build backend, read from pyproject.toml in a stage of their own: the deps stage
# copies only this list, so an edit elsewhere in pyproject.toml (test extras, tool settings) keeps its cache.
FROM torch AS requirements
COPY pyproject.toml /tmp/pyproject.toml
RUN python -c "import tomllib; p = tomllib.load(open('/tmp/pyproject.toml', 'rb')); \
print('\n'.join(p['project']['dependencies'] + p['build-system']['requires']))" >/tmp/requirements.txt

FROM torch AS deps
# pip reads PIP_INDEX_URL from the environment: the index for everything but torch.
ARG PIP_INDEX_URL=https://pypi.org/simple
COPY --from=requirements /tmp/requirements.txt /tmp/requirements.txt
RUN --mount=type=secret,id=extra_ca \
    pip.sh install -r /tmp/requirements.txt \
    && python -c "import torch; print('torch', torch.__version__)"

# Stage 2: the project as a wheel. Every package pyproject's [tool.setuptools.packages.find] lists is copied
# (tests/deploy/test_docker.py checks the two lists agree): the console command imports all four.
FROM deps AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dllm_kvq dllm_kvq
COPY service service
COPY calibration calibration
COPY evaluation evaluation
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /dist .

# Stage 3: what runs.
FROM ${CUDA_BASE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 tini \
    && rm -rf /var/lib/apt/lists/*
# A fixed non-root uid/gid so volume ownership is predictable (Kubernetes runAsUser/fsGroup use the same).
RUN groupadd --gid 10001 dllm \
    && useradd --uid 10001 --gid dllm --create-home --home-dir /home/dllm --shell /usr/sbin/nologin dllm \
    && mkdir -p /data/hf /data/store /data/runs \
    && chown -R dllm:dllm /data
COPY --from=deps /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/data/hf \
    DLLM_HOST=0.0.0.0 \
    DLLM_PORT=8000 \
    DLLM_STORE_URL=/data/store
# The project itself: a few MB on top of the cached venv layer. Copied, not bind-mounted from the wheel stage:
# a COPY's cache key is what it copies, while a RUN's mount from another stage is not part of the RUN's key, so
# a new wheel would meet a cached install (podman did exactly that). `dllm-kvq --help` proves the console
# command the entrypoint runs imports.
COPY --from=wheel /dist /tmp/dist
RUN pip install --no-deps --no-index --no-cache-dir /tmp/dist/*.whl \
    && rm -rf /tmp/dist \
    && dllm-kvq --help >/dev/null \
    && python -c "import dllm_kvq.cli, service, calibration, evaluation"
COPY --chmod=0644 deploy/docker/healthcheck.py /usr/local/lib/dllm-kvq/healthcheck.py
# The Hugging Face cache (model weights) outlives the container; the local policy store is for runs without
# Redis; calibration and evaluation write their reports under /data/runs.
VOLUME ["/data/hf", "/data/store", "/data/runs"]
WORKDIR /home/dllm
USER 10001:10001
EXPOSE 8000
# Ready = model loaded and a one-step denoise passes (GET /health/ready answers 200). An 8B checkpoint takes
# minutes to load, hence the long start period. Docker-format images only: podman's default OCI format drops
# HEALTHCHECK (build with `--format docker`); compose files carry the same check.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/usr/local/lib/dllm-kvq/healthcheck.py"]
# tini forwards SIGTERM to the server so it drains (no new requests, in-flight ones finish).
ENTRYPOINT ["tini", "--", "dllm-kvq"]
CMD ["serve"]
