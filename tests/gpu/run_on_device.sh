#!/usr/bin/env bash
# kvmap's GPU check, in one script: a few minutes on one GPU (about 4 on an H200).
#
#   bash tests/gpu/run_on_device.sh            # from anywhere; output also under $OUT or ./gpu-out
#
# Needs on the GPU machine:
#   - Linux x86-64, an NVIDIA driver (libcuda.so.1), one GPU with about 20 GiB free;
#   - python3 >= 3.11 with a CUDA build of torch, numpy, pytest and pytest-timeout (the
#     device image's python3 has them; PYTHON=... picks another interpreter);
#   - kvmap's other dependencies (nixl-cu13, grpcio >= 1.85.1, protobuf >= 7.35, structlog,
#     grpcio-health-checking, grpcio-reflection, prometheus-client), from one of:
#       .whl/   wheels made by `bash tests/gpu/fetch_wheels.sh` where PyPI is reachable
#               (about 36 MB; carry it: the device machine has no network), or
#       PyPI    when this machine reaches it, or
#       the interpreter itself, e.g. PYTHON=.venv/bin/python for a venv made on a GPU
#               machine. The .venv that .ci/setup makes here does not do: its torch is the
#               CPU build, and it is far larger than the 64 MiB a device run carries.
# Installs nothing into the system: packages go to a temporary --target directory, and the
# project's source roots go on PYTHONPATH (daemon/, client/, protos/gen/, tools/: each
# holds part of the kvmap namespace package in folders named as they are imported).
#
# Steps (each bounded by `timeout`; later steps run even when one fails):
#   1. environment: GPU, driver, python, torch;
#   2. ipc_probe.py: open a worker's IPC handle as kvmapd does, and whether memory kvmapd
#      imported can be re-exported (what UCX cuda_ipc needs between two daemons);
#   3. pytest: the CUDA IPC unit tests (fake driver) and tests/gpu (real driver);
#   4. kvmap.tools.gpu_demo: two kvmapd + two GPU workers, GLM-5.3 geometry scaled to
#      $KVMAP_GPU_BLOCKS blocks (default 2048, 2 x 7 GiB), baseline then coalesce, scattered
#      pulls, every byte verified, dead-worker memory release; UCX protocol choices logged.
# Writes to $OUT: summary.txt env.txt probe.txt pytest.txt demo.txt ucx.txt logs.tgz
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
out=${OUT:-$root/gpu-out}
mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/kvmap-gpu.XXXXXX")
trap 'rm -rf "$work"' EXIT
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
declare -A rc

step() { echo; echo "=== $* ($(date +%T))"; }

step "1. environment"
{
  nvidia-smi -L || echo "nvidia-smi: not available"
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv || true
  "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "| torch", torch.__version__,
"| CUDA", torch.version.cuda, "| devices", torch.cuda.device_count())'
} 2>&1 | tee "$out/env.txt"

step "2. python packages"
site=$work/site
if compgen -G ".whl/*.whl" >/dev/null; then
  echo "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into $site"
  timeout 300 "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
elif ! "$py" -c 'import nixl._api, structlog, grpc_health, grpc_reflection' 2>/dev/null; then
  echo "no .whl/: trying PyPI"
  timeout 300 "$py" -m pip install -q --no-compile --target "$site" nixl==1.5.1 nixl-cu13==1.5.1 \
    "grpcio>=1.85.1" grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
    "protobuf>=7.35.1" structlog prometheus-client
fi
# The source roots of the kvmap namespace package (folders named as imported).
src="$root/daemon:$root/client:$root/protos/gen:$root/tools"
# Ours first, then the wheels (they replace an older grpcio/protobuf of the image).
export PYTHONPATH="$src:$site${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c '
import torch, nixl._api, kvmap.daemon.api.server, kvmap.daemon.adapters.cuda_ipc, kvmap.v1.registry_pb2_grpc
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("imports OK: nixl", nixl._api.__file__)'; then
  echo "kvmap GPU check: the environment is incomplete (see above); nothing else can run"
  exit 2
fi

step "3. CUDA IPC probe"
timeout 120 "$py" tests/gpu/ipc_probe.py 2>&1 | tee "$out/probe.txt"
rc[probe]=${PIPESTATUS[0]}

step "4. pytest: tests/unit/test_cuda_ipc.py tests/unit/test_gpu_demo.py tests/gpu"
# test_gpu_pd runs gpu_demo at a small size; step 5 runs it at scale, so skip it here.
timeout 300 "$py" -m pytest -q -p no:cacheprovider -rs -o cache_dir="$work/.pytest" \
  tests/unit/test_cuda_ipc.py tests/unit/test_gpu_demo.py tests/gpu \
  --deselect tests/gpu/test_gpu_pd.py::test_gpu_pulls_verify_under_both_planners 2>&1 |
  tee "$out/pytest.txt"
rc[pytest]=${PIPESTATUS[0]}

step "5. P/D pulls on the GPU: baseline and coalesce"
# UCX prints the protocol it picks per operation: shows whether cuda_ipc carried the data.
UCX_PROTO_INFO=y timeout 480 "$py" -m kvmap.tools.gpu_demo --blocks "${KVMAP_GPU_BLOCKS:-2048}" \
  --logs "$work/logs" 2>&1 | tee "$out/demo.txt"
rc[demo]=${PIPESTATUS[0]}

step "6. UCX protocols used by the daemons"
{
  grep -rhoE "[^|]*(cuda_ipc|cuda_copy|rndv|zcopy|bcopy)[^|]*" "$work/logs" 2>/dev/null |
    sed 's/^ *//; s/ *$//' | sort | uniq -c | sort -rn | head -40
} | tee "$out/ucx.txt"
tar -C "$work" -czf "$out/logs.tgz" logs 2>/dev/null || true

{
  echo "kvmap GPU check on $(nvidia-smi -L 2>/dev/null | head -1)"
  for k in probe pytest demo; do echo "  $k: exit ${rc[$k]}"; done
  grep -E "^  (planner|baseline|coalesce) " "$out/demo.txt" || true
  tail -1 "$out/demo.txt"
} | tee "$out/summary.txt"
for k in probe pytest demo; do [ "${rc[$k]}" = 0 ] || exit 1; done
exit 0
