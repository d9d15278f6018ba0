"""Protobuf wire-format pieces written by hand, where bytes already
serialized are put into a message without being parsed and copied again:
the client's local-call frames around a serialized spec, the decode
daemon's stream messages around serialized BeginTransfer calls."""

from __future__ import annotations


def varint(n: int) -> bytes:
    """``n`` (not negative) as a protobuf base-128 varint."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)
