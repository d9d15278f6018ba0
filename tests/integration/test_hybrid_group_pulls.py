"""Pulls whose transfer groups carry different numbers of blocks, as the
vLLM connector sends them with the hybrid KV cache manager (a full-attention
group with every block of the prompt, a sliding-window group with only its
window's last blocks), between real daemons with real NIXL agents; and the
owner's grant covering each group's blocks, no more."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_transfers import Pair, _close, _side

from kvmap.tools.grants import grant
from kvmap.v1 import admin_pb2, admin_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    # One pair for the module: the refused pulls write nothing.
    tmp_path = tmp_path_factory.mktemp("hybrid-groups")
    p = _side(tmp_path, "prefill", "coalesce", "--fill")
    d = _side(tmp_path, "decode", "baseline")
    yield Pair(p, d)
    _close(d, p)


# Group 0: a 9-block prompt, every block; group 1: the window's last 3.
FULL_REMOTE, FULL_LOCAL = [4, 9, 10, 11, 20, 21, 30, 2, 7], [40, 41, 42, 1, 3, 5, 6, 8, 12]
WINDOW_REMOTE, WINDOW_LOCAL = [33, 34, 35], [13, 14, 15]
GROUPS = [
    {"group": 0, "local": FULL_LOCAL, "remote": FULL_REMOTE},
    {"group": 1, "local": WINDOW_LOCAL, "remote": WINDOW_REMOTE},
]


def test_groups_with_different_block_counts_move_every_byte(pair: Pair) -> None:
    """One pull with 9 blocks in one group and 3 in the other (granted exactly those) moves every
    block of both groups: the decode worker verifies each against the prefill pattern, and the
    daemons count 12 blocks."""
    out = pair.pull("hybrid", GROUPS)
    assert out["ok"], out
    assert out["bad_blocks"] == 0
    with pair.decode.daemon.channel() as ch:
        stats = admin_pb2_grpc.AdminStub(ch).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    assert stats.transfers.blocks == len(FULL_REMOTE) + len(WINDOW_REMOTE)
    assert (stats.transfers.pulls_done, stats.transfers.failed) == (1, 0)


@pytest.mark.parametrize(
    "granted_groups",
    [
        # The full group only: the window group is not covered at all.
        [{"group": 0, "blocks": FULL_REMOTE}],
        # The window group without its first block.
        [{"group": 0, "blocks": FULL_REMOTE}, {"group": 1, "blocks": WINDOW_REMOTE[1:]}],
        # The window group's blocks granted in the other group.
        [{"group": 0, "blocks": FULL_REMOTE + WINDOW_REMOTE}],
    ],
)
def test_grant_must_cover_every_groups_blocks(
    pair: Pair, granted_groups: list[dict[str, object]]
) -> None:
    """A capability that does not cover every pulled block of every group (a group missing, a
    block missing, blocks granted in another group) is PERMISSION_DENIED, and the decode
    worker's memory is byte for byte as it was."""
    before = pair.decode.worker.call({"cmd": "digest"})["digest"]
    capability = grant(pair.prefill.worker, "partial", granted_groups)
    out = pair.pull("partial", GROUPS, capability=capability)
    assert (out["ok"], out["code"]) == (False, "PERMISSION_DENIED"), out
    assert pair.decode.worker.call({"cmd": "digest"})["digest"] == before
