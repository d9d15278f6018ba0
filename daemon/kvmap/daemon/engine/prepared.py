"""The transfer engine's caches: handshakes (and the remote agents they
loaded) per target and worker, compatibility verdicts per pair of
generations, and prepared descriptor lists per (local generation, remote
generation, layer selection). Each is an LRU of a stated size, keyed by a
named tuple. A changed remote agent or generation drops what was prepared
against it before anything new is posted; a request is checked against its
piece table before anything is cached for it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from kvmap.core.compat import check_compatible
from kvmap.core.errors import FailedPrecondition
from kvmap.core.geometry import DeviceKind, RegionMapModel, WorkerKey
from kvmap.core.transfer_pieces import LayerSelection, PieceTable, Side, build_piece_table
from kvmap.core.transfer_plan import piece_dlist_rows, plan_transfer
from kvmap.core.transfer_requests import TransferRequest
from kvmap.daemon.adapters.metrics import Metrics
from kvmap.daemon.adapters.nixl_port import DlistHandle, MemoryType, NixlPort
from kvmap.daemon.adapters.nixl_thread import NixlRunner
from kvmap.daemon.adapters.peer_client import PeerHandshake
from kvmap.daemon.engine.bounded import Lru
from kvmap.daemon.engine.remote_agents import RemoteAgents
from kvmap.daemon.engine.workers import WorkerRecord

# (target, worker) handshakes kept; a target none of them names is detached,
# so this bounds the loaded remote agents too.
MAX_CACHED_HANDSHAKES = 1024
# Prepared (piece table, local and remote lists) entries kept: a few per
# (local worker, remote worker) pair and layer selection in use.
MAX_PREPARED = 256
# (local generation, remote generation) pairs found compatible (core.compat).
MAX_COMPATIBLE = 1024


class HandshakeKey(NamedTuple):
    """A remote daemon and one of its workers."""

    target: str
    worker: WorkerKey


class PairKey(NamedTuple):
    """The two workers of a transfer as they are now (both generations and
    the peer's agent): what a compatibility verdict and a prepared list
    hold for."""

    local: WorkerKey
    local_generation: int
    target: str
    remote: WorkerKey
    remote_generation: int
    remote_agent: str


class PreparedKey(NamedTuple):
    pair: PairKey
    selections: tuple[LayerSelection, ...]


def pair_key(local: WorkerRecord, hs: PeerHandshake, req: TransferRequest) -> PairKey:
    return PairKey(
        local.key, local.generation, req.target, req.remote, hs.generation, hs.agent_name
    )


def side_memory(model: RegionMapModel, who: str) -> tuple[int, MemoryType]:
    """The one (device ordinal, memory type) a worker's allocations share, as
    its owning daemon registered them."""
    kinds = {(a.device.index, a.device.kind) for a in model.allocations}
    if len(kinds) != 1:
        raise FailedPrecondition(
            f"{who} {model.worker}: allocations on several devices {sorted(kinds)}; "
            "one transfer needs one device per side"
        )
    ((index, kind),) = kinds
    return index, MemoryType.VRAM if kind is DeviceKind.CUDA else MemoryType.DRAM


@dataclass
class Prepared:
    """Piece table and NIXL lists for one (local gen, remote gen, selection);
    none of the three for a token-mode transfer (explicit descriptors only)."""

    table: PieceTable | None
    local_dlist: DlistHandle | None
    remote_dlist: DlistHandle | None
    # (NIXL dev_id, memory type) of each side.
    local_mem: tuple[int, MemoryType]
    remote_mem: tuple[int, MemoryType]
    # Transfers between planning and posting with these lists; a stale entry
    # is released by the last of them.
    users: int = 0
    stale: bool = False


class TransferCaches:
    """The engine's caches and the one lock that guards their changes
    (never held while waiting for a remote daemon)."""

    def __init__(self, agent: NixlPort, nixl: NixlRunner, metrics: Metrics) -> None:
        self._agent = agent
        self._nixl = nixl
        self._metrics = metrics
        self.agents = RemoteAgents(agent, nixl, self._agent_changed)
        self.handshakes: Lru[HandshakeKey, PeerHandshake] = Lru(MAX_CACHED_HANDSHAKES)
        self._prepared: Lru[PreparedKey, Prepared] = Lru(MAX_PREPARED)
        # Only successes are kept: a refused pair changes no cache, and is
        # compared again (cheaply) on its next request.
        self._compatible: Lru[PairKey, bool] = Lru(MAX_COMPATIBLE)
        self._lock = asyncio.Lock()

    def __len__(self) -> int:
        return len(self._prepared)

    async def _release(self, keys: list[PreparedKey]) -> None:
        """Forget cache entries; free their lists now or when the last
        transfer using them has posted."""
        for key in keys:
            p = self._prepared.pop(key)
            if p is not None:
                await self._retire(p)

    async def _retire(self, p: Prepared) -> None:
        p.stale = True
        if p.users == 0:
            await self._free(p)

    async def _free(self, p: Prepared) -> None:
        for dlist in (p.local_dlist, p.remote_dlist):
            if dlist is not None:
                await self._nixl(partial(self._agent.release_dlist, dlist))

    async def forget_local(self, key: WorkerKey, generation: int) -> None:
        """A local record was retired: drop lists prepared over its memory."""
        async with self._lock:
            await self._release(
                [
                    k
                    for k in self._prepared
                    if k.pair.local == key and k.pair.local_generation == generation
                ]
            )

    async def learn(self, key: HandshakeKey, hs: PeerHandshake) -> PeerHandshake:
        """Apply a handshake's answer: a restarted remote (new agent) or a new
        generation drops what was prepared against the old one first."""
        target = key.target
        async with self._lock:
            if self.agents.agent_of(target) not in (None, hs.agent_name):
                await self._release([k for k in self._prepared if k.pair.target == target])
                for old in [k for k in self.handshakes if k.target == target]:
                    self.handshakes.pop(old)
            await self.agents.load(target, hs.agent_name, hs.daemon_instance, hs.agent_metadata)
            old_hs = self.handshakes.peek(key)
            if old_hs is not None and old_hs.generation != hs.generation:
                await self._release(
                    [
                        k
                        for k in self._prepared
                        if k.pair.target == target and k.pair.remote == key.worker
                    ]
                )
            for evicted, _hs in self.handshakes.put(key, hs):
                if not any(k.target == evicted.target for k in self.handshakes):
                    await self.agents.detach(evicted.target)  # its lists go with its agent
            self._metrics.remote_agents.set(len(self.agents))
        return hs

    async def _agent_changed(self, name: str) -> None:
        """Lists prepared against a reloaded or removed remote agent go."""
        await self._release([k for k in self._prepared if k.pair.remote_agent == name])

    async def prepare(
        self, local: WorkerRecord, hs: PeerHandshake, req: TransferRequest, write: bool
    ) -> Prepared:
        """The cached lists for this pair and selection, or new ones once the
        request checked out against their piece table."""
        key = PreparedKey(pair_key(local, hs, req), req.selections)
        async with self._lock:
            found = self._prepared.get(key)
            if found is not None:
                found.users += 1
                return found
            self._check_compatible(key.pair, local, hs)
            table = build_piece_table(local.model, hs.model, req.selections)
            local_mem = side_memory(local.model, "local worker")
            remote_mem = side_memory(hs.model, "remote worker")
            # Every check of the request against the table, before anything
            # is prepared or cached for it: a rejected request leaves the
            # caches as they were (the caller plans again, from the cache).
            plan_transfer(table, req.pairs, destination=Side.REMOTE if write else Side.LOCAL)
            local_rows = piece_dlist_rows(table, Side.LOCAL, local_mem[0])
            remote_rows = piece_dlist_rows(table, Side.REMOTE, remote_mem[0])
            local_dl = await self._nixl(partial(self._agent.prep_local, local_rows, local_mem[1]))
            remote_dl = await self._nixl(
                partial(self._agent.prep_remote, hs.agent_name, remote_rows, remote_mem[1])
            )
            prepared = Prepared(table, local_dl, remote_dl, local_mem, remote_mem, users=1)
            for _, evicted in self._prepared.put(key, prepared):
                await self._retire(evicted)
            return prepared

    async def check_compatible(
        self, local: WorkerRecord, hs: PeerHandshake, req: TransferRequest
    ) -> None:
        async with self._lock:
            self._check_compatible(pair_key(local, hs, req), local, hs)

    def _check_compatible(self, pair: PairKey, local: WorkerRecord, hs: PeerHandshake) -> None:
        """Both workers' KV caches mean the same thing (once per generations)."""
        if self._compatible.get(pair) is None:
            check_compatible(local.model, hs.model)
            self._compatible.put(pair, True)

    async def done_with(self, p: Prepared) -> None:
        p.users -= 1
        if p.stale and p.users == 0:
            await self._free(p)

    async def close(self) -> None:
        async with self._lock:
            await self._release(list(self._prepared))
            await self.agents.close()
