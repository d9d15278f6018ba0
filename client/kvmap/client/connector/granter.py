"""Grants made off vLLM's scheduler thread.

vLLM calls ``request_finished`` on its scheduler thread, and every request
of the engine waits while it runs; it must return the kv_transfer_params,
capabilities included, that the decode side will present. A call to kvmapd
per tensor-parallel rank there cost every step that finished requests a
round trip per rank per request.

So where kvmapd takes a capability the caller drew
(``DAEMON_FEATURE_CALLER_CAPABILITIES``), the scheduler draws each rank's
capability itself (256 random bits, as kvmapd would) and returns at once;
this one thread makes the grants, in order, a moment later. The grant binds
the same blocks, request, uses, direction and lifetime as before: only who
drew the random bits changed. A decode that asks before the grant arrived
is refused and asks again for a moment (``kvmap.core.retry.GRANT_RACE_S``).

A job that fails (kvmapd unreachable, a refused grant, a daemon that drew a
capability of its own) revokes what it granted and is reported, so the
scheduler frees the request's kept blocks at once instead of at the end of
their lease. A kvmapd that predates caller capabilities costs that one
request (recomputed by its decode engine): the scheduler then grants in
place, as before, waiting for each answer. A job that waited longer than
``max_age_s`` is not granted at all: a capability must not come alive long
after it was handed on.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmap.client.client import KvmapClient
from kvmap.client.connector.grants import revoke
from kvmap.client.connector.logids import ids
from kvmap.core.errors import KvmapError
from kvmap.tracing import NULL_SPAN, Span, use
from kvmap.v1 import registry_pb2, types_pb2

log = logging.getLogger("kvmap.client.connector")


def new_capability() -> str:
    """256 random bits, URL-safe, as kvmapd draws them."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class RankGrant:
    """One rank's grant of one request's blocks, under ``capability``."""

    worker: types_pb2.WorkerId
    capability: str
    blocks: dict[int, list[int]]
    ttl_ms: int
    max_uses: int
    open_uses: bool
    unread_release: registry_pb2.UnreadRelease.ValueType


def make_grant(
    client: KvmapClient, request_id: str, g: RankGrant
) -> registry_pb2.GrantTransferResponse:
    """Ask kvmapd for ``g`` (an older kvmapd answers with a capability of
    its own)."""
    return client.grant_transfer(
        g.worker,
        request_id,
        g.blocks,
        ttl_ms=g.ttl_ms,
        max_uses=g.max_uses,
        open_uses=g.open_uses,
        unread_release=g.unread_release,
        capability=g.capability,
    )


class OlderKvmapd(KvmapError):
    """kvmapd granted, but not as asked: under a capability it drew (it
    predates caller capabilities) or as a one-use grant (it predates open
    grants). The capability handed on will never work."""


def grant_one(client: KvmapClient, request_id: str, g: RankGrant) -> None:
    """Make ``g`` in kvmapd; one an older kvmapd made otherwise than asked
    is revoked and raises ``OlderKvmapd``."""
    resp = make_grant(client, request_id, g)
    if resp.capability != g.capability or resp.open_uses != g.open_uses:
        revoke(client, g.worker, request_id)
        raise OlderKvmapd("kvmapd does not take a caller's capability (an older kvmapd)")


@dataclass(frozen=True)
class _Job:
    request_id: str
    grants: tuple[RankGrant, ...]
    queued: float
    # The connector's grant span: kvmapd's grant spans are its children.
    span: Span


class BackgroundGranter:
    """One thread that makes the grants the scheduler handed on, in order."""

    def __init__(
        self,
        client: KvmapClient,
        *,
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._max_age_s = max_age_s
        self._clock = clock
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._failed: queue.Queue[str] = queue.Queue()
        # Set once kvmapd showed it predates caller capabilities: the
        # scheduler grants in place from then on.
        self.older_kvmapd = False
        self._thread = threading.Thread(target=self._run, name="kvmap-granter", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, grants: Sequence[RankGrant], span: Span = NULL_SPAN) -> None:
        self._jobs.put(_Job(request_id, tuple(grants), self._clock(), span))

    def failed(self) -> list[str]:
        """The requests whose grants failed since the last call."""
        out: list[str] = []
        while True:
            try:
                out.append(self._failed.get_nowait())
            except queue.Empty:
                return out

    def idle(self, timeout_s: float) -> bool:
        """Whether every job handed on so far is done (tests, shutdown)."""
        deadline = self._clock() + timeout_s
        while self._jobs.unfinished_tasks:
            if self._clock() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._grant(job)
            finally:
                self._jobs.task_done()

    def _grant(self, job: _Job) -> None:
        waited = self._clock() - job.queued
        if waited > self._max_age_s:
            self._fail(job, [], f"not granted: it waited {waited:.1f}s to be sent")
            return
        granted: list[types_pb2.WorkerId] = []
        use(job.span)
        try:
            for g in job.grants:
                grant_one(self._client, job.request_id, g)
                granted.append(g.worker)
        except KvmapError as err:
            self.older_kvmapd |= isinstance(err, OlderKvmapd)
            self._fail(job, granted, err.message)
        finally:
            use(NULL_SPAN)

    def _fail(self, job: _Job, granted: list[types_pb2.WorkerId], why: str) -> None:
        log.error(
            "%s: kvmapd did not grant the transfer (%s); freeing its blocks",
            ids(job.request_id),
            why,
        )
        for worker in granted:
            revoke(self._client, worker, job.request_id)
        self._failed.put(job.request_id)
