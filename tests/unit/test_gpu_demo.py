"""The GPU demo's pieces that need no GPU: the vectorised fill/verify agrees
with demo_worker's pattern, the GPU worker's registration is one the daemon
accepts (allocations by storage, shared blocks, view offsets), block lists
and the report."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmap.client.cuda_export import CudaStorage
from kvmap.client.shm_export import SharedView
from kvmap.core import convert
from kvmap.core import planner as planners
from kvmap.tools import gpu_demo_worker
from kvmap.tools.demo_worker import DemoGeometry, pattern
from kvmap.tools.gpu_demo import Phase, Pull, pull_line, scattered, summary_table
from kvmap.tools.gpu_demo_worker import GpuDemoWorker, count_bad, fill_rows, pattern_rows
from kvmap.v1 import types_pb2

pytestmark = pytest.mark.timeout(60)

GEO = DemoGeometry(num_blocks=12, block_tokens=4, mla_layers=3, indexer_layers=2)
UUID = "GPU-5e0e1f2a-3b4c-5d6e-7f80-91a2b3c4d5e6"


def test_pattern_rows_is_demo_workers_pattern() -> None:
    """The GPU worker's vectorised pattern_rows produces, row for row, the same bytes as
    demo_worker's per-block pattern for each group and seed."""
    blocks = torch.tensor([0, 5, 11, 4096])
    for group, seed in ((0, 0), (1, 3)):
        rows = pattern_rows(group, blocks, 777, seed)
        for i, b in enumerate(blocks.tolist()):
            assert torch.equal(rows[i], pattern(group, b, 777, seed))


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # Three blocks of 100 bytes per chunk: exercises the chunk boundaries.
    monkeypatch.setattr(gpu_demo_worker, "CHUNK_SCRATCH_BYTES", 8 * 100 * 3)


@pytest.mark.usefixtures("small_chunks")
def test_fill_in_chunks_writes_every_block() -> None:
    """fill_rows, working in chunks smaller than the tensor, writes every block's pattern, including
    across chunk boundaries."""
    rows = torch.zeros(10, 100, dtype=torch.uint8)
    fill_rows(rows, 1, seed=2)
    for b in range(10):
        assert torch.equal(rows[b], pattern(1, b, 100, 2))


@pytest.mark.usefixtures("small_chunks")
def test_count_bad_counts_blocks_that_differ_in_the_chosen_slices() -> None:
    """count_bad counts the local blocks that differ from their remote pattern only within the given
    byte slices, across chunks, and rejects mismatched block lists."""
    remote = torch.zeros(10, 100, dtype=torch.uint8)
    fill_rows(remote, 0, seed=0)
    local = torch.zeros_like(remote)
    pairs = [(9, 0), (1, 7), (2, 3), (0, 9), (5, 5)]
    for lb, rb in pairs:
        local[lb] = remote[rb]
    lbs, rbs = [p[0] for p in pairs], [p[1] for p in pairs]
    whole = [(0, 100)]
    assert count_bad(local, 0, local=lbs, remote=rbs, slices=whole) == 0
    local[2, 70] ^= 1  # block 2 now differs at byte 70
    local[0, 10] ^= 1  # block 0 at byte 10
    assert count_bad(local, 0, local=lbs, remote=rbs, slices=whole) == 2
    assert count_bad(local, 0, local=lbs, remote=rbs, slices=[(50, 50)]) == 1
    assert count_bad(local, 0, local=lbs, remote=rbs, slices=[(20, 30)]) == 0
    with pytest.raises(ValueError, match="2 local blocks for 1 remote"):
        count_bad(local, 0, local=[0, 1], remote=[0], slices=whole)


def _fake_export(shared_block: bool) -> Any:
    """export_cuda_tensors as the caching allocator could answer: one block
    per group, or both groups carved out of one block."""

    def export(tensors: list[torch.Tensor]) -> tuple[list[CudaStorage], list[SharedView]]:
        sizes = [int(t.numel()) for t in tensors]
        if shared_block:
            total = sum(sizes) + 4096
            storages = [
                CudaStorage(0, UUID, b"\x07" * 64, 4096, sizes[0], total, 1),
                CudaStorage(0, UUID, b"\x07" * 64, 4096 + sizes[0], sizes[1], total, 2),
            ]
        else:
            storages = [
                CudaStorage(0, UUID, bytes([i + 1]) * 64, 0, n, n, i + 1)
                for i, n in enumerate(sizes)
            ]
        return storages, [SharedView(i, 0) for i in range(len(tensors))]

    return export


@pytest.mark.parametrize("shared_block", [False, True])
def test_gpu_worker_registration_is_valid_and_coalesces(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, shared_block: bool
) -> None:
    """The GPU worker registers cuda_ipc allocations on its device UUID, with no fds, that pass the
    daemon's validation and coalesce to one region per group, whether the groups share an
    allocator block or not."""
    monkeypatch.setattr(gpu_demo_worker, "export_cuda_tensors", _fake_export(shared_block))
    worker = types_pb2.WorkerId(engine_id="gpu")
    w = GpuDemoWorker(str(tmp_path / "none.sock"), worker, GEO, "cpu")  # no call is made
    try:
        req, fds = w.registration()
    finally:
        w.client.close()
    assert fds == []
    assert [a.WhichOneof("handle") for a in req.allocations] == ["cuda_ipc", "cuda_ipc"]
    assert {a.device.uuid for a in req.allocations} == {UUID}
    assert {a.device.type for a in req.allocations} == {types_pb2.DEVICE_TYPE_CUDA}
    geometry = convert.parse_and_validate(req)  # the daemon's own checks
    plan = planners.get_planner("coalesce").plan(geometry)
    assert len(plan.regions) == 2 and plan.descriptor_count == 2 * GEO.num_blocks
    indexer_page = GEO.block_tokens * 132
    last = req.views[-1]
    assert last.offset_bytes == (GEO.indexer_layers - 1) * indexer_page
    assert last.block_stride_bytes == GEO.indexer_layers * indexer_page


def test_scattered_ids_are_distinct_in_range_and_reproducible() -> None:
    """scattered returns distinct block ids within range, the same ones for the same seed, and a
    permutation when asked for all of them."""
    ids = scattered(random.Random(3), 50, 40)
    assert len(ids) == len(set(ids)) == 40 and all(0 <= b < 50 for b in ids)
    assert ids == scattered(random.Random(3), 50, 40)
    assert sorted(scattered(random.Random(1), 8, 8)) == list(range(8))


def test_report_lines_and_phase_verdict() -> None:
    """Pull lines show throughput and a yes/NO verdict or the error; a phase is OK only if every
    pull verified, all were finished and released; the summary table has one row per phase."""
    good = Pull("req-0", 4, descriptors=400, post_s=0.002, done_s=0.008, nbytes=10**8, bad_blocks=0)
    bad = Pull("req-1", 4, descriptors=8, post_s=0.001, done_s=0.001, nbytes=10**6, bad_blocks=2)
    assert good.ok and good.gbps == pytest.approx(10.0)
    assert pull_line(good).split()[-1] == "yes" and "NO: 2 blocks differ" in pull_line(bad)
    assert "FAILED UNAVAILABLE: gone" in pull_line(Pull("req-2", 4, error="UNAVAILABLE: gone"))
    base = Phase("baseline", prefill_descriptors=206_848, pulls=[good], finished=1)
    coal = Phase("coalesce", prefill_descriptors=4_096, pulls=[good, bad], finished=2)
    assert base.ok and not coal.ok
    assert not Phase("coalesce", pulls=[good], finished=0).ok  # owner never told
    assert not Phase("coalesce", pulls=[good], finished=1, released=False).ok
    header, row_b, row_c = summary_table([base, coal])
    assert "registered descs" in header and "GB/s" in header
    assert row_b.split()[:3] == ["baseline", "206,848", "400"] and row_b.endswith("yes")
    assert row_c.split()[0] == "coalesce" and row_c.endswith("NO")
