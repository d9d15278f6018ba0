"""Keep one worker registered with its daemon and attached, across daemon
restarts.

A ``WorkerSession`` registers the worker (sending its fds first), opens the
``Attach`` stream and reads it on a thread, handing every event to a
callback. Whenever the stream ends without the worker asking (the daemon
restarted or was upgraded), the session attaches again, retrying with
exponential backoff and jitter until it succeeds or is stopped. A restarted
kvmapd with a state directory has usually restored the worker already (new
generation, same memory); one that answers the Attach with NOT_FOUND does
not know it, and the session registers the *same* worker again (same
identity, same memory, the fds sent anew) before attaching. Either way the
daemon hands out a new generation, which is how peers learn to re-handshake.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvmap.client.client import KvmapClient
from kvmap.client.transports.base import AttachStream
from kvmap.core.errors import DeadlineExceeded, KvmapError, NotFound
from kvmap.core.retry import RetryPolicy
from kvmap.v1 import registry_pb2, types_pb2

log = logging.getLogger("kvmap.client.session")

EventCallback = Callable[[registry_pb2.AttachResponse], None]


@dataclass(frozen=True)
class Backoff(RetryPolicy):
    """Delays between reconnection attempts: ``RetryPolicy``'s arithmetic
    (``initial_s`` growing by ``multiplier`` up to ``max_s``, each scaled by
    a random factor in ``[1 - jitter, 1]`` so that many workers of one pod do
    not retry in step), with the session's own defaults."""

    initial_s: float = 0.1
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The pause after each failed attempt, in order (endless), each
        drawn from ``rng``."""
        r = rng or random.Random()
        for attempt in itertools.count():
            yield self.delay(attempt, r.random())


class WorkerSession:
    def __init__(
        self,
        client: KvmapClient,
        request: registry_pb2.RegisterWorkerRequest,
        fds: Sequence[int] = (),
        *,
        on_event: EventCallback | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.client = client
        self.request = request
        self.fds = list(fds)
        self.on_event = on_event
        self.backoff = backoff or Backoff()
        self.region_map: types_pb2.RegionMap | None = None
        # What the daemon registered with lists (RegisterWorkerResponse.features);
        # renewed at every registration, so a daemon upgraded (or rolled back)
        # under the worker is seen as it is.
        self.features: frozenset[int] = frozenset()
        self.daemon_instance = ""
        self.registrations = 0
        self.disconnects = 0
        self.connected = threading.Event()
        # Set by the stream's first event (``attached``): the daemon has the
        # stream open, so it grants this worker's transfers (GrantTransfer
        # refuses a worker with no Attach stream: its events would reach no one).
        self.attached = threading.Event()
        self._stream: AttachStream | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def worker(self) -> types_pb2.WorkerId:
        return self.request.worker

    @property
    def generation(self) -> int:
        m = self.region_map
        return m.generation if m is not None else 0

    def start(self, timeout_s: float) -> types_pb2.RegionMap:
        """Register and attach, retrying with backoff for up to ``timeout_s``
        (the daemon may still be starting); then keep the worker attached on a
        thread. Raises the last error when the time runs out."""
        if self._thread is not None:
            raise RuntimeError("session already started")
        deadline = _Deadline(timeout_s)
        delays = self.backoff.delays()
        while True:
            try:
                self._connect()
                break
            except KvmapError as err:
                delay = next(delays)
                if deadline.remaining() < delay:
                    raise DeadlineExceeded(
                        f"could not register worker {_name(self.worker)} with kvmapd in "
                        f"{timeout_s}s: {err}"
                    ) from err
                log.info("kvmapd not reachable yet (%s); retrying in %.2fs", err, delay)
                if self._stop.wait(delay):
                    raise
        self._thread = threading.Thread(
            target=self._run, name=f"kvmap-attach-{self.worker.tp_rank}", daemon=True
        )
        self._thread.start()
        if not self.attached.wait(max(deadline.remaining(), 0.0)):
            # Registered, but the daemon has not answered the Attach stream yet;
            # the session keeps trying, and grants wait for it.
            log.warning("kvmap worker %s: Attach not answered yet", _name(self.worker))
        assert self.region_map is not None
        return self.region_map

    def _connect(self) -> None:
        registered = self.client.register_worker(self.request, self.fds)
        region_map = registered.region_map
        stream = self.client.attach(self.worker)
        with self._lock:
            if self._stop.is_set():
                stream.cancel()
                return
            self._stream = stream
            self.region_map = region_map
            self.features = frozenset(registered.features)
            self.registrations += 1
        self.connected.set()
        log.info(
            "kvmap worker %s registered: generation %d, %d regions",
            _name(self.worker),
            region_map.generation,
            len(region_map.regions),
        )

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                stream = self._stream
            assert stream is not None
            error: BaseException | None = None
            attached = False
            try:
                for event in stream:
                    attached |= event.WhichOneof("event") == "attached"
                    self._handle(event)
            except KvmapError as err:
                error = err
                if isinstance(err, NotFound) and not attached:
                    # The daemon does not know this worker (a restart without
                    # its state, or it dropped it): register it again.
                    self.connected.clear()
                    self._reconnect(register=True)
                    continue
            except Exception as err:  # a transport bug must not kill the session
                log.exception("kvmap attach stream failed")
                error = err
            if self._stop.is_set():
                return
            self.connected.clear()
            self.disconnects += 1
            log.warning(
                "kvmap attach stream of %s ended (%s); attaching again",
                _name(self.worker),
                error or "closed by kvmapd",
            )
            self._reconnect(register=False)

    def _reconnect(self, register: bool) -> None:
        for delay in self.backoff.delays():
            if self._stop.wait(delay):
                return
            try:
                if not register:
                    # The answer (attached, or NOT_FOUND) may come on the
                    # stream, or at once from a transport that knows it.
                    stream = self.client.attach(self.worker)
                    with self._lock:
                        self._stream = stream
                    return
                self._connect()
                return
            except NotFound:
                register = True
            except KvmapError as err:
                log.info("kvmapd still unreachable (%s); next try in up to %.2fs", err, delay)

    def _handle(self, event: registry_pb2.AttachResponse) -> None:
        which = event.WhichOneof("event")
        if which == "attached":
            self.daemon_instance = event.attached.daemon_instance
            self.connected.set()
            self.attached.set()
            if event.attached.generation != self.generation:
                # Restored by a restarted daemon: its map (best effort).
                try:
                    self.region_map = self.client.get_region_map(self.worker)
                except KvmapError as err:
                    log.info("region map of %s after re-attach: %s", _name(self.worker), err)
        if self.on_event is None:
            return
        try:
            self.on_event(event)
        except Exception:
            log.exception("kvmap attach event handler failed on %s", which)

    def wait_connected(self, timeout_s: float) -> bool:
        return self.connected.wait(timeout_s)

    def stop(self, deregister: bool = True, timeout_s: float = 5.0) -> None:
        """End the session; with ``deregister`` tell the daemon the worker is
        gone (best effort: a daemon that is down forgets it anyway)."""
        self._stop.set()
        with self._lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self.connected.clear()
        if deregister:
            try:
                self.client.deregister(self.worker)
            except KvmapError as err:
                log.debug("deregister %s: %s", _name(self.worker), err)


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self._end = time.monotonic() + seconds

    def remaining(self) -> float:
        return self._end - time.monotonic()


def _name(w: types_pb2.WorkerId) -> str:
    return f"{w.engine_id}/dp{w.dp_rank}/tp{w.tp_rank}/pp{w.pp_rank}"
