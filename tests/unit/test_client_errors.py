"""The client raises the project's one error tree (``kvmap.core.errors``) for
every gRPC status, and its reconnection backoff is the core's retry
arithmetic with the session's own numbers."""

from __future__ import annotations

import itertools
import random

import grpc
import pytest

from kvmap.client.errors import OtherStatus, from_status, from_status_number, status_name
from kvmap.client.session import Backoff
from kvmap.core import errors
from kvmap.core.retry import RetryPolicy


@pytest.mark.parametrize("status", list(grpc.StatusCode), ids=lambda s: s.name)
def test_every_status_becomes_an_error_of_the_core_tree(status: grpc.StatusCode) -> None:
    """A status named like one of our codes becomes that code's core class
    (so ``except NotFound`` catches the daemon's and the client's alike);
    any other (CANCELLED, ...) becomes OtherStatus keeping gRPC's name. The
    message is "<STATUS>: <details>" and ``status_name`` gives the status back."""
    err = from_status(status.name, "details")
    assert isinstance(err, errors.KvmapError)
    assert err.message == f"{status.name}: details"
    assert status_name(err) == status.name
    code = errors.ErrorCode.__members__.get(status.name)
    if code is None:
        assert isinstance(err, OtherStatus)
        assert (err.code, err.status) == (errors.ErrorCode.UNKNOWN, status.name)
    else:
        assert not isinstance(err, OtherStatus)
        assert err.code is code
        assert type(err) is type(errors.error_for(code, "x"))


def test_the_classes_are_the_cores() -> None:
    """The statuses callers catch by class are the core's classes, not copies."""
    assert type(from_status("NOT_FOUND", "")) is errors.NotFound
    assert type(from_status("UNAVAILABLE", "")) is errors.Unavailable
    assert type(from_status("PERMISSION_DENIED", "")) is errors.PermissionDenied
    invalid = from_status("INVALID_ARGUMENT", "bad")
    assert type(invalid) is errors.InvalidArgument
    assert str(invalid) == "INVALID_ARGUMENT: bad"


def test_a_name_that_is_no_status_is_unknown() -> None:
    """A status name gRPC does not have (an fd hand-off reply from some other
    program) counts as UNKNOWN; so does anything outside the tree."""
    err = from_status("NO_SUCH_STATUS", "odd")
    assert (type(err), err.message) == (errors.KvmapError, "UNKNOWN: odd")
    assert status_name(RuntimeError("bug")) == "UNKNOWN"


@pytest.mark.parametrize("status", list(grpc.StatusCode), ids=lambda s: s.name)
def test_a_status_by_number_is_the_status_by_name(status: grpc.StatusCode) -> None:
    """A status carried as its number (the local calls socket's end frame)
    raises what the same status by name does."""
    by_number = from_status_number(status.value[0], "details")
    by_name = from_status(status.name, "details")
    assert (type(by_number), by_number.message) == (type(by_name), by_name.message)


def test_a_number_that_is_no_status_is_unknown() -> None:
    """A number gRPC does not define is UNKNOWN, as an unknown name is."""
    err = from_status_number(99, "details")
    assert type(err) is errors.KvmapError and err.message == "UNKNOWN: details"


def test_backoff_is_the_retry_arithmetic_with_the_sessions_numbers() -> None:
    """Backoff keeps its own defaults (0.1 s growing x2 up to 5 s, jitter
    0.2) and its delays are exactly RetryPolicy's for the same draws."""
    backoff = Backoff()
    assert (backoff.initial_s, backoff.max_s, backoff.multiplier, backoff.jitter) == (
        0.1,
        5.0,
        2.0,
        0.2,
    )
    policy = RetryPolicy(0.1, 5.0, 2.0, 0.2)
    draws = random.Random(7)
    expected = [policy.delay(attempt, draws.random()) for attempt in range(12)]
    assert list(itertools.islice(backoff.delays(random.Random(7)), 12)) == expected
    assert expected[0] <= 0.1
    assert expected[-1] >= 5.0 * 0.8
