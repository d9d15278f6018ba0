"""Who may call kvmap's services on the TCP port: a server interceptor that
answers only authorized peers (``kvmap.core.peer_policy`` decides).

Everything of ``kvmap.v1`` on TCP is guarded: ``Peer`` hands out the NIXL
agent metadata (with it, a NIXL agent can READ every registered byte) and
``RegionMaps`` reveals the addresses of registered memory. Health and
reflection stay open for probes. A refused caller gets PERMISSION_DENIED with
one message, before its request is even read, so it learns nothing about
the daemon's workers.

An address is not an authorization by itself: everything on the host (and
every container of a pod) shares loopback. Without mutual TLS a caller
must present the shared peer secret (``peer_secret_file``) in the
``kvmap-peer-secret`` metadata *and* call from a ``peer_accept`` address; a
daemon with neither a secret nor mutual TLS refuses every TCP caller.

``peer_identity`` names the authenticated caller for the owner's side: its
address, and its certificate identities under mutual TLS. Claims, leases and
their quotas are keyed by it, not by the agent name a caller declares.

Installed inside ``ErrorsAndContext`` (listed after it), so a refusal is
logged and counted like any other rejected RPC.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from grpc import aio

from kvmap.core.errors import PermissionDenied
from kvmap.core.peer_policy import (
    INBOUND_DENIED,
    PEER_SECRET_METADATA,
    PeerPolicy,
    grpc_peer_address,
    secret_matches,
)
from kvmap.daemon.api.handlers import (
    Ctx,
    WrappedHandlers,
    is_kvmap_method,
    read_after,
    read_each,
)
from kvmap.daemon.api.limits import tcp_request_limit

log = structlog.get_logger("kvmapd.authorization")

# Peer strings whose answer is remembered at most (then forgotten at once):
# connections, each with its own source port, are far fewer.
MAX_REMEMBERED_PEERS = 4096

# auth_context() keys under which grpcio reports the client certificate's DNS
# and URI SANs (grpcio 1.85; pinned by tests/security/test_peer_authorization.py).
SAN_KEYS = ("peer_dns", "peer_uri")

if TYPE_CHECKING:
    from kvmap.daemon.api.handlers import Handler

    _Interceptor = aio.ServerInterceptor[Any, Any]
else:
    _Interceptor = aio.ServerInterceptor


def certificate_identities(context: Ctx) -> list[str]:
    """The DNS and URI SANs of the client certificate (empty without one)."""
    auth = context.auth_context() or {}
    return [v.decode("utf-8", "replace") for key in SAN_KEYS for v in auth.get(key, ())]


def presented_secret(context: Ctx) -> str | bytes | None:
    """The peer secret the caller sent (None when it sent none)."""
    for key, value in context.invocation_metadata() or ():
        if key == PEER_SECRET_METADATA:
            return value
    return None


def peer_identity(context: Ctx) -> str:
    """Who an authorized TCP caller is, as the owner's side keys claims and
    quotas: its IP address (a daemon reconnects from other ports) and, under
    mutual TLS, its certificate identities (pods of one service account
    share a SPIFFE ID, so the address still tells them apart)."""
    address = grpc_peer_address(context.peer())
    sans = sorted(certificate_identities(context))
    # The IPv4-mapped form of an IPv4 client is the same peer.
    ip = "" if address is None else str(getattr(address, "ipv4_mapped", None) or address)
    return " ".join([ip or context.peer(), *sans])


class PeerAuthorization(_Interceptor):
    """With mutual TLS, by certificate identity; otherwise by the shared peer
    secret and the source address; with neither, no one."""

    def __init__(
        self,
        policy: PeerPolicy,
        mutual_tls: bool,
        secret: bytes | None = None,
        on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        self._policy = policy
        self._mutual_tls = mutual_tls
        self._secret = secret
        # Told (peer, reason) of each refusal: the operator's view counts them.
        self._on_refused = on_refused
        self._wrapped = WrappedHandlers(self._wrap)
        # Without mutual TLS the answer depends on the peer's address alone
        # (the policy never changes): each peer string (address and port,
        # one per connection) is parsed and matched once, not per call.
        self._by_address: dict[str, bool] = {}

    def authorized(self, context: Ctx) -> bool:
        if self._mutual_tls:
            return self._policy.accepts_identities(certificate_identities(context))
        # Checked on every call (metadata is per call); an address alone is
        # what any neighbour on loopback has.
        if self._secret is None or not secret_matches(presented_secret(context), self._secret):
            return False
        peer = context.peer()
        known = self._by_address.get(peer)
        if known is None:
            known = self._policy.accepts_address(grpc_peer_address(peer))
            if len(self._by_address) >= MAX_REMEMBERED_PEERS:
                self._by_address.clear()
            self._by_address[peer] = known
        return known

    def refusal_reason(self, context: Ctx) -> str:
        """Why a refused caller was refused, for the operator only (the
        caller hears ``INBOUND_DENIED`` whatever it lacked)."""
        if self._mutual_tls:
            return "its certificate identities are not in peer_identity"
        if self._secret is None:
            return "no peer authentication is configured here (no peer_secret_file, no mutual TLS)"
        presented = presented_secret(context)
        if presented is None:
            return "presented no peer secret"
        if not secret_matches(presented, self._secret):
            return "presented another peer secret"
        return "its address is not in peer_accept"

    def check(self, context: Ctx) -> None:
        if not self.authorized(context):
            peer, reason = context.peer(), self.refusal_reason(context)
            log.warning("peer_refused", peer=peer, reason=reason)
            if self._on_refused is not None:
                self._on_refused(peer, reason)
            raise PermissionDenied(INBOUND_DENIED)

    def _guard(self, context: Ctx) -> _Guard:
        return _Guard(self, context)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or not is_kvmap_method(handler_call_details):
            return handler
        wrapped = self._wrapped.get(str(handler_call_details.method), handler)
        return handler if wrapped is None else wrapped  # _wrap never answers None

    def _wrap(self, method: str, handler: Handler) -> Handler:
        # The request is read only once the caller is authorized: a stranger's
        # bytes are neither buffered whole nor decoded (and it sees no
        # INVALID_ARGUMENT either); an authorized one's are bounded per method.
        limit = tcp_request_limit(method)
        wrapped = read_after(handler, self._guard, limit) or read_each(handler, self._guard, limit)
        if wrapped is not None:
            return wrapped
        # A streaming-request RPC that does not stream its answers too (none
        # is served on TCP) must not slip through unguarded: it is refused
        # until it is guarded here (without reading what it was sent).
        return grpc.stream_unary_rpc_method_handler(self._refuse)

    async def _refuse(self, requests: Any, context: Ctx) -> Any:
        raise PermissionDenied(INBOUND_DENIED)


class _Guard:
    """``PeerAuthorization``'s check around one call, as a plain async
    context manager (a generator-based one costs an async generator, which
    the event loop tracks, per call): the caller is checked on entry, before
    its request is parsed; nothing happens on exit."""

    __slots__ = ("_context", "_owner")

    def __init__(self, owner: PeerAuthorization, context: Ctx) -> None:
        self._owner = owner
        self._context = context

    async def __aenter__(self) -> None:
        self._owner.check(self._context)

    async def __aexit__(self, *exc: object) -> bool:
        return False
