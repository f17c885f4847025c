# syntax=docker/dockerfile:1
# Our worker: `cascade cloud worker` (the PyTorch engine, ".[cloud]"). The CPU build of torch by
# default; for NVIDIA GPUs: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# (CUDA's libraries come with that wheel; the node gives the driver). EXTRAS=cloud,models adds the
# catalogue's shipped models (smollm2-135m, ...; they build llama-cpp-python: a few minutes).
# Built from the repository root wherever Docker runs:
#   docker build -f deploy/docker/worker.Dockerfile -t cascade-worker:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: the wheel, and a virtualenv with torch, it and its extras -------------------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=cloud
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# compilers for dependencies that build from source (llama-cpp-python, with EXTRAS=...,models);
# this stage is thrown away. Debian's package versions move with the base image: not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cascade/ cascade/
COPY cascade_cli/ cascade_cli/
COPY cloud_tier/ cloud_tier/
COPY edge_agent/ edge_agent/
COPY model_distribution/ model_distribution/
COPY sync/ sync/
COPY testkit/ testkit/
# torch first, from its own index (PyPI's default torch is the CUDA build)
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/venv/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}" \
    && /opt/venv/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && /opt/venv/bin/pip install --no-cache-dir "$(find /wheels -name 'cascade_serve-*.whl')[${EXTRAS}]"

# --- runtime: the virtualenv, g++ for the engine's CPU kernel, an unprivileged user -----------
FROM ${PYTHON_IMAGE}
# g++: the engine compiles its CPU paged-attention kernel for the node's CPU (-march=native) at
# first use (CASCADE_ENGINE_NATIVE_KERNELS=0: the pure torch path, and g++ can go). Debian's
# versions move with the base image: not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    OMP_WAIT_POLICY=passive \
    CASCADE_HOME=/var/lib/cascade \
    CASCADE_CLOUD_SERVER_HOST=0.0.0.0 \
    CASCADE_CLOUD_SERVER_PORT=8000
RUN groupadd --system --gid 10001 cascade \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/cascade --create-home cascade
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /var/lib/cascade
EXPOSE 8000
# the model is converted (and the kernel built) at the first start: minutes
HEALTHCHECK --interval=15s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
ENTRYPOINT ["cascade"]
CMD ["cloud", "worker"]
