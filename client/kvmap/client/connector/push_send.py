"""Push mode, prefill side: one ``PushSender`` per prefill worker (rank).

A push-mode request (kv_transfer_params ``transfer_mode`` "push" with the
router's push id) is written into the decode side's blocks by this rank's
kvmapd (Transfers.Push), under the write capability the decode worker's
kvmapd granted and offered (``push_offered`` events on the Attach stream).
Its layers are cut into ``push_layer_groups`` groups: in the step where its
prompt completes, each group is pushed as soon as its last layer is saved
(``layer_saved``), while the next layers compute; a request that took
several steps (chunked prefill) is pushed whole when it finishes. An offer
that arrives late is served at once. The blocks stay kept (vLLM's delayed
free) until every push of this rank finished, failed or the lease ran out.

Only an offer carrying the push id of one of this rank's own requests is
ever acted on: an id the router made for that request alone.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvmap.client.client import KvmapClient
from kvmap.client.connector.fixes import fix_for
from kvmap.client.connector.logids import ids
from kvmap.client.connector.metadata import PushSendTask
from kvmap.client.connector.options import ConnectorOptions
from kvmap.client.connector.pushes import (
    PrefillRank,
    decode_ranks_written,
    layer_groups,
    layer_pushes,
    push_spec,
    uses_per_writer,
    writers_of,
)
from kvmap.client.errors import describe
from kvmap.core.errors import KvmapError
from kvmap.core.push_offers import Offer, offer_from_proto
from kvmap.v1 import registry_pb2, transfers_pb2

log = logging.getLogger("kvmap.client.connector")

# Offers kept for push ids this rank does not know (yet): the decode side
# can be quicker than this engine's scheduler, and every worker of the
# engine hears every offer (other data-parallel ranks' too).
MAX_WAITING_OFFERS = 4096
Sync = Callable[[], None]


@dataclass
class _Push:
    task: PushSendTask
    deadline: float
    finished: bool = False
    ready: set[int] = field(default_factory=set)
    syncs: dict[int, Sync] = field(default_factory=dict)
    expected: set[int] | None = None
    offers: dict[int, Offer] = field(default_factory=dict)
    # Per decode rank: the uses its grant admits (every writer's pushes).
    readers: dict[int, int] = field(default_factory=dict)
    # (decode rank, layer group) -> its spec, then its pending future.
    todo: dict[tuple[int, int], transfers_pb2.TransferSpec] = field(default_factory=dict)
    running: dict[tuple[int, int], concurrent.futures.Future[object]] = field(default_factory=dict)
    error: str = ""


class PushSender:
    def __init__(
        self,
        client: KvmapClient,
        rank: PrefillRank,
        options: ConnectorOptions,
        *,
        pool: concurrent.futures.ThreadPoolExecutor,
        clock: Callable[[], float],
    ) -> None:
        self.client = client
        self.rank = rank
        self.options = options
        self._pool = pool
        self._clock = clock
        self._groups: list[dict[int, tuple[str, ...]]] = [{}]
        self._last_layer: dict[str, int] = {}
        self._pushes: dict[str, _Push] = {}
        self._by_push_id: dict[str, str] = {}
        self._step: list[_Push] = []
        self._offers: queue.SimpleQueue[Offer] = queue.SimpleQueue()
        self._waiting: collections.OrderedDict[str, list[Offer]] = collections.OrderedDict()
        self.pushed = 0
        self.failed = 0

    def __len__(self) -> int:
        return len(self._pushes)

    def set_layers(self, layers: Sequence[tuple[str, int]]) -> None:
        """The worker's layers ((name, transfer group)) in compute order."""
        self._groups = layer_groups(layers, self.options.push_layer_groups)
        self._last_layer = {}
        for k, group in enumerate(self._groups):
            last = max((layers.index((n, g)) for g, names in group.items() for n in names))
            self._last_layer[layers[last][0]] = k

    def on_event(self, event: registry_pb2.PushOfferedEvent) -> None:
        """A ``push_offered`` event (on the session's thread)."""
        try:
            self._offers.put(offer_from_proto(event.offer))
        except KvmapError as err:
            log.warning("push offer from %s refused: %s", event.peer, err.message)

    # Steps ---------------------------------------------------------------

    def start(
        self, ready: Sequence[PushSendTask], sent: Sequence[PushSendTask], aborted: set[str]
    ) -> None:
        """This step's requests whose prompt completes in it (``ready``),
        finished ones (``sent``: every layer group may go), aborted ones."""
        now = self._clock()
        self._step = [self._track(task, now) for task in ready]
        for task in sent:
            push = self._track(task, now)
            push.finished = True
            push.ready.update(range(len(self._groups)))
        for request_id in aborted & self._pushes.keys():
            # Its blocks were not kept: the offers are released, no free reported.
            self._give_up(self._pushes[request_id], "the request was aborted")
            self._forget(request_id)
        self._take_offers()
        for push in self._pushes.values():
            self._issue(push)

    def _track(self, task: PushSendTask, now: float) -> _Push:
        push = self._pushes.get(task.request_id)
        if push is None:
            push = _Push(task, now + self.options.lease_seconds)
            self._pushes[task.request_id] = push
            self._by_push_id[task.push_id] = task.request_id
            for offer in self._waiting.pop(task.push_id, []):
                self._add_offer(push, offer)
        return push

    @property
    def pushing_layers(self) -> bool:
        return bool(self._step)

    def layer_saved(self, layer_name: str, sync: Sync | None = None) -> None:
        """A layer's KV is computed (``save_kv_layer``): when it ends a layer
        group, that group of this step's requests is pushed wherever offered.
        ``sync`` waits until the bytes are in memory (a GPU's event)."""
        k = self._last_layer.get(layer_name)
        if k is None or not self._step:
            return
        self._take_offers()
        for push in self._step:
            push.ready.add(k)
            if sync is not None:
                push.syncs[k] = sync
            self._issue(push)

    # Offers -----------------------------------------------------------------

    def _take_offers(self) -> None:
        while True:
            try:
                offer = self._offers.get_nowait()
            except queue.Empty:
                return
            request_id = self._by_push_id.get(offer.push_id)
            if request_id is not None and request_id in self._pushes:
                self._add_offer(self._pushes[request_id], offer)
                continue
            self._waiting.setdefault(offer.push_id, []).append(offer)
            self._waiting.move_to_end(offer.push_id)
            while len(self._waiting) > MAX_WAITING_OFFERS:
                self._waiting.popitem(last=False)

    def _add_offer(self, push: _Push, offer: Offer) -> None:
        """Take an offer of one of this rank's requests: its pushes are
        listed (each goes once its layer group is ready); an offer this rank
        cannot serve, or one for a request it gave up, is released at once."""
        d = offer.decode_worker.tp_rank
        if d in push.offers:
            return
        try:
            if push.expected is None:
                push.expected = decode_ranks_written(self.rank, offer.decode_tp_size)
            if d not in push.expected:
                return
            offered = {g.transfer_group for g in offer.groups}
            push.readers[d] = writers_of(self.rank, offer) * uses_per_writer(self._groups, offered)
            push.offers[d] = offer
            if push.error:
                self._pool.submit(self._release, offer, push.readers[d])
                return
            spec, _ = push_spec(self.rank, push.task, offer, self.options)
        except ValueError as err:
            push.offers.setdefault(d, offer)
            self._give_up(push, f"cannot push into the offered blocks: {err}")
            return
        if spec is not None:
            for k, cut in layer_pushes(spec, self._groups, push.readers[d]):
                push.todo[(d, k)] = cut

    # Pushes -----------------------------------------------------------------

    def _issue(self, push: _Push) -> None:
        if push.error:
            return
        for key in [key for key in push.todo if key[1] in push.ready]:
            spec = push.todo.pop(key)
            sync = push.syncs.get(key[1])
            push.running[key] = self._pool.submit(self._push, spec, sync)

    def _push(self, spec: transfers_pb2.TransferSpec, sync: Sync | None) -> object:
        if sync is not None:
            sync()
        return self.client.push(spec, timeout_s=spec.timeout_ms / 1000 + 2.0)

    def poll(self) -> set[str]:
        """Requests whose blocks may be freed now (vLLM's finished_sending)."""
        self._take_offers()
        now = self._clock()
        done: set[str] = set()
        for request_id, push in list(self._pushes.items()):
            self._issue(push)
            self._reap(push)
            if not push.finished:
                if now >= push.deadline + self.options.lease_seconds:
                    # Computed but never reported finished (nor aborted).
                    self._forget(request_id)
                continue
            if push.running or (not push.error and not self._complete(push, now)):
                continue
            self._forget(request_id)
            done.add(request_id)
        self._prune_waiting()
        return done

    def _forget(self, request_id: str) -> None:
        push = self._pushes.pop(request_id)
        self._by_push_id.pop(push.task.push_id, None)

    def _reap(self, push: _Push) -> None:
        for key, future in list(push.running.items()):
            if not future.done():
                continue
            del push.running[key]
            exc = future.exception()
            if exc is None:
                self.pushed += 1
            elif not push.error:
                self._give_up(push, describe(exc))

    def _complete(self, push: _Push, now: float) -> bool:
        """Whether every decode rank this rank writes has all its pushes
        done; past the lease, given up."""
        if push.expected is not None and push.expected <= push.offers.keys() and not push.todo:
            return True
        if now >= push.deadline:
            self._give_up(
                push, f"no offer for every decode rank within {self.options.lease_seconds}s"
            )
            return True
        return False

    def _give_up(self, push: _Push, why: str) -> None:
        """Stop pushing ``push``: the decode ranks offered are told at once
        (a released use of their grants), so they recompute rather than
        wait out their timeout."""
        if push.error:
            return
        push.error = why
        push.todo.clear()
        self.failed += 1
        log.warning("%s: not pushing its KV: %s%s", ids(push.task.request_id), why, fix_for(why))
        for d, offer in push.offers.items():
            self._pool.submit(self._release, offer, push.readers.get(d, 0))

    def _release(self, offer: Offer, readers: int) -> None:
        req = transfers_pb2.ReleaseRequest(
            request_id=offer.request_id,
            local_worker=self.rank.worker,
            remote_target=offer.decode_target,
            remote_worker=offer.decode_worker,
            capability=offer.capability,
            readers=readers,
            timeout_ms=int(self.options.call_timeout_s * 1000),
        )
        try:
            self.client.release(req, timeout_s=self.options.call_timeout_s + 2.0)
        except KvmapError as err:
            log.info("%s: telling the decode side failed: %s", ids(offer.request_id), err.message)

    def _prune_waiting(self) -> None:
        """Forget waiting offers whose grant expired."""
        now_ms = time.time_ns() // 1_000_000
        for push_id in [
            p for p, offers in self._waiting.items() if offers[0].expires_unix_ms < now_ms
        ]:
            del self._waiting[push_id]
