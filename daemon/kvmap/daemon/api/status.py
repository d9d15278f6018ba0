"""The one place an exception becomes a gRPC status and message."""

from __future__ import annotations

import grpc

from kvmap.core.errors import status_of
from kvmap.daemon.adapters.grpc_codes import GRPC_STATUS


def grpc_status(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and bounded message a caller gets for ``err``; anything
    outside the error tree is INTERNAL and names only its type."""
    code, message = status_of(err)
    return GRPC_STATUS[code], message
