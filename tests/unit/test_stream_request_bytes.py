"""``transfer_wire.stream_request_bytes``: a BeginTransferStreamRequest
joined from its calls' bytes is the message protobuf itself would write for
those calls, byte for byte, and parses back to them (hypothesis over call
counts, sizes up to and past each varint length boundary, and ids of every
int64 magnitude)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvmap.core.transfer_wire import stream_request_bytes
from kvmap.v1 import peer_pb2, types_pb2

ids = st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=300)
calls = st.lists(
    st.builds(
        lambda request_id, groups, padding: peer_pb2.BeginTransferRequest(
            request_id=request_id,
            capability=padding,
            groups=[types_pb2.BlockGrant(transfer_group=g, block_ids=b) for g, b in groups],
        ),
        st.text(max_size=40),
        st.lists(st.tuples(st.integers(0, 2**31 - 1), ids), max_size=3),
        # Lengths around 127/128 and 16383/16384: one-, two- and three-byte varints.
        st.sampled_from([0, 1, 100, 127, 128, 129, 16_383, 16_384, 70_000]).map(lambda n: "c" * n),
    ),
    max_size=6,
)


@settings(max_examples=150, deadline=None)
@given(calls)
def test_joined_calls_are_protobufs_own_bytes(
    given_calls: list[peer_pb2.BeginTransferRequest],
) -> None:
    """What the decode daemon writes on the stream is what protobuf would
    have written for the same calls, and the owner reads those calls."""
    joined = stream_request_bytes([c.SerializeToString() for c in given_calls])
    assert joined == peer_pb2.BeginTransferStreamRequest(calls=given_calls).SerializeToString()
    parsed = peer_pb2.BeginTransferStreamRequest.FromString(joined)
    assert list(parsed.calls) == given_calls


def test_no_calls_is_the_empty_message() -> None:
    """No calls: the empty message (zero bytes), as protobuf writes it."""
    assert stream_request_bytes([]) == b""
    assert not peer_pb2.BeginTransferStreamRequest.FromString(b"").calls
