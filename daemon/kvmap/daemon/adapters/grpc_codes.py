"""The table between our ``ErrorCode``s and gRPC's status codes, both ways.

It lives here, not in the api layer, because two layers need it: the api turns
our errors into statuses on the wire (``kvmap.daemon.api.status``) and the peer
client, an adapter, turns remote daemons' statuses back into our errors.
Adapters may not import the api (core < adapters < engine < api), and the core
may not import grpc, so the adapters are the lowest layer that can hold it.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

import grpc

from kvmap.core.errors import ErrorCode

# Every ErrorCode, to the gRPC status of the same name (a unit test holds both).
GRPC_STATUS: Mapping[ErrorCode, grpc.StatusCode] = types.MappingProxyType(
    {
        ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
        ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
        ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
        ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
        ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
        ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
        ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
        ErrorCode.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
        ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
        ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
        ErrorCode.UNKNOWN: grpc.StatusCode.UNKNOWN,
    }
)

_ERROR_CODE: Mapping[grpc.StatusCode, ErrorCode] = types.MappingProxyType(
    {status: code for code, status in GRPC_STATUS.items()}
)


def error_code(status: grpc.StatusCode) -> ErrorCode:
    """The inverse of ``GRPC_STATUS``; statuses we never send (OK, CANCELLED,
    ABORTED, ...) are UNKNOWN to us."""
    return _ERROR_CODE.get(status, ErrorCode.UNKNOWN)


# gRPC's status codes by number (google.rpc.Code): how a status travels in a
# message (Peer.BeginTransfers' per-call results) rather than as a status.
_BY_NUMBER: Mapping[int, grpc.StatusCode] = types.MappingProxyType(
    {status.value[0]: status for status in grpc.StatusCode}
)


def status_number(status: grpc.StatusCode) -> int:
    """``status`` as its google.rpc.Code number."""
    number: int = status.value[0]
    return number


def status_from_number(number: int) -> grpc.StatusCode:
    """The status a number names; UNKNOWN for a number that names none."""
    return _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)


# Trailing-metadata key of KvmapError.reason (see core/errors.py).
REASON_KEY = "kvmap-reason"


def reason_metadata(reason: str) -> tuple[tuple[str, str], ...]:
    """The trailing metadata that carries an error's reason (none without one)."""
    return ((REASON_KEY, reason),) if reason else ()


def reason_of(metadata: object) -> str:
    """The ``kvmap-reason`` a peer sent in its trailing metadata, or ""."""
    if not metadata:
        return ""
    for item in metadata:  # type: ignore[attr-defined]
        key, value = item[0], item[1]
        if key == REASON_KEY and isinstance(value, str):
            return value
    return ""
