"""gRPC calls this daemon makes to remote daemons (the Peer service), with
bounded deadlines and statuses mapped into the error tree."""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import Callable, Mapping
from functools import partial

import grpc
from grpc import aio

from kvmap.daemon.adapters.config_files import read_pem
from kvmap.daemon.adapters.grpc_codes import error_code
from kvmap.daemon.core import convert
from kvmap.daemon.core.config import DaemonConfig
from kvmap.daemon.core.errors import (
    DeadlineExceeded,
    ErrorCode,
    FailedPrecondition,
    InvalidArgument,
    KvmapError,
    NotFound,
    StaleGeneration,
    Unavailable,
)
from kvmap.daemon.core.geometry import RegionMapModel, WorkerKey
from kvmap.v1 import peer_pb2, peer_pb2_grpc

# What a remote daemon's status becomes here. These four are about the request
# and pass through; anything else (a peer that is down, broken or overloaded)
# means the peer is unavailable to this transfer.
_PASSED_THROUGH: Mapping[ErrorCode, Callable[[str], KvmapError]] = types.MappingProxyType(
    {
        ErrorCode.NOT_FOUND: NotFound,
        ErrorCode.FAILED_PRECONDITION: FailedPrecondition,
        ErrorCode.INVALID_ARGUMENT: partial(InvalidArgument, "remote_worker"),
        ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    }
)


def _peer_error(target: str, err: aio.AioRpcError) -> KvmapError:
    what = f"remote daemon {target}: {err.code().name}: {err.details()}"
    return _PASSED_THROUGH.get(error_code(err.code()), Unavailable)(what)


# Remote daemons this daemon keeps a channel open to at once.
MAX_CHANNELS = 64


class PeerHandshake:
    """What a remote daemon told us about one of its workers."""

    def __init__(self, resp: peer_pb2.GetAgentMetadataResponse) -> None:
        self.agent_name = resp.agent_name
        self.agent_metadata = resp.agent_metadata
        self.generation = resp.generation
        self.daemon_instance = resp.daemon_instance
        self.model: RegionMapModel = convert.region_map_from_proto(resp.region_map)


class PeerClient:
    """One channel per remote target, reused across transfers."""

    def __init__(
        self, connect_timeout_s: float, credentials: grpc.ChannelCredentials | None = None
    ) -> None:
        self._timeout = connect_timeout_s
        self._credentials = credentials
        self._channels: dict[str, aio.Channel] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def _stub(self, target: str) -> peer_pb2_grpc.PeerAsyncStub:
        channel = self._channels.pop(target, None)
        if channel is not None:
            self._channels[target] = channel  # most recently used last
        else:
            if len(self._channels) >= MAX_CHANNELS:
                # Targets come from requests: keep a bounded set of channels.
                oldest = next(iter(self._channels))
                stale = self._channels.pop(oldest)
                task = asyncio.get_running_loop().create_task(stale.close(grace=None))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
            options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
            channel = (
                aio.secure_channel(target, self._credentials, options=options)
                if self._credentials is not None
                else aio.insecure_channel(target, options=options)
            )
            self._channels[target] = channel
        return peer_pb2_grpc.PeerStub(channel)

    async def handshake(self, target: str, worker: WorkerKey) -> PeerHandshake:
        req = peer_pb2.GetAgentMetadataRequest(worker=convert.worker_id_to_proto(worker))
        try:
            resp = await self._stub(target).GetAgentMetadata(
                req, timeout=self._timeout, wait_for_ready=False
            )
        except aio.AioRpcError as err:
            raise _peer_error(target, err) from None
        try:
            return PeerHandshake(resp)
        except InvalidArgument as err:
            raise FailedPrecondition(
                f"remote daemon {target} sent a bad region map: {err}"
            ) from None

    async def begin(self, target: str, req: peer_pb2.BeginTransferRequest) -> str:
        try:
            resp = await self._stub(target).BeginTransfer(req, timeout=self._timeout)
        except aio.AioRpcError as err:
            if error_code(err.code()) is ErrorCode.FAILED_PRECONDITION:
                raise StaleGeneration(str(req.worker), req.generation, 0) from None
            raise _peer_error(target, err) from None
        return resp.transfer_token

    async def end(self, target: str, token: str, completed: bool) -> None:
        # Best effort: the owner's lease releases the pin anyway.
        with contextlib.suppress(aio.AioRpcError):
            await self._stub(target).EndTransfer(
                peer_pb2.EndTransferRequest(transfer_token=token, completed=completed),
                timeout=self._timeout,
            )

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()


def peer_credentials(config: DaemonConfig) -> grpc.ChannelCredentials | None:
    """mTLS towards peers when this daemon has a certificate."""
    if not config.tls_cert:
        return None
    ca = config.peer_ca or config.tls_client_ca
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca) if ca else None,
        private_key=read_pem(config.tls_key),
        certificate_chain=read_pem(config.tls_cert),
    )
