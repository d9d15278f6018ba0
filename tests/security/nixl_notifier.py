"""A stranger's NIXL agent that sends one "transfer done" notification to a
kvmapd's agent: it asks the daemon's Peer port for the agent metadata (as any
peer may), loads it and sends ``kvmap1:done:<TOKEN>``, then waits for a line
on stdin before it goes (UCX delivers while the agent lives).

Run by ``test_capabilities.py`` as its own process (UCX on loopback); prints
one JSON object with its agent name once the notification is sent.

    python nixl_notifier.py HOST:PORT ENGINE_ID TOKEN
"""

from __future__ import annotations

import json
import sys
import uuid

from kvmap.daemon.adapters.nixl_agent import NixlAgent
from kvmap.daemon.engine.leases import notification
from kvmap.tools.peers import peer_channel
from kvmap.v1 import peer_pb2, peer_pb2_grpc, types_pb2


def main(target: str, engine: str, token: str, secret: str = "") -> None:
    with peer_channel(target, secret) as ch:
        md = peer_pb2_grpc.PeerStub(ch).GetAgentMetadata(
            peer_pb2.GetAgentMetadataRequest(worker=types_pb2.WorkerId(engine_id=engine)),
            timeout=10,
        )
    name = f"forger-{uuid.uuid4().hex[:8]}"
    # UCX's progress thread: the notification goes out while this waits.
    with NixlAgent.create(name, progress_thread=True) as agent:
        remote = agent.add_remote(md.agent_metadata)
        agent.send_notif(remote, notification(token))
        print(json.dumps({"agent": name}), flush=True)
        sys.stdin.readline()
        agent.remove_remote(remote)


if __name__ == "__main__":
    main(*sys.argv[1:5])
