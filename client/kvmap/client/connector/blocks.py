"""Block lists: how a decode request's allocated blocks pair with the blocks
the prefill side offered, by whole blocks (equal block sizes) or by tokens
(different block sizes). One tuple of block ids per transfer group."""

from __future__ import annotations

BlockIds = tuple[tuple[int, ...], ...]
# vLLM's null block: the placeholder its hybrid KV cache manager leaves where
# a sliding-window group holds no block (tokens that fell out of the window);
# it is shared by every request and never holds a request's KV.
NULL_BLOCK_ID = 0


def pair_blocks(local: BlockIds, remote: BlockIds) -> tuple[BlockIds, BlockIds]:
    """Pair local and remote blocks group by group. The local side may hold
    fewer (its prefix cache has the leading ones): the remote list is trimmed
    from the front, as NIXL does. Raises ``ValueError`` when they cannot pair."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local KV cache groups, {len(remote)} remote")
    out_local, out_remote = [], []
    for g, (lg, rg) in enumerate(zip(local, remote, strict=True)):
        if len(lg) > len(rg):
            raise ValueError(f"group {g}: {len(lg)} local blocks for {len(rg)} remote blocks")
        out_local.append(tuple(lg))
        out_remote.append(tuple(rg[len(rg) - len(lg) :]) if lg else ())
    return tuple(out_local), tuple(out_remote)


def map_token_ranges(
    local: BlockIds,
    remote: BlockIds,
    *,
    num_tokens: int,
    local_tokens: int,
    remote_tokens: int,
) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """Token-mode groups (local blocks, remote blocks, tokens to move, the
    remote side's first token) between engines of different block sizes,
    for a ``num_tokens`` prompt.

    Each list holds a group's trailing blocks (the leading ones are in the
    local prefix cache, or out of a sliding window): they start where the
    blocks that would hold the prompt run out. Both lists are cut to the
    later of the two starts. A start inside a remote block (a local prefix
    hit ending inside a larger prefill block) keeps that block and reads from
    that token on (``GroupBlocks.remote_first_token``); a start inside a
    local block cannot be loaded into whole blocks and raises ``ValueError``
    (the request is recomputed), as do block lists that cannot end with the
    prompt."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local KV cache groups, {len(remote)} remote")
    if num_tokens <= 0:
        raise ValueError("kv_transfer_params.remote_num_tokens: needed when block sizes differ")
    out: list[tuple[tuple[int, ...], tuple[int, ...], int, int]] = []
    for g, (lg, rg) in enumerate(zip(local, remote, strict=True)):
        if not lg:
            out.append(((), (), 0, 0))
            continue
        l0 = (-(-num_tokens // local_tokens) - len(lg)) * local_tokens
        r0 = (-(-num_tokens // remote_tokens) - len(rg)) * remote_tokens
        if l0 < 0 or r0 < 0:
            raise ValueError(
                f"group {g}: {len(lg)} local blocks of {local_tokens} tokens and {len(rg)} "
                f"remote blocks of {remote_tokens} do not end with a {num_tokens}-token prompt"
            )
        start = max(l0, r0)
        if (start - l0) % local_tokens:
            raise ValueError(
                f"group {g}: the KV to load starts at token {start}, inside a local block "
                f"of {local_tokens} tokens"
            )
        skip, first = divmod(start - r0, remote_tokens)
        lcut, rcut = lg[(start - l0) // local_tokens :], rg[skip:]
        out.append((tuple(lcut), tuple(rcut), num_tokens - start, first))
    return out
