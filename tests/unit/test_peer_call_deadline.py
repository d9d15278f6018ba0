"""A call to an owner that is slow to answer (its first contact under load
took over 3 s) is bounded by the transfer's time, not by connect_timeout_s:
a pull must not fail while its deadline has time left.

A real gRPC Peer service on 127.0.0.1 answers every call only after
``SLOW_S``; the daemon's real peer client calls it with a connect timeout
shorter than that."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from grpc import aio

from kvmap.core.config import DaemonConfig
from kvmap.core.errors import DeadlineExceeded, NotFound
from kvmap.core.geometry import WorkerKey
from kvmap.core.transfer_requests import Announcement
from kvmap.daemon.adapters.peer_client import PeerClient
from kvmap.v1 import peer_pb2, peer_pb2_grpc

pytestmark = pytest.mark.timeout(60)

SLOW_S = 1.0
CONNECT_S = 0.3  # shorter than the owner takes to answer
WORKER = WorkerKey("prefill")


class SlowOwner(peer_pb2_grpc.PeerServicer):
    """Answers after SLOW_S: no such worker to a handshake, a token to a begin."""

    async def GetAgentMetadata(  # noqa: N802  (the generated method name)
        self, request: peer_pb2.GetAgentMetadataRequest, context: Any
    ) -> peer_pb2.GetAgentMetadataResponse:
        await asyncio.sleep(SLOW_S)
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such worker")
        raise AssertionError("abort returns no answer")

    async def BeginTransfer(  # noqa: N802
        self, request: peer_pb2.BeginTransferRequest, context: Any
    ) -> peer_pb2.BeginTransferResponse:
        await asyncio.sleep(SLOW_S)
        return peer_pb2.BeginTransferResponse(transfer_token="lease-1")


async def serving() -> tuple[aio.Server, str]:
    server = aio.server()
    peer_pb2_grpc.add_PeerServicer_to_server(SlowOwner(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def announcement() -> Announcement:
    return Announcement(
        request_id="req-1",
        worker=WORKER,
        generation=1,
        agent_name="owner-agent",
        peer_agent="puller-agent",
        write=False,
        lease_ms=10_000,
        blocks=1,
        nbytes=4096,
        capability="cap",
        groups=(),
        replaces_agents=(),
        readers=1,
    )


def run(scenario: Any) -> Any:
    async def main() -> Any:
        server, target = await serving()
        try:
            return await scenario(target)
        finally:
            await server.stop(grace=None)

    return asyncio.run(main())


def test_a_slow_handshake_is_bounded_by_the_transfer_timeout() -> None:
    """With the daemon's configuration (connect 0.3 s, transfers 5 s) a
    handshake the owner answers after 1 s gets the owner's answer
    (NOT_FOUND), not DEADLINE_EXCEEDED at the connect timeout."""
    config = DaemonConfig(connect_timeout_s=CONNECT_S, transfer_timeout_s=5.0)

    async def scenario(target: str) -> BaseException | None:
        client = PeerClient.for_config(config)
        try:
            await client.handshake(target, WORKER)
        except (NotFound, DeadlineExceeded) as err:
            return err
        finally:
            await client.close()
        return None

    assert isinstance(run(scenario), NotFound)


def test_a_slow_begin_is_bounded_by_the_time_it_is_given() -> None:
    """A begin given the transfer's 5 s gets the owner's token after 1 s
    although the connect timeout is 0.3 s; one given 0.3 s fails
    DEADLINE_EXCEEDED: the bound is the caller's, whichever it is."""

    async def scenario(target: str) -> tuple[object, object]:
        client = PeerClient(connect_timeout_s=CONNECT_S)
        try:
            token = await client.begin(target, announcement(), 5.0)
            try:
                await client.begin(target, announcement(), CONNECT_S)
            except DeadlineExceeded as err:
                return token, err
            return token, None
        finally:
            await client.close()

    token, err = run(scenario)
    assert token == "lease-1"
    assert isinstance(err, DeadlineExceeded)
