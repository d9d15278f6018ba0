"""``demo_worker`` with its KV cache on a GPU: the same GLM-like
block-outermost layout and JSON-line commands, but the rows are torch CUDA
tensors, exported as CUDA IPC handles by ``kvmap.client.cuda_export`` (the
client's exporter: versioned-handle parsing, expandable-segment refusal,
block sizes from the caching allocator) instead of shared-memory fds.

Filling and verifying run on the GPU in chunks (one pass per chunk of
blocks, never a Python loop per block), so a worker of several GiB fills and
checks in well under a second. Block contents are ``demo_worker.pattern``
(``kvmap.tools.block_pattern``): a decode worker verifies what it pulled
without seeing prefill's memory.
Run by ``kvmap.tools.gpu_demo`` and tests/gpu.
"""

from __future__ import annotations

import sys

import torch

from kvmap.client.cuda_export import export_cuda_tensors
from kvmap.tools import demo_worker
from kvmap.tools.demo_worker import (
    DemoGeometry,
    DemoWorker,
    geometry,
    pattern_rows,
    serve_worker,
    worker_arguments,
    worker_id,
)
from kvmap.v1 import registry_pb2, types_pb2

__all__ = ["GpuDemoWorker", "chunk_blocks", "count_bad", "fill_rows", "main", "pattern_rows"]

# Bytes of int64 scratch one fill/verify chunk may use on the GPU.
CHUNK_SCRATCH_BYTES = 512 << 20


def chunk_blocks(row_bytes: int) -> int:
    """Blocks per chunk so that one chunk's int64 scratch fits the budget."""
    return demo_worker.chunk_blocks(row_bytes, CHUNK_SCRATCH_BYTES)


def fill_rows(rows: torch.Tensor, group: int, seed: int) -> None:
    """``demo_worker.fill_rows`` within this module's scratch budget."""
    demo_worker.fill_rows(rows, group, seed, scratch_bytes=CHUNK_SCRATCH_BYTES)


def count_bad(
    rows: torch.Tensor,
    group: int,
    *,
    local: list[int],
    remote: list[int],
    slices: list[tuple[int, int]],
    seed: int = 0,
) -> int:
    """``demo_worker.count_bad`` within this module's scratch budget."""
    return demo_worker.count_bad(
        rows,
        group,
        local=local,
        remote=remote,
        slices=slices,
        seed=seed,
        scratch_bytes=CHUNK_SCRATCH_BYTES,
    )


class GpuDemoWorker(DemoWorker):
    def __init__(
        self, socket: str, worker: types_pb2.WorkerId, geo: DemoGeometry, device: str
    ) -> None:
        self.device = torch.device(device)
        super().__init__(socket, worker, geo)

    def _allocate(self) -> list[torch.Tensor]:
        return [
            torch.zeros(
                self.geo.num_blocks, g.layers * g.page_bytes, dtype=torch.uint8, device=self.device
            )
            for g in self.geo.groups
        ]

    def registration(self) -> tuple[registry_pb2.RegisterWorkerRequest, list[int]]:
        req = registry_pb2.RegisterWorkerRequest(
            worker=self.worker, kv_cache_layout="BLHNC", block_size_tokens=self.geo.block_tokens
        )
        # One allocation per distinct storage (the caching allocator may put
        # both groups in one cudaMalloc block: then they share a handle).
        storages, placed = export_cuda_tensors(self.rows)
        for si, s in enumerate(storages):
            req.allocations.append(s.allocation(f"kv-cuda{si}"))
        for gi, (g, where) in enumerate(zip(self.geo.groups, placed, strict=True)):
            for li, name in enumerate(self.geo.layer_names(gi)):
                req.views.add(
                    layer_name=name,
                    allocation_id=f"kv-cuda{where.storage_index}",
                    transfer_group=gi,
                    cache_kind=g.kind,
                    dtype="uint8",
                    offset_bytes=where.offset_bytes + li * g.page_bytes,
                    block_len_bytes=g.page_bytes,
                    block_stride_bytes=g.layers * g.page_bytes,
                    num_blocks=self.geo.num_blocks,
                )
        return req, []

    def fill(self, seed: int = 0) -> None:
        self.seed = seed
        for gi, rows in enumerate(self.rows):
            fill_rows(rows, gi, seed)
        torch.cuda.synchronize(self.device)

    def verify(
        self, group: int, local: list[int], remote: list[int], layers: list[str], seed: int = 0
    ) -> int:
        slices = self.layer_slices(group, layers)
        return count_bad(
            self.rows[group], group, local=local, remote=remote, slices=slices, seed=seed
        )


def main(argv: list[str] | None = None) -> int:
    p = worker_arguments("kvmap-gpu-demo-worker")
    p.add_argument("--device", default="cuda:0")
    args = p.parse_args(argv)
    w = GpuDemoWorker(args.socket, worker_id(args), geometry(args), args.device)
    return serve_worker(w, fill=args.fill, kv_bytes=sum(int(r.numel()) for r in w.rows))


if __name__ == "__main__":
    sys.exit(main())
