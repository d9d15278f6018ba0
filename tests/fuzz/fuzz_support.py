"""What the fuzz tests share: a live daemon under test, its observable state,
the closed set of statuses each RPC may answer, and hypothesis strategies of
hostile values.

Every call carries a deadline. A call that runs into the *client's* deadline
is a hang and fails the test; a ``DEADLINE_EXCEEDED`` the daemon reports
itself (a transfer's own ``timeout_ms``) is a precise status like any other.
The two are told apart by who wrote the status, not by how long it took:
the daemon's own DEADLINE_EXCEEDED says which transfer or peer ran out of
time; gRPC's (client-side, or the stream torn down at the deadline) does not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples

from kvmap.tools.launch import DaemonProc
from kvmap.v1 import (
    admin_pb2_grpc,
    peer_pb2_grpc,
    region_maps_pb2,
    region_maps_pb2_grpc,
    registry_pb2_grpc,
    transfers_pb2_grpc,
    types_pb2,
)

Code = grpc.StatusCode
OK = Code.OK
# Never an answer to a request, whatever it holds.
FORBIDDEN = frozenset({Code.UNKNOWN, Code.INTERNAL, Code.DATA_LOSS})
# Client-side deadline of one call: far above anything a sane answer takes.
CALL_TIMEOUT_S = 20.0
# How kvmapd's own DEADLINE_EXCEEDED begins: it names the transfer that ran
# into its timeout_ms ("transfer <id>: no completion in <n>s") or the peer
# whose answer it passes on ("remote daemon <target>: ..."). gRPC's own texts
# for a call that ran out of the client's deadline ("Deadline Exceeded",
# "Stream removed (Deadline Exceeded)") never do.
DAEMON_DEADLINE_PREFIXES = ("transfer ", "remote daemon ")
# Channels of the tests accept and send more than the daemon's 16 MiB limit,
# so that the limit observed is the daemon's.
TEST_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]

# Examples per fuzzed RPC; KVMAP_FUZZ_SCALE=10 fuzzes ten times longer. The
# Hypothesis profile (hypothesis_profiles.py) scales them first: all under
# ci, a tenth under dev.
SCALE = float(os.environ.get("KVMAP_FUZZ_SCALE", "1"))


def fuzz_settings(full: int) -> settings:
    return settings(
        max_examples=max(1, int(examples(full) * SCALE)),
        deadline=None,
        database=None,
        print_blob=True,  # a failure prints @reproduce_failure(...) to replay it
        # One live daemon serves every example: its fixture is module-scoped.
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.filter_too_much,
        ],
    )


# The closed set of statuses of each RPC, besides OK where OK is possible.
INVALID, NOT_FOUND, PRECONDITION = (
    Code.INVALID_ARGUMENT,
    Code.NOT_FOUND,
    Code.FAILED_PRECONDITION,
)
EXHAUSTED, UNAVAILABLE, DEADLINE = (
    Code.RESOURCE_EXHAUSTED,
    Code.UNAVAILABLE,
    Code.DEADLINE_EXCEEDED,
)
# A transfer without the owner's capability for exactly it; a Registry call
# on a worker without its registering uid's credentials (kvmap-peer-token),
# or a path registration without the caller's.
DENIED = Code.PERMISSION_DENIED
ALLOWED: dict[str, frozenset[Code]] = {
    "/kvmap.v1.Registry/RegisterWorker": frozenset(
        {OK, INVALID, NOT_FOUND, PRECONDITION, EXHAUSTED, Code.ALREADY_EXISTS, DENIED}
    ),
    "/kvmap.v1.Registry/DeregisterWorker": frozenset({OK, INVALID, NOT_FOUND, DENIED}),
    "/kvmap.v1.Registry/Attach": frozenset({OK, INVALID, NOT_FOUND, DENIED}),
    "/kvmap.v1.Registry/GrantTransfer": frozenset(
        {OK, INVALID, NOT_FOUND, PRECONDITION, EXHAUSTED, UNAVAILABLE, DENIED}
    ),
    "/kvmap.v1.Registry/RevokeTransfer": frozenset({OK, INVALID, NOT_FOUND, DENIED}),
    "/kvmap.v1.RegionMaps/ListWorkers": frozenset({OK, INVALID}),
    "/kvmap.v1.RegionMaps/GetRegionMap": frozenset({OK, INVALID, NOT_FOUND}),
    "/kvmap.v1.RegionMaps/PlanPreview": frozenset({OK, INVALID, EXHAUSTED}),
    "/kvmap.v1.Admin/Replan": frozenset({OK, INVALID}),
    "/kvmap.v1.Admin/GetStats": frozenset({OK, INVALID}),
    "/kvmap.v1.Admin/GetStatus": frozenset({OK, INVALID}),
    "/kvmap.v1.Transfers/Pull": frozenset(
        {OK, INVALID, NOT_FOUND, PRECONDITION, EXHAUSTED, UNAVAILABLE, DEADLINE, DENIED}
    ),
    "/kvmap.v1.Transfers/Push": frozenset(
        {OK, INVALID, NOT_FOUND, PRECONDITION, EXHAUSTED, UNAVAILABLE, DEADLINE, DENIED}
    ),
    "/kvmap.v1.Transfers/Release": frozenset(
        {OK, INVALID, NOT_FOUND, PRECONDITION, EXHAUSTED, UNAVAILABLE, DEADLINE, DENIED}
    ),
    # Relayed to the named prefill daemon: its answer, or why it was not reached.
    "/kvmap.v1.Transfers/OfferPush": frozenset(
        {OK, INVALID, NOT_FOUND, EXHAUSTED, UNAVAILABLE, DEADLINE, DENIED}
    ),
    "/kvmap.v1.Peer/GetAgentMetadata": frozenset({OK, INVALID, NOT_FOUND}),
    "/kvmap.v1.Peer/BeginTransfer": frozenset(
        {OK, INVALID, NOT_FOUND, PRECONDITION, EXHAUSTED, UNAVAILABLE, DENIED}
    ),
    # A refused call's status goes in its result; the RPC itself fails only
    # whole (more than MAX_BEGIN_CALLS calls, undecodable bytes).
    "/kvmap.v1.Peer/BeginTransfers": frozenset({OK, INVALID, EXHAUSTED}),
    # The same, per message of the stream.
    "/kvmap.v1.Peer/BeginTransferStream": frozenset({OK, INVALID, EXHAUSTED}),
    "/kvmap.v1.Peer/EndTransfer": frozenset({OK, INVALID, NOT_FOUND}),
    # NOT_FOUND: no attached worker of the engine the offer names.
    "/kvmap.v1.Peer/OfferPush": frozenset({OK, INVALID, NOT_FOUND}),
}
UNIX_METHODS = [m for m in ALLOWED if not m.startswith("/kvmap.v1.Peer/")]
TCP_METHODS = [m for m in ALLOWED if m.startswith(("/kvmap.v1.Peer/", "/kvmap.v1.RegionMaps/"))]
STREAMING = {"/kvmap.v1.Registry/Attach", "/kvmap.v1.Transfers/Pull", "/kvmap.v1.Transfers/Push"}
# Methods that stream both ways.
BIDI = {"/kvmap.v1.Peer/BeginTransferStream"}


@dataclass
class Outcome:
    code: Code
    details: str
    responses: list[Any] = field(default_factory=list)

    @property
    def response(self) -> Any:
        return self.responses[-1] if self.responses else None


def _finish(timeout: float, err: grpc.RpcError, what: str) -> Outcome:
    """The status the daemon answered; raises if the client's own deadline
    ended the call instead (no answer: a hang)."""
    code, details = err.code(), err.details() or ""
    if code is Code.DEADLINE_EXCEEDED and not details.startswith(DAEMON_DEADLINE_PREFIXES):
        raise AssertionError(f"{what}: no answer within the {timeout}s client deadline (a hang)")
    return Outcome(code, details)


def call(
    fn: Callable[..., Any], request: Any, what: str, timeout: float = CALL_TIMEOUT_S
) -> Outcome:
    """A unary call, its status and its answer. Raises on a hang."""
    try:
        resp = fn(request, timeout=timeout)
    except grpc.RpcError as err:
        return _finish(timeout, err, what)
    return Outcome(OK, "", [resp])


def call_stream(
    fn: Callable[..., Any],
    request: Any,
    what: str,
    timeout: float = CALL_TIMEOUT_S,
    first_only: bool = False,
) -> Outcome:
    """A server-streaming call read to its end (or its first message, then
    cancelled: Attach never ends by itself)."""
    it = fn(request, timeout=timeout)
    out: list[Any] = []
    try:
        for msg in it:
            out.append(msg)
            if first_only:
                it.cancel()
                break
    except grpc.RpcError as err:
        if first_only and out and err.code() is Code.CANCELLED:
            return Outcome(OK, "", out)
        o = _finish(timeout, err, what)
        o.responses = out
        return o
    return Outcome(OK, "", out)


def short(msg: Any, limit: int = 600) -> str:
    """A request for an assertion message (proto text, truncated)."""
    if isinstance(msg, Message):
        text = json_format.MessageToJson(msg, indent=None, preserving_proto_field_name=True)
    else:
        text = repr(msg)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


class Live:
    """A daemon process under test with channels and stubs on both listeners."""

    def __init__(self, daemon: DaemonProc) -> None:
        self.daemon = daemon
        self.unix = grpc.insecure_channel(daemon.unix_target, options=TEST_CHANNEL_OPTIONS)
        self.tcp = daemon.channel(tcp=True, options=TEST_CHANNEL_OPTIONS)
        self.registry = registry_pb2_grpc.RegistryStub(self.unix)
        self.maps = region_maps_pb2_grpc.RegionMapsStub(self.unix)
        self.tcp_maps = region_maps_pb2_grpc.RegionMapsStub(self.tcp)
        self.admin = admin_pb2_grpc.AdminStub(self.unix)
        self.transfers = transfers_pb2_grpc.TransfersStub(self.unix)
        self.peer = peer_pb2_grpc.PeerStub(self.tcp)

    def close(self) -> None:
        self.unix.close()
        self.tcp.close()

    def raw_unary(self, method: str, tcp: bool = False) -> Any:
        ch = self.tcp if tcp else self.unix
        return ch.unary_unary(method, request_serializer=None, response_deserializer=None)

    def raw_stream(self, method: str, tcp: bool = False) -> Any:
        ch = self.tcp if tcp else self.unix
        return ch.unary_stream(method, request_serializer=None, response_deserializer=None)

    def raw_bidi(self, method: str, tcp: bool = False) -> Any:
        """A method that streams both ways, called with one request message."""
        ch = self.tcp if tcp else self.unix
        stream = ch.stream_stream(method, request_serializer=None, response_deserializer=None)
        return lambda request, timeout: stream(iter([request]), timeout=timeout)

    # Observable state -------------------------------------------------------

    def snapshot(self) -> str:
        """Every registered worker's summary and full region map (generations
        included), as canonical JSON: equal strings, equal state."""
        listed = self.maps.ListWorkers(region_maps_pb2.ListWorkersRequest(), timeout=10)
        maps = []
        for w in listed.workers:
            got = self.maps.GetRegionMap(
                region_maps_pb2.GetRegionMapRequest(worker=w.worker), timeout=10
            )
            maps.append(json_format.MessageToDict(got, preserving_proto_field_name=True))
        state = {
            "workers": json_format.MessageToDict(listed, preserving_proto_field_name=True),
            "maps": maps,
        }
        return json.dumps(state, sort_keys=True)

    def generation(self, engine_id: str) -> int:
        got = self.maps.GetRegionMap(
            region_maps_pb2.GetRegionMapRequest(worker=types_pb2.WorkerId(engine_id=engine_id)),
            timeout=10,
        )
        return got.region_map.generation

    def crashes(self) -> str:
        """Tracebacks the daemon logged for requests it did not expect."""
        lines = [
            line
            for line in self.daemon.log().splitlines()
            if "rpc_crashed" in line or "Traceback" in line or "background_task_failed" in line
        ]
        return "\n".join(lines[-5:])

    def assert_healthy(self) -> None:
        """Process alive, health SERVING on both listeners."""
        rc = self.daemon.proc.poll()
        assert rc is None, f"kvmapd exited {rc}:\n{self.daemon.log()[-4000:]}"
        for ch in (self.unix, self.tcp):
            got = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
            assert got.status == health_pb2.HealthCheckResponse.SERVING


def check_status(live: Live, method: str, outcome: Outcome, request: Any) -> None:
    """The status is in ``method``'s closed set and never UNKNOWN/INTERNAL."""
    allowed = ALLOWED[method]
    if outcome.code in FORBIDDEN or outcome.code not in allowed:
        raise AssertionError(
            f"{method} answered {outcome.code.name} ({outcome.details!r}); allowed: "
            f"{sorted(c.name for c in allowed)}\nrequest: {short(request)}\n"
            f"daemon log:\n{live.crashes()}"
        )


def check_rejected(live: Live, method: str, outcome: Outcome, request: Any, before: str) -> None:
    """Status rules, and a rejected request changed nothing."""
    check_status(live, method, outcome, request)
    if outcome.code is not OK:
        after = live.snapshot()
        assert after == before, (
            f"{method} was rejected with {outcome.code.name} ({outcome.details!r}) but the "
            f"daemon's state changed\nrequest: {short(request)}"
        )


# Strategies of hostile values ---------------------------------------------

INT64_EDGES = [
    -(2**63),
    -(2**62) - 1,
    -4096,
    -1,
    0,
    1,
    2,
    7,
    4095,
    4096,
    2**24,
    2**24 + 1,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**53 + 1,
    2**62,
    2**62 + 1,
    2**63 - 1,
]
UINT32_EDGES = [0, 1, 2, 3, 7, 2**16, 2**31 - 1, 2**31, 2**32 - 1]
UINT64_EDGES = [0, 1, 2, 3, 2**32, 2**63, 2**64 - 1]

int64s = st.one_of(
    st.sampled_from(INT64_EDGES),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(-8, 1 << 16),
)
uint32s = st.one_of(st.sampled_from(UINT32_EDGES), st.integers(0, 2**32 - 1))
uint64s = st.one_of(st.sampled_from(UINT64_EDGES), st.integers(0, 2**64 - 1))
# Valid UTF-8 only: the protobuf runtime refuses lone surrogates client-side.
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=24)
odd_strings = st.one_of(
    st.sampled_from(["", " ", "..", "/", "\t", "é", "x" * 4096, "💥" * 100]),
    texts,
)


def worker_ids(known: Iterable[str]) -> st.SearchStrategy[types_pb2.WorkerId]:
    """Worker ids: registered engines (with odd ranks too), unknown and odd ones."""
    engines = st.one_of(st.sampled_from(["", *known, "ghost"]), odd_strings)
    ranks = st.one_of(st.just(0), uint32s)
    return st.builds(
        types_pb2.WorkerId, engine_id=engines, dp_rank=ranks, tp_rank=ranks, pp_rank=ranks
    )


def is_key(w: types_pb2.WorkerId, engine_id: str) -> bool:
    """Whether ``w`` names exactly the worker registered as ``engine_id`` (ranks 0)."""
    return (w.engine_id, w.dp_rank, w.tp_rank, w.pp_rank) == (engine_id, 0, 0, 0)


def request_class(method: str) -> type[Message]:
    """The request message class of ``/kvmap.v1.Service/Method``."""
    from google.protobuf import message_factory

    from kvmap.v1 import (
        admin_pb2,
        peer_pb2,
        registry_pb2,
        transfers_pb2,
    )

    service, name = method.strip("/").split("/")
    short_service = service.rsplit(".", 1)[-1]
    for module in (registry_pb2, region_maps_pb2, admin_pb2, transfers_pb2, peer_pb2):
        svc = module.DESCRIPTOR.services_by_name.get(short_service)
        if svc is not None:
            cls: type[Message] = message_factory.GetMessageClass(
                svc.methods_by_name[name].input_type
            )
            return cls
    raise KeyError(method)
