"""The project's error tree. Every error knows its gRPC status.

    KvmapError
    ├── InvalidArgument      INVALID_ARGUMENT   (names the offending field)
    ├── NotFound             NOT_FOUND
    ├── AlreadyExists        ALREADY_EXISTS
    ├── FailedPrecondition   FAILED_PRECONDITION
    │   └── StaleGeneration  (a peer's region map changed under a transfer)
    ├── ResourceExhausted    RESOURCE_EXHAUSTED (a stated limit was hit)
    ├── Unavailable          UNAVAILABLE        (a peer or the daemon is unreachable / draining)
    ├── DeadlineExceeded     DEADLINE_EXCEEDED
    ├── Unimplemented        UNIMPLEMENTED
    └── InternalError        INTERNAL
        └── TransferError    (NIXL reported a failed transfer or call)

Only ``grpc_status`` turns these into statuses on the wire (see
``kvmap.daemon.api.rpc``); the NIXL adapter maps NIXL's exceptions into this tree.
"""

from __future__ import annotations

import grpc


class KvmapError(Exception):
    """Base of every error the daemon reports to a caller."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(KvmapError):
    """The request is malformed. ``field`` is a path like ``views[17].num_blocks``."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem


class NotFound(KvmapError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(KvmapError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(KvmapError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleGeneration(FailedPrecondition):
    """A transfer was planned against a generation that is no longer current."""

    def __init__(self, worker: str, expected: int, current: int) -> None:
        super().__init__(
            f"worker {worker}: region map generation {expected} is stale (current {current})"
        )
        self.expected = expected
        self.current = current


class ResourceExhausted(KvmapError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KvmapError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KvmapError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unimplemented(KvmapError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(KvmapError):
    code = grpc.StatusCode.INTERNAL


class TransferError(InternalError):
    """NIXL reported a failed call or transfer; ``nixl_status`` is its own word."""

    def __init__(self, message: str, nixl_status: str = "") -> None:
        super().__init__(message)
        self.nixl_status = nixl_status


# Status messages (and the log lines that carry them) echo request fields;
# bound them so a huge field cannot make a huge answer or log line.
MAX_STATUS_MESSAGE = 1024


def grpc_status(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place that turns an exception into a gRPC status and message."""
    if isinstance(err, KvmapError):
        message = err.message
        if len(message) > MAX_STATUS_MESSAGE:
            message = message[:MAX_STATUS_MESSAGE] + f"... ({len(err.message)} characters)"
        return err.code, message
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}"
