"""A peer's first contact with a remote daemon, step by step, with the same
public functions the decode daemon's transfer engine calls: the Peer
handshake (gRPC to the real remote daemon, region map parsed and checked),
loading the remote NIXL agent, the piece table (common refinement of both
maps), and preparing the local and remote descriptor lists.

Run inside the bench's decode worker process (which runs next to the decode
daemon and has loopback UCX set up), with its own NIXL agent and a sparse
full-scale copy of the local geometry registered, so each step can be
repeated and timed to the microsecond. The end-to-end cold first contact
through the daemons (which adds the UCX connection and the first post) is
measured by the runner; on a busy two-core machine it is a few milliseconds
of noise around the same figure, which is why the steps are timed here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
from typing import Any

from kvmap.client.fd_handoff import sealed_memfd
from kvmap.core import convert
from kvmap.core import planner as planners
from kvmap.core.geometry import WorkerKey
from kvmap.core.transfer_pieces import LayerSelection, Side, build_piece_table
from kvmap.core.transfer_plan import piece_dlist_rows
from kvmap.daemon.adapters import memory
from kvmap.daemon.adapters.nixl_agent import NixlAgent
from kvmap.daemon.adapters.peer_client import PeerClient, PeerHandshake
from kvmap.tools.bench.profiles import get_profile
from kvmap.tools.peers import read_secret, session_peer_secret

STEPS = ("handshake", "load_agent", "piece_table", "prep_lists")


async def _handshakes(
    target: str, remote: WorkerKey, reps: int
) -> tuple[list[float], PeerHandshake]:
    # The peer secret the daemons started by this harness share.
    secret = read_secret(session_peer_secret()).encode()
    client = PeerClient(connect_timeout_s=30.0, secret=secret)
    try:
        hs = await client.handshake(target, remote)  # opens the channel
        samples = []
        for _ in range(reps):
            start = time.perf_counter()
            hs = await client.handshake(target, remote)
            samples.append(time.perf_counter() - start)
        return samples, hs
    finally:
        await client.close()


def first_contact_steps(
    target: str, remote_engine_id: str, profile_name: str, planner_name: str, reps: int
) -> dict[str, Any]:
    """Median seconds of each first-contact step over ``reps`` repetitions."""
    profile = get_profile(profile_name)
    samples: dict[str, list[float]] = {step: [] for step in STEPS}
    samples["handshake"], hs = asyncio.run(_handshakes(target, WorkerKey(remote_engine_id), reps))
    geometry = profile.geometry(1, f"bench-contact-{os.getpid()}")
    plan = planners.get_planner(planner_name).plan(geometry)
    selections = [LayerSelection(g.transfer_group) for g in profile.request_groups]
    with contextlib.ExitStack() as stack:
        agent = NixlAgent.create(f"bench-contact-{os.getpid()}")
        stack.callback(agent.close)
        bases: dict[str, int] = {}
        for alloc in geometry.allocations:
            fd = sealed_memfd(f"kvmap-bench-contact-{alloc.id}", alloc.size_bytes)  # sparse
            mapped = memory.import_shm_fd(fd, 0, alloc.size_bytes)
            stack.callback(mapped.close)
            agent.register_dram(mapped.address, mapped.size)
            bases[alloc.id] = mapped.address
        local = convert.model_from_plan(geometry, plan, 1, bases)
        for _ in range(reps):
            start = time.perf_counter()
            name = agent.add_remote(hs.agent_metadata)
            samples["load_agent"].append(time.perf_counter() - start)
            start = time.perf_counter()
            table = build_piece_table(local, hs.model, selections)
            samples["piece_table"].append(time.perf_counter() - start)
            start = time.perf_counter()
            local_dl = agent.prep_local(piece_dlist_rows(table, Side.LOCAL, 0))
            remote_dl = agent.prep_remote(name, piece_dlist_rows(table, Side.REMOTE, 0))
            samples["prep_lists"].append(time.perf_counter() - start)
            agent.release_dlist(local_dl)
            agent.release_dlist(remote_dl)
            agent.remove_remote(name)
    medians = {f"{step}_seconds": statistics.median(samples[step]) for step in STEPS}
    return {
        **medians,
        "total_seconds": sum(medians.values()),
        "pieces": len(table.pieces),
        "samples": samples,
    }
