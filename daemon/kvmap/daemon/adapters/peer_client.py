"""gRPC calls this daemon makes to remote daemons (the Peer service), with
bounded deadlines and statuses mapped into the error tree.

This is the only place that dials peers, so it enforces the outbound
allow-list (``peer_allow``, and ``peer_identities`` under mutual TLS): a target
is resolved and checked before any connection is made, and the checked address
is what gets dialled (a second DNS answer cannot swap it). A target that is not
allowed gets PERMISSION_DENIED with one message, whatever lies behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
import ssl
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
import structlog
from grpc import aio

from kvmap.core import convert
from kvmap.core.config import DaemonConfig, parse_host_port
from kvmap.core.errors import (
    HANDSHAKE_AGAIN,
    DeadlineExceeded,
    ErrorCode,
    FailedPrecondition,
    InvalidArgument,
    KvmapError,
    NotFound,
    OwnerRefused,
    PermissionDenied,
    StaleGeneration,
    Unavailable,
)
from kvmap.core.geometry import RegionMapModel, WorkerKey
from kvmap.core.peer_policy import (
    LOOPBACK,
    OUTBOUND_DENIED,
    PEER_SECRET_METADATA,
    IPAddress,
    PeerPolicy,
    is_host_name,
)
from kvmap.core.push_offers import Offer, offer_to_proto
from kvmap.core.transfer_requests import Announcement, ReleaseNotice
from kvmap.core.transfer_wire import (
    announcement_to_proto,
    release_notice_to_proto,
    stream_request_bytes,
)
from kvmap.daemon.adapters.config_files import read_pem
from kvmap.daemon.adapters.grpc_codes import error_code, reason_of
from kvmap.daemon.adapters.peer_batches import BeginBatches, outcomes
from kvmap.daemon.adapters.peer_secret import peer_secret
from kvmap.daemon.adapters.peer_stream import BeginStreams, StreamUnsupported
from kvmap.tracing import TRACEPARENT
from kvmap.v1 import peer_pb2, peer_pb2_grpc

log = structlog.get_logger("kvmapd.peers")

# What a remote daemon's status becomes here. These five are about the request
# and pass through; anything else (a peer that is down, broken or overloaded)
# means the peer is unavailable to this transfer.
_PASSED_THROUGH: Mapping[ErrorCode, Callable[[str], KvmapError]] = types.MappingProxyType(
    {
        ErrorCode.NOT_FOUND: NotFound,
        ErrorCode.FAILED_PRECONDITION: FailedPrecondition,
        ErrorCode.INVALID_ARGUMENT: partial(InvalidArgument, "remote_worker"),
        ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
        # The owner refused the capability: the caller's to know, not an outage.
        ErrorCode.PERMISSION_DENIED: PermissionDenied,
    }
)


def unreachable(target: str) -> Unavailable:
    """The one answer for a target this daemon cannot reach, whatever lies
    behind it: a closed port, a silent one, a filtered address or a server
    that does not speak gRPC (or TLS) all read alike, in code, message and
    time, so that a pull is no port scanner (docs/security.md)."""
    return Unavailable(f"remote daemon {target}: {UNREACHABLE}")


# Its message: the same for every way of being unreachable.
UNREACHABLE = "no connection within the connect timeout"


def _peer_error(target: str, err: aio.AioRpcError) -> KvmapError:
    return _status_error(target, err.code(), err.details())


def _status_error(target: str, status: grpc.StatusCode, details: str | None) -> KvmapError:
    what = f"remote daemon {target}: {status.name}: {details}"
    return _PASSED_THROUGH.get(error_code(status), Unavailable)(what)


def _begin_error(
    target: str,
    req: peer_pb2.BeginTransferRequest,
    status: grpc.StatusCode,
    details: str,
    reason: str,
) -> KvmapError:
    """What a BeginTransfer that ended with ``status`` raises here. Only what
    a new handshake cures is retried as stale; anything else (an expired
    capability, say) reaches the caller as it is."""
    if reason == HANDSHAKE_AGAIN:
        return StaleGeneration(str(req.worker), req.generation, 0)
    if status == grpc.StatusCode.PERMISSION_DENIED:
        # The owner refused the capability (core.retry: the grant race).
        return OwnerRefused(f"remote daemon {target}: {status.name}: {details}")
    return _status_error(target, status, details)


# The stream's full method name, as the generated stub has it.
BEGIN_TRANSFER_STREAM = "/kvmap.v1.Peer/BeginTransferStream"

# Remote daemons this daemon keeps a channel open to at once.
MAX_CHANNELS = 64

PEER_CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # A peer daemon restarted or upgraded is back within seconds, and pulls
    # wait on it (transfer_retry): gRPC's default reconnect backoff (1 s,
    # growing 1.6x to 2 min) would have the channel fail them at once for
    # long after it is back. The connect timeout floor
    # (grpc.min_reconnect_backoff_ms, 20 s) stays: a slow network still gets
    # its time to connect.
    ("grpc.initial_reconnect_backoff_ms", 100),
    # At most 0.25 s between tries: a pull waiting on an upgraded daemon
    # (its gap ~1 s) goes through within a quarter second of its return.
    ("grpc.max_reconnect_backoff_ms", 250),
)


class PeerHandshake:
    """What a remote daemon told us about one of its workers."""

    def __init__(self, resp: peer_pb2.GetAgentMetadataResponse) -> None:
        self.agent_name = resp.agent_name
        self.agent_metadata = resp.agent_metadata
        self.daemon_instance = resp.daemon_instance
        self.model: RegionMapModel = convert.region_map_from_proto(resp.region_map)
        # The region map's (the response's own generation field is deprecated).
        self.generation = self.model.generation


@dataclass(frozen=True)
class TlsIdentity:
    """This daemon's client certificate and the CA of its peers (PEM paths),
    for checking a peer server's certificate identity before dialling it."""

    cert: str
    key: str
    ca: str  # "" means the system's roots, as for gRPC


@dataclass(frozen=True)
class Dial:
    """A checked target: the address to dial and the name TLS must verify."""

    address: str
    tls_name: str


DEFAULT_POLICY = PeerPolicy.parse(LOOPBACK, LOOPBACK, ())


class PeerClient:
    """One channel per remote target, reused across transfers; only targets
    the policy allows are dialled."""

    def __init__(
        self,
        connect_timeout_s: float,
        credentials: grpc.ChannelCredentials | None = None,
        policy: PeerPolicy = DEFAULT_POLICY,
        tls_identity: TlsIdentity | None = None,
        *,
        call_timeout_s: float | None = None,
        secret: bytes | None = None,
    ) -> None:
        # Connecting (name look-up, the TLS identity check) is bounded by the
        # connect timeout: a dead or silent target fails fast and the
        # transfer retries. A call on a connected channel is bounded by the
        # transfer's own time instead: an owner slow to answer (its first
        # contact under load took over 3 s) must not fail a pull whose
        # deadline has time left.
        self._timeout = connect_timeout_s
        self._call_timeout = max(call_timeout_s or connect_timeout_s, connect_timeout_s)
        self._credentials = credentials
        self._policy = policy
        # Under mutual TLS with listed identities, each new peer's server
        # certificate must carry one of them.
        self._tls_identity = tls_identity if policy.identities and credentials else None
        # Each target's channel and its stub, made with it: a stub per call
        # costs microseconds on every transfer.
        self._channels: dict[str, tuple[aio.Channel, peer_pb2_grpc.PeerAsyncStub]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        # Targets of open channels that were waited on for the connect
        # timeout and have not connected since (see _connected).
        self._unreached: set[str] = set()
        # Sent with every call: without mutual TLS, owners answer only
        # callers that present the peers' shared secret.
        self._metadata: tuple[tuple[str, str], ...] = (
            ((PEER_SECRET_METADATA, secret.decode("ascii")),) if secret else ()
        )
        # Leases granted to callers that gave up, being ended (_end_later).
        self._ending: set[asyncio.Task[None]] = set()
        self._batches = BeginBatches(
            self._begin_alone, self._begin_many, failure=_begin_error, end=self._end_later
        )
        self._streams = BeginStreams(self._open_stream, self._end_later)

    @classmethod
    def for_config(cls, config: DaemonConfig) -> PeerClient:
        tls = (
            TlsIdentity(config.tls_cert, config.tls_key, config.peer_ca or config.tls_client_ca)
            if config.tls_cert
            else None
        )
        return cls(
            config.connect_timeout_s,
            peer_credentials(config),
            config.peer_policy,
            tls,
            call_timeout_s=config.transfer_timeout_s,
            secret=peer_secret(config),
        )

    async def _stub(self, target: str) -> peer_pb2_grpc.PeerAsyncStub:
        if target not in self._channels:
            try:
                dial = await self._checked(target)
            except PermissionDenied:
                # The caller learns nothing; the operator learns what was refused.
                log.warning("peer_not_allowed", target=target[:256])
                raise
            if target not in self._channels:  # another call may have dialled meanwhile
                self._open(target, dial)
        entry = self._channels.pop(target)
        self._channels[target] = entry  # most recently used last
        return entry[1]

    def _open(self, target: str, dial: Dial) -> None:
        if len(self._channels) >= MAX_CHANNELS:
            # Targets come from requests: keep a bounded set of channels.
            oldest = next(iter(self._channels))
            stale, _ = self._channels.pop(oldest)
            self._unreached.discard(oldest)
            self._streams.drop(oldest)
            task = asyncio.get_running_loop().create_task(stale.close(grace=None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        options: list[tuple[str, Any]] = [*PEER_CHANNEL_OPTIONS]
        if self._credentials is None:
            self._add(target, aio.insecure_channel(dial.address, options=options))
            return
        # The address is the checked one; the certificate must still name the host.
        options.append(("grpc.ssl_target_name_override", dial.tls_name))
        self._add(target, aio.secure_channel(dial.address, self._credentials, options=options))

    def _add(self, target: str, channel: aio.Channel) -> None:
        self._channels[target] = (channel, peer_pb2_grpc.PeerStub(channel))
        self._unreached.discard(target)

    async def _checked(self, target: str) -> Dial:
        """Resolve and check ``target``; PermissionDenied (one message) unless allowed."""
        denied = PermissionDenied(OUTBOUND_DENIED)
        try:
            host, port = parse_host_port(target, "remote_target")
        except ValueError:
            raise denied from None
        address = _ip(host)
        if address is None:
            address = await self._resolved(host, port, denied)
        elif not self._policy.allows_addresses([address]):
            raise denied
        dial = Dial(_host_port(address, port), host)
        if self._tls_identity is not None:
            await self._check_server_identity(target, dial, denied)
        return dial

    async def _resolved(self, host: str, port: int, denied: PermissionDenied) -> IPAddress:
        by_name = self._policy.allows_name(host)
        # A name that no rule could allow is never looked up: no DNS oracle.
        if not is_host_name(host) or not (by_name or self._policy.allow_networks):
            raise denied
        try:
            infos = await asyncio.wait_for(
                asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP
                ),
                self._timeout,
            )
        except (OSError, TimeoutError):
            if by_name:
                raise Unavailable(f"remote daemon {host}: cannot resolve its name") from None
            raise denied from None
        addresses = [a for a in (_ip(str(info[4][0])) for info in infos) if a is not None]
        if not addresses or not (by_name or self._policy.allows_addresses(addresses)):
            raise denied
        return addresses[0]

    async def _check_server_identity(
        self, target: str, dial: Dial, denied: PermissionDenied
    ) -> None:
        assert self._tls_identity is not None
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            sans = await asyncio.wait_for(_server_sans(self._tls_identity, dial), self._timeout)
        except (OSError, ssl.SSLError, TimeoutError) as err:
            # The operator learns why; the caller, only that it is unreachable,
            # after the connect timeout however soon this failed (a refused
            # connection fails at once, a silent port only at the timeout).
            log.warning("peer_tls_check_failed", target=target[:256], error=str(err))
            await asyncio.sleep(max(0.0, started + self._timeout - loop.time()))
            raise unreachable(target) from None
        if not self._policy.accepts_identities(sans):
            raise denied

    async def handshake(self, target: str, worker: WorkerKey) -> PeerHandshake:
        req = peer_pb2.GetAgentMetadataRequest(worker=convert.worker_id_to_proto(worker))
        # An upgraded owner may serve BeginTransfers now.
        self._batches.forget(target)
        stub = await self._stub(target)
        await self._connected(target)
        try:
            # Shared by every pull waiting on it; each is bounded by its own
            # deadline, and the call is cancelled once all of them gave up.
            resp = await stub.GetAgentMetadata(
                req, timeout=self._call_timeout, wait_for_ready=False, metadata=self._metadata
            )
        except aio.AioRpcError as err:
            raise _peer_error(target, err) from None
        # Its calls go on the stream only if it says it serves one.
        self._streams.learn(target, peer_pb2.PEER_FEATURE_BEGIN_TRANSFER_STREAM in resp.features)
        try:
            return PeerHandshake(resp)
        except InvalidArgument as err:
            raise FailedPrecondition(
                f"remote daemon {target} sent a bad region map: {err}"
            ) from None

    async def _connected(self, target: str) -> None:
        """Return once ``target``'s channel is connected, else raise
        ``unreachable``. A closed port would answer UNAVAILABLE at once and a
        silent one only time out, so both wait the connect timeout, the one
        way a silent port is told, while the channel keeps dialling (a peer
        that comes back within it is met). Once a target has been waited on,
        later calls fail at once until its channel connects (each asks it to
        dial again): alike for both, and a pull's retries then end
        UNAVAILABLE by its deadline rather than in another wait."""
        channel = self._channels[target][0]
        if channel.get_state(try_to_connect=True) is grpc.ChannelConnectivity.READY:
            self._unreached.discard(target)
            return
        if target in self._unreached:
            raise unreachable(target)
        try:
            await asyncio.wait_for(channel.channel_ready(), self._timeout)
        except TimeoutError:
            if self._channels.get(target, (None,))[0] is channel:  # not evicted meanwhile
                self._unreached.add(target)
            raise unreachable(target) from None

    async def begin(self, target: str, announcement: Announcement, timeout_s: float) -> str:
        """Peer.BeginTransfer, bounded by ``timeout_s``: the transfer's time;
        with others to the same target if one is in flight (``peer_batches``)."""
        req = announcement_to_proto(announcement)
        return await self._batches.begin(target, req, timeout_s)

    async def _begin_alone(
        self, target: str, req: peer_pb2.BeginTransferRequest, data: bytes, timeout_s: float
    ) -> str:
        """One call: on the target's stream (``data``, the call's bytes if it
        was serialized already, when it queued), else as Peer.BeginTransfer."""
        if self._streams.supported(target):
            try:
                message = stream_request_bytes([data or req.SerializeToString()])
                answer = await self._streams.send(target, message, timeout_s)
            except StreamUnsupported:
                pass  # sent as an RPC below
            except aio.AioRpcError as err:
                reason = reason_of(err.trailing_metadata())
                raise _begin_error(target, req, err.code(), err.details() or "", reason) from None
            else:
                (outcome,) = outcomes(target, [req], answer.results, _begin_error)
                if isinstance(outcome, KvmapError):
                    raise outcome
                return outcome
        # Alone, the traceparent travels as metadata, where owners before
        # BeginTransfers read it.
        traceparent, req.traceparent = req.traceparent, ""
        return await self._begin(target, req, timeout_s, traceparent)

    async def _begin_many(
        self,
        target: str,
        calls: Sequence[tuple[peer_pb2.BeginTransferRequest, bytes]],
        timeout_s: float,
    ) -> peer_pb2.BeginTransfersResponse:
        """The calls (each with its serialized bytes) on the target's
        stream, else as Peer.BeginTransfers; a failed stream or call raises
        its ``AioRpcError``."""
        if self._streams.supported(target):
            message = stream_request_bytes([data for _, data in calls])
            try:
                answer = await self._streams.send(target, message, timeout_s)
            except StreamUnsupported:
                pass
            else:
                return peer_pb2.BeginTransfersResponse(results=answer.results)
        stub = await self._stub(target)
        req = peer_pb2.BeginTransfersRequest(calls=[call for call, _ in calls])
        return await stub.BeginTransfers(req, timeout=timeout_s, metadata=self._metadata)

    async def _open_stream(
        self, target: str
    ) -> aio.StreamStreamCall[bytes, peer_pb2.BeginTransferStreamResponse]:
        """``target``'s BeginTransferStream, open for as long as both
        daemons run (no deadline: each call on it has its own). Its
        messages are written as the bytes they already are
        (``transfer_wire.stream_request_bytes``): no request serializer."""
        await self._stub(target)  # dials the channel (the allow-list first)
        channel = self._channels[target][0]
        method = channel.stream_stream(
            BEGIN_TRANSFER_STREAM,
            request_serializer=None,
            response_deserializer=peer_pb2.BeginTransferStreamResponse.FromString,
        )
        return method(None, metadata=self._metadata)

    async def release(self, target: str, notice: ReleaseNotice, timeout_s: float) -> None:
        """Give up a use of the owner's grant: BeginTransfer with ``release``
        on the wire, which owners of this release and the one before answer."""
        await self._begin(target, release_notice_to_proto(notice), timeout_s, notice.traceparent)

    async def _begin(
        self, target: str, req: peer_pb2.BeginTransferRequest, timeout_s: float, traceparent: str
    ) -> str:
        metadata = self._metadata
        if traceparent:  # the owner's span of the transfer is a child of ours
            metadata = (*metadata, (TRACEPARENT, traceparent))
        try:
            resp = await (await self._stub(target)).BeginTransfer(
                req, timeout=timeout_s, metadata=metadata
            )
        except aio.AioRpcError as err:
            reason = reason_of(err.trailing_metadata())
            raise _begin_error(target, req, err.code(), err.details() or "", reason) from None
        return resp.transfer_token

    async def offer_push(self, target: str, offer: Offer, timeout_s: float) -> int:
        """Peer.OfferPush: hand a decode worker's write-granted blocks (a
        checked offer) to the prefill engine on ``target``; how many of its
        workers heard."""
        stub = await self._stub(target)
        await self._connected(target)
        try:
            resp = await stub.OfferPush(
                peer_pb2.PeerOfferPushRequest(offer=offer_to_proto(offer)),
                timeout=timeout_s,
                metadata=self._metadata,
            )
        except aio.AioRpcError as err:
            raise _peer_error(target, err) from None
        return resp.workers

    async def end(self, target: str, token: str) -> None:
        """Tell the owner a transfer it began is over, off the caller's path:
        a pull that failed because the owner's link or node is gone answers
        its caller at once, not after this call's own timeout (measured on a
        test bed: 3 s past the pull's deadline)."""
        self._end_later(target, token)

    async def _end_now(self, target: str, token: str) -> None:
        # Best effort: the owner's lease releases the pin anyway (and a target
        # that is no longer allowed is not dialled again to say so).
        with contextlib.suppress(aio.AioRpcError, KvmapError):
            await (await self._stub(target)).EndTransfer(
                peer_pb2.EndTransferRequest(transfer_token=token),
                timeout=self._timeout,
                metadata=self._metadata,
            )

    def _end_later(self, target: str, token: str) -> None:
        """End a lease granted to a caller that gave up (``end``), off the
        path of whoever found it; ``close`` waits for it."""
        task = asyncio.get_running_loop().create_task(self._end_now(target, token))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def close(self) -> None:
        await self._streams.close()
        await self._batches.close()
        await asyncio.gather(*self._ending, return_exceptions=True)
        for channel, _ in self._channels.values():
            await channel.close(grace=None)
        self._channels.clear()
        self._unreached.clear()


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


def _ip(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _host_port(address: IPAddress, port: int) -> str:
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"{host}:{port}"


async def _server_sans(tls: TlsIdentity, dial: Dial) -> list[str]:
    """The DNS and URI SANs of the certificate the server at ``dial`` presents
    (verified against the peers' CA; gRPC verifies the host name itself)."""
    context = ssl.create_default_context(cafile=tls.ca or None)
    context.check_hostname = False
    context.load_cert_chain(tls.cert, tls.key)
    context.set_alpn_protocols(["h2"])
    host, _, port = dial.address.rpartition(":")
    sni = None if _ip(dial.tls_name) is not None else dial.tls_name
    _, writer = await asyncio.open_connection(
        host.strip("[]"), int(port), ssl=context, server_hostname=sni or ""
    )
    try:
        cert = writer.get_extra_info("peercert") or {}
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await writer.wait_closed()
    return [str(v) for kind, v in cert.get("subjectAltName", ()) if kind in ("DNS", "URI")]
