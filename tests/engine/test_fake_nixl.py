"""The fake NIXL keeps the parts of NIXL's contract the engine's tests rely
on: descriptors must lie inside memory registered on their side, transfers
copy real bytes when polled, notifications reach the other agent, and a peer
that went away is Unavailable."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import pytest
from fake_nixl import FakeAgent, FakeNetwork, read

from kvmap.core.errors import NotFound, TransferError, Unavailable
from kvmap.daemon.adapters.nixl_port import MemoryType, XferOp, XferState

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pair() -> Iterator[tuple[FakeAgent, FakeAgent, int, int]]:
    """Agents a and b, each with 4 KiB registered, b knowing a's metadata."""
    net = FakeNetwork()
    a, b = net.agent("a"), net.agent("b")
    mem_a, mem_b = ctypes.create_string_buffer(4096), ctypes.create_string_buffer(4096)
    addr_a, addr_b = ctypes.addressof(mem_a), ctypes.addressof(mem_b)
    a.register(addr_a, 4096)
    b.register(addr_b, 4096)
    ctypes.memmove(addr_a, bytes(range(256)) * 16, 4096)
    assert b.add_remote(a.metadata()) == "a"
    yield a, b, addr_a, addr_b
    del mem_a, mem_b


def test_read_copies_remote_bytes_when_polled_and_notifies(
    pair: tuple[FakeAgent, FakeAgent, int, int],
) -> None:
    """READ of two strided descriptors copies a's bytes into b's memory on
    poll, not before, and a then takes b's notification."""
    a, b, addr_a, addr_b = pair
    local = b.prep_local(np.array([[addr_b, 16, 0, 32, 2]]))
    remote = b.prep_remote("a", np.array([[addr_a + 100, 16, 0, 64, 2]]))
    xfer = b.post_prepped(XferOp.READ, local, [0, 1], remote, [1, 0], notif=b"done")
    assert read(addr_b, 48) == bytes(48)
    assert b.poll(xfer) is XferState.DONE
    assert read(addr_b, 16) == read(addr_a + 164, 16)
    assert read(addr_b + 32, 16) == read(addr_a + 100, 16)
    assert a.take_notifs() == {"b": [b"done"]} and a.take_notifs() == {}


def test_descriptors_outside_registered_memory_are_not_found(
    pair: tuple[FakeAgent, FakeAgent, int, int],
) -> None:
    """A local or remote descriptor reaching past a registration, or of
    another memory type, is NotFound, as NIXL reports it."""
    _, b, addr_a, addr_b = pair
    with pytest.raises(NotFound):
        b.prep_local(np.array([[addr_b + 4000, 100, 0]]))
    with pytest.raises(NotFound):
        b.prep_remote("a", np.array([[addr_a, 16, 0, 4096, 2]]))
    with pytest.raises(NotFound):
        b.prep_remote("a", np.array([[addr_a, 16, 0]]), MemoryType.VRAM)
    with pytest.raises(NotFound):
        b.prep_remote("c", np.array([[addr_a, 16, 0]]))


def test_write_to_deregistered_memory_fails_and_dead_peer_is_unavailable(
    pair: tuple[FakeAgent, FakeAgent, int, int],
) -> None:
    """A transfer over remote memory deregistered since its metadata was
    loaded fails with TransferError on poll; once the peer is killed, posts
    and notifications are Unavailable."""
    a, b, addr_a, addr_b = pair
    before = read(addr_a, 16)
    a.deregister(a.registrations[0])
    xfer = b.post_descs(XferOp.WRITE, [[addr_b, 16, 0]], [[addr_a, 16, 0]], "a")
    assert b.poll(xfer) is XferState.ERR and isinstance(xfer.error, TransferError)
    assert read(addr_a, 16) == before
    b.network.kill("a")
    with pytest.raises(Unavailable):
        b.post_descs(XferOp.READ, [[addr_b, 16, 0]], [[addr_a, 16, 0]], "a")
    with pytest.raises(Unavailable):
        b.send_notif("a", b"x")
