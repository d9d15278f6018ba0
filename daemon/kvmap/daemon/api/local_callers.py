"""Who calls the Registry on the Unix socket: gRPC does not say (the peer of
a Unix-socket call is just ``unix:``), so a caller proves its uid with a
credential token from the fd hand-off socket, whose SO_PEERCRED the kernel
vouches for (``FdHandoffServer``; the client's ``send_credentials``), sent
as the metadata ``kvmap-peer-token``. A token is a 128-bit secret that only
the process it was given to knows; it lives 120 s.

A call without a token has no known uid: it may act only on workers that
were registered without one (raw gRPC callers); a worker registered with a
token is then its uid's (``engine.lifecycle.Lifecycle.check_caller``).
"""

from __future__ import annotations

from typing import Any

from grpc import aio

from kvmap.core.errors import NotFound, PermissionDenied
from kvmap.daemon.adapters.fd_handoff import FdHandoffServer, PeerCred

PEER_TOKEN_METADATA = "kvmap-peer-token"


def local_caller(context: aio.ServicerContext[Any, Any], fds: FdHandoffServer) -> PeerCred | None:
    """The calling process's credentials, or None when it sent no token.
    An unknown or expired token is PERMISSION_DENIED (the client fetches a
    fresh one and calls again)."""
    token = next(
        (str(v) for k, v in context.invocation_metadata() or () if k == PEER_TOKEN_METADATA),
        None,
    )
    if token is None:
        return None
    try:
        return fds.peer(token)
    except NotFound:
        raise PermissionDenied(
            f"{PEER_TOKEN_METADATA}: unknown or expired credential token;"
            " get a fresh one from the fd hand-off socket"
        ) from None
