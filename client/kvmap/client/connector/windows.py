"""Which blocks of a request a transfer moves when some KV cache groups do
not hold the whole sequence: sliding-window groups (only the last blocks)
and state groups (Mamba: only the running-state slot)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmap.client.connector.blocks import NULL_BLOCK_ID, BlockIds


@dataclass(frozen=True)
class GroupWindows:
    """How many trailing blocks of each transfer group a transfer needs, in
    transfer-group order: 0 for a group that needs all of them (full
    attention). Empty (the default): no group is windowed.

    With vLLM's hybrid KV cache manager a sliding-window group's block list
    spans the whole sequence, the blocks that fell out of the window being
    the null block; only the last ``cdiv(window, block_size) + 1`` blocks can
    hold KV the window reads (the extra one because the window need not start
    on a block boundary), as NixlConnector clips them.

    ``states`` marks the state groups (Mamba / linear attention), whose
    blocks hold a recurrent state rather than tokens: per transfer group the
    speculative scratch slots vLLM allocates after the running-state slot,
    None for a token group (empty: no state group). A transfer moves only
    the running-state slot, as NixlConnector does."""

    blocks: tuple[int, ...] = ()
    states: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if any(n < 0 for n in self.blocks):
            raise ValueError(f"negative window in {self.blocks}")
        if self.states and len(self.states) != len(self.blocks):
            raise ValueError(f"{len(self.states)} state marks for {len(self.blocks)} groups")
        if any(n is not None and n < 0 for n in self.states):
            raise ValueError(f"negative scratch slots in {self.states}")

    @classmethod
    def from_windows(
        cls, windows: Sequence[tuple[int, int]], states: Sequence[int | None] = ()
    ) -> GroupWindows:
        """From (sliding window in tokens or 0, block size in tokens) per
        group, and the state groups' scratch slots (see ``states``)."""
        out = []
        for window, block_size in windows:
            if window < 0 or block_size <= 0:
                raise ValueError(f"bad window {window} / block size {block_size}")
            out.append(-(-window // block_size) + 1 if window else 0)
        return cls(tuple(out), tuple(states) if any(n is not None for n in states) else ())

    @property
    def windowed(self) -> bool:
        return any(self.blocks)

    @property
    def has_state(self) -> bool:
        """Whether some group holds recurrent state (Mamba)."""
        return bool(self.states)

    def clip(self, block_ids: Sequence[Sequence[int]]) -> BlockIds:
        """The blocks a transfer moves: each windowed group's last blocks,
        each state group's running-state slot; with the hybrid manager's
        lists (``blocks`` given) every group without its leading null
        blocks. Unchanged when ``blocks`` is empty. Raises ``ValueError``
        when the number of groups differs."""
        groups = tuple(tuple(int(b) for b in g) for g in block_ids)
        if not self.blocks or not groups:
            return groups
        if len(groups) != len(self.blocks):
            raise ValueError(f"{len(groups)} KV cache groups, {len(self.blocks)} known")
        states = self.states or (None,) * len(groups)
        return tuple(
            _state_slot(g, s) if s is not None else _strip_null(g[-n:] if n else g)
            for g, n, s in zip(groups, self.blocks, states, strict=True)
        )

    def fit(self, local: BlockIds, remote: BlockIds) -> BlockIds:
        """``local`` with each windowed group cut to at most as many (last)
        blocks as the remote group has: a local block before the remote
        window is out of the window (nothing to load into it). Full groups
        are left for ``pair_blocks`` to check."""
        if not self.windowed or len(local) != len(remote) or len(local) != len(self.blocks):
            return local
        return tuple(
            lg[len(lg) - len(rg) :] if n and len(lg) > len(rg) else lg
            for lg, rg, n in zip(local, remote, self.blocks, strict=True)
        )


def _state_slot(ids: tuple[int, ...], scratch: int) -> tuple[int, ...]:
    """A state group's running-state slot: the last block before its
    speculative scratch slots (vLLM's ``clip_ssm_state_blocks``); what comes
    before it is null or a superseded state."""
    if not ids:
        return ids
    kept = ids[: len(ids) - min(scratch, len(ids) - 1)]
    return kept[-1:]


def _strip_null(ids: tuple[int, ...]) -> tuple[int, ...]:
    start = 0
    while start < len(ids) and ids[start] == NULL_BLOCK_ID:
        start += 1
    return ids[start:]
