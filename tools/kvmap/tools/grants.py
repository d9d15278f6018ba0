"""Grants between demo workers, as the vLLM connector makes them: the worker
that owns the blocks a transfer reads (a pull) or writes (a push) grants
exactly those blocks for one request id (its ``grant`` command), and the
worker that runs the transfer carries the capability in its ``pull`` or
``push`` command. The daemons refuse a transfer without one."""

from __future__ import annotations

from typing import Any

from kvmap.tools.launch import WorkerProc


class GrantRefused(RuntimeError):
    """The owner's daemon did not grant; ``answer`` is the worker's reply
    (``code``, ``message``)."""

    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__(f"grant refused: {answer.get('code')}: {answer.get('message')}")
        self.answer = answer


def owner_blocks(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The owner's side of a transfer command's ``groups`` (its ``remote``
    block ids), one entry per transfer group, each id once, in order: the
    ``groups`` of a ``grant`` command."""
    blocks: dict[int, dict[int, None]] = {}
    for g in groups:
        blocks.setdefault(int(g["group"]), {}).update(dict.fromkeys(int(b) for b in g["remote"]))
    return [{"group": group, "blocks": list(ids)} for group, ids in blocks.items()]


def grant(
    owner: WorkerProc,
    request_id: str,
    groups: list[dict[str, Any]],
    *,
    ttl_ms: int = 0,
    max_uses: int = 0,
    write: bool = False,
) -> str:
    """``owner`` grants ``groups`` ([{"group", "blocks"}]) for
    ``request_id``, to be read or (``write``) written; the capability.
    Raises ``GrantRefused``."""
    answer = owner.call(
        {
            "cmd": "grant",
            "request_id": request_id,
            "groups": groups,
            "ttl_ms": ttl_ms,
            "max_uses": max_uses,
            "access": "write" if write else "read",
        }
    )
    if not answer.get("ok"):
        raise GrantRefused(answer)
    return str(answer["capability"])


def granted(owner: WorkerProc, cmd: dict[str, Any], **kw: Any) -> dict[str, Any]:
    """``cmd`` (a ``pull`` or ``push`` command) with the capability ``owner``
    granted for exactly its remote blocks and request id: a read grant for a
    pull, a write grant for a push."""
    write = cmd["cmd"] == "push"
    capability = grant(owner, cmd["request_id"], owner_blocks(cmd["groups"]), write=write, **kw)
    return {**cmd, "capability": capability}
