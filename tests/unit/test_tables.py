"""tables: the text kvmapd plan and kvmapctl print."""

from __future__ import annotations

from kvmap.daemon.cli import tables
from kvmap.v1 import region_maps_pb2, types_pb2


def _summary(engine: str, descriptors: int, baseline: int) -> region_maps_pb2.WorkerSummary:
    return region_maps_pb2.WorkerSummary(
        worker=types_pb2.WorkerId(engine_id=engine, tp_rank=1),
        generation=3,
        planner=types_pb2.PlannerInfo(name="coalesce", version=1),
        region_count=2,
        view_count=101,
        descriptor_count=descriptors,
        baseline_descriptor_count=baseline,
        registered_bytes=3 * 1024**3 // 2,
    )


def test_render_workers() -> None:
    """The wide workers table has a daemon/planner header, one row per worker with generation,
    planner, counts, thousands separators, saving and registered size, "n/a" saving when there is
    no baseline, and aligned columns; the default one leaves out the views and baseline columns."""
    resp = region_maps_pb2.ListWorkersResponse(
        daemon_instance="pod-a",
        planner=types_pb2.PlannerInfo(name="coalesce", version=1),
        workers=[_summary("glm", 64_044, 3_234_222), _summary("odd", 0, 0)],
    )
    assert tables.render_workers(resp).splitlines()[2].split() == [
        "worker", "gen", "planner", "regions", "descriptors", "saving", "registered",
    ]  # fmt: skip
    lines = tables.render_workers(resp, wide=True).splitlines()
    assert lines[0] == "daemon pod-a  planner coalesce v1"
    assert lines[2].split() == [
        "worker", "gen", "planner", "regions", "views", "descriptors", "baseline", "saving",
        "registered",
    ]  # fmt: skip
    assert lines[3].split() == [
        "glm/dp0/tp1/pp0", "3", "coalesce", "v1", "2", "101", "64,044", "3,234,222", "98.0%",
        "1.5", "GiB",
    ]  # fmt: skip
    assert lines[4].split()[8] == "n/a"
    assert len({len(line) for line in lines[2:4]}) == 1  # right-aligned numbers line up


def test_render_workers_without_workers() -> None:
    """An empty ListWorkers response renders as "-" placeholders and "(no workers registered)"."""
    text = tables.render_workers(region_maps_pb2.ListWorkersResponse())
    assert text == "daemon -  planner -\n(no workers registered)\n"


def test_render_region_map_abbreviates_long_layer_names() -> None:
    """A region with many long layer names shows the count and the first and last names truncated
    with "...", and a map without a baseline shows "saving n/a"."""
    names = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(23)]
    region = types_pb2.Region(
        id=0,
        allocation_id="kv",
        block_len_bytes=10,
        block_stride_bytes=20,
        num_blocks=5,
        layer_names=names,
        fallback_reason="",
    )
    m = types_pb2.RegionMap(
        worker=types_pb2.WorkerId(engine_id="e"), regions=[region], descriptor_count=5
    )
    text = tables.render_region_map(m)
    assert "(baseline 0, saving n/a)" in text
    row = text.splitlines()[-1]
    assert row.split()[7:11] == ["no", "23", "model.layers.0.self_attn.inde...", ".."]
    assert row.endswith("model.layers.22.self_attn.ind...")
