"""The project's error tree. Every error carries one of our own ``ErrorCode``s.

    KvmapError               UNKNOWN
    ├── InvalidArgument      INVALID_ARGUMENT   (names the offending field)
    │   └── ConfigError      (a configuration key's value; also a ValueError)
    ├── NotFound             NOT_FOUND
    ├── AlreadyExists        ALREADY_EXISTS
    ├── PermissionDenied     PERMISSION_DENIED  (the caller may not do this; says no more)
    │   └── OwnerRefused     (a peer daemon refused a transfer's capability)
    ├── FailedPrecondition   FAILED_PRECONDITION
    │   └── HandshakeAgain   (reason HANDSHAKE_AGAIN: a fresh handshake cures it)
    │       └── StaleGeneration  (a peer's region map changed under a transfer)
    │           └── RequestedGenerationGone (the spec's generation; no cure)
    ├── ResourceExhausted    RESOURCE_EXHAUSTED (a stated limit was hit)
    ├── Unavailable          UNAVAILABLE        (a peer or the daemon is unreachable / draining)
    ├── DeadlineExceeded     DEADLINE_EXCEEDED
    ├── Unimplemented        UNIMPLEMENTED
    └── InternalError        INTERNAL
        └── TransferError    (NIXL reported a failed transfer or call)

The codes are named like gRPC's status codes but are ours, so the core imports
no grpc. The client raises this tree too: ``error_for`` is the error a caller
of kvmapd raises for a status it received (``kvmap.client.errors``), so
``except NotFound`` means one class in the daemon, the client and the tools.
``status_of`` says what any exception reports to a caller (code and bounded
message); ``kvmap.daemon.api.status.grpc_status`` is the one place that turns
that into a status on the wire, through the table in
``kvmap.daemon.adapters.grpc_codes``. The NIXL adapter maps NIXL's exceptions
into this tree and the peer client maps remote daemons' statuses into it.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Mapping
from functools import partial


@enum.unique
class ErrorCode(enum.Enum):
    """What kind of failure an error is; each name is the gRPC status it becomes."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    UNIMPLEMENTED = "UNIMPLEMENTED"
    INTERNAL = "INTERNAL"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    UNKNOWN = "UNKNOWN"


class KvmapError(Exception):
    """Base of every error the daemon reports to a caller."""

    code: ErrorCode = ErrorCode.UNKNOWN
    # A machine-readable reason beside the code, for the few errors a caller
    # must tell apart from others with the same code (sent as trailing
    # metadata ``kvmap-reason``, like google.rpc.ErrorInfo.reason).
    reason: str = ""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(KvmapError):
    """The request is malformed. ``field`` is a path like ``views[17].num_blocks``."""

    code = ErrorCode.INVALID_ARGUMENT

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}" if field else problem)
        self.field = field
        self.problem = problem


class ConfigError(InvalidArgument, ValueError):
    """A configuration key has a value the daemon cannot use. ``key`` is the
    key (the flag's name with underscores) and ``value`` what it was given;
    the daemon's start-up says where the value came from (the file or the
    flag), a replan answers INVALID_ARGUMENT. A ValueError too, as every
    other configuration problem is."""

    def __init__(self, key: str, value: object, problem: str) -> None:
        super().__init__(key, problem)
        self.key = key
        self.value = value


class NotFound(KvmapError):
    code = ErrorCode.NOT_FOUND


class AlreadyExists(KvmapError):
    code = ErrorCode.ALREADY_EXISTS


class PermissionDenied(KvmapError):
    """The caller is not allowed to do this. The message is deliberately generic:
    it must not tell a stranger which of the checks it failed."""

    code = ErrorCode.PERMISSION_DENIED


class OwnerRefused(PermissionDenied):
    """The peer daemon that owns a transfer's blocks refused its capability
    (BeginTransfer answered PERMISSION_DENIED). A puller tries again for a
    moment (``kvmap.core.retry.GRANT_RACE_S``): the owner's worker may have
    handed the capability on before its daemon had the grant."""


class FailedPrecondition(KvmapError):
    code = ErrorCode.FAILED_PRECONDITION


# The reason of every error that a fresh handshake cures.
HANDSHAKE_AGAIN = "HANDSHAKE_AGAIN"


class HandshakeAgain(FailedPrecondition):
    """The peer's daemon or worker changed since the caller's handshake."""

    reason = HANDSHAKE_AGAIN


class StaleGeneration(HandshakeAgain):
    """A transfer was planned against a generation that is no longer current."""

    def __init__(self, worker: str, expected: int, current: int) -> None:
        super().__init__(
            f"worker {worker}: region map generation {expected} is stale (current {current})"
        )
        self.expected = expected
        self.current = current


class RequestedGenerationGone(StaleGeneration):
    """A transfer spec pins a remote generation that a fresh handshake shows
    is not current: asking again cannot bring it back, so it is never retried
    (``core.retry``)."""


class ResourceExhausted(KvmapError):
    code = ErrorCode.RESOURCE_EXHAUSTED


class Unavailable(KvmapError):
    code = ErrorCode.UNAVAILABLE


# The message of what a draining daemon refuses (SIGTERM, an upgrade): its
# own workers' clients retry it, as they retry the daemon being down.
SHUTTING_DOWN = "kvmapd is shutting down"


class DeadlineExceeded(KvmapError):
    code = ErrorCode.DEADLINE_EXCEEDED


class Unimplemented(KvmapError):
    code = ErrorCode.UNIMPLEMENTED


class InternalError(KvmapError):
    code = ErrorCode.INTERNAL


class TransferError(InternalError):
    """NIXL reported a failed call or transfer; ``nixl_status`` is its own word."""

    def __init__(self, message: str, nixl_status: str = "") -> None:
        super().__init__(message)
        self.nixl_status = nixl_status


# Status messages (and the log lines that carry them) echo request fields;
# bound them so a huge field cannot make a huge answer or log line.
MAX_STATUS_MESSAGE = 1024


def status_of(err: BaseException) -> tuple[ErrorCode, str]:
    """What an exception reports to a caller: its code and a bounded message.
    Anything outside the tree is a bug and reports only its type, not its text."""
    if isinstance(err, KvmapError):
        message = err.message
        if len(message) > MAX_STATUS_MESSAGE:
            message = message[:MAX_STATUS_MESSAGE] + f"... ({len(err.message)} characters)"
        return err.code, message
    return ErrorCode.INTERNAL, f"internal error: {type(err).__name__}"


# The error a caller raises for each code it receives: the class of that code
# (an invalid argument names no field: the message says which).
_ERROR_FOR: Mapping[ErrorCode, Callable[[str], KvmapError]] = types.MappingProxyType(
    {
        ErrorCode.INVALID_ARGUMENT: partial(InvalidArgument, ""),
        ErrorCode.NOT_FOUND: NotFound,
        ErrorCode.ALREADY_EXISTS: AlreadyExists,
        ErrorCode.FAILED_PRECONDITION: FailedPrecondition,
        ErrorCode.RESOURCE_EXHAUSTED: ResourceExhausted,
        ErrorCode.UNAVAILABLE: Unavailable,
        ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
        ErrorCode.UNIMPLEMENTED: Unimplemented,
        ErrorCode.INTERNAL: InternalError,
        ErrorCode.PERMISSION_DENIED: PermissionDenied,
        ErrorCode.UNKNOWN: KvmapError,
    }
)


def error_for(code: ErrorCode, message: str) -> KvmapError:
    """The error of ``code`` carrying ``message``: what a caller raises when
    kvmapd answered with that code (the inverse of ``status_of``'s code)."""
    return _ERROR_FOR[code](message)
