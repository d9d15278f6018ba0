"""WorkerSession against in-process kvmapds (tests/support/inproc_daemon.py):
register + attach, events, reconnection with backoff after the daemon goes
away, stop."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch
from inproc_daemon import InprocDaemon, InprocNetwork

from kvmap.client.aio import AsyncKvmapClient
from kvmap.client.client import KvmapClient
from kvmap.client.geometry import LayerSpec, export_registration
from kvmap.client.session import Backoff, WorkerSession
from kvmap.client.transports.base import AttachStream
from kvmap.core.errors import DeadlineExceeded, KvmapError, NotFound
from kvmap.v1 import registry_pb2, transfers_pb2, types_pb2

FAST = Backoff(initial_s=0.01, max_s=0.05)
WORKER = types_pb2.WorkerId(engine_id="engine-a", tp_rank=0)
KEY = ("engine-a", 0, 0, 0)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for ``cond`` (an event the test observes), failing after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


class _CountedStream:
    """An Attach stream that reports its failure (gRPC delivers an Attach
    error on the stream's first read, not at the call)."""

    def __init__(self, inner: AttachStream, failed: Callable[[], None]) -> None:
        self._inner, self._failed = inner, failed

    def __iter__(self) -> Iterator[registry_pb2.AttachResponse]:
        try:
            yield from self._inner
        except KvmapError:
            self._failed()
            raise

    def cancel(self) -> None:
        self._inner.cancel()


class CountingClient(KvmapClient):
    """A real client of an in-process daemon that counts its register and
    attach calls (or Attach streams) that failed, and runs ``on_first_failure`` once, at the
    first one (the test's view of the session's attempts)."""

    def __init__(
        self, daemon: InprocDaemon, on_first_failure: Callable[[], None] | None = None
    ) -> None:
        super().__init__(daemon.transport())
        self.failures = 0
        self._on_first_failure = on_first_failure
        self._lock = threading.Lock()

    def _failed(self) -> None:
        with self._lock:
            self.failures += 1
            hook, self._on_first_failure = self._on_first_failure, None
        if hook is not None:
            hook()

    def register_worker(
        self, req: registry_pb2.RegisterWorkerRequest, fds: Sequence[int] = ()
    ) -> registry_pb2.RegisterWorkerResponse:
        try:
            return super().register_worker(req, fds)
        except KvmapError:
            self._failed()
            raise

    def attach(self, worker: types_pb2.WorkerId) -> AttachStream:
        try:
            return _CountedStream(super().attach(worker), self._failed)
        except KvmapError:
            self._failed()
            raise


@pytest.fixture
def net() -> Iterator[InprocNetwork]:
    with InprocNetwork() as network:
        yield network


@pytest.fixture
def daemon(net: InprocNetwork) -> InprocDaemon:
    return net.daemon()


def registration(nb: int = 8) -> tuple[registry_pb2.RegisterWorkerRequest, list[int], torch.Tensor]:
    kv = torch.zeros(nb, 64, dtype=torch.uint8)
    req, fds = export_registration(
        WORKER, {"layer0": kv}, {"layer0": LayerSpec(0, types_pb2.CACHE_KIND_MHA, nb)},
        block_size_tokens=16,
    )  # fmt: skip
    return req, fds, kv


def test_backoff_grows_to_its_cap_with_jitter() -> None:
    """Backoff delays start at ``initial_s`` (less jitter), grow to ``max_s`` and
    stay there, each within the jitter band; a cap below the start is refused."""
    b = Backoff(initial_s=0.1, max_s=1.0, multiplier=2.0, jitter=0.2)
    delays = list(itertools.islice(b.delays(random.Random(1)), 8))
    assert 0.08 - 1e-9 <= delays[0] <= 0.1
    assert all(0.8 - 1e-9 <= d <= 1.0 for d in delays[4:])
    with pytest.raises(ValueError):
        Backoff(initial_s=2.0, max_s=1.0)


def test_start_registers_attaches_and_delivers_events(daemon: InprocDaemon) -> None:
    """start() registers (generation 1) and attaches; the first event handed to
    the callback is ``attached`` naming the daemon instance; stop() deregisters."""
    req, fds, _kv = registration()
    events: list[registry_pb2.AttachResponse] = []
    session = WorkerSession(daemon.client(), req, fds, on_event=events.append, backoff=FAST)
    region_map = session.start(timeout_s=2)
    assert region_map.generation == 1 and session.registrations == 1
    wait_for(lambda: daemon.subscriber_count(KEY) == 1)
    wait_for(lambda: bool(events))
    assert events[0].WhichOneof("event") == "attached"
    assert session.daemon_instance == daemon.instance
    session.stop()
    assert daemon.workers() == []  # deregistered (and its stream gone)


def test_daemon_restart_without_state_registers_the_worker_again(daemon: InprocDaemon) -> None:
    """After its daemon went away (and the session's attempts failed while it
    was down), a restarted daemon that lost its state (it forgot the worker)
    gets it registered again: same worker, the new instance."""
    req, fds, _kv = registration()
    client = CountingClient(daemon)
    session = WorkerSession(client, req, fds, backoff=FAST)
    session.start(timeout_s=2)
    first_instance = daemon.instance
    daemon.stop()
    wait_for(lambda: not session.connected.is_set())
    wait_for(lambda: client.failures >= 3)  # a few failed attempts while it is down
    assert daemon.workers() == []
    daemon.restart(forget_state=True)
    assert session.wait_connected(5)
    wait_for(lambda: daemon.subscriber_count(KEY) == 1)
    assert daemon.workers() == [KEY]
    assert daemon.generation(KEY) == 1 and session.generation == 1
    # Over gRPC each Attach tried while the daemon was down ends as a disconnect.
    assert session.registrations == 2 and session.disconnects >= 1
    wait_for(lambda: session.daemon_instance == daemon.instance != first_instance)
    session.stop()


def test_daemon_restart_restores_the_worker_and_the_session_attaches(daemon: InprocDaemon) -> None:
    """A daemon restarted with its state folder opens the worker's memory
    again and restores it at generation 2 (no registration from the client);
    the session attaches to the new instance after the disconnect."""
    req, fds, _kv = registration()
    session = WorkerSession(daemon.client(), req, fds, backoff=FAST)
    session.start(timeout_s=2)
    first_instance = daemon.instance
    daemon.restart()
    wait_for(lambda: session.daemon_instance == daemon.instance != first_instance)
    wait_for(lambda: daemon.subscriber_count(KEY) == 1)
    assert daemon.generation(KEY) == 2
    assert session.registrations == 1 and session.disconnects >= 1
    session.stop()


def test_worker_dropped_by_daemon_registers_again(daemon: InprocDaemon) -> None:
    """When the Attach stream breaks (and the daemon, left without a stream,
    dropped the worker), the session registers and attaches again by itself."""
    req, fds, _kv = registration()
    session = WorkerSession(daemon.client(), req, fds, backoff=FAST)
    session.start(timeout_s=2)
    # The stream breaks; the daemon, left without one, drops the worker.
    daemon.break_attach_streams([KEY])
    wait_for(lambda: session.registrations == 2)
    wait_for(lambda: daemon.subscriber_count(KEY) == 1)
    session.stop()


@pytest.mark.timeout(30)
def test_start_waits_for_a_daemon_that_comes_up(daemon: InprocDaemon) -> None:
    """start() against a daemon that is down keeps trying: the daemon comes up
    right after the first attempt failed, and start() registers with it."""
    daemon.stop()
    req, fds, _kv = registration()
    client = CountingClient(daemon, on_first_failure=daemon.restart)
    session = WorkerSession(client, req, fds, backoff=FAST)
    assert session.start(timeout_s=20).generation == 1
    assert client.failures == 1  # it was down at first, and waited
    assert daemon.workers() == [KEY]
    session.stop()


@pytest.mark.timeout(30)
def test_start_gives_up_after_its_timeout(daemon: InprocDaemon) -> None:
    """start() against a daemon that never comes up retries, then raises
    DeadlineExceeded naming the worker and the daemon's last error (rather
    than retrying for ever: the test's timeout guards against a hang)."""
    daemon.stop()
    req, fds, _kv = registration()
    client = CountingClient(daemon)
    session = WorkerSession(client, req, fds, backoff=FAST)
    with pytest.raises(DeadlineExceeded, match="could not register worker engine-a") as err:
        session.start(timeout_s=1.0)
    assert "kvmapd is not running" in str(err.value)
    assert client.failures >= 2  # it retried before giving up
    assert daemon.workers() == []


def test_attach_to_unregistered_worker_is_not_found(daemon: InprocDaemon) -> None:
    """Attaching a worker the daemon does not know ends the stream with
    NotFound at its first read."""
    client = daemon.client()
    with pytest.raises(NotFound):
        next(iter(client.attach(WORKER)))


def test_async_client_registers_attaches_and_reads_events(daemon: InprocDaemon) -> None:
    """The asyncio client registers, reads the ``attached`` event from its
    stream and sees the worker in the daemon's stats while it is attached."""
    req, fds, _kv = registration()

    async def go() -> tuple[int, str, int]:
        client = AsyncKvmapClient(daemon.transport())
        m = await client.register(req, fds)
        stream = await client.attach(WORKER)
        first = None
        async for event in stream:
            first = event.WhichOneof("event")
            break
        stats = await client.get_stats()
        stream.cancel()
        await client.close()
        return m.generation, str(first), stats.workers

    assert asyncio.run(go()) == (1, "attached", 1)


def test_pull_copies_bytes_counts_and_notifies_owner(net: InprocNetwork) -> None:
    """A pull between two daemons copies exactly the requested blocks,
    counts them on both sides and tells the owner (PULLED_FROM, request id)."""
    pd, dd = net.daemon(), net.daemon()
    kv_p = torch.arange(8 * 64, dtype=torch.int64).to(torch.uint8).view(8, 64)
    kv_d = torch.zeros(8, 64, dtype=torch.uint8)
    specs = {"l": LayerSpec(0, types_pb2.CACHE_KIND_MHA, 8)}
    events: list[registry_pb2.AttachResponse] = []
    sessions = []
    for d, engine, kv, on in ((pd, "p", kv_p, events.append), (dd, "d", kv_d, None)):
        w = types_pb2.WorkerId(engine_id=engine)
        req, fds = export_registration(w, {"l": kv}, specs, block_size_tokens=16)
        s = WorkerSession(d.client(), req, fds, on_event=on, backoff=FAST)
        s.start(2)
        sessions.append(s)
    # The owner grants exactly the blocks read, as the vLLM connector does.
    grant = sessions[0].client.grant_transfer(types_pb2.WorkerId(engine_id="p"), "r1", {0: [2, 7]})
    spec = transfers_pb2.TransferSpec(
        request_id="r1",
        local_worker=types_pb2.WorkerId(engine_id="d"),
        remote_target=pd.target,
        remote_worker=types_pb2.WorkerId(engine_id="p"),
        capability=grant.capability,
    )
    spec.groups.add(transfer_group=0, local_block_ids=[5, 0], remote_block_ids=[2, 7])
    result = dd.client().pull(spec)
    assert result.bytes == 128
    assert torch.equal(kv_d[5], kv_p[2]) and torch.equal(kv_d[0], kv_p[7])
    assert dd.get_stats().transfers.blocks == 2 and pd.get_stats().transfers.served_blocks == 2
    wait_for(lambda: any(e.WhichOneof("event") == "transfer_finished" for e in events))
    done = next(e for e in events if e.WhichOneof("event") == "transfer_finished")
    assert done.transfer_finished.request_id == "r1"
    assert done.transfer_finished.direction == registry_pb2.TRANSFER_DIRECTION_PULLED_FROM
    for s in sessions:
        s.stop()


class _GatedStream:
    """An Attach stream whose events reach the session only once ``gate`` is
    set: the daemon has not answered the stream yet (a gRPC stream is opened
    by its first read, not by the call)."""

    def __init__(self, inner: AttachStream, gate: threading.Event) -> None:
        self._inner, self._gate = inner, gate

    def __iter__(self) -> Iterator[registry_pb2.AttachResponse]:
        self._gate.wait(30)
        yield from self._inner

    def cancel(self) -> None:
        self._gate.set()
        self._inner.cancel()


class GatedClient(KvmapClient):
    """A real client of an in-process daemon whose Attach answers wait for ``gate``."""

    def __init__(self, daemon: InprocDaemon, gate: threading.Event) -> None:
        super().__init__(daemon.transport())
        self.gate = gate

    def attach(self, worker: types_pb2.WorkerId) -> AttachStream:
        return _GatedStream(super().attach(worker), self.gate)


def test_start_returns_once_the_daemon_answered_the_attach_stream(daemon: InprocDaemon) -> None:
    """start() returns only after the stream's first event (``attached``), so the worker's
    transfers can be granted at once (GrantTransfer refuses a worker whose Attach stream the
    daemon has not opened); until the daemon answers, start() waits."""
    req, fds, _kv = registration()
    gate = threading.Event()
    session = WorkerSession(GatedClient(daemon, gate), req, fds, backoff=FAST)
    done = threading.Event()
    starter = threading.Thread(target=lambda: (session.start(timeout_s=20), done.set()))
    starter.start()
    wait_for(lambda: daemon.workers() == [KEY])  # registered, stream not answered
    assert not done.wait(0.3) and not session.attached.is_set()
    gate.set()
    starter.join(10)
    assert done.is_set() and session.attached.is_set()
    assert session.daemon_instance == daemon.instance
    session.stop()


def test_a_stopping_daemon_ends_attach_streams_at_once(daemon: InprocDaemon) -> None:
    """A daemon that stops ends every open Attach stream itself, cleanly,
    once its transfers are drained: the worker's stream simply ends (no
    CANCELLED or UNAVAILABLE left for the server's grace period to cut), so
    the stop never waits out that grace for streams that never end, and the
    worker's session attaches again to the next daemon."""
    req, fds, _kv = registration()
    client = daemon.client()
    client.register(req, fds)
    stream = iter(client.attach(WORKER))
    assert next(stream).WhichOneof("event") == "attached"
    daemon.stop()
    assert list(stream) == []  # ended by the daemon, with OK
