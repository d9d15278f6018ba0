"""Error codes: every ErrorCode becomes the gRPC status of the same name, the
api reports bounded messages, and the peer client maps remote statuses back."""

from __future__ import annotations

import grpc
import pytest
from grpc import aio

from kvmap.core import errors
from kvmap.core.errors import MAX_STATUS_MESSAGE, ErrorCode
from kvmap.daemon.adapters import peer_client
from kvmap.daemon.adapters.grpc_codes import GRPC_STATUS, error_code
from kvmap.daemon.api.status import grpc_status


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_maps_to_the_status_of_its_name(code: ErrorCode) -> None:
    """Each ErrorCode becomes the gRPC status of the same name on the wire."""
    assert GRPC_STATUS[code] is grpc.StatusCode[code.name]
    assert error_code(GRPC_STATUS[code]) is code


def test_codes_and_statuses_are_one_to_one() -> None:
    """The ErrorCode -> gRPC table covers every code and no two codes share a status."""
    assert set(GRPC_STATUS) == set(ErrorCode)
    assert len(set(GRPC_STATUS.values())) == len(ErrorCode)


@pytest.mark.parametrize(
    "status",
    [s for s in grpc.StatusCode if s.name not in ErrorCode.__members__],
    ids=lambda s: s.name,
)
def test_statuses_we_never_send_are_unknown_to_us(status: grpc.StatusCode) -> None:
    """A gRPC status outside our table (OK, CANCELLED, ABORTED, ...) maps back to UNKNOWN."""
    assert error_code(status) is ErrorCode.UNKNOWN


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (errors.KvmapError("m"), "UNKNOWN"),
        (errors.InvalidArgument("views[1]", "m"), "INVALID_ARGUMENT"),
        (errors.NotFound("m"), "NOT_FOUND"),
        (errors.AlreadyExists("m"), "ALREADY_EXISTS"),
        (errors.PermissionDenied("m"), "PERMISSION_DENIED"),
        (errors.FailedPrecondition("m"), "FAILED_PRECONDITION"),
        (errors.StaleGeneration("w", 1, 2), "FAILED_PRECONDITION"),
        (errors.ResourceExhausted("m"), "RESOURCE_EXHAUSTED"),
        (errors.Unavailable("m"), "UNAVAILABLE"),
        (errors.DeadlineExceeded("m"), "DEADLINE_EXCEEDED"),
        (errors.Unimplemented("m"), "UNIMPLEMENTED"),
        (errors.InternalError("m"), "INTERNAL"),
        (errors.TransferError("m", "NIXL_ERR_BACKEND"), "INTERNAL"),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, errors.KvmapError) else v,
)
def test_each_error_reaches_the_wire_as_its_status(err: errors.KvmapError, status: str) -> None:
    """Each error class of the tree reaches the wire with its own status and unchanged message."""
    assert grpc_status(err) == (grpc.StatusCode[status], err.message)


def test_long_messages_are_bounded() -> None:
    """A status message longer than MAX_STATUS_MESSAGE is cut at exactly that length and says how
    long it was."""
    err = errors.NotFound("x" * (MAX_STATUS_MESSAGE + 10))
    code, message = grpc_status(err)
    assert code is grpc.StatusCode.NOT_FOUND
    assert message == "x" * MAX_STATUS_MESSAGE + f"... ({MAX_STATUS_MESSAGE + 10} characters)"
    assert grpc_status(errors.NotFound("x" * MAX_STATUS_MESSAGE))[1] == "x" * MAX_STATUS_MESSAGE


def test_exceptions_outside_the_tree_are_internal_and_name_only_their_type() -> None:
    """An exception outside the error tree becomes INTERNAL naming only its type, never its
    message."""
    assert grpc_status(KeyError("secret path")) == (
        grpc.StatusCode.INTERNAL,
        "internal error: KeyError",
    )


def _rpc_error(status: grpc.StatusCode) -> aio.AioRpcError:
    return aio.AioRpcError(status, aio.Metadata(), aio.Metadata(), details="why")


_PASSED_THROUGH = {
    grpc.StatusCode.NOT_FOUND: errors.NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
}


@pytest.mark.parametrize(
    ("status", "expected"), list(_PASSED_THROUGH.items()), ids=lambda v: getattr(v, "name", "")
)
def test_peer_statuses_about_the_request_pass_through(
    status: grpc.StatusCode, expected: type[errors.KvmapError]
) -> None:
    """A peer's NOT_FOUND, FAILED_PRECONDITION, INVALID_ARGUMENT, DEADLINE_EXCEEDED and
    PERMISSION_DENIED become the same error class here."""
    err = peer_client._peer_error("peer:1", _rpc_error(status))
    assert type(err) is expected
    assert err.message.endswith(f"remote daemon peer:1: {status.name}: why")  # field: prefix
    if isinstance(err, errors.InvalidArgument):
        assert err.field == "remote_worker"


@pytest.mark.parametrize(
    "status",
    [s for s in grpc.StatusCode if s not in _PASSED_THROUGH and s is not grpc.StatusCode.OK],
    ids=lambda s: s.name,
)
def test_other_peer_statuses_make_the_peer_unavailable(status: grpc.StatusCode) -> None:
    """Any other status from a peer makes that peer Unavailable, naming its address."""
    err = peer_client._peer_error("peer:1", _rpc_error(status))
    assert type(err) is errors.Unavailable
    assert err.message == f"remote daemon peer:1: {status.name}: why"


def test_only_errors_a_handshake_cures_carry_the_handshake_again_reason() -> None:
    """StaleGeneration and HandshakeAgain travel with ``kvmap-reason:
    HANDSHAKE_AGAIN`` (what the decode side retries on); a plain
    FAILED_PRECONDITION such as an expired capability carries no reason."""
    from kvmap.daemon.adapters.grpc_codes import REASON_KEY, reason_metadata, reason_of

    stale = errors.StaleGeneration("w", 1, 2)
    assert reason_metadata(stale.reason) == ((REASON_KEY, errors.HANDSHAKE_AGAIN),)
    assert reason_of(reason_metadata(stale.reason)) == errors.HANDSHAKE_AGAIN
    assert errors.HandshakeAgain("restarted").reason == errors.HANDSHAKE_AGAIN
    assert reason_metadata(errors.FailedPrecondition("capability expired").reason) == ()
    assert reason_of(()) == "" and reason_of(None) == ""
    assert reason_of((("other", "x"), (REASON_KEY, "OTHER"))) == "OTHER"
