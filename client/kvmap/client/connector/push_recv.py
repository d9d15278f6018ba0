"""Push mode, decode side: one ``PushReceiver`` per decode worker (rank).

For each push-mode request the scheduler lists (``PushRecvTask``), the
worker asks its own kvmapd for a write grant of exactly the request's
allocated blocks (open: the prefill side's first push declares how many
pushes use it) and offers them, through its kvmapd, to the prefill engine's
kvmapd. The request has loaded once its grant is used up by pushes
(``TransferFinishedEvent`` PUSHED_TO, ``exhausted``): vLLM sees its KV only
then, never a part of it. It has failed when the prefill side released a
use instead (it could not push), when the offer could not be delivered, or
when ``push_timeout_s`` passed; then the grant is revoked, and the blocks
are handed back to vLLM (to recompute) only once no announced write into
them is left in flight: a late write must never land in reused blocks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass

from kvmap.client.client import KvmapClient
from kvmap.client.connector.fixes import fix_for
from kvmap.client.connector.grants import MAX_GRANT_TTL_MS
from kvmap.client.connector.logids import ids
from kvmap.client.connector.metadata import PushRecvTask
from kvmap.client.connector.options import ConnectorOptions
from kvmap.client.errors import describe
from kvmap.core.errors import KvmapError
from kvmap.v1 import registry_pb2, types_pb2

log = logging.getLogger("kvmap.client.connector")


@dataclass
class _Waiting:
    task: PushRecvTask
    offered: concurrent.futures.Future[int]
    deadline: float
    error: str = ""
    # Past this, a failed request's blocks go back even with writes in
    # flight (their leases ended at the owner long before).
    drain_until: float = 0.0


class PushReceiver:
    def __init__(
        self,
        client: KvmapClient,
        worker: types_pb2.WorkerId,
        options: ConnectorOptions,
        *,
        tp_size: int,
        block_size: int,
        pool: concurrent.futures.ThreadPoolExecutor,
        clock: Callable[[], float],
    ) -> None:
        self.client = client
        self.worker = worker
        self.options = options
        self.tp_size = tp_size
        self.block_size = block_size
        self._pool = pool
        self._clock = clock
        self._waiting: dict[str, _Waiting] = {}
        # (request id, used up, released) of each finished write or release.
        self._events: queue.SimpleQueue[tuple[str, bool, bool]] = queue.SimpleQueue()
        self.loaded = 0
        self.failed = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def on_event(self, done: registry_pb2.TransferFinishedEvent) -> None:
        """A PUSHED_TO event (on the session's thread)."""
        self._events.put((done.request_id, done.exhausted, done.released))

    def start(self, task: PushRecvTask) -> None:
        now = self._clock()
        offered = self._pool.submit(self._grant_and_offer, task)
        self._waiting[task.request_id] = _Waiting(task, offered, now + self.options.push_timeout_s)

    def _grant_and_offer(self, task: PushRecvTask) -> int:
        """Grant the write of the task's blocks and offer them; how many
        prefill workers heard (raises ``KvmapError`` or ``ValueError``)."""
        if not self.options.peer_address:
            raise ValueError("no peer_address configured: the prefill side cannot reach us")
        blocks = {g: ids for g, ids in enumerate(task.local_block_ids) if ids}
        ttl_ms = int((self.options.push_timeout_s + self.options.transfer_timeout_s) * 1000)
        grant = self.client.grant_transfer(
            self.worker,
            task.request_id,
            blocks,
            ttl_ms=min(ttl_ms, MAX_GRANT_TTL_MS),
            open_uses=True,
            unread_release=registry_pb2.UNREAD_RELEASE_REFUSED,
            access=registry_pb2.GRANT_ACCESS_WRITE,
        )
        offer = types_pb2.PushOffer(
            push_id=task.source.push_id,
            prefill_engine_id=task.source.engine_id,
            decode_worker=self.worker,
            decode_target=self.options.peer_address,
            decode_tp_size=self.tp_size,
            decode_block_size=self.block_size,
            first_token=task.first_token,
            num_tokens=task.num_tokens,
            groups=[types_pb2.BlockGrant(transfer_group=g, block_ids=b) for g, b in blocks.items()],
            capability=grant.capability,
            expires_unix_ms=grant.expires_unix_ms,
            request_id=task.request_id,
        )
        return self.client.offer_push(
            task.source.target, offer, timeout_s=self.options.call_timeout_s
        )

    def poll(self) -> tuple[set[str], set[str]]:
        """(loaded, failed) since the last call; a failed one is also loaded
        (vLLM's finished_recving) and is recomputed."""
        self._take_events()
        now = self._clock()
        loaded: set[str] = set()
        failed: set[str] = set()
        for request_id, w in list(self._waiting.items()):
            w.error = w.error or self._failure(w, now)
            if not w.error or not self._drained(w, now):
                continue
            del self._waiting[request_id]
            loaded.add(request_id)
            if w.error == _LOADED:
                self.loaded += 1
                continue
            self.failed += 1
            failed.add(request_id)
            source = w.task.source
            log.warning(
                "%s: the push of its KV failed (%s); reported as a load failure%s",
                ids(request_id, peer=source.target),
                w.error,
                fix_for(w.error),
            )
        return loaded, failed

    def _take_events(self) -> None:
        while True:
            try:
                request_id, used_up, released = self._events.get_nowait()
            except queue.Empty:
                return
            w = self._waiting.get(request_id)
            if w is None or w.error:
                continue
            if released:
                w.error = "the prefill side gave up its push"
            elif used_up:
                w.error = _LOADED

    def _failure(self, w: _Waiting, now: float) -> str:
        """Why a waiting request failed ("" while it may still load)."""
        if w.offered.done():
            exc = w.offered.exception()
            if exc is not None:
                return f"offering its blocks: {describe(exc)}"
        if now >= w.deadline:
            return f"no push within push_timeout_s {self.options.push_timeout_s}s"
        return ""

    def _drained(self, w: _Waiting, now: float) -> bool:
        """Whether a finished request's blocks may go back to vLLM: at once
        when loaded; when failed, once its grant is revoked and no announced
        write into its blocks is in flight (or the writers' leases are long
        over)."""
        if w.error == _LOADED:
            return True
        if not w.drain_until:
            w.drain_until = now + self.options.transfer_timeout_s
        try:
            in_flight = self.client.revoke_transfer(self.worker, w.task.request_id)
        except KvmapError as err:
            log.warning("%s: revoking its write grant failed: %s", w.task.request_id, err.message)
            in_flight = 0
        return in_flight == 0 or now >= w.drain_until


# ``_Waiting.error`` of a request whose pushes all landed.
_LOADED = "loaded"
