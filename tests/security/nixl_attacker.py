"""A stranger on the network with its own NIXL agent: it asks a kvmapd's
Peer port for a worker's agent metadata and region map (as any peer may),
loads the metadata, and tries to READ and WRITE bytes around the worker's
registered allocations directly over UCX, with no BeginTransfer at all.

Run by ``test_hostile_peers.py`` as its own process (UCX on loopback);
prints one JSON object: for each attempt, ``DONE``, ``ERR`` or ``refused:
<error>``.

    python nixl_attacker.py HOST:PORT ENGINE_ID
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
import uuid
from typing import Any

import numpy as np

from kvmap.core.errors import KvmapError
from kvmap.daemon.adapters.nixl_agent import NixlAgent, XferOp, XferState
from kvmap.tools.peers import peer_channel
from kvmap.v1 import peer_pb2, peer_pb2_grpc, types_pb2

LOCAL_BYTES = 1 << 20


def _attempts(allocs: list[tuple[str, int, int]]) -> list[tuple[str, XferOp, int, int]]:
    out: list[tuple[str, XferOp, int, int]] = []
    for alloc_id, base, size in allocs:
        out += [
            (f"{alloc_id}: read inside (control)", XferOp.READ, base + 16, 64),
            (f"{alloc_id}: write just past the end", XferOp.WRITE, base + size, 64),
            (f"{alloc_id}: write straddling the end", XferOp.WRITE, base + size - 32, 64),
            (f"{alloc_id}: write just before the start", XferOp.WRITE, base - 64, 64),
            (f"{alloc_id}: write straddling the start", XferOp.WRITE, base - 32, 64),
            (f"{alloc_id}: write the whole allocation and one more page", XferOp.WRITE,
             base, size + 4096),
            (f"{alloc_id}: read a page past the end", XferOp.READ, base + size, 4096),
            (f"{alloc_id}: write 1 GiB away", XferOp.WRITE, base + (1 << 30), 64),
        ]  # fmt: skip
    return out


def _try(agent: NixlAgent, remote: str, op: XferOp, *, local: int, addr: int, n: int) -> str:
    try:
        xfer = agent.post_descs(op, [[local, n, 0]], [[addr, n, 0]], remote)
    except KvmapError as err:
        return f"refused: {type(err).__name__}: {err}"
    deadline = time.monotonic() + 10
    try:
        while True:
            state = agent.poll(xfer)
            if state is not XferState.PROC:
                return state.value
            if time.monotonic() > deadline:
                return "PROC (no completion in 10s)"
            time.sleep(0.001)
    finally:
        agent.release(xfer)


def main(target: str, engine: str, secret: str = "") -> dict[str, Any]:
    """``secret``: the peer secret to present ("" for none: a neighbour)."""
    with peer_channel(target, secret) as ch:
        md = peer_pb2_grpc.PeerStub(ch).GetAgentMetadata(
            peer_pb2.GetAgentMetadataRequest(worker=types_pb2.WorkerId(engine_id=engine)),
            timeout=10,
        )
    allocs = [(a.id, a.base_address, a.size_bytes) for a in md.region_map.allocations]
    local = np.full(LOCAL_BYTES * 2, 0x5A, dtype=np.uint8)
    addr = local.ctypes.data_as(ctypes.c_void_p).value or 0
    results: dict[str, str] = {}
    with NixlAgent.create(f"attacker-{uuid.uuid4().hex[:8]}") as agent:
        agent.register_dram(addr, local.nbytes)
        remote = agent.add_remote(md.agent_metadata)
        for label, op, raddr, n in _attempts(allocs):
            results[label] = _try(agent, remote, op, local=addr, addr=raddr, n=n)
        agent.remove_remote(remote)
    return {"agent": md.agent_name, "results": results}


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])), flush=True)
