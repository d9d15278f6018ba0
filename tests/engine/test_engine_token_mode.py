"""Token-mode pulls (``GroupBlocks.num_tokens``) through the transfer engine
over the fake NIXL: the bytes of exactly the requested tokens move, and bad
token-mode input is INVALID_ARGUMENT before any peer is asked."""

from __future__ import annotations

import pytest
from harness import BLOCKS, PAGE, Node, Worker, cluster, run, spec, two

from kvmap.core.errors import InvalidArgument
from kvmap.v1 import transfers_pb2

pytestmark = pytest.mark.timeout(60)

TOKENS_PER_BLOCK = 16  # the harness registers block_size_tokens=16
TOKEN = PAGE // TOKENS_PER_BLOCK  # an MLA page holds one latent per token


def token_spec(
    wa: Worker,
    b: Node,
    wb: Worker,
    local: list[int],
    remote: list[int],
    *,
    num_tokens: int,
    first: int = 0,
) -> transfers_pb2.TransferSpec:
    s = spec(wa, b, wb, list(zip(local, remote, strict=False)))
    del s.groups[:]
    s.groups.add(
        transfer_group=0,
        local_block_ids=local,
        remote_block_ids=remote,
        num_tokens=num_tokens,
        remote_first_token=first,
    )
    s.capability = b.grant(wb, s.request_id, {0: sorted(set(remote))})
    return s


def test_token_mode_pull_moves_exactly_the_requested_tokens() -> None:
    """20 tokens of remote blocks 5, 1 into local blocks 0, 2: block 0's pages are block 5's,
    block 2's first 4 tokens of each page are block 1's, every other byte of both workers stays."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            before_a = [[wa.page(i, ly) for ly in range(2)] for i in range(BLOCKS)]
            before_b = [[wb.page(i, ly) for ly in range(2)] for i in range(BLOCKS)]
            statuses = await a.transfer(token_spec(wa, b, wb, [0, 2], [5, 1], num_tokens=20))
            assert statuses[-1].state == transfers_pb2.TRANSFER_STATE_DONE
            assert statuses[-1].stats.bytes == 2 * 20 * TOKEN
            want = [list(p) for p in before_a]
            for ly in range(2):
                want[0][ly] = before_b[5][ly]
                want[2][ly] = before_b[1][ly][: 4 * TOKEN] + before_a[2][ly][4 * TOKEN :]
            assert [[wa.page(i, ly) for ly in range(2)] for i in range(BLOCKS)] == want
            assert [[wb.page(i, ly) for ly in range(2)] for i in range(BLOCKS)] == before_b

    run(main())


def test_token_mode_pull_from_a_remote_first_token() -> None:
    """20 tokens from remote token 4 (GroupBlocks.remote_first_token, inside remote block 5) into
    local blocks 0, 2: block 0 gets block 5's tokens 4..15 then block 1's 0..3, block 2's first 4
    tokens get block 1's 4..7; every other byte of both workers stays."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            before_a = [[wa.page(i, ly) for ly in range(2)] for i in range(BLOCKS)]
            before_b = [[wb.page(i, ly) for ly in range(2)] for i in range(BLOCKS)]
            pull = token_spec(wa, b, wb, [0, 2], [5, 1], num_tokens=20, first=4)
            statuses = await a.transfer(pull)
            assert statuses[-1].state == transfers_pb2.TRANSFER_STATE_DONE
            assert statuses[-1].stats.bytes == 2 * 20 * TOKEN
            want = [list(p) for p in before_a]
            for ly in range(2):
                b5, b1 = before_b[5][ly], before_b[1][ly]
                want[0][ly] = b5[4 * TOKEN :] + b1[: 4 * TOKEN]
                want[2][ly] = b1[4 * TOKEN : 8 * TOKEN] + before_a[2][ly][4 * TOKEN :]
            assert [[wa.page(i, ly) for ly in range(2)] for i in range(BLOCKS)] == want
            assert [[wb.page(i, ly) for ly in range(2)] for i in range(BLOCKS)] == before_b

    run(main())


def test_bad_remote_first_token_is_invalid_argument() -> None:
    """A remote first token past what the remote blocks listed hold, a negative one, and one in a
    block-pair transfer (num_tokens 0) are INVALID_ARGUMENT naming remote_first_token; the local
    worker's memory does not change."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            before_a = [wa.block(i) for i in range(BLOCKS)]
            past = token_spec(wa, b, wb, [0, 2], [5, 1], num_tokens=20, first=13)
            with pytest.raises(
                InvalidArgument,
                match=r"groups\[0\]\.remote_first_token: 2 blocks of 16 tokens cannot hold 20 "
                r"tokens from token 13",
            ):
                await a.transfer(past)
            negative = token_spec(wa, b, wb, [0], [5], num_tokens=4, first=-1)
            with pytest.raises(InvalidArgument, match=r"remote_first_token: -1 is not in"):
                await a.transfer(negative)
            pairs = spec(wa, b, wb, [(0, 5)])
            pairs.groups[0].remote_first_token = 3
            pairs.capability = b.grant(wb, pairs.request_id, {0: [5]})
            with pytest.raises(
                InvalidArgument, match=r"spec.groups\[0\]\.remote_first_token: 3 without num_tokens"
            ):
                await a.transfer(pairs)
            assert [wa.block(i) for i in range(BLOCKS)] == before_a

    run(main())


def test_bad_token_mode_input_is_invalid_argument() -> None:
    """Groups mixing token mode and block pairs, and too few blocks for the tokens, are
    INVALID_ARGUMENT naming the field; neither worker's memory changes."""

    async def main() -> None:
        async with cluster() as c:
            a, wa, b, wb = await two(c)
            before_a = [wa.block(i) for i in range(BLOCKS)]
            mixed = token_spec(wa, b, wb, [0], [5], num_tokens=10)
            mixed.groups.add(transfer_group=0, local_block_ids=[1], remote_block_ids=[2])
            with pytest.raises(InvalidArgument, match=r"spec.groups\[1\].num_tokens: 0 in a"):
                await a.transfer(mixed)
            short = token_spec(wa, b, wb, [0], [5], num_tokens=20)
            with pytest.raises(
                InvalidArgument,
                match=r"groups\[0\]\.local_block_ids: 1 blocks of 16 tokens cannot hold 20",
            ):
                await a.transfer(short)
            assert [wa.block(i) for i in range(BLOCKS)] == before_a

    run(main())
