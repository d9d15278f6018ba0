"""A token-mode pull's remote first token (``GroupBlocks.remote_first_token``)
against two real daemons and test-owned memory: it reads exactly the tokens
it names, and no offset reads a byte outside the remote blocks listed, nor
outside the blocks the capability grants. Each hostile offset gets its exact
status, and both workers' memory and both daemons' maps stay as they were.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from security_support import Cluster, start_cluster

from kvmap.v1 import transfers_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

Code = grpc.StatusCode
TOKENS = 16  # the workers' block_size_tokens
TOKEN = 64 // TOKENS  # an MLA layer's 64-byte block holds 4 bytes per token


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from start_cluster(tmp_path_factory.mktemp("token_offsets"))


def token_pull(
    c: Cluster,
    request_id: str,
    local: list[int],
    remote: list[int],
    *,
    num_tokens: int,
    first: int,
    granted: list[int] | None = None,
) -> transfers_pb2.TransferSpec:
    """A token-mode pull of MLA group 0 with the prefill worker's grant of
    ``granted`` (default: the remote blocks listed)."""
    capability = c.pw.grant(request_id, {0: granted if granted is not None else remote})
    spec = c.spec(
        [{"group": 0, "local": local, "remote": remote}],
        request_id=request_id,
        capability=capability,
    )
    spec.groups[0].num_tokens = num_tokens
    spec.groups[0].remote_first_token = first
    return spec


def test_a_remote_first_token_reads_exactly_the_tokens_it_names(c: Cluster) -> None:
    """The positive control: 20 tokens from remote token 4 (inside block 5) into local blocks 3
    and 7: block 3 gets block 5's tokens 4..15 then block 1's 0..3, block 7's first 4 tokens get
    block 1's 4..7, in every MLA layer; nothing else of either worker changes."""
    spec = token_pull(c, "offset-ok", [3, 7], [5, 1], num_tokens=20, first=4)
    assert c.transfer(spec, write=False) == (Code.OK, "")
    for layer in c.dw.layer_names(0):
        d3, d7 = c.dw.span(0, 3, layer), c.dw.span(0, 7, layer)
        s5, s1 = c.pw.buf[c.pw.span(0, 5, layer)], c.pw.buf[c.pw.span(0, 1, layer)]
        c.dw.expected[d3] = list(s5[4 * TOKEN :]) + list(s1[: 4 * TOKEN])
        c.dw.expected[d7.start : d7.start + 4 * TOKEN] = s1[4 * TOKEN : 8 * TOKEN]
    c.assert_all_intact("after a pull from a remote first token")


# (local, remote, num_tokens, first, granted, status, message fragment)
HOSTILE = {
    "offset past the remote blocks listed": (
        [3], [5], 16, 4, None, Code.INVALID_ARGUMENT,
        "groups[0].remote_first_token: 1 blocks of 16 tokens cannot hold 16 tokens from token 4",
    ),
    "offset past the last remote block": (
        [3], [5, 31], 1, 2 * TOKENS, None, Code.INVALID_ARGUMENT,
        "groups[0].remote_first_token: 2 blocks of 16 tokens cannot hold 1 tokens from token 32",
    ),
    "negative offset": (
        [3], [5], 4, -1, None, Code.INVALID_ARGUMENT, "groups[0].remote_first_token: -1 is not in",
    ),
    "int64 max offset": (
        [3], [5], 4, 2**63 - 1, None, Code.INVALID_ARGUMENT, "groups[0].remote_first_token",
    ),
    "offset into a listed block the capability does not grant": (
        [3], [5, 6], 16, TOKENS, [5], Code.PERMISSION_DENIED, "",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HOSTILE))
def test_an_offset_cannot_read_outside_the_listed_or_granted_blocks(c: Cluster, name: str) -> None:
    """Each hostile remote first token (past the blocks listed, negative, int64 max, or into a
    listed block the capability does not grant) is refused with its exact status, and both
    workers' memory and both daemons' maps stay unchanged."""
    local, remote, num_tokens, first, granted, code, fragment = HOSTILE[name]
    before = (c.p.snapshot(), c.d.snapshot())
    spec = token_pull(
        c, f"hostile-{name[:16]}", local, remote, num_tokens=num_tokens, first=first,
        granted=granted,
    )  # fmt: skip
    got, msg = c.transfer(spec, write=False)
    assert (got, fragment in msg) == (code, True), (got, msg)
    c.assert_all_intact(f"after a refused offset ({name})")
    assert (c.p.snapshot(), c.d.snapshot()) == before
    c.p.assert_healthy()
    c.d.assert_healthy()
