"""gRPC servicers. Thin: each turns a request into one call on the engine
(its wire form read by ``api.wire_in``) and the result into a response
(written by ``api.wire_out``); errors propagate as KvmapError and become
statuses in ``rpc``. The Attach stream's replay of stored events is here:
it is the stream's own protocol (stored first, then live, each acknowledged
once sent)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

import structlog
from grpc import aio
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from kvmap.core import planner as planners
from kvmap.core.config import parse_host_port
from kvmap.core.convert import model_from_plan
from kvmap.core.errors import SHUTTING_DOWN, KvmapError, ResourceExhausted, Unavailable
from kvmap.core.features import DAEMON_FEATURES
from kvmap.core.transfer_requests import TransferRequest, UseRelease
from kvmap.core.transfer_wire import MAX_BEGIN_CALLS, MAX_REQUEST_ID, MAX_TRANSFER_ID
from kvmap.daemon.adapters.fd_handoff import PeerCred
from kvmap.daemon.adapters.grpc_codes import status_number
from kvmap.daemon.api.admin_status import status, worker_summary
from kvmap.daemon.api.authorization import peer_identity
from kvmap.daemon.api.local_callers import local_caller
from kvmap.daemon.api.status import grpc_status
from kvmap.daemon.api.wire_in import (
    announcement_from_proto,
    parse_and_validate,
    push_offer,
    registration,
    release_from_request,
    release_notice_from_proto,
    transfer_from_spec,
    worker_key,
    worker_key_from_proto,
)
from kvmap.daemon.api.wire_out import (
    attach_event,
    attached,
    planner_info_to_proto,
    region_map_to_proto,
    report_to_proto,
    stats,
    worker_id_to_proto,
)
from kvmap.daemon.engine.app import DaemonApp
from kvmap.daemon.engine.transfers import new_transfer_id
from kvmap.tracing import NULL_SPAN, Span, traceparent_in, traceparent_of
from kvmap.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
    region_maps_pb2,
    region_maps_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    transfers_pb2,
    transfers_pb2_grpc,
)

Ctx = aio.ServicerContext[Any, Any]
# Who calls, as the listener knows it (gRPC: the credential token's uid; the
# local calls socket: the connection's SO_PEERCRED); None when unknown.
Caller = Callable[[], PeerCred | None]

log = structlog.get_logger("kvmapd.rpc")


# Longest peer agent name a log line carries (a hostile caller's is cut).
_MAX_LOGGED_AGENT = 256


def _bind_transfer_ids(request: peer_pb2.BeginTransferRequest, peer: str) -> None:
    """The owner's log lines of one BeginTransfer (its rejection included)
    carry the ids the caller's daemon logs the transfer under."""
    structlog.contextvars.bind_contextvars(
        request_id=request.request_id[:MAX_REQUEST_ID],
        transfer_id=request.transfer_id[:MAX_TRANSFER_ID],
        peer=peer,
        peer_agent=request.peer_agent[:_MAX_LOGGED_AGENT],
        worker=str(worker_key_from_proto(request.worker))[:_MAX_LOGGED_AGENT],
    )


def _caller_span(app: DaemonApp, context: Ctx) -> str:
    """The caller's span (its ``traceparent`` metadata); "" without reading
    the metadata when tracing is off."""
    return traceparent_in(context.invocation_metadata()) if app.tracer.enabled else ""


def _span(app: DaemonApp, parent: str, name: str, **attributes: str | int) -> Span:
    """The span of one call, a child of the caller's ``parent`` (a
    traceparent); ``NULL_SPAN``, at the cost of this branch, when tracing is off."""
    if not app.tracer.enabled:
        return NULL_SPAN
    return app.tracer.start(name, parent=parent, server=True, attributes=attributes)


def _lease_span(app: DaemonApp, parent: str, request: peer_pb2.BeginTransferRequest) -> Span:
    """The owner's span of an announced transfer (or a release of a use), a
    child of the caller's ``parent`` (a traceparent), under the same ids as
    its log lines (``_bind_transfer_ids``)."""
    if not app.tracer.enabled:
        return NULL_SPAN
    bound = structlog.contextvars.get_contextvars()
    ids = {k: str(bound.get(k, "")) for k in ("request_id", "transfer_id", "peer", "peer_agent")}
    name = "kvmap.release" if request.release else "kvmap.lease"
    attributes: dict[str, str | int] = {**ids, "worker": str(bound.get("worker", ""))}
    attributes |= {"blocks": request.blocks, "bytes": request.bytes}
    return _span(app, parent, name, **attributes)


async def attach_events(
    app: DaemonApp,
    request: registry_pb2.AttachRequest,
    caller: Caller,
) -> AsyncIterator[registry_pb2.AttachResponse]:
    """A worker's Attach stream, for either listener (gRPC's Attach, the
    local calls socket's attach call): ``attached`` first, then the events
    stored while no stream was open (or before a restart), then live ones,
    each acknowledged once it has been handed to the stream; it ends when
    the daemon stops. ``caller()`` is the uid the listener vouches for (None:
    none known), asked for after the worker is found, as every Registry
    call does."""
    key = worker_key(request.worker)
    record = app.table.get(key)
    # Only the uid that registered it hears its events (and keeps it alive).
    app.lifecycle.check_caller(key, caller())
    queue = app.table.subscribe(key)
    store = app.store
    try:
        yield attached(record.generation, app.instance)
        # Notifications that arrived while no stream was open (or before
        # a restart) first; queued live ones may repeat them: at least once.
        sent: set[int] = set()
        for event_id, stored in store.pending_events(key):
            yield attach_event(stored)
            store.ack_event(event_id)
            sent.add(event_id)
        while True:
            event_id, event = await queue.get()
            if event_id < 0 or event is None:  # STREAM_END: the daemon is stopping
                return
            if event_id and event_id in sent:
                continue
            yield attach_event(event)
            if event_id:
                store.ack_event(event_id)
    finally:
        # The stream ended: the worker closed it, died, or the daemon is
        # stopping. A worker with no live Attach stream is gone.
        remaining = app.table.unsubscribe(key, queue)
        if remaining == 0 and not app.draining and app.table.find(key) is not None:
            await app.lifecycle.worker_gone(key)


class RegistryService(registry_pb2_grpc.RegistryServicer):
    def __init__(self, app: DaemonApp) -> None:
        self.app = app

    async def RegisterWorker(
        self, request: registry_pb2.RegisterWorkerRequest, context: Ctx
    ) -> registry_pb2.RegisterWorkerResponse:
        if self.app.draining:
            raise Unavailable(SHUTTING_DOWN)
        caller = local_caller(context, self.app.fds)
        # The worker's id, then who may register it, before the rest is read.
        self.app.lifecycle.check_replacer(worker_key(request.worker), caller)
        geometry = registration(request)
        record = await self.app.lifecycle.register(geometry, self.app.planner, caller)
        return registry_pb2.RegisterWorkerResponse(
            region_map=region_map_to_proto(record.model), features=DAEMON_FEATURES
        )

    async def DeregisterWorker(
        self, request: registry_pb2.DeregisterWorkerRequest, context: Ctx
    ) -> registry_pb2.DeregisterWorkerResponse:
        key = worker_key(request.worker)
        self.app.lifecycle.check_caller(key, local_caller(context, self.app.fds))
        record = await self.app.lifecycle.deregister(key)
        return registry_pb2.DeregisterWorkerResponse(generation=record.generation)

    async def Attach(
        self, request: registry_pb2.AttachRequest, context: Ctx
    ) -> AsyncIterator[registry_pb2.AttachResponse]:
        caller = functools.partial(local_caller, context, self.app.fds)
        async for event in attach_events(self.app, request, caller):
            yield event

    async def GrantTransfer(
        self, request: registry_pb2.GrantTransferRequest, context: Ctx
    ) -> registry_pb2.GrantTransferResponse:
        caller = functools.partial(local_caller, context, self.app.fds)
        return grant_transfer(self.app, request, caller, _caller_span(self.app, context))

    async def RevokeTransfer(
        self, request: registry_pb2.RevokeTransferRequest, context: Ctx
    ) -> registry_pb2.RevokeTransferResponse:
        caller = functools.partial(local_caller, context, self.app.fds)
        return revoke_transfer(self.app, request, caller)


def grant_transfer(
    app: DaemonApp,
    request: registry_pb2.GrantTransferRequest,
    caller: Caller,
    parent: str,
) -> registry_pb2.GrantTransferResponse:
    """GrantTransfer, for either listener: ``caller()`` is the uid the
    listener vouches for (``attach_events``), ``parent`` the caller's
    traceparent ("" for none)."""
    key = worker_key(request.worker)
    request_id = request.request_id[:MAX_REQUEST_ID]
    blocks = sum(len(g.block_ids) for g in request.groups)
    with _span(app, parent, "kvmap.grant", request_id=request_id, worker=str(key), blocks=blocks):
        app.lifecycle.check_caller(key, caller())
        capability, grant = app.owner.grant(
            key,
            request_id=request.request_id,
            groups=[(g.transfer_group, g.block_ids) for g in request.groups],
            ttl_ms=request.ttl_ms,
            max_uses=request.max_uses,
            open_uses=request.open_uses,
            unread_release=request.unread_release,
            access=request.access,
            capability=request.capability,
        )
    return registry_pb2.GrantTransferResponse(
        capability=capability,
        generation=grant.generation,
        expires_unix_ms=grant.expires_unix_ms,
        open_uses=grant.open,
        unread_release=registry_pb2.UnreadRelease.ValueType(grant.unread_release),
        access=registry_pb2.GrantAccess.ValueType(grant.access),
    )


def revoke_transfer(
    app: DaemonApp,
    request: registry_pb2.RevokeTransferRequest,
    caller: Caller,
) -> registry_pb2.RevokeTransferResponse:
    """RevokeTransfer, for either listener (``grant_transfer``)."""
    key = worker_key(request.worker)
    app.lifecycle.check_caller(key, caller())
    in_flight = app.owner.revoke(key, request.request_id)
    return registry_pb2.RevokeTransferResponse(writes_in_flight=in_flight)


class RegionMapsService(region_maps_pb2_grpc.RegionMapsServicer):
    def __init__(self, app: DaemonApp) -> None:
        self.app = app

    async def ListWorkers(
        self, request: region_maps_pb2.ListWorkersRequest, context: Ctx
    ) -> region_maps_pb2.ListWorkersResponse:
        resp = region_maps_pb2.ListWorkersResponse(
            daemon_instance=self.app.instance,
            planner=planner_info_to_proto(self.app.planner.info),
        )
        resp.workers.extend(worker_summary(r) for r in self.app.table.records())
        return resp

    async def GetRegionMap(
        self, request: region_maps_pb2.GetRegionMapRequest, context: Ctx
    ) -> region_maps_pb2.GetRegionMapResponse:
        record = self.app.table.get(worker_key(request.worker))
        return region_maps_pb2.GetRegionMapResponse(region_map=region_map_to_proto(record.model))

    async def PlanPreview(
        self, request: region_maps_pb2.PlanPreviewRequest, context: Ctx
    ) -> region_maps_pb2.PlanPreviewResponse:
        planner = planners.get_planner(request.planner or self.app.planner.info.name)
        geometry = parse_and_validate(request.spec, field_prefix="spec.")
        plan = planner.plan(geometry)
        model = model_from_plan(geometry, plan, 0, {})
        return region_maps_pb2.PlanPreviewResponse(region_map=region_map_to_proto(model))


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, app: DaemonApp) -> None:
        self.app = app

    async def Replan(
        self, request: admin_pb2.ReplanRequest, context: Ctx
    ) -> admin_pb2.ReplanResponse:
        records = await self.app.replan(request.planner)
        resp = admin_pb2.ReplanResponse(planner=planner_info_to_proto(self.app.planner.info))
        for record in records:
            resp.workers.add(
                worker=worker_id_to_proto(record.key),
                generation=record.generation,
                descriptor_count=record.model.descriptor_count,
            )
        return resp

    async def GetStats(
        self, request: admin_pb2.GetStatsRequest, context: Ctx
    ) -> admin_pb2.GetStatsResponse:
        return stats(self.app.stats())

    async def GetStatus(
        self, request: admin_pb2.GetStatusRequest, context: Ctx
    ) -> admin_pb2.GetStatusResponse:
        return status(self.app)


def add_unix_services(server: aio.Server, app: DaemonApp) -> None:
    registry_pb2_grpc.add_RegistryServicer_to_server(RegistryService(app), server)
    region_maps_pb2_grpc.add_RegionMapsServicer_to_server(RegionMapsService(app), server)
    admin_pb2_grpc.add_AdminServicer_to_server(AdminService(app), server)
    transfers_pb2_grpc.add_TransfersServicer_to_server(TransfersService(app), server)


def add_tcp_services(server: aio.Server, app: DaemonApp) -> PeerService:
    """The TCP listener's services; the Peer servicer, whose streams end
    when the daemon stops (``PeerService.end_streams``)."""
    region_maps_pb2_grpc.add_RegionMapsServicer_to_server(RegionMapsService(app), server)
    peer = PeerService(app)
    peer_pb2_grpc.add_PeerServicer_to_server(peer, server)
    return peer


def _names(*services: str) -> tuple[str, ...]:
    health = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    return (*services, health, reflection.SERVICE_NAME)


def unix_service_names() -> tuple[str, ...]:
    return _names(
        "kvmap.v1.Registry", "kvmap.v1.RegionMaps", "kvmap.v1.Admin", "kvmap.v1.Transfers"
    )


def tcp_service_names() -> tuple[str, ...]:
    return _names("kvmap.v1.RegionMaps", "kvmap.v1.Peer")


# What this daemon's Peer service serves beyond every release's methods
# (GetAgentMetadataResponse.features).
PEER_FEATURES = (
    peer_pb2.PEER_FEATURE_BEGIN_TRANSFER_STREAM,
    peer_pb2.PEER_FEATURE_PUSH_OFFERS,
)


class PeerService(peer_pb2_grpc.PeerServicer):
    def __init__(self, app: DaemonApp) -> None:
        self.app = app
        # Done when the daemon stops (``end_streams``). Made on the loop:
        # servicers are made in ``Daemon.start``.
        self._ending: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def GetAgentMetadata(
        self, request: peer_pb2.GetAgentMetadataRequest, context: Ctx
    ) -> peer_pb2.GetAgentMetadataResponse:
        record = self.app.lifecycle.worker_for_peer(worker_key(request.worker))
        return peer_pb2.GetAgentMetadataResponse(
            agent_name=self.app.agent_name,
            agent_metadata=await self.app.agent_metadata(),
            region_map=region_map_to_proto(record.model),
            # Deprecated (region_map.generation), still sent for older callers.
            generation=record.generation,
            daemon_instance=self.app.instance,
            features=PEER_FEATURES,
        )

    async def BeginTransfer(
        self, request: peer_pb2.BeginTransferRequest, context: Ctx
    ) -> peer_pb2.BeginTransferResponse:
        # Claims, leases and their quotas belong to who the connection says
        # the caller is, not to the agent name it declares.
        peer = peer_identity(context)
        parent = _caller_span(self.app, context)
        return peer_pb2.BeginTransferResponse(transfer_token=self._begin(request, peer, parent))

    async def BeginTransfers(
        self, request: peer_pb2.BeginTransfersRequest, context: Ctx
    ) -> peer_pb2.BeginTransfersResponse:
        """Each call as its own BeginTransfer (``_begin_calls``). On TCP the
        whole request is within one BeginTransfer's size limit
        (``api/limits.py``)."""
        results = self._begin_calls(request.calls, peer_identity(context), "BeginTransfers")
        return peer_pb2.BeginTransfersResponse(results=results)

    async def BeginTransferStream(
        self, requests: AsyncIterator[peer_pb2.BeginTransferStreamRequest], context: Ctx
    ) -> AsyncIterator[peer_pb2.BeginTransferStreamResponse]:
        """BeginTransfers' calls as the messages of one stream: each request
        message is answered by one response, in order, until the caller ends
        the stream or this daemon stops (``end_streams``: the stream ends OK,
        and the caller's next call opens one to whoever serves then). The
        caller was checked when the stream opened (``authorization``); each
        message is within BeginTransfers' size limit (``api/limits.py``)."""
        peer = peer_identity(context)
        iterator = aiter(requests)
        while True:
            read = asyncio.ensure_future(anext(iterator, None))
            try:
                await asyncio.wait((read, self._ending), return_when=asyncio.FIRST_COMPLETED)
            finally:  # stopping, or the call cancelled: the rest is not read
                stopping = not read.done()
                if stopping:
                    read.cancel()
            if stopping:  # what was read is answered
                return
            request = read.result()
            if request is None:  # the caller ended the stream
                return
            results = self._begin_calls(request.calls, peer, "BeginTransferStream")
            yield peer_pb2.BeginTransferStreamResponse(results=results)

    def end_streams(self) -> None:
        """The daemon stops: open BeginTransferStream calls end once the
        message each is answering (if any) is answered."""
        if not self._ending.done():
            self._ending.set_result(None)

    def _begin_calls(
        self, calls: Sequence[peer_pb2.BeginTransferRequest], peer: str, method: str
    ) -> list[peer_pb2.BeginTransferResult]:
        """Each call as its own BeginTransfer, in order, its span a child of
        its own traceparent; a refused call's status goes in its result and
        its ``rpc_rejected`` line (as a refused BeginTransfer's, with the
        call's index), and the next call is taken as if it came alone."""
        if len(calls) > MAX_BEGIN_CALLS:
            raise ResourceExhausted(f"{len(calls)} calls; at most {MAX_BEGIN_CALLS}")
        results = []
        rpc_context = structlog.contextvars.get_contextvars()
        for i, call in enumerate(calls):
            try:
                parent = traceparent_of(call.traceparent) if self.app.tracer.enabled else ""
                token = self._begin(call, peer, parent)
                results.append(peer_pb2.BeginTransferResult(transfer_token=token))
            except KvmapError as err:
                status, message = grpc_status(err)
                # Under the call's ids, bound by _begin.
                log.warning("rpc_rejected", code=status.name, error=message, call=i)
                # Among the recent errors (Admin.GetStatus), as a refused RPC is.
                self.app.activity.failed("tcp", method, status.name, message, call.request_id)
                results.append(peer_pb2.BeginTransferResult(
                    code=status_number(status), message=message, reason=err.reason
                ))  # fmt: skip
            finally:  # the next call's lines carry its own ids, not these
                structlog.contextvars.clear_contextvars()
                structlog.contextvars.bind_contextvars(**rpc_context)
        return results

    def _begin(self, request: peer_pb2.BeginTransferRequest, peer: str, parent: str) -> str:
        """Claim, lease and pin for one announced transfer (its lease token),
        or spend a use for a release (""); a refusal raises."""
        _bind_transfer_ids(request, peer)
        # A lease's span ends with the lease; a refusal's or a release's, here.
        span = _lease_span(self.app, parent, request)
        if span.trace_id():  # traced: the log lines name the trace too
            structlog.contextvars.bind_contextvars(trace_id=span.trace_id())
        try:
            if request.release:
                self.app.owner.release(release_notice_from_proto(request), peer=peer)
                span.end()
                return ""
            lease = self.app.owner.begin(announcement_from_proto(request), peer=peer, span=span)
        except KvmapError as err:
            self.app.metrics.served(peer, err.code.name)  # a refusal, per peer
            span.fail(err.code.name, err.message)
            span.end()
            raise
        return lease.token

    async def EndTransfer(
        self, request: peer_pb2.EndTransferRequest, context: Ctx
    ) -> peer_pb2.EndTransferResponse:
        self.app.owner.end(request.transfer_token, peer=peer_identity(context))
        return peer_pb2.EndTransferResponse()

    async def OfferPush(
        self, request: peer_pb2.PeerOfferPushRequest, context: Ctx
    ) -> peer_pb2.PeerOfferPushResponse:
        if self.app.draining:
            raise Unavailable(SHUTTING_DOWN)
        try:
            offer = push_offer(request.offer)
        except KvmapError:
            self.app.push_offers.refuse_malformed()
            raise
        workers = self.app.push_offers.relay(offer, peer=peer_identity(context))
        return peer_pb2.PeerOfferPushResponse(workers=workers)


class TransfersService(transfers_pb2_grpc.TransfersServicer):
    def __init__(self, app: DaemonApp) -> None:
        self.app = app

    async def Pull(
        self, request: transfers_pb2.PullRequest, context: Ctx
    ) -> AsyncIterator[transfers_pb2.PullResponse]:
        async for state in self.reports(request.spec, "pull", _caller_span(self.app, context)):
            yield transfers_pb2.PullResponse(status=state)

    async def Push(
        self, request: transfers_pb2.PushRequest, context: Ctx
    ) -> AsyncIterator[transfers_pb2.PushResponse]:
        async for state in self.reports(request.spec, "push", _caller_span(self.app, context)):
            yield transfers_pb2.PushResponse(status=state)

    async def reports(
        self, spec: transfers_pb2.TransferSpec, kind: Literal["pull", "push"], parent: str
    ) -> AsyncIterator[transfers_pb2.TransferStatus]:
        """One Pull or Push, over gRPC or the local calls socket
        (``api.local_calls``): its statuses, or the error it fails with."""
        if self.app.draining:
            raise Unavailable(SHUTTING_DOWN)
        req = transfer_from_spec(spec, self.app.config.transfer_timeout_s)
        async for state in self._tracked(req, kind, parent):
            yield state

    async def Release(
        self, request: transfers_pb2.ReleaseRequest, context: Ctx
    ) -> transfers_pb2.ReleaseResponse:
        """What a Pull whose spec has the (deprecated) release flag does, as
        its own RPC: one report (DONE, "released") and nothing moved."""
        if self.app.draining:
            raise Unavailable(SHUTTING_DOWN)
        use = release_from_request(request, self.app.config.transfer_timeout_s)
        async for _ in self._tracked(use, "release", _caller_span(self.app, context)):
            pass
        return transfers_pb2.ReleaseResponse()

    async def OfferPush(
        self, request: transfers_pb2.OfferPushRequest, context: Ctx
    ) -> transfers_pb2.OfferPushResponse:
        """Relay a worker's offer to the prefill daemon at ``target``: only
        the uid that registered the offered worker may offer its blocks, and
        the offer is checked here before it leaves (``core.push_offers``)."""
        if self.app.draining:
            raise Unavailable(SHUTTING_DOWN)
        offer = push_offer(request.offer)
        key = worker_key(offer.decode_worker, "offer.decode_worker")
        self.app.table.get(key)
        self.app.lifecycle.check_caller(key, local_caller(context, self.app.fds))
        parse_host_port(request.target, "target")
        timeout_s = (request.timeout_ms / 1000) or self.app.config.transfer_timeout_s
        workers = await self.app.adapters.peers.offer_push(request.target, offer, timeout_s)
        return transfers_pb2.OfferPushResponse(workers=workers)

    async def _tracked(
        self,
        req: TransferRequest | UseRelease,
        kind: Literal["pull", "push", "release"],
        parent: str,
    ) -> AsyncIterator[transfers_pb2.TransferStatus]:
        """The engine's reports of one transfer, which the live view
        (Admin.GetStatus) lists as in flight until it ends, either way.
        The RPC's log lines (and a failure among the recent errors) carry the
        transfer's request id (the one the worker's logs know it by) and its
        transfer id, which each report tells the caller too. Its span is a
        child of the caller's (``parent``, a traceparent or "")."""
        structlog.contextvars.bind_contextvars(request_id=req.request_id)
        transfer_id = new_transfer_id()
        entry = self.app.activity.begin(req, kind)
        try:
            reports = self.app.engine.run(
                req, write=kind == "push", transfer_id=transfer_id, traceparent=parent
            )
            async for report in reports:
                entry.phase = report.phase.name
                state = report_to_proto(report)
                state.transfer_id = transfer_id
                yield state
        finally:
            self.app.activity.end(entry)
