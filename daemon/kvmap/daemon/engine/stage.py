"""Where a running transfer is, in words: a transfer that runs out of time
says where it waited ("no completion in 30.0s, waiting for NIXL to complete
it"). ``TransferEngine.run`` starts one per transfer; the tasks the transfer
starts inherit it through the context."""

from __future__ import annotations

import contextvars

from kvmap.core.errors import DeadlineExceeded, Unavailable


class Stage:
    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = "starting"

    def set(self, now: str) -> None:
        self.now = now


_STAGE: contextvars.ContextVar[Stage] = contextvars.ContextVar("kvmap_transfer_stage")


def new_stage() -> Stage:
    """The running transfer's stage, from now on."""
    stage = Stage()
    _STAGE.set(stage)
    return stage


def stage() -> Stage:
    """The running transfer's stage (a stage of its own outside a transfer)."""
    return _STAGE.get(None) or Stage()


def say_where(err: BaseException, now: str) -> None:
    """A peer's outage or deadline names the stage the transfer was in (its
    message already names the peer: "remote daemon <target>: ..."), so an
    operator tells a link lost before the handshake from one lost mid-read."""
    if isinstance(err, Unavailable | DeadlineExceeded) and now not in err.message:
        err.message = f"{err.message} (while {now})"
