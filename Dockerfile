# syntax=docker/dockerfile:1
#
# kvmapd image, built from this repository's source (never from a registry):
#   docker build -t ghcr.io/kvmap/kvmapd:0.1.0 .
# It holds no torch: kvmapd never imports it (docs/image.md).
# The vLLM image with the kvmap connector installed (the manifests' vllm-kvmap):
#   docker build --target vllm-kvmap --build-arg VLLM_IMAGE=vllm/vllm-openai:<tag> \
#     -t ghcr.io/kvmap/vllm-kvmap:0.1.0 .
# The build context is an allowlist (.dockerignore): pyproject.toml, README.md,
# the package sources and the default config.
# Without a Docker engine: deploy/image/build-and-check.sh builds this file
# with buildah and checks the image against deploy/k8s (docs/image.md).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:latest

# ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
# The project's `nixl` extra pins nixl==1.5.1: keep the two equal (tests/deploy).
ARG NIXL_VERSION=1.5.1
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/kvmap
ENV PATH=/opt/kvmap/bin:$PATH
RUN pip install --upgrade pip
# NIXL's CUDA 13 wheel (the one `import nixl` picks where no CUDA 12 torch is
# installed), without its declared dependencies: torch, which neither its API
# nor kvmapd imports, and numpy, a dependency of the project. The wheel also
# holds nixl_ep_cu13 (expert-parallel torch extensions, 91 MB) and UCX's
# perftest, which kvmap never loads: removed, as tests/gpu/fetch_wheels.sh does.
RUN pip install --no-deps "nixl-cu13==${NIXL_VERSION}" \
 && site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && rm -r "$site/nixl_ep_cu13" "$site"/nixl_cu13.libs/ucx/libucx_perftest*
COPY . /src
# The project itself, from source (pulls grpcio, numpy, ... from the index),
# with OpenTelemetry's OTLP exporter (the `traces` extra: spans are sent only
# where an endpoint is configured), then proof that NIXL loads, the exporter
# imports and torch is nowhere.
RUN pip install "/src[traces]" \
 && python -c "import kvmap.daemon, kvmap.client, kvmap.v1" \
 && python -c "import kvmap.tracing.otel" \
 && python -c "from kvmap.daemon.adapters.nixl_agent import nixl_module; nixl_module('_api')" \
 && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch'" \
 && kvmapd --help >/dev/null

# ---------------------------------------------------------------------------
# Optional: vLLM plus the kvmap client/connector. --no-deps keeps vLLM's own
# torch; then the project's runtime dependencies (none is torch or nixl; only
# the daemon imports nixl). tests/deploy checks this list against
# pyproject.toml.
FROM ${VLLM_IMAGE} AS vllm-kvmap
COPY --from=build /src /tmp/kvmap-src
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/kvmap-src \
 && python3 -m pip install --no-cache-dir "grpcio>=1.70" "grpcio-health-checking>=1.70" "grpcio-reflection>=1.70" "protobuf>=7.35.1" "structlog>=24.1" "prometheus-client>=0.20" "numpy>=2" \
 && rm -rf /tmp/kvmap-src \
 && python3 -c "import importlib.util as u; assert u.find_spec('kvmap.client.vllm_connector')"

# ---------------------------------------------------------------------------
# Default target: the kvmapd sidecar.
FROM ${PYTHON_IMAGE} AS kvmapd
# No rdma-core from Debian: the nixl wheels bundle UCX with its own rdma-core
# user space (libibverbs, libmlx5, libnl). Debian's copies next to them put a
# second libibverbs and libnl into the process (UCX's EFA transport loads
# Debian's libefa, which links them), and kvmapd then segfaults at every exit
# in the bundled libnl's destructor (found by deploy/image/build-and-check.sh,
# see docs/image.md). libnuma1 is the system library the project is tested
# with. The CUDA driver comes from the host through the NVIDIA container runtime.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1 \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 kvmap \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin kvmap \
 && mkdir -p /etc/kvmap /run/kvmap /var/lib/kvmap \
 && chown 10001:10001 /run/kvmap /var/lib/kvmap
COPY --from=build /opt/kvmap /opt/kvmap
# Default configuration; Kubernetes mounts the ConfigMap over /etc/kvmap.
COPY deploy/k8s/base/kvmapd.toml /etc/kvmap/kvmapd.toml
ENV PATH=/opt/kvmap/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
# Numeric, so that the kubelet can verify runAsNonRoot.
USER 10001:10001
# 50051: Peer, RegionMaps, health, reflection (--listen); 9464: /metrics.
EXPOSE 50051 9464
ENTRYPOINT ["kvmapd"]
CMD ["serve", "--config", "/etc/kvmap/kvmapd.toml"]
