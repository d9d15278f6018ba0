"""Plain-text tables of region maps and workers, for ``kvmapd plan`` and ``kvmapctl``.

Takes the wire messages so that both the daemon (planning locally) and the
CLI (reading a remote daemon) render exactly the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvmap.v1 import region_maps_pb2, types_pb2

Row = TypeVar("Row")

# Layer names like "model.layers.61.self_attn.attn" are long; a column of two
# of them stays readable when each is cut to this many characters.
_MAX_NAME = 32


def render_region_map(m: types_pb2.RegionMap) -> str:
    saving = _saving(m.descriptor_count, m.baseline_descriptor_count)
    header = [
        ("worker", _worker(m.worker)),
        ("generation", str(m.generation)),
        ("planner", _planner(m.planner)),
        (
            "layout",
            f"{m.kv_cache_layout or '-'}, {m.block_size_tokens} tokens per block, "
            f"tp_size {m.tp_size or 1}, {m.view_count} views",
        ),
        (
            "descriptors",
            f"{m.descriptor_count:,} in {len(m.regions)} regions "
            f"(baseline {m.baseline_descriptor_count:,}, saving {saving})",
        ),
    ]
    width = max(len(k) for k, _ in header)
    lines = [f"{k:<{width}}  {v}" for k, v in header]
    rows = [
        [
            str(r.id),
            str(r.transfer_group),
            r.allocation_id,
            str(r.offset_bytes),
            str(r.block_len_bytes),
            str(r.block_stride_bytes),
            str(r.num_blocks),
            "yes" if r.full_row else "no",
            str(len(r.layer_names)),
            _layer_range(r.layer_names),
            r.fallback_reason,
        ]
        for r in m.regions
    ]
    headers = ["id", "group", "allocation", "offset", "len", "stride", "blocks", "full_row"]
    headers += ["layers", "first..last", "fallback"]
    lines += ["", *_table(headers, rows, numeric={0, 1, 3, 4, 5, 6, 8})]
    return "\n".join(lines) + "\n"


def render_workers(resp: region_maps_pb2.ListWorkersResponse, wide: bool = False) -> str:
    lines = [f"daemon {resp.daemon_instance or '-'}  planner {_planner(resp.planner)}"]
    if not resp.workers:
        return "\n".join([*lines, "(no workers registered)"]) + "\n"
    return "\n".join([*lines, "", *workers_table(resp.workers, wide)]) + "\n"


def workers_table(workers: Sequence[region_maps_pb2.WorkerSummary], wide: bool) -> list[str]:
    """One line per worker; ``wide`` adds the view and baseline counts."""
    columns: list[Column[region_maps_pb2.WorkerSummary]] = [
        Column("worker", lambda w: _worker(w.worker)),
        Column("gen", lambda w: str(w.generation), numeric=True),
        Column("planner", lambda w: _planner(w.planner)),
        Column("regions", lambda w: str(w.region_count), numeric=True),
        Column("views", lambda w: str(w.view_count), numeric=True, wide=True),
        Column("descriptors", lambda w: f"{w.descriptor_count:,}", numeric=True),
        Column("baseline", lambda w: f"{w.baseline_descriptor_count:,}", numeric=True, wide=True),
        Column("saving", lambda w: _saving(w.descriptor_count, w.baseline_descriptor_count)),
        Column("registered", lambda w: _bytes(w.registered_bytes), numeric=True),
    ]
    return columns_table(columns, workers, wide)


def worker_id(w: types_pb2.WorkerId) -> str:
    """A worker as ``workers`` prints it (and ``regions`` takes it)."""
    return _worker(w)


def _worker(w: types_pb2.WorkerId) -> str:
    # Same spelling as geometry.WorkerKey.__str__, which the logs use.
    return f"{w.engine_id}/dp{w.dp_rank}/tp{w.tp_rank}/pp{w.pp_rank}"


def _planner(p: types_pb2.PlannerInfo) -> str:
    return f"{p.name} v{p.version}" if p.name else "-"


def _saving(descriptors: int, baseline: int) -> str:
    if baseline <= 0:
        return "n/a"
    return f"{100.0 * (baseline - descriptors) / baseline:.1f}%"


def bytes_text(n: int) -> str:
    return _bytes(n)


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _short(name: str) -> str:
    # Cut at the end: the layer number near the front is what tells rows apart.
    return name if len(name) <= _MAX_NAME else name[: _MAX_NAME - 3] + "..."


def _layer_range(names: Sequence[str]) -> str:
    if not names:
        return "-"
    if len(names) == 1:
        return _short(names[0])
    joiner = ", " if len(names) == 2 else " .. "
    return _short(names[0]) + joiner + _short(names[-1])


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: set[int]) -> list[str]:
    """Aligned columns: numbers to the right, text to the left."""
    widths = [max([len(h)] + [len(row[c]) for row in rows]) for c, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        padded = (
            cell.rjust(widths[c]) if c in numeric else cell.ljust(widths[c])
            for c, cell in enumerate(cells)
        )
        return "  ".join(padded).rstrip()

    return [line(headers), *(line(row) for row in rows)]


@dataclass(frozen=True)
class Column(Generic[Row]):
    """A table column: its header, its cell of a row, its alignment, and
    whether only ``-o wide`` shows it."""

    header: str
    cell: Callable[[Row], str]
    numeric: bool = False
    wide: bool = False


def columns_table(columns: Sequence[Column[Row]], rows: Sequence[Row], wide: bool) -> list[str]:
    shown = [c for c in columns if wide or not c.wide]
    cells = [[c.cell(row) for c in shown] for row in rows]
    numeric = {i for i, c in enumerate(shown) if c.numeric}
    return _table([c.header for c in shown], cells, numeric)
