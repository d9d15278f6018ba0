"""A stand-in for a vLLM worker, run as its own process by ``kvmapd demo`` and
by the integration tests: it allocates a GLM-like block-outermost KV cache in
shared memory, hands it to its kvmapd (fd over SCM_RIGHTS), keeps the Attach
stream open, and obeys JSON-line commands on stdin (grant, pull, push,
verify, ...), answering one JSON line each on stdout. As a vLLM prefill
worker does, the owner of the blocks grants a transfer (``grant``: a
capability for exactly those blocks of one request) and the other side's
``pull``/``push`` carries that ``capability``.

Block contents are a pure function of (group, block id, byte, seed), distinct
for every 8-byte word of the cache (``kvmap.tools.block_pattern``), so a
decode worker verifies what it pulled without seeing the prefill worker's
memory, and a block pulled from any other block, group or offset fails.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
from google.protobuf import json_format

from kvmap.client.client import KvmapClient
from kvmap.client.errors import status_name
from kvmap.client.session import Backoff, WorkerSession
from kvmap.client.shm_export import export_tensor
from kvmap.core.config import DaemonConfig
from kvmap.core.errors import KvmapError
from kvmap.tools import block_pattern, json_lines
from kvmap.v1 import registry_pb2, transfers_pb2, types_pb2

# A restarted sidecar is back within a second or two.
RECONNECT = Backoff(initial_s=0.05, max_s=1.0)

# GLM-5.3's per-token page sizes (bytes): MLA latent 656, indexer key 132.
MLA_TOKEN_BYTES = 656
INDEXER_TOKEN_BYTES = 132


@dataclass(frozen=True)
class GroupLayout:
    kind: int  # types_pb2.CacheKind
    layers: int
    page_bytes: int
    prefix: str


@dataclass(frozen=True)
class DemoGeometry:
    num_blocks: int
    block_tokens: int
    mla_layers: int
    indexer_layers: int

    @property
    def groups(self) -> tuple[GroupLayout, ...]:
        # A group without layers has no memory to register (a model without
        # an indexer): it is left out rather than registered empty.
        return tuple(g for g in self._all_groups() if g.layers)

    def _all_groups(self) -> tuple[GroupLayout, ...]:
        return (
            GroupLayout(
                types_pb2.CACHE_KIND_MLA,
                self.mla_layers,
                self.block_tokens * MLA_TOKEN_BYTES,
                "model.layers.{}.self_attn.attn",
            ),
            GroupLayout(
                types_pb2.CACHE_KIND_INDEXER,
                self.indexer_layers,
                self.block_tokens * INDEXER_TOKEN_BYTES,
                "model.layers.{}.self_attn.indexer.k_cache",
            ),
        )

    def layer_names(self, group: int) -> list[str]:
        g = self.groups[group]
        # Indexer layers are numbered after the MLA ones, as distinct names.
        first = 0 if group == 0 else self.mla_layers
        return [g.prefix.format(first + i) for i in range(g.layers)]


# kvmapd's transfer deadline when a spec names none (core.config), and how
# much longer a transfer call waits for the daemon's answer.
DEFAULT_TRANSFER_TIMEOUT_S = DaemonConfig.transfer_timeout_s
CALL_GRACE_S = 5.0

# Bytes of int64 scratch one fill/verify chunk may use.
CHUNK_SCRATCH_BYTES = 512 << 20


def _int64(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def pattern_rows(view: int, blocks: torch.Tensor, row_bytes: int, seed: int = 0) -> torch.Tensor:
    """``block_pattern``'s bytes of many blocks at once, on ``blocks.device``:
    a ``[len(blocks), row_bytes]`` uint8 tensor (view = transfer group here:
    a row holds all layers of a group)."""
    words = -(-row_bytes // block_pattern.WORD_BYTES)
    b = blocks.to(torch.int64)
    if b.numel():
        block_pattern.check_bounds(int(b.min().item()), int(b.max().item()), words)
    w = torch.arange(words, dtype=torch.int64, device=b.device)
    x = (b[:, None] << block_pattern.WORD_BITS) | w[None, :]
    x ^= _int64(block_pattern.key_mask(view, seed))
    tmp = torch.empty_like(x)
    for shift, mul in block_pattern.ROUNDS:
        # A logical right shift: torch's >> on int64 is arithmetic.
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp &= (1 << (64 - shift)) - 1
        x ^= tmp
        if mul != 1:
            # int64 multiplication keeps the low 64 bits, as uint64's does.
            x *= _int64(mul)
    # Little-endian, as on every platform kvmap runs on (x86-64, arm64, CUDA).
    return x.view(torch.uint8)[:, :row_bytes]


def pattern(group: int, block: int, row_bytes: int, seed: int = 0) -> torch.Tensor:
    """The bytes of block ``block`` of group ``group`` on a prefill worker."""
    return pattern_rows(group, torch.tensor([block]), row_bytes, seed)[0]


def chunk_blocks(row_bytes: int, scratch_bytes: int = CHUNK_SCRATCH_BYTES) -> int:
    """Blocks per chunk so that one chunk's int64 scratch fits the budget."""
    return max(1, scratch_bytes // (8 * max(row_bytes, 1)))


def fill_rows(
    rows: torch.Tensor, group: int, seed: int = 0, scratch_bytes: int = CHUNK_SCRATCH_BYTES
) -> None:
    """Write group ``group``'s pattern into every block (row) of ``rows``,
    chunk by chunk (never a Python loop per block)."""
    n, row_bytes = rows.shape
    step = chunk_blocks(row_bytes, scratch_bytes)
    for start in range(0, n, step):
        blocks = torch.arange(start, min(n, start + step), device=rows.device)
        rows[start : start + len(blocks)] = pattern_rows(group, blocks, row_bytes, seed)


def count_bad(
    rows: torch.Tensor,
    group: int,
    *,
    local: list[int],
    remote: list[int],
    slices: list[tuple[int, int]],
    seed: int = 0,
    scratch_bytes: int = CHUNK_SCRATCH_BYTES,
) -> int:
    """How many ``local[i]`` rows differ from remote block ``remote[i]``'s
    pattern in any of the byte ``slices`` (offset, length)."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local blocks for {len(remote)} remote blocks")
    row_bytes = rows.shape[1]
    step = chunk_blocks(row_bytes, scratch_bytes)
    bad = 0
    for start in range(0, len(local), step):
        lb = torch.tensor(local[start : start + step], dtype=torch.int64, device=rows.device)
        rb = torch.tensor(remote[start : start + step], dtype=torch.int64, device=rows.device)
        want = pattern_rows(group, rb, row_bytes, seed)
        got = rows[lb]  # a gather; index_select is far slower on uint8 rows
        differs = torch.zeros(len(lb), dtype=torch.bool, device=rows.device)
        for off, n in slices:
            differs |= (got[:, off : off + n] != want[:, off : off + n]).any(dim=1)
        bad += int(differs.sum().item())
    return bad


class DemoWorker:
    def __init__(self, socket: str, worker: types_pb2.WorkerId, geo: DemoGeometry) -> None:
        self.geo = geo
        self.worker = worker
        self.client = KvmapClient.connect(socket)
        # One allocation per transfer group: [num_blocks, layers * page]
        # (block-outermost: a block's layers are adjacent in one row).
        self.rows = self._allocate()
        self.seed = 0
        # The engine's tensor-parallel size this rank registers with (ranks
        # above 0 need it: kvmapd refuses tp_rank >= tp_size).
        self.tp_size = 1
        self.events: list[dict[str, Any]] = []
        self.session: WorkerSession | None = None
        self._events_lock = threading.Lock()

    def _allocate(self) -> list[torch.Tensor]:
        return [
            torch.zeros(self.geo.num_blocks, g.layers * g.page_bytes, dtype=torch.uint8)
            for g in self.geo.groups
        ]

    def registration(self) -> tuple[registry_pb2.RegisterWorkerRequest, list[int]]:
        req = registry_pb2.RegisterWorkerRequest(
            worker=self.worker,
            kv_cache_layout="BLHNC",
            block_size_tokens=self.geo.block_tokens,
            tp_size=self.tp_size,
        )
        fds: list[int] = []
        for gi, (g, rows) in enumerate(zip(self.geo.groups, self.rows, strict=True)):
            # Into a memfd sealed against shrinking, as the daemon requires.
            fd, size, _ = export_tensor(rows)
            fds.append(fd)
            alloc_id = f"kv-group{gi}"
            req.allocations.add(
                id=alloc_id,
                size_bytes=size,
                device=types_pb2.Device(type=types_pb2.DEVICE_TYPE_CPU),
                shm_fd=types_pb2.ShmFdHandle(index=gi),
            )
            for li, name in enumerate(self.geo.layer_names(gi)):
                req.views.add(
                    layer_name=name,
                    allocation_id=alloc_id,
                    transfer_group=gi,
                    cache_kind=g.kind,
                    dtype="uint8",
                    offset_bytes=li * g.page_bytes,
                    block_len_bytes=g.page_bytes,
                    block_stride_bytes=g.layers * g.page_bytes,
                    num_blocks=self.geo.num_blocks,
                )
        return req, fds

    def register(self) -> types_pb2.RegionMap:
        """Register the current memory. The first call starts the client
        library's session, which keeps the worker attached (and registered
        again when a restarted daemon does not know it) for the life of the
        process; later calls register anew (a new generation)."""
        req, fds = self.registration()
        if self.session is None:
            self.session = WorkerSession(
                self.client, req, fds, on_event=self._on_event, backoff=RECONNECT
            )
            return self.session.start(timeout_s=60)
        self.session.request, self.session.fds = req, fds
        registered = self.client.register_worker(req, fds)
        self.session.region_map = registered.region_map
        self.session.features = frozenset(registered.features)
        return registered.region_map

    def _on_event(self, event: registry_pb2.AttachResponse) -> None:
        self._record(json_format.MessageToDict(event, preserving_proto_field_name=True))

    def fill(self, seed: int = 0) -> None:
        self.seed = seed
        for gi, rows in enumerate(self.rows):
            fill_rows(rows, gi, seed)

    def _record(self, event: dict[str, Any]) -> None:
        with self._events_lock:
            self.events.append(event)

    def layer_slices(self, group: int, layers: list[str]) -> list[tuple[int, int]]:
        g = self.geo.groups[group]
        names = self.geo.layer_names(group)
        chosen = layers or names
        return [(names.index(n) * g.page_bytes, g.page_bytes) for n in chosen]

    def verify(
        self, group: int, local: list[int], remote: list[int], layers: list[str], seed: int = 0
    ) -> int:
        """Local block ``local[i]`` holds remote block ``remote[i]``'s bytes
        (written with ``seed``) in the selected layers; returns the number of
        mismatching blocks."""
        slices = self.layer_slices(group, layers)
        return count_bad(
            self.rows[group], group, local=local, remote=remote, slices=slices, seed=seed
        )

    def digest(self) -> list[str]:
        """sha256 of every group's whole memory (to show bytes were untouched:
        any change, a reordering of bytes included, changes it)."""
        host = (rows.cpu().contiguous().numpy() for rows in self.rows)
        return [hashlib.sha256(h.data).hexdigest() for h in host]


def _spec(cmd: dict[str, Any], worker: types_pb2.WorkerId) -> transfers_pb2.TransferSpec:
    spec = transfers_pb2.TransferSpec(
        request_id=cmd["request_id"],
        local_worker=worker,
        remote_target=cmd["remote_target"],
        remote_worker=json_format.ParseDict(cmd["remote_worker"], types_pb2.WorkerId()),
        remote_generation=int(cmd.get("remote_generation", 0)),
        timeout_ms=int(cmd.get("timeout_ms", 0)),
        # From the remote owner's ``grant`` command; the daemons refuse a
        # transfer without one.
        capability=cmd.get("capability", ""),
    )
    for g in cmd["groups"]:
        spec.groups.add(
            transfer_group=g["group"],
            local_block_ids=g["local"],
            remote_block_ids=g["remote"],
            layer_names=g.get("layers", []),
        )
    return spec


def _failed(err: KvmapError) -> dict[str, Any]:
    return {"ok": False, "code": status_name(err), "message": err.message}


def _transfer(w: DemoWorker, op: str, cmd: dict[str, Any]) -> dict[str, Any]:
    """``pull`` or ``push`` (with the remote owner's ``capability``), and for
    a pull the count of blocks whose bytes do not verify."""
    spec = _spec(cmd, w.worker)
    # The call outlasts the daemon's own deadline for the transfer, so that
    # the daemon's answer (its last error after retries) is what comes back,
    # not the client's DEADLINE_EXCEEDED racing it.
    timeout_s = (spec.timeout_ms / 1000 or DEFAULT_TRANSFER_TIMEOUT_S) + CALL_GRACE_S
    try:
        transfer = w.client.pull if op == "pull" else w.client.push
        result = transfer(spec, timeout_s)
    except KvmapError as err:
        return _failed(err)
    out: dict[str, Any] = {"ok": True, "stats": result.__dict__}
    if op == "pull" and cmd.get("verify", True):
        seed = int(cmd.get("seed", 0))
        out["bad_blocks"] = sum(
            w.verify(g["group"], g["local"], g["remote"], g.get("layers", []), seed)
            for g in cmd["groups"]
        )
    return out


_ACCESS = {"read": registry_pb2.GRANT_ACCESS_READ, "write": registry_pb2.GRANT_ACCESS_WRITE}


def _grant(w: DemoWorker, cmd: dict[str, Any]) -> dict[str, Any]:
    """``grant``: this worker (the owner) lets a peer read (``access``
    "read", the default) or write ("write") exactly ``groups`` ([{"group",
    "blocks"}]) for ``request_id``; ``revoke`` takes every grant of
    ``request_id`` back."""
    try:
        if cmd["cmd"] == "revoke":
            w.client.revoke_transfer(w.worker, cmd["request_id"])
            return {"ok": True}
        blocks: dict[int, list[int]] = {}
        for g in cmd["groups"]:
            blocks.setdefault(int(g["group"]), []).extend(int(b) for b in g["blocks"])
        grant = w.client.grant_transfer(
            w.worker,
            cmd["request_id"],
            blocks,
            ttl_ms=int(cmd.get("ttl_ms", 0)),
            max_uses=int(cmd.get("max_uses", 0)),
            access=_ACCESS[cmd.get("access", "read")],
        )
    except KvmapError as err:
        return _failed(err)
    return {
        "ok": True,
        "capability": grant.capability,
        "generation": grant.generation,
        "expires_unix_ms": grant.expires_unix_ms,
    }


def handle(w: DemoWorker, cmd: dict[str, Any]) -> dict[str, Any]:  # noqa: PLR0911  (one answer per command)
    op = cmd["cmd"]
    if op in ("pull", "push"):
        return _transfer(w, op, cmd)
    if op in ("grant", "revoke"):
        return _grant(w, cmd)
    if op == "verify":
        bad = w.verify(
            cmd["group"], cmd["local"], cmd["remote"], cmd.get("layers", []), cmd.get("seed", 0)
        )
        return {"ok": True, "bad_blocks": bad}
    if op == "fill":
        w.fill(int(cmd.get("seed", 0)))
        return {"ok": True}
    if op == "realloc":
        # New memory with other contents, registered anew: a puller that read
        # the old mapping would see the old seed's bytes.
        w.rows = w._allocate()
        w.fill(int(cmd["seed"]))
        m = w.register()
        return {"ok": True, "generation": m.generation}
    if op == "zero":
        for rows in w.rows:
            rows.zero_()
        return {"ok": True}
    if op == "digest":
        return {"ok": True, "digest": w.digest()}
    if op == "events":
        with w._events_lock:
            return {"ok": True, "events": list(w.events)}
    if op == "reregister":
        m = w.register()
        assert w.session is not None
        # What the daemon lists (RegisterWorkerResponse.features), by name.
        features = [registry_pb2.DaemonFeature.Name(f) for f in sorted(w.session.features)]  # type: ignore[arg-type]
        return {"ok": True, "generation": m.generation, "features": features}
    return {"ok": False, "code": "UNKNOWN_COMMAND", "message": op}


def worker_arguments(prog: str) -> argparse.ArgumentParser:
    """The command line every demo worker (CPU or GPU) takes."""
    p = argparse.ArgumentParser(prog=prog, allow_abbrev=False)
    p.add_argument("--socket", required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--tp-rank", type=int, default=0)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--mla-layers", type=int, default=6)
    p.add_argument("--indexer-layers", type=int, default=3)
    p.add_argument("--fill", action="store_true", help="write the prefill pattern")
    return p


def geometry(args: argparse.Namespace) -> DemoGeometry:
    return DemoGeometry(args.blocks, args.block_tokens, args.mla_layers, args.indexer_layers)


def worker_id(args: argparse.Namespace) -> types_pb2.WorkerId:
    return types_pb2.WorkerId(engine_id=args.engine_id, tp_rank=args.tp_rank)


def main(argv: list[str] | None = None) -> int:
    args = worker_arguments("kvmap-demo-worker").parse_args(argv)
    w = DemoWorker(args.socket, worker_id(args), geometry(args))
    w.tp_size = args.tp_size
    return serve_worker(w, fill=args.fill)


def serve_worker(w: DemoWorker, fill: bool, **ready_extra: Any) -> int:
    """Fill (prefill side), register, then answer commands until exit."""
    if fill:
        w.fill()
    region_map = w.register()
    ready = {
        "ready": True,
        "pid": os.getpid(),
        **ready_extra,
        "region_map": json_format.MessageToDict(region_map, preserving_proto_field_name=True),
    }
    json_lines.serve(ready, lambda cmd: handle(w, cmd))
    w.client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
