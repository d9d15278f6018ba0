"""Typed errors of the client library, one per gRPC status the daemon uses.

    KvmapClientError
    ├── InvalidArgument      (the request was malformed; nothing changed)
    ├── NotFound             (unknown worker, group or layer)
    ├── FailedPrecondition   (stale generation, incompatible geometry, expired grant)
    ├── PermissionDenied     (no capability, or one that does not allow this transfer)
    ├── ResourceExhausted    (a stated limit was hit)
    ├── Unavailable          (daemon or peer unreachable, daemon draining)
    ├── DeadlineExceeded
    └── DaemonError          (anything else the daemon reported)

``from_rpc_error`` is the one place gRPC errors become these.
"""

from __future__ import annotations

import grpc


class KvmapClientError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class InvalidArgument(KvmapClientError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KvmapClientError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(KvmapClientError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(KvmapClientError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KvmapClientError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvmapClientError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KvmapClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DaemonError(KvmapClientError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[KvmapClientError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        PermissionDenied,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
    )
}


def from_status(code: grpc.StatusCode, details: str) -> KvmapClientError:
    cls = _BY_CODE.get(code, DaemonError)
    return cls(f"{code.name}: {details}", code)


def from_rpc_error(err: grpc.RpcError) -> KvmapClientError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return from_status(code, details or "")
