# syntax=docker/dockerfile:1
# One image for the server, the calibration job and the evaluation job (see deploy/docker/entrypoint.sh).
#
#   docker build -t dllm-kvq .                                  # CUDA build of torch (GPU hosts)
#   docker build --build-arg TORCH_VARIANT=cpu -t dllm-kvq:cpu . # CPU build (docker-compose.cpu.yml)
#
# The base is NVIDIA's CUDA runtime image so the container sees the driver through the NVIDIA Container
# Toolkit; torch's CUDA wheels bring their own cuBLAS/cuDNN, so the runtime flavour (not cudnn/devel) is enough.
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

FROM ${CUDA_BASE} AS build
# TORCH_VARIANT selects the wheel index: cu128 (default), cu126, cu130, ... or cpu.
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cu128
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the variant's index, so the project's `torch>=...` requirement is already met and pip
# never pulls a second build from PyPI.
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "torch==${TORCH_VERSION}"
WORKDIR /src
# Metadata first: the dependency layer is rebuilt only when pyproject.toml changes.
COPY pyproject.toml README.md ./
COPY service/__init__.py service/__init__.py
COPY calibration/__init__.py calibration/__init__.py
COPY evaluation/__init__.py evaluation/__init__.py
RUN pip install . && pip uninstall -y dllm-kvq
COPY service service
COPY calibration calibration
COPY evaluation evaluation
RUN pip install --no-deps . \
    && python -c "import service, calibration, evaluation"

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
COPY --from=build /opt/venv /opt/venv
COPY --chmod=0755 deploy/docker/entrypoint.sh /usr/local/bin/dllm-kvq
COPY --chmod=0644 deploy/docker/healthcheck.py /usr/local/lib/dllm-kvq/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/data/hf \
    DLLM_HOST=0.0.0.0 \
    DLLM_PORT=8000 \
    DLLM_STORE_URL=/data/store
# The Hugging Face cache (model weights) outlives the container; the local policy store is for runs without
# Redis; calibration and evaluation write their reports under /data/runs.
VOLUME ["/data/hf", "/data/store", "/data/runs"]
WORKDIR /home/dllm
USER 10001:10001
EXPOSE 8000
# Ready = model loaded and a one-step denoise passes (GET /health/ready answers 200). An 8B checkpoint takes
# minutes to load, hence the long start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/usr/local/lib/dllm-kvq/healthcheck.py"]
# tini forwards SIGTERM to the server so it drains (no new requests, in-flight ones finish).
ENTRYPOINT ["tini", "--", "dllm-kvq"]
CMD ["serve"]
