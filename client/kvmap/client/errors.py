"""Where the client's errors come from: gRPC statuses become the project's
error tree (``kvmap.core.errors``), the same classes kvmapd raises, so
``except NotFound`` means one class everywhere.

    KvmapError               (UNKNOWN, and the base of everything below)
    ├── InvalidArgument      (the request was malformed; nothing changed)
    ├── NotFound             (unknown worker, group or layer)
    ├── FailedPrecondition   (stale generation, incompatible geometry, expired grant)
    ├── PermissionDenied     (no capability, or one that does not allow this transfer)
    ├── ResourceExhausted    (a stated limit was hit)
    ├── Unavailable          (daemon or peer unreachable, daemon draining)
    ├── DeadlineExceeded
    ├── AlreadyExists, Unimplemented, InternalError
    └── OtherStatus          (a gRPC status kvmapd never sends: CANCELLED, ...)

``from_rpc_error`` is the one place gRPC errors become these
(``from_status_number`` for a status carried in a message); an error's
message is ``"<STATUS>: <details>"``.
"""

from __future__ import annotations

import grpc

from kvmap.core.errors import ErrorCode, KvmapError, error_for


class OtherStatus(KvmapError):
    """A gRPC status outside the daemon's codes (CANCELLED when the client
    was closed under a call, ABORTED, ...). Its code is UNKNOWN; ``status``
    is the gRPC status's name."""

    def __init__(self, message: str, status: str) -> None:
        super().__init__(message)
        self.status = status


def from_status(status: str, details: str) -> KvmapError:
    """The error for gRPC status ``status`` (its name, e.g. ``"NOT_FOUND"``;
    an unknown name counts as UNKNOWN) with the daemon's ``details``. Our
    codes are named as gRPC's statuses, so the name is the whole mapping."""
    if status not in grpc.StatusCode.__members__:
        status = ErrorCode.UNKNOWN.name
    message = f"{status}: {details}"
    code = ErrorCode.__members__.get(status)
    if code is None:
        return OtherStatus(message, status)
    return error_for(code, message)


# gRPC's status names by number (google.rpc.Code): how a status travels in
# a message (the local calls socket's LocalCallEnd) rather than as a status.
_STATUS_NAMES = {status.value[0]: status.name for status in grpc.StatusCode}


def from_status_number(code: int, details: str) -> KvmapError:
    """``from_status`` for a status given by its number (UNKNOWN for a
    number that names none)."""
    return from_status(_STATUS_NAMES.get(code, ErrorCode.UNKNOWN.name), details)


def from_rpc_error(err: grpc.RpcError) -> KvmapError:
    """The error a failed gRPC call raises to the client's callers."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return from_status(code.name, details or "")


def status_name(err: BaseException) -> str:
    """The gRPC status name an error stands for ("UNKNOWN" for one outside
    the tree): how the connector's statistics count failed loads."""
    if isinstance(err, OtherStatus):
        return err.status
    if isinstance(err, KvmapError):
        return err.code.name
    return ErrorCode.UNKNOWN.name


def describe(exc: BaseException) -> str:
    """What a failed call's log line and failure report say: a kvmap
    error's message, else the exception's type and text."""
    if isinstance(exc, KvmapError):
        return exc.message
    return f"{type(exc).__name__}: {exc}"
