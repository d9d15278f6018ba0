"""The scheduler side of the connector: one ``SchedulerCore`` per engine, in
vLLM's scheduler process. It decides per request what the workers do (the
per-step ``ConnectorMeta``), and on a prefill engine it asks this pod's
kvmapd to grant the pulls of a finished request's blocks and writes the
``kv_transfer_params`` that carry the capability. See README.md here."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvmap.client.client import KvmapClient
from kvmap.client.connector.blocks import BlockIds
from kvmap.client.connector.granter import (
    BackgroundGranter,
    RankGrant,
    make_grant,
    new_capability,
)
from kvmap.client.connector.grants import MAX_GRANT_TTL_MS, revoke
from kvmap.client.connector.logids import ids
from kvmap.client.connector.metadata import ConnectorMeta, PushRecvTask, PushSendTask, RecvTask
from kvmap.client.connector.options import ConnectorOptions, host_port
from kvmap.client.connector.params import (
    CAPABILITY_KEY,
    OPEN_GRANTS_KEY,
    PARAMS_VERSION,
    READERS_TP_KEY,
    TRACEPARENT_KEY,
    TRUNCATED_KEY,
    UNREAD_CAPABILITY,
    PushSource,
    RemoteSource,
    is_push,
    push_id_of,
)
from kvmap.client.connector.tp_mapping import TpSplit, tp_readers
from kvmap.client.connector.traces import connector_tracer, grant_span, load_parent
from kvmap.client.connector.windows import GroupWindows
from kvmap.core.errors import KvmapError
from kvmap.tracing import NULL_SPAN, current, use
from kvmap.v1 import registry_pb2, types_pb2

log = logging.getLogger("kvmap.client.connector")

# No windowed or state group: every block of a request moves.
_NO_WINDOWS = GroupWindows()


class SchedulerCore:
    """vLLM's scheduler-side connector calls, on plain ids and lists: which
    requests load remote KV, what each step's workers do, and the params a
    finished prefill request returns (its blocks granted, then kept)."""

    def __init__(
        self,
        engine_id: str,
        options: ConnectorOptions,
        *,
        dp_rank: int = 0,
        pp_rank: int = 0,
        tp_size: int = 1,
        client: KvmapClient | None = None,
        windows: GroupWindows = _NO_WINDOWS,
        block_size: int = 0,
        kv_heads: int = 0,
        replicated: bool = False,
    ) -> None:
        self.engine_id = engine_id
        self.options = options
        self.dp_rank = dp_rank
        self.pp_rank = pp_rank
        self.tp_size = tp_size
        # The decode ranks that read each rank's blocks (a bad pairing of
        # sizes is a configuration error: raised here, at start-up).
        self.decode_tp_size = options.decode_tp_size or tp_size
        self.readers = tp_readers(kv_heads, tp_size, self.decode_tp_size, replicated=replicated)
        # No decode TP size configured: open grants (readers all 1 here).
        self.open_grants = not options.decode_tp_size
        # The ranks whose open grant a decode may release unread (declaring
        # no readers); every other grant says REFUSED, so a capability
        # holder cannot burn it. A fixed-count grant cannot be released
        # unread at all.
        unread = TpSplit(kv_heads, replicated).unread_allowed(tp_size)
        self.unread_release = [
            registry_pb2.UNREAD_RELEASE_ALLOWED
            if self.open_grants and allowed
            else registry_pb2.UNREAD_RELEASE_REFUSED
            for allowed in unread
        ]
        # Offered with the KV, so a decode engine of another block size can
        # map the two block grids (0: not said).
        self.block_size = block_size
        # Sliding-window groups: only their last blocks are offered and loaded.
        self.windows = windows
        # This pod's kvmapd, which grants the transfers of kept blocks; None
        # on engines that only consume KV (they keep nothing).
        self.client = client
        self.tracer = connector_tracer(options)
        self._meta = ConnectorMeta()
        # Grants off vLLM's scheduler thread (``_grant``), made at the
        # first; a job never older than this.
        self._granter: BackgroundGranter | None = None
        self._grant_max_age_s = min(options.call_timeout_s, options.lease_seconds / 4)
        # Push-mode prefill requests of this engine: their push ids, and
        # the finished ones whose blocks wait for their pushes.
        self._push_ids: dict[str, str] = {}
        self._pushing: set[str] = set()
        # Push-mode decode requests: the prompt tokens their local prefix
        # cache holds, as num_new_matched_tokens heard it.
        self._push_first_token: dict[str, int] = {}

    def num_new_matched_tokens(
        self,
        request_id: str,
        params: Mapping[str, Any] | None,
        num_prompt_tokens: int,
        num_computed_tokens: int,
    ) -> tuple[int, bool]:
        """Tokens this request will load asynchronously beyond what is
        computed locally (vLLM's ``get_num_new_matched_tokens``)."""
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        try:
            if is_push(params):
                PushSource.parse(params)
                if not self.options.peer_address:
                    raise ValueError("push mode needs peer_address (this pod's kvmapd)")
            else:
                RemoteSource.parse(params)
        except ValueError as err:
            log.warning("%s: not loading remote KV: %s", ids(request_id), err)
            return 0, False
        count = self.loaded_tokens(num_prompt_tokens) - num_computed_tokens
        if count > 0 and is_push(params):
            # The offer names the first token to write: vLLM sets the
            # request's own count only after allocating (after_alloc).
            self._push_first_token[request_id] = num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    @property
    def prefill_backoff(self) -> int:
        """Trailing prompt tokens the prefill engine leaves uncomputed and
        the decode engine computes: one where a group holds recurrent state.
        vLLM computes a prompt's last token on the decode engine even when
        every token's KV was loaded; rewriting an attention slot is harmless,
        but a Mamba state holding the whole prompt would take that token a
        second time. The prefill engine's state is h(N-1), from which the
        decode engine derives h(N) (NixlConnector's rule)."""
        return 1 if self.windows.has_state else 0

    def loaded_tokens(self, num_prompt_tokens: int) -> int:
        """Prompt tokens a decode request loads: all but the backoff."""
        backoff = self.prefill_backoff
        if backoff and num_prompt_tokens > backoff:
            return num_prompt_tokens - backoff
        return num_prompt_tokens

    def prefill_truncation(
        self, params: dict[str, Any] | None, num_prompt_tokens: int, *, reads_prefix_cache: bool
    ) -> int:
        """Trailing prompt tokens to drop from a new prefill request
        (``do_remote_decode``) so it stops short by the backoff; 0 for any
        other request, for one already cut (``params`` marked: a preempted
        request comes back), and for one that skips reading the prefix cache
        (prompt logprobs: its decode side recomputes the whole prompt)."""
        backoff = self.prefill_backoff
        if (
            not backoff
            or not params
            or not params.get("do_remote_decode")
            or params.get(TRUNCATED_KEY)
            or num_prompt_tokens <= backoff
            or not reads_prefix_cache
        ):
            return 0
        params[TRUNCATED_KEY] = True
        return backoff

    def after_alloc(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        local_block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        """Blocks were allocated for the request (``update_state_after_alloc``);
        ``trace_headers``: vLLM's trace context of the request, if any."""
        if not params:
            return
        if params.get("do_remote_decode"):
            self._after_alloc_prefill(request_id, params)
            return
        if not params.get("do_remote_prefill"):
            return
        if is_push(params):
            first_token = self._push_first_token.pop(request_id, 0)
            self._offer_blocks(request_id, params, local_block_ids, num_external_tokens,
                               first_token)  # fmt: skip
        elif num_external_tokens > 0:
            try:
                source = RemoteSource.parse(params)
            except ValueError as err:  # num_new_matched_tokens said 0 already
                log.warning("%s: not loading remote KV: %s", ids(request_id), err)
            else:
                local = self._local_blocks(local_block_ids, source)
                parent, link = load_parent(source.traceparent, trace_headers)
                self._meta.recv.append(RecvTask(request_id, source, local, parent, link))
        else:
            self._release(request_id, params, trace_headers)
        # One transfer per request, even when vLLM calls this again.
        params["do_remote_prefill"] = False

    def _after_alloc_prefill(self, request_id: str, params: Mapping[str, Any]) -> None:
        if not is_push(params):
            self._meta.in_batch.add(request_id)
            return
        try:
            self._push_ids[request_id] = push_id_of(params)
        except ValueError as err:
            log.warning("%s: not pushing its KV: %s", ids(request_id), err)

    def _offer_blocks(
        self,
        request_id: str,
        params: Mapping[str, Any],
        local_block_ids: Sequence[Sequence[int]],
        num_external_tokens: int,
        first_token: int,
    ) -> None:
        """A push-mode decode request: its workers offer its blocks."""
        if num_external_tokens <= 0:
            return  # its prefix cache holds the whole prompt: the prefill side's lease frees
        try:
            source = PushSource.parse(params)
        except ValueError as err:  # num_new_matched_tokens said 0 already
            log.warning("%s: not loading remote KV: %s", ids(request_id), err)
            return
        local = self.windows.clip(local_block_ids)
        self._meta.push_recv.append(
            PushRecvTask(request_id, source, local, first_token, num_external_tokens)
        )

    def layer_push_wanted(self, request_id: str) -> bool:
        """Whether ``prompt_scheduled`` should hear of this request."""
        return request_id in self._push_ids

    def prompt_scheduled(
        self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int
    ) -> None:
        """A push-mode prefill request's prompt completes in the step being
        built (its whole prompt was scheduled at once): its workers push its
        layer groups as they are computed."""
        push_id = self._push_ids.get(request_id)
        if push_id is not None:
            self._meta.push_ready.append(
                self._push_task(request_id, push_id, block_ids, num_tokens)
            )

    def _push_task(
        self, request_id: str, push_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int
    ) -> PushSendTask:
        blocks = tuple(tuple(g) for g in self.windows.clip(block_ids))
        return PushSendTask(request_id, push_id, blocks, num_tokens, self.windows)

    def _push_finished(
        self,
        request_id: str,
        *,
        finished_normally: bool,
        block_ids: Sequence[Sequence[int]],
        num_computed_tokens: int,
    ) -> tuple[bool, dict[str, Any] | None]:
        """A push-mode prefill request finished: its blocks wait for the
        pushes (no grant: the decode side granted the writes)."""
        push_id = self._push_ids.pop(request_id, "")
        task = self._push_task(request_id, push_id, block_ids, num_computed_tokens)
        if not push_id or not finished_normally or not any(task.block_ids):
            self._meta.not_processed.add(request_id)
            return False, None
        self._meta.push_send.append(task)
        self._pushing.add(request_id)
        return True, {
            "do_remote_prefill": False,
            "do_remote_decode": False,
            "transfer_mode": "push",
            "kvmap_params_version": PARAMS_VERSION,
        }

    @property
    def pushing(self) -> bool:
        """Whether kept blocks wait for pushes: vLLM must keep stepping (its
        workers push, and report the frees, only when it steps), even with
        no request left to run (``has_pending_push_work``)."""
        return bool(self._pushing)

    def freed(self, request_ids: Iterable[str]) -> None:
        """Requests whose kept blocks vLLM freed (finished_sending)."""
        self._pushing.difference_update(request_ids)

    def _release(
        self,
        request_id: str,
        params: Mapping[str, Any],
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        """The workers release this decode request's uses of the prefill
        side's grants (it loads none of the blocks), so the prefill side
        frees them now rather than when its lease runs out."""
        try:
            source = RemoteSource.parse(params)
        except ValueError:
            return  # never a pull either: nothing to release
        if source.capability:
            parent, link = load_parent(source.traceparent, trace_headers)
            self._meta.release.append(RecvTask(request_id, source, (), parent, link))

    def _local_blocks(
        self, local_block_ids: Sequence[Sequence[int]], source: RemoteSource
    ) -> BlockIds:
        """The allocated blocks the remote blocks load into: windowed groups
        clipped as the prefill side clipped its own (a group count that does
        not match is left for ``pair_blocks`` to refuse)."""
        local = tuple(tuple(int(b) for b in g) for g in local_block_ids)
        try:
            local = self.windows.clip(local)
        except ValueError:
            return local
        if source.block_size and self.block_size and source.block_size != self.block_size:
            return local  # other block grids: the token mapping aligns the trailing blocks
        return self.windows.fit(local, source.block_ids)

    def build_meta(self) -> ConnectorMeta:
        if self._granter is not None:
            # Offered, kept, and their grants failed: no pull can come.
            self._meta.ungranted.update(self._granter.failed())
        meta, self._meta = self._meta, ConnectorMeta()
        return meta

    def wait_for_grants(self, timeout_s: float) -> bool:
        """Whether every grant handed on so far was made, or failed, within
        ``timeout_s`` (they are made off this thread: ``_grant``)."""
        return self._granter is None or self._granter.idle(timeout_s)

    def shutdown(self) -> None:
        """Stop the grants' thread (those handed on are made first)."""
        if self._granter is not None:
            self.wait_for_grants(self.options.call_timeout_s)
            self._granter.close()

    def request_finished(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        *,
        finished_normally: bool,
        block_ids: Sequence[Sequence[int]],
        num_computed_tokens: int,
        trace_headers: Mapping[str, str] | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks for a pull?, kv_transfer_params for the client);
        ``trace_headers``: vLLM's trace context of the request, if any."""
        self._push_first_token.pop(request_id, None)  # ended before it was allocated
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # A decode request that ended before it was scheduled: nothing to
            # pull; its uses of the grants are released.
            params["do_remote_prefill"] = False
            self._release(request_id, params)
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if is_push(params):
            return self._push_finished(
                request_id,
                finished_normally=finished_normally,
                block_ids=block_ids,
                num_computed_tokens=num_computed_tokens,
            )
        if not finished_normally or not self.options.peer_address:
            if finished_normally:
                log.error("%s: no peer_address configured; not offering KV", ids(request_id))
            self._meta.not_processed.add(request_id)
            return False, None
        # Only the blocks a transfer needs are offered (and granted).
        groups = [list(g) for g in self.windows.clip(block_ids)]
        capability, open_grants, traceparent = self._traced_grant(request_id, groups, trace_headers)
        # Blocks nobody may pull are not kept.
        keep = bool(capability)
        if keep:
            self._meta.send[request_id] = self.options.lease_seconds
        else:
            self._meta.not_processed.add(request_id)
        offered = self._offered_params(request_id, groups, num_computed_tokens)
        offered.update(self._optional_params(capability, open_grants, traceparent))
        return keep, offered

    def _offered_params(
        self, request_id: str, groups: list[list[int]], num_computed_tokens: int
    ) -> dict[str, Any]:
        """The kv_transfer_params every offered (pull-mode) request returns."""
        host, port = host_port(self.options.peer_address, "peer_address")
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_block_ids": groups,
            "remote_target": self.options.peer_address,
            "remote_host": host,
            "remote_port": port,
            "remote_dp_rank": self.dp_rank,
            "remote_pp_rank": self.pp_rank,
            "tp_size": self.tp_size,
            "remote_num_tokens": num_computed_tokens,
            "kvmap_params_version": PARAMS_VERSION,
        }

    def _optional_params(
        self, capability: str, open_grants: bool, traceparent: str
    ) -> dict[str, Any]:
        """The kv_transfer_params keys offered only when they say something."""
        optional: dict[str, Any] = {}
        if self.decode_tp_size != self.tp_size:
            optional[READERS_TP_KEY] = self.decode_tp_size
        if open_grants:
            optional[OPEN_GRANTS_KEY] = True
        if self.block_size:
            optional["remote_block_size"] = self.block_size
        if capability:
            optional[CAPABILITY_KEY] = capability
        if traceparent:  # the grant's span, which the decode side's spans join
            optional[TRACEPARENT_KEY] = traceparent
        return optional

    def _traced_grant(
        self, request_id: str, groups: list[list[int]], trace_headers: Mapping[str, str] | None
    ) -> tuple[str, bool, str]:
        """``_grant`` (nothing when there are no blocks) under its span, which
        the grant calls carry to kvmapd: the capability, whether its grants
        are open, and the span's traceparent ("" when not traced)."""
        if not any(groups):
            return "", False, ""
        with grant_span(self.tracer, request_id, trace_headers) as span:
            use(span)
            try:
                capability, open_grants = self._grant(request_id, groups)
            finally:
                use(NULL_SPAN)
        traceparent = span.traceparent()
        if capability and traceparent:
            # The worker's span of freeing the kept blocks is the grant's child.
            self._meta.send_traces[request_id] = traceparent
        return capability, open_grants, traceparent

    def _rank_workers(self) -> list[types_pb2.WorkerId]:
        """This engine's workers that hold a request's blocks: one per
        tensor-parallel rank (read by ``readers[rank]`` decode ranks)."""
        return [
            types_pb2.WorkerId(
                engine_id=self.engine_id, dp_rank=self.dp_rank, tp_rank=r, pp_rank=self.pp_rank
            )
            for r in range(self.tp_size)
        ]

    def _grant(self, request_id: str, groups: list[list[int]]) -> tuple[str, bool]:
        """Grant a pull of exactly ``groups`` (block ids per transfer group)
        on every rank's worker for the lease's time: the capabilities joined
        in rank order, or "" (logged) when any grant fails; then the grants
        already made are revoked, since no one will be told of them. And
        whether every grant is open (a kvmapd that predates open grants
        makes each a one-use grant: decode engines of this TP size only).

        The capabilities are drawn here and granted off this thread
        (``connector.granter``): vLLM's scheduler thread does not wait on
        kvmapd. Once a kvmapd showed it predates caller capabilities, the
        grants are made here and waited for, under the capabilities it draws."""
        if self.client is None:
            log.error("%s: no kvmapd to grant the transfer; not offering KV", ids(request_id))
            return "", False
        ranks = self._rank_grants(groups)
        capabilities = [g.capability if g else UNREAD_CAPABILITY for g in ranks]
        if self._granter is None:
            self._granter = BackgroundGranter(self.client, max_age_s=self._grant_max_age_s)
        if not self._granter.older_kvmapd:
            self._granter.submit(request_id, [g for g in ranks if g], current())
            return ".".join(capabilities), self.open_grants
        granted: list[types_pb2.WorkerId] = []
        open_grants = self.open_grants
        try:
            for i, g in enumerate(ranks):
                if g is None:
                    continue
                grant = make_grant(self.client, request_id, g)
                granted.append(g.worker)
                # The older kvmapd drew its own capability.
                capabilities[i] = grant.capability
                open_grants &= grant.open_uses
        except KvmapError as err:
            current().fail(err.code.name, err.message)
            log.error(
                "%s: kvmapd did not grant the transfer (%s); not offering its KV",
                ids(request_id),
                err.message,
            )
            for worker in granted:
                revoke(self.client, worker, request_id)
            return "", False
        return ".".join(capabilities), open_grants

    def _rank_grants(self, groups: list[list[int]]) -> list[RankGrant | None]:
        """Each rank's grant of ``groups`` under a capability drawn here
        (None: no decode rank reads the rank, nothing to grant; its worker
        frees the blocks at once)."""
        blocks = {g: ids for g, ids in enumerate(groups) if ids}
        # A lease longer than kvmapd's longest grant: the grant ends first,
        # and the blocks wait unreadable until the lease frees them.
        ttl_ms = min(int(self.options.lease_seconds * 1000), MAX_GRANT_TTL_MS)
        return [
            RankGrant(
                worker=worker,
                capability=new_capability(),
                blocks=blocks,
                ttl_ms=ttl_ms,
                # Exactly as many completed pulls as decode ranks read this
                # rank (open: as the first decode rank declares): a replayed
                # capability beyond them is refused.
                max_uses=0 if self.open_grants else self.readers[worker.tp_rank],
                open_uses=self.open_grants,
                unread_release=self.unread_release[worker.tp_rank],
            )
            if self.readers[worker.tp_rank]
            else None
            for worker in self._rank_workers()
        ]
