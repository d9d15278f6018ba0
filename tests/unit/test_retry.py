"""The transfer retry policy (``core.retry``): which failures are retried,
and the backoff arithmetic (bounded, growing, jittered, within a deadline)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmap.core import errors
from kvmap.core.retry import RetryPolicy, retryable

policies = st.builds(
    lambda initial, span, multiplier, jitter, attempt_s: RetryPolicy(
        initial, initial * span, multiplier, jitter, attempt_s
    ),
    st.floats(1e-3, 10.0),
    st.floats(1.0, 100.0),
    st.floats(1.0, 4.0),
    st.floats(0.0, 0.99),
    st.one_of(st.just(0.0), st.floats(0.0, 10.0)),
)
draws = st.floats(0.0, 1.0, exclude_max=True)


def test_what_a_restart_causes_is_retried_and_nothing_else() -> None:
    """UNAVAILABLE (a peer down, a worker re-registering) and HANDSHAKE_AGAIN
    (a new agent or generation) are retried; refusals, bad arguments, unknown
    workers, other preconditions (an expired capability), limits, deadlines,
    a pinned generation that is gone, and non-kvmap errors are not."""
    assert retryable(errors.Unavailable("peer down"))
    assert retryable(errors.HandshakeAgain("agent changed"))
    assert retryable(errors.StaleGeneration("w", 1, 2))
    for final in (
        errors.PermissionDenied("no"),
        errors.InvalidArgument("f", "bad"),
        errors.NotFound("no such worker"),
        errors.FailedPrecondition("capability expired"),
        errors.ResourceExhausted("limit"),
        errors.DeadlineExceeded("late"),
        errors.TransferError("nixl"),
        errors.RequestedGenerationGone("w", 1, 2),
        RuntimeError("bug"),
    ):
        assert not retryable(final), final


@given(policies, st.integers(0, 10_000), draws)
def test_a_delay_lies_between_the_jittered_and_the_full_step(
    policy: RetryPolicy, attempt: int, draw: float
) -> None:
    """Every delay is positive, at most ``max_s``, and within the jitter
    band below its step ``min(initial * multiplier**attempt, max)``."""
    step = policy.max_s
    for i in range(attempt + 1):  # no power: the reference must not overflow
        step = min(policy.initial_s if i == 0 else step * policy.multiplier, policy.max_s)
    delay = policy.delay(attempt, draw)
    assert 0 < delay <= policy.max_s
    assert step * (1 - policy.jitter) - 1e-12 <= delay <= step + 1e-12


@given(policies, st.integers(0, 200), draws)
def test_steps_never_shrink(policy: RetryPolicy, attempt: int, draw: float) -> None:
    """With the same draw, a later attempt never waits less than an earlier one."""
    assert policy.delay(attempt + 1, draw) >= policy.delay(attempt, draw) - 1e-12


@given(policies, st.integers(0, 200), draws, st.floats(-10.0, 1000.0))
def test_next_delay_fits_in_the_time_left_or_is_none(
    policy: RetryPolicy, attempt: int, draw: float, remaining: float
) -> None:
    """The next pause is the delay when it and then ``attempt_s`` end before
    the deadline, else None."""
    pause = policy.next_delay(attempt, draw, remaining)
    delay = policy.delay(attempt, draw)
    assert pause == (delay if delay + policy.attempt_s < remaining else None)


@given(policies, draws, st.floats(0.0, 100.0))
def test_the_pauses_of_one_transfer_add_up_to_less_than_its_deadline(
    policy: RetryPolicy, draw: float, deadline: float
) -> None:
    """Taking pauses until ``next_delay`` says no never sleeps so long that
    the last attempt has less than ``attempt_s`` before the deadline."""
    slept, attempt = 0.0, 0
    while (pause := policy.next_delay(attempt, draw, deadline - slept)) is not None:
        slept += pause
        attempt += 1
    assert slept + policy.attempt_s < deadline or slept == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_s": 0.0},
        {"initial_s": 2.0, "max_s": 1.0},
        {"multiplier": 0.5},
        {"jitter": 1.0},
        {"jitter": -0.1},
        {"attempt_s": -0.1},
        {"attempt_s": float("inf")},
        {"attempt_s": float("nan")},
    ],
)
def test_a_policy_that_could_not_back_off_is_refused(kwargs: dict[str, float]) -> None:
    """Zero or inverted bounds, a shrinking multiplier, a jitter outside [0, 1) or an
    attempt time that is negative or not finite are refused."""
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_out_of_range_attempt_or_draw_is_refused() -> None:
    """A negative attempt or a draw outside [0, 1) is a caller's bug."""
    for attempt, draw in ((-1, 0.0), (0, 1.0), (0, -0.5)):
        with pytest.raises(ValueError):
            RetryPolicy().delay(attempt, draw)
