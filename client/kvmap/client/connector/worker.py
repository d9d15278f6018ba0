"""The worker side of the connector: one ``WorkerCore`` per vLLM worker (one
rank). It keeps the worker registered with this pod's kvmapd
(``WorkerSession``), runs the decode side's pulls and releases on a thread
pool, tracks the prefill side's kept blocks until a peer has pulled them
(kvmapd's ``TransferFinishedEvent``) or their lease ran out, and reports
what finished each step (vLLM's ``get_finished``). See README.md here."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

from kvmap.client.client import KvmapClient, TransferResult
from kvmap.client.connector.blocks import BlockIds, pair_blocks
from kvmap.client.connector.fixes import fix_for
from kvmap.client.connector.grants import revoke
from kvmap.client.connector.logids import ids
from kvmap.client.connector.metadata import ConnectorMeta, RecvTask
from kvmap.client.connector.options import ConnectorOptions
from kvmap.client.connector.params import RemoteSource
from kvmap.client.connector.pulls import PullSpecs, release_request, with_timeout
from kvmap.client.connector.push_recv import PushReceiver
from kvmap.client.connector.push_send import PushSender, Sync
from kvmap.client.connector.pushes import PrefillRank
from kvmap.client.connector.stats import TransferStatsBook
from kvmap.client.connector.tp_mapping import TpSplit, tp_readers
from kvmap.client.connector.traces import connector_tracer, freed, load_span
from kvmap.client.errors import describe, status_name
from kvmap.client.session import WorkerSession
from kvmap.core.errors import SHUTTING_DOWN, KvmapError, NotFound, Unavailable
from kvmap.core.retry import RetryPolicy
from kvmap.tracing import NULL_SPAN, Span, use
from kvmap.v1 import registry_pb2, transfers_pb2, types_pb2

log = logging.getLogger("kvmap.client.connector")
T = TypeVar("T")

# A pull that has not ended this long after its own deadline is given up.
WATCHDOG_GRACE_S = 5.0
# The longest pause between two attempts of a pull that broke because this
# pod's kvmapd restarted under it: a restart's gap is about a second, and a
# try against the local socket while it is down costs a refused connect.
PULL_RETRY_MAX_S = 0.25
# The time left that an attempt after such a pause needs: one started closer
# to the deadline could only end DEADLINE_EXCEEDED, which hides why the load
# failed (the daemon's own pull retries leave the same room).
PULL_ATTEMPT_S = 0.5


@dataclass(frozen=True)
class TransferResults:
    finished_sending: set[str]
    finished_recving: set[str]
    failed_recving: set[str]


@dataclass(frozen=True)
class LoadRecord:
    """One finished (or failed) load, kept for inspection and logs."""

    request_id: str
    remote_request_id: str
    local_block_ids: BlockIds
    remote_block_ids: BlockIds
    ok: bool
    error: str
    seconds: float
    bytes: int


@dataclass
class _Load:
    task: RecvTask
    spec: transfers_pb2.TransferSpec | None
    future: concurrent.futures.Future[TransferResult] | None
    started: float
    deadline: float
    error: str = ""
    # Its span (connector.traces.load_span), ended with the load.
    span: Span = NULL_SPAN


def _pulled_remote_blocks(load: _Load) -> BlockIds:
    """The remote blocks a successful load read, per group."""
    spec = load.spec
    if spec is not None and any(g.num_tokens for g in spec.groups):
        by_group = {g.transfer_group: tuple(g.remote_block_ids) for g in spec.groups}
        return tuple(by_group.get(g, ()) for g in range(len(load.task.source.block_ids)))
    return pair_blocks(load.task.local_block_ids, load.task.source.block_ids)[1]


class WorkerCore:
    """vLLM's worker-side connector calls, on plain ids and lists: register
    the KV cache, start each step's loads and releases, track the kept
    blocks of prefill requests, and say what finished."""

    def __init__(
        self,
        client: KvmapClient,
        worker: types_pb2.WorkerId,
        options: ConnectorOptions,
        *,
        tp_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
        history: int = 1024,
        block_size: int = 0,
        kv_heads: int = 0,
        replicated: bool = False,
    ) -> None:
        self.client = client
        self.worker = worker
        self.options = options
        self.tp_size = tp_size
        self.block_size = block_size
        self.split = TpSplit(kv_heads, replicated)
        self.pulls = PullSpecs(
            worker,
            options,
            tp_size=tp_size,
            block_size=block_size,
            split=self.split,
            features=lambda: self.daemon_features,
        )
        # Finished pulls that free a prefill request's blocks on this rank.
        self.send_readers = tp_readers(
            kv_heads, tp_size, options.decode_tp_size or tp_size, replicated=replicated
        )[worker.tp_rank]
        self.clock = clock
        self.tracer = connector_tracer(options)
        # Kept requests' grant spans (tracing on): their frees' parents.
        self._send_traces: dict[str, str] = {}
        self.session: WorkerSession | None = None
        self.loads: collections.deque[LoadRecord] = collections.deque(maxlen=history)
        self.leases_expired = 0
        # Grant uses this rank released (loads that needed no block).
        self.released = 0
        # What loads and leases did since vLLM last took it (connector stats).
        self.stats = TransferStatsBook()
        # (request id, whether its grant is used up; None: the daemon does
        # not say) of each finished pull of this rank's blocks.
        self._events: queue.SimpleQueue[tuple[str, bool | None]] = queue.SimpleQueue()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=options.max_parallel_pulls, thread_name_prefix="kvmap-pull"
        )
        self._loading: dict[str, _Load] = {}
        self._shut_down = False
        self._to_process: set[str] = set()
        self._send_deadline: dict[str, float] = {}
        # Pulls finished so far of prefill requests read by several ranks.
        self._send_pulls: dict[str, int] = {}
        # Kept requests of a rank no decode rank reads, freed at the next poll.
        self._unread_sends: set[str] = set()
        self._load_errors: set[int] = set()
        self._init_push(clock)

    def _init_push(self, clock: Callable[[], float]) -> None:
        """Push mode's two sides (connector.push_recv, connector.push_send),
        on a pool of their own: a step's layer-group pushes must not wait
        behind pulls."""
        self._push_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.options.max_parallel_pulls, thread_name_prefix="kvmap-push"
        )
        self.push_recv = PushReceiver(
            self.client,
            self.worker,
            self.options,
            tp_size=self.tp_size,
            block_size=self.block_size,
            pool=self._push_pool,
            clock=clock,
        )
        rank = PrefillRank(
            self.worker,
            self.tp_size,
            self.block_size,
            self.split,
            features=lambda: self.daemon_features,
        )
        self.push_send = PushSender(
            self.client, rank, self.options, pool=self._push_pool, clock=clock
        )

    # Registration ---------------------------------------------------------

    def register(
        self, request: registry_pb2.RegisterWorkerRequest, fds: Sequence[int]
    ) -> types_pb2.RegionMap:
        # The layers in the order the model computes them: its layer groups.
        self.push_send.set_layers([(v.layer_name, v.transfer_group) for v in request.views])
        self.session = WorkerSession(
            self.client, request, fds, on_event=self.on_event, backoff=self.options.backoff
        )
        return self.session.start(self.options.register_timeout_s)

    def on_event(self, event: registry_pb2.AttachResponse) -> None:
        """Attach events (on the session's thread)."""
        kind = event.WhichOneof("event")
        if kind == "push_offered":
            self.push_send.on_event(event.push_offered)
        if kind != "transfer_finished":
            return
        done = event.transfer_finished
        if done.direction == registry_pb2.TRANSFER_DIRECTION_PULLED_FROM:
            self._events.put((done.request_id, done.exhausted if done.max_uses else None))
        elif done.direction == registry_pb2.TRANSFER_DIRECTION_PUSHED_TO:
            self.push_recv.on_event(done)

    # Steps ----------------------------------------------------------------

    def start(self, meta: ConnectorMeta) -> None:
        """Start this step's loads and track this step's sends."""
        now = self.clock()
        for task in meta.recv:
            self._submit(task, now)
        for task in meta.release:
            self._submit_release(task)
        self._to_process |= meta.in_batch
        self._send_traces.update(meta.send_traces)
        for request_id in meta.not_processed:
            self._to_process.discard(request_id)
            self._send_pulls.pop(request_id, None)
            self._send_traces.pop(request_id, None)
        for request_id, lease_s in meta.send.items():
            if not self.send_readers:
                # No decode rank reads this rank (granted nothing): its
                # blocks are freed at the next poll.
                self._to_process.discard(request_id)
                self._unread_sends.add(request_id)
                continue
            # A pull may already have finished: then it is no longer listed.
            if request_id in self._to_process:
                self._send_deadline[request_id] = now + lease_s
        for request_id in meta.ungranted:
            # Its grant failed after it was offered: freed at the next poll.
            if request_id in self._to_process:
                self._to_process.discard(request_id)
                self._send_deadline.pop(request_id, None)
                self._send_pulls.pop(request_id, None)
                self._unread_sends.add(request_id)
        for recv in meta.push_recv:
            self.push_recv.start(recv)
        self.push_send.start(meta.push_ready, meta.push_send, meta.not_processed)

    def layer_saved(self, layer_name: str, sync: Sync | None = None) -> None:
        """vLLM saved a layer's KV (``save_kv_layer``): push mode's layer groups."""
        self.push_send.layer_saved(layer_name, sync)

    @property
    def pushing_layers(self) -> bool:
        """Whether this step has requests whose layer groups are pushed as
        their layers are saved (a GPU worker records an event per layer then)."""
        return self.push_send.pushing_layers

    @property
    def daemon_features(self) -> frozenset[int]:
        """What this rank's kvmapd listed when the worker last registered."""
        return self.session.features if self.session is not None else frozenset()

    def specs_for(self, task: RecvTask) -> list[transfers_pb2.TransferSpec]:
        """The pulls of one load (``PullSpecs.specs_for``)."""
        return self.pulls.specs_for(task)

    def readers_of(self, src: RemoteSource) -> tuple[int, ...]:
        """Per prefill rank, how many ranks of this engine read it (``PullSpecs.readers_of``)."""
        return self.pulls.readers_of(src)

    def release_specs(self, task: RecvTask, *, pulling: bool) -> list[transfers_pb2.TransferSpec]:
        """The releases this rank sends for ``task`` (``PullSpecs.release_specs``)."""
        return self.pulls.release_specs(task, pulling=pulling)

    def _submit_release(self, task: RecvTask, *, pulling: bool = False) -> None:
        """Send ``task``'s releases (``release_specs``) in the background:
        best effort, since the prefill side's lease frees the blocks anyway."""
        if registry_pb2.DAEMON_FEATURE_RELEASE not in self.daemon_features:
            # An older kvmapd would take the release for a pull of nothing.
            return
        try:
            specs = self.release_specs(task, pulling=pulling)
        except ValueError as err:
            log.info("%s: not releasing remote KV: %s", _task_ids(task), err)
            return
        for spec in specs:
            span = load_span(self.tracer, task, "release")
            self._pool.submit(_traced, span, partial(self._release, spec, span), end=True)

    def _release(self, spec: transfers_pb2.TransferSpec, span: Span) -> None:
        timeout_s = spec.timeout_ms / 1000 + 2.0
        try:
            if registry_pb2.DAEMON_FEATURE_RELEASE_RPC in self.daemon_features:
                self.client.release(release_request(spec), timeout_s=timeout_s)
            else:
                # A kvmapd of the previous release: the deprecated flag.
                self.client.pull(spec, timeout_s=timeout_s)
            self.released += 1
        except KvmapError as err:
            span.fail(err.code.name, err.message)
            log.info(
                "%s: releasing the prefill rank's grant failed: %s", _spec_ids(spec), err.message
            )

    def _submit(self, task: RecvTask, now: float) -> None:
        deadline = now + self.options.transfer_timeout_s + WATCHDOG_GRACE_S
        try:
            specs = self.specs_for(task)
        except ValueError as err:
            log.warning("%s: cannot load remote KV: %s", _task_ids(task), err)
            self._loading[task.request_id] = _Load(task, None, None, now, deadline, str(err))
            return
        # Prefill ranks no decode rank reads: their blocks are freed now.
        self._submit_release(task, pulling=True)
        until = now + self.options.transfer_timeout_s
        span = load_span(self.tracer, task)
        if len(specs) == 1:
            future = self._pool.submit(_traced, span, partial(self._pull, specs[0], until))
        else:
            future = self._pool.submit(_traced, span, partial(self._pull_all, specs, until))
        self._loading[task.request_id] = _Load(task, specs[0], future, now, deadline, span=span)

    def _pull_all(
        self, specs: Sequence[transfers_pb2.TransferSpec], deadline: float
    ) -> TransferResult:
        """The pulls of one load from several prefill ranks, one after the
        other within the load's deadline; the first failure fails the load."""
        results = []
        for spec in specs:
            results.append(self._pull(with_timeout(spec, deadline - self.clock()), deadline))
        return TransferResult(
            descriptors=sum(r.descriptors for r in results),
            bytes=sum(r.bytes for r in results),
            post_seconds=sum(r.post_seconds for r in results),
            completion_seconds=sum(r.completion_seconds for r in results),
            remote_generation=results[-1].remote_generation,
            handshaked=any(r.handshaked for r in results),
            transfer_id=",".join(r.transfer_id for r in results),
        )

    def _pull(self, spec: transfers_pb2.TransferSpec, deadline: float) -> TransferResult:
        """Pull; a pull that broke because this pod's kvmapd restarted under
        it is issued again (same capability: the owner's grant outlives a
        failed attempt) after a backoff, while ``deadline`` allows."""
        opts = self.options
        # Asking this pod's own kvmapd again is cheap, and every second of
        # pause past its return is latency the request pays: a short cap.
        initial = min(opts.reconnect_initial_s, PULL_RETRY_MAX_S)
        policy = RetryPolicy(
            initial,
            max(min(opts.reconnect_max_s, PULL_RETRY_MAX_S), initial),
            attempt_s=PULL_ATTEMPT_S,
        )
        attempt = 0
        while True:
            before = self._daemon_instance()
            try:
                # The gRPC deadline sits a little past the daemon's own deadline.
                timeout_s = spec.timeout_ms / 1000 + 2.0
                return self.client.pull(spec, timeout_s=timeout_s)
            except KvmapError as err:
                remaining = deadline - self.clock()
                pause = None
                if self._local_daemon_restarted(err, before):
                    pause = policy.next_delay(attempt, random.random(), remaining)
                if pause is None:
                    raise
                log.info(
                    "%s: pull broke as kvmapd restarted (%s); again in %.2fs",
                    _spec_ids(spec),
                    err.message,
                    pause,
                )
            time.sleep(pause)
            attempt += 1
            # The daemon's deadline is what is left of the load's.
            spec = with_timeout(spec, deadline - self.clock())

    def _daemon_instance(self) -> str:
        """The kvmapd instance this worker is attached to ("" before any)."""
        return self.session.daemon_instance if self.session is not None else ""

    def _local_daemon_restarted(self, err: KvmapError, before: str) -> bool:
        """Whether a failed pull met this pod's own kvmapd restarting: the
        decode side's one classification of a failed pull. Its UNAVAILABLE or
        NOT_FOUND (the restarted daemon does not know the worker yet) count
        only when the daemon is down now or is another instance than the one
        the worker was attached to when the pull began, and its UNAVAILABLE
        counts when the daemon refused the pull because it is draining
        (SIGTERM: it is about to be replaced); otherwise, from the same
        instance, they are the peer's (the daemon already retried those
        until the deadline) or final. Everything else (PERMISSION_DENIED,
        INVALID_ARGUMENT, ...) never is."""
        if not isinstance(err, Unavailable | NotFound):
            return False
        if isinstance(err, Unavailable) and SHUTTING_DOWN in err.message:
            return True
        try:
            now = self.client.get_stats().daemon_instance
        except Unavailable:
            return True  # still down: restarting (the deadline bounds the wait)
        except KvmapError:
            return False
        return bool(before) and now != before

    def poll(self) -> TransferResults:
        """What finished since the last call (vLLM's ``get_finished``)."""
        now = self.clock()
        sending = self._pulled_sends() | self._expired_sends(now) | self._unread_sends
        self._unread_sends = set()
        recving: set[str] = set()
        failed: set[str] = set()
        for request_id, load in list(self._loading.items()):
            outcome = self._outcome(load, now)
            if outcome is None:
                continue
            error, nbytes = outcome
            del self._loading[request_id]
            recving.add(request_id)
            if error:
                failed.add(request_id)
            self._finish_load(load, error, nbytes, now)
        sending |= self.push_send.poll()
        pushed, push_failed = self.push_recv.poll()
        return TransferResults(sending, recving | pushed, failed | push_failed)

    def _pulled_sends(self) -> set[str]:
        """Prefill requests whose blocks a peer finished pulling (daemon events)."""
        done: set[str] = set()
        while True:
            try:
                request_id, used_up = self._events.get_nowait()
            except queue.Empty:
                return done
            if request_id in self._to_process:
                # Freed once every decode rank reading this rank has pulled
                # (or released): the daemon says when the grant is used up;
                # one that does not say, once ``send_readers`` pulls finished.
                if used_up is False:
                    continue
                pulls = self._send_pulls.pop(request_id, 0) + 1
                if used_up is None and pulls < self.send_readers:
                    self._send_pulls[request_id] = pulls
                    continue
                self._to_process.discard(request_id)
                self._send_deadline.pop(request_id, None)
                freed(self.tracer, request_id, self._send_traces.pop(request_id, ""))
                done.add(request_id)
            else:
                log.debug("pull of unknown or expired request %s finished", request_id)

    def _expired_sends(self, now: float) -> set[str]:
        """Prefill requests whose lease ran out before any pull: their grants
        revoked (a late capability must never read reused blocks), freed."""
        expired: set[str] = set()
        for request_id, deadline in list(self._send_deadline.items()):
            if now < deadline:
                continue
            log.warning(
                "%s: no pull within the %ss lease; freeing its blocks",
                ids(request_id),
                self.options.lease_seconds,
            )
            del self._send_deadline[request_id]
            self._to_process.discard(request_id)
            self._send_pulls.pop(request_id, None)
            revoke(self.client, self.worker, request_id)
            freed(
                self.tracer, request_id, self._send_traces.pop(request_id, ""), "DEADLINE_EXCEEDED"
            )
            self.leases_expired += 1
            self.stats.record_kv_expired_req()
            expired.add(request_id)
        return expired

    def _outcome(self, load: _Load, now: float) -> tuple[str, int] | None:
        """(error or "", bytes) of a load that ended, None while it runs;
        an ended load is counted in ``stats``."""
        if load.future is None:
            self.stats.record_failed_transfer("INVALID_PARAMS")
            load.span.fail("INVALID_ARGUMENT", load.error)
            return load.error, 0
        if load.future.done():
            exc = load.future.exception()
            if exc is not None:
                self.stats.record_failed_transfer(status_name(exc))
                load.span.fail(status_name(exc), describe(exc))
                return describe(exc), 0
            result = load.future.result()
            self.stats.record_transfer(result)
            load.span.set(bytes=result.bytes, transfer_id=result.transfer_id)
            log.debug("%s: loaded %d bytes", _load_ids(load, result.transfer_id), result.bytes)
            return "", result.bytes
        if now >= load.deadline:
            load.future.cancel()
            self.stats.record_failed_transfer("DEADLINE_EXCEEDED")
            load.span.fail("DEADLINE_EXCEEDED", "no answer from kvmapd in time")
            return (
                f"no answer from kvmapd within {self.options.transfer_timeout_s}s "
                f"+ {WATCHDOG_GRACE_S}s"
            ), 0
        return None

    def _finish_load(self, load: _Load, error: str, nbytes: int, now: float) -> None:
        """Log and keep a record of an ended load; note a failed one's blocks."""
        load.span.end()
        local, remote = load.task.local_block_ids, load.task.source.block_ids
        if error:
            log.warning(
                "%s: loading its KV failed (%s); reported as a load failure%s",
                _load_ids(load),
                error,
                fix_for(error),
            )
            if len(local) == 1:
                self._load_errors.update(local[0])
        self.loads.append(
            LoadRecord(
                request_id=load.task.request_id,
                remote_request_id=load.task.source.request_id,
                local_block_ids=local,
                remote_block_ids=_pulled_remote_blocks(load) if not error else remote,
                ok=not error,
                error=error,
                seconds=now - load.started,
                bytes=nbytes,
            )
        )

    def load_error_blocks(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    @property
    def pending_loads(self) -> int:
        return len(self._loading) + len(self.push_recv)

    @property
    def pending_sends(self) -> int:
        return len(self._to_process) + len(self.push_send)

    def shutdown(self) -> None:
        """Once: vLLM may call it again (the engine's finalizer after an
        explicit shutdown), when the channel to kvmapd is closed already."""
        if self._shut_down:
            return
        self._shut_down = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._push_pool.shutdown(wait=False, cancel_futures=True)
        if self.session is not None:
            self.session.stop(deregister=True, timeout_s=self.options.call_timeout_s)
        self.client.close()


def _traced(span: Span, call: Callable[[], T], *, end: bool = False) -> T:
    """``call()`` on a pool thread with ``span`` current, so that its calls
    to kvmapd carry it (``traceparent``); ``end``: the span ends with it."""
    use(span)
    try:
        return call()
    finally:
        use(NULL_SPAN)
        if end:
            span.end()


def _task_ids(task: RecvTask) -> str:
    return ids(task.source.request_id, local_request_id=task.request_id, peer=task.source.target)


def _spec_ids(spec: transfers_pb2.TransferSpec) -> str:
    return ids(spec.request_id, peer=spec.remote_target, worker=spec.remote_worker)


def _load_ids(load: _Load, transfer_id: str = "") -> str:
    """A load's ids: the daemons' request id, this engine's, the prefill
    daemon and (of the first rank pulled from) worker, the transfer id
    once the daemon answered, the trace id when traced."""
    task = load.task
    return ids(
        task.source.request_id,
        local_request_id=task.request_id,
        transfer_id=transfer_id,
        peer=task.source.target,
        worker=load.spec.remote_worker if load.spec is not None else None,
        trace_id=load.span.trace_id(),
    )
