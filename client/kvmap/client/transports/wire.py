"""Request bytes shared by the two ways a Pull or Push reaches kvmapd (gRPC,
``grpc.py``, and the local calls socket, ``local_calls.py``): both carry the
same serialized ``PullRequest`` / ``PushRequest``."""

from __future__ import annotations

from kvmap.core.protowire import varint
from kvmap.v1 import transfers_pb2

# Field 1 (``spec``), length-delimited: the tag of PullRequest and
# PushRequest's only field.
_SPEC_TAG = b"\x0a"


def spec_request_bytes(spec: transfers_pb2.TransferSpec) -> bytes:
    """``PullRequest(spec=spec)`` (or ``PushRequest``) as serialized, the
    same bytes, without first deep-copying a spec of thousands of block ids
    into a request message only to serialize it."""
    body = spec.SerializeToString()
    return _SPEC_TAG + varint(len(body)) + body
