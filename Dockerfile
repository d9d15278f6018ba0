# syntax=docker/dockerfile:1
#
# kvmapd image, built from this repository's source (never from a registry):
#   docker build -t ghcr.io/kvmap/kvmapd:0.1.0 .
# torch build (default: PyPI's Linux x86_64 wheel, which is a CUDA build; pick
# a CUDA version or CPU-only explicitly with the PyTorch index):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 ...
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu ...
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
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/kvmap
ENV PATH=/opt/kvmap/bin:$PATH
RUN pip install --upgrade pip
# torch first, on its own and from the chosen index: the project pins
# torch==2.13.0 (which a local build such as 2.13.0+cu130 satisfies), so the
# next step keeps this build instead of resolving another one.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY . /src
# The project itself, from source (pulls nixl, grpcio, ... from the index).
RUN pip install /src \
 && python -c "import kvmap.daemon, kvmap.client, kvmap.v1" \
 && kvmapd --help >/dev/null

# ---------------------------------------------------------------------------
# Optional: vLLM plus the kvmap client/connector. --no-deps keeps vLLM's own
# torch; the client's runtime dependencies are the project's minus torch and
# nixl (only the daemon imports nixl). tests/deploy checks this list against
# pyproject.toml.
FROM ${VLLM_IMAGE} AS vllm-kvmap
COPY --from=build /src /tmp/kvmap-src
RUN python3 -m pip install --no-cache-dir --no-deps /tmp/kvmap-src \
 && python3 -m pip install --no-cache-dir "grpcio>=1.70" "grpcio-health-checking>=1.70" "grpcio-reflection>=1.70" "protobuf>=7.35.1" "structlog>=24.1" "prometheus-client>=0.20" \
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
