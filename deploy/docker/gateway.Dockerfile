# syntax=docker/dockerfile:1
# The gateway: `cascade cloud serve` in front of workers elsewhere (--workers URL,... or found
# through the Kubernetes API with --k8s-selector). The ".[gateway]" install: no torch, no weights.
# Built from the repository root wherever Docker runs:
#   docker build -f deploy/docker/gateway.Dockerfile -t cascade-gateway:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# --- build: the wheel, and a virtualenv with it and its gateway extra -------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY cascade/ cascade/
COPY cascade_cli/ cascade_cli/
COPY cloud_tier/ cloud_tier/
COPY edge_agent/ edge_agent/
COPY model_distribution/ model_distribution/
COPY sync/ sync/
COPY testkit/ testkit/
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
    && /opt/venv/bin/pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && /opt/venv/bin/pip install --no-cache-dir "$(find /wheels -name 'cascade_serve-*.whl')[gateway]"

# --- runtime: the virtualenv only, as an unprivileged user -----------------------------------
FROM ${PYTHON_IMAGE}
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    CASCADE_HOME=/var/lib/cascade \
    CASCADE_CLOUD_GATEWAY_HOST=0.0.0.0 \
    CASCADE_CLOUD_GATEWAY_PORT=8000
RUN groupadd --system --gid 10001 cascade \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/cascade --create-home cascade
COPY --from=build /opt/venv /opt/venv
# numeric, so that Kubernetes' runAsNonRoot can check it
USER 10001:10001
WORKDIR /var/lib/cascade
EXPOSE 8000
# /healthz answers 503 while no worker is healthy: "unhealthy" means "cannot serve"
HEALTHCHECK --interval=15s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=2)"]
ENTRYPOINT ["cascade"]
# a gateway needs its workers: docker run IMAGE cloud serve --workers http://gpu-a:8000,...
CMD ["cloud", "serve", "--help"]
