"""The prefill/decode state machines of the vLLM connector, without vLLM.

``SchedulerCore`` runs in vLLM's scheduler (one per engine) and decides, per
request, what the workers must do; ``WorkerCore`` runs in each worker, keeps
the worker registered with its kvmapd (``WorkerSession``), runs the pulls
and reports what finished. ``kvmap.client.vllm_connector`` adapts vLLM's
objects to these; everything here takes plain ids, lists and dicts, so it is
tested against the in-memory transport without vLLM.

The contract is vLLM's NixlConnector's, so existing P/D proxies work:

prefill (``kv_transfer_params = {"do_remote_decode": true}``)
    the request runs as usual; when it finishes normally its blocks are kept
    (``request_finished`` returns ``delay_free=True``) and it returns
    ``kv_transfer_params`` naming this pod's kvmapd, the worker, the blocks
    and the request, and ``kvmap_capability``: what this pod's kvmapd granted
    (``Registry.GrantTransfer``) for exactly those blocks of that request,
    for ``lease_seconds``; without it no daemon lets a peer read them. The
    blocks are freed when this worker's kvmapd reports that the grant is used
    up (``TransferFinishedEvent.exhausted``: as many pulls, or releases, as
    decode ranks read this rank; the grants are open, and each decode rank
    declares that count, unless ``decode_tp_size`` fixes it), or when the
    lease runs out, whichever comes first; the grant is revoked when they are freed for any
    reason but a finished pull. A grant that fails frees the blocks at once
    and the params carry no capability (the decode side recomputes).
decode (those params, with ``do_remote_prefill: true``)
    the scheduler learns that the prompt's tokens will be loaded
    asynchronously; once blocks are allocated the worker asks its kvmapd to
    pull the remote blocks into them, presenting the capability, and reports
    the request as received when the pull is done. A decode rank that needs
    none of the blocks (its prefix cache holds them) releases its use of the
    grant instead, and decode rank 0 releases the grants of prefill ranks no
    decode rank reads, so the prefill side frees them at once. Params without a
    well-formed capability never become a pull. A pull that fails (or is
    never sent), or does not finish within
    ``transfer_timeout_s`` (plus a grace period), is reported as a failed
    load (a pull that broke because this pod's own kvmapd restarted under it
    is first issued again, with backoff, until that timeout): vLLM recomputes
    the prompt (``kv_load_failure_policy: recompute``) or fails the request
    (``fail``, vLLM's default), and never waits forever.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import queue
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvmap.client.client import KvmapClient, TransferResult
from kvmap.client.errors import KvmapClientError, NotFound, Unavailable
from kvmap.client.session import Backoff, WorkerSession
from kvmap.client.stats import TransferStatsBook
from kvmap.core.errors import SHUTTING_DOWN, KvmapError
from kvmap.core.grants import MAX_USES
from kvmap.core.reshard import rank_heads, source_ranks, source_readers
from kvmap.core.retry import RetryPolicy
from kvmap.v1 import registry_pb2, transfers_pb2, types_pb2

log = logging.getLogger("kvmap.client.pd")

# Version of the kv_transfer_params this connector writes and reads.
PARAMS_VERSION = 1
# A pull that has not ended this long after its own deadline is given up.
WATCHDOG_GRACE_S = 5.0
# The longest pause between two attempts of a pull that broke because this
# pod's kvmapd restarted under it.
PULL_RETRY_MAX_S = 1.0
# kv_transfer_params key of the capability(ies) the prefill side granted.
CAPABILITY_KEY = "kvmap_capability"
# kv_transfer_params key of the decode TP size the prefill side's grants
# (and its wait for pulls) were sized for; absent: the prefill's own TP size.
READERS_TP_KEY = "kvmap_decode_tp_size"
# kv_transfer_params mark of open grants (no decode TP size configured): each
# decode rank declares how many decode ranks read the prefill rank it pulls
# from, and the owner's kvmapd fixes each grant's use count from that.
OPEN_GRANTS_KEY = "kvmap_open_grants"
# The longest grant kvmapd gives (GrantTransferRequest.ttl_ms).
MAX_GRANT_TTL_MS = 3_600_000
# One capability per prefill tensor-parallel rank, in rank order, joined by
# ".": each is kvmapd's URL-safe token. The bounds keep a hostile HTTP body
# from making the connector carry (or log) anything big or odd.
# Stands in ``kvmap_capability`` for a prefill rank that no decode rank
# reads (so granted nothing); never a capability kvmapd issues.
UNREAD_CAPABILITY = "-"
_CAPABILITY = re.compile(r"[A-Za-z0-9_-]{1,128}(?:\.[A-Za-z0-9_-]{1,128})*")
MAX_CAPABILITY_CHARS = 8192

# kv_transfer_params mark of a prefill request whose prompt the connector
# cut short (private: the params a prefill request returns are built anew).
TRUNCATED_KEY = "_kvmap_prefill_truncated"

BlockIds = tuple[tuple[int, ...], ...]
# vLLM's null block: the placeholder its hybrid KV cache manager leaves where
# a sliding-window group holds no block (tokens that fell out of the window);
# it is shared by every request and never holds a request's KV.
NULL_BLOCK_ID = 0


def default_socket() -> str:
    """kvmapd's default socket: $XDG_RUNTIME_DIR/kvmap/kvmapd.sock, else
    /tmp/kvmap-<uid>/kvmapd.sock (as ``kvmapd serve`` without --socket)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "kvmap", "kvmapd.sock")
    return f"/tmp/kvmap-{os.getuid()}/kvmapd.sock"


def _host_port(value: str, key: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"kv_connector_extra_config.{key}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _typed(key: str, value: Any, default: object) -> Any:
    """``value`` as the type of the option's ``default``; a wrong type (a
    bool for a number, a fraction for an int) raises ``ValueError`` naming the key."""
    try:
        if isinstance(default, str):
            if not isinstance(value, str):
                raise TypeError
            return value
        if isinstance(value, bool):
            raise TypeError
        if isinstance(default, int) and not isinstance(default, bool):
            if int(value) != value:
                raise TypeError
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"kv_connector_extra_config.{key}: expected {type(default).__name__}, got {value!r}"
        ) from None


_POSITIVE_OPTIONS = (
    "transfer_timeout_s",
    "lease_seconds",
    "register_timeout_s",
    "call_timeout_s",
    "reconnect_initial_s",
    "reconnect_max_s",
    "max_parallel_pulls",
)


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` of the kvmap connector."""

    # kvmapd's Unix socket (its fd hand-off socket is "<socket>.fds").
    socket: str = field(default_factory=default_socket)
    # This pod's kvmapd TCP address as peers reach it ("$(POD_IP):50051");
    # required where the engine produces KV (kv_producer, kv_both).
    peer_address: str = ""
    # Deadline of one pull (handshake + post + completion), in seconds.
    transfer_timeout_s: float = 30.0
    # How long a prefill request's blocks wait for a pull before being freed.
    lease_seconds: float = 120.0
    # How long a worker waits for its kvmapd at start-up.
    register_timeout_s: float = 60.0
    # Deadline of the unary calls (register, deregister, stats).
    call_timeout_s: float = 10.0
    # Pulls a worker runs at once.
    max_parallel_pulls: int = 8
    # Reconnection backoff after the daemon went away.
    reconnect_initial_s: float = 0.1
    reconnect_max_s: float = 5.0
    # Tensor-parallel size of the decode engines that load this (prefill)
    # engine's KV; 0: any (open grants: each decode rank declares how many
    # decode ranks read a prefill rank, and kvmapd fixes the count from the
    # first). Set, each rank's grant admits exactly as many pulls as decode
    # ranks read from it, and decode engines of another size are refused.
    # Either way a rank's blocks are freed once its grant is used up (or
    # the lease ran out).
    decode_tp_size: int = 0

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, *, producer: bool = False
    ) -> ConnectorOptions:
        """Parse and check; unknown keys and wrong types raise ``ValueError``
        naming the key."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown keys {unknown} for the kvmap connector "
                f"(known: {sorted(known)})"
            )
        defaults = cls()
        values = {key: _typed(key, value, getattr(defaults, key)) for key, value in extra.items()}
        opts = cls(**values)
        opts._check(producer)
        return opts

    def _check(self, producer: bool) -> None:
        """Ranges and required keys, once the types are right."""
        for key in _POSITIVE_OPTIONS:
            if getattr(self, key) <= 0:
                raise ValueError(f"kv_connector_extra_config.{key}: must be positive")
        if not self.socket:
            raise ValueError("kv_connector_extra_config.socket: must not be empty")
        if not 0 <= self.decode_tp_size <= MAX_USES:
            raise ValueError(
                f"kv_connector_extra_config.decode_tp_size: must be in [0, {MAX_USES}]"
            )
        if self.peer_address:
            _host_port(self.peer_address, "peer_address")
        elif producer:
            raise ValueError(
                "kv_connector_extra_config.peer_address: required on engines that produce KV "
                "(kv_producer, kv_both): this pod's kvmapd TCP address, e.g. $(POD_IP):50051"
            )
        Backoff(self.reconnect_initial_s, max(self.reconnect_max_s, self.reconnect_initial_s))

    @property
    def backoff(self) -> Backoff:
        return Backoff(
            self.reconnect_initial_s, max(self.reconnect_max_s, self.reconnect_initial_s)
        )


@dataclass(frozen=True)
class RemoteSource:
    """Where a decode request's prompt KV is: parsed ``kv_transfer_params``."""

    target: str
    engine_id: str
    request_id: str
    block_ids: BlockIds
    dp_rank: int = 0
    pp_rank: int = 0
    tp_size: int = 1
    num_tokens: int = 0
    # As received; checked (``rank_capability``) before any pull is built.
    capability: str = ""
    # The prefill engine's block size in tokens; 0 from engines that do not
    # say (then it must be this engine's).
    block_size: int = 0
    # The decode TP size the prefill side's grants were sized for (0: its own).
    readers_tp_size: int = 0
    # The prefill side's grants are open (any decode TP size declares its own).
    open_grants: bool = False

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> RemoteSource:
        def need(key: str, kind: type) -> Any:
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool) or value == "":
                raise ValueError(f"kv_transfer_params.{key}: missing or not a {kind.__name__}")
            return value

        target = need("remote_target", str)
        _host_port(target, "remote_target")
        raw = params.get("remote_block_ids")
        if not isinstance(raw, list | tuple) or not raw:
            raise ValueError("kv_transfer_params.remote_block_ids: missing or empty")
        groups = raw if isinstance(raw[0], list | tuple) else [raw]
        try:
            block_ids = tuple(tuple(int(b) for b in g) for g in groups)
        except (TypeError, ValueError):
            raise ValueError("kv_transfer_params.remote_block_ids: not lists of ints") from None
        return cls(
            target=target,
            engine_id=need("remote_engine_id", str),
            request_id=need("remote_request_id", str),
            block_ids=block_ids,
            dp_rank=int(params.get("remote_dp_rank", 0)),
            pp_rank=int(params.get("remote_pp_rank", 0)),
            tp_size=int(params.get("tp_size", 1)),
            num_tokens=int(params.get("remote_num_tokens", 0)),
            capability=_capability_text(params.get(CAPABILITY_KEY)),
            block_size=int(params.get("remote_block_size", 0)),
            readers_tp_size=int(params.get(READERS_TP_KEY, 0)),
            open_grants=params.get(OPEN_GRANTS_KEY) is True,
        )


def _capability_text(value: Any) -> str:
    """The capability as received, "" when it is not a string (a bounded
    prefix of an over-long one, enough for ``rank_capability`` to refuse it)."""
    if not isinstance(value, str):
        return ""
    return value[: MAX_CAPABILITY_CHARS + 1]


def rank_capability(capability: str, tp_size: int, tp_rank: int) -> str:
    """The capability of prefill rank ``tp_rank`` in ``kvmap_capability``
    (one per rank of ``tp_size``, joined by "."). Raises ``ValueError`` when
    it is missing or malformed: such params never become a pull."""
    key = f"kv_transfer_params.{CAPABILITY_KEY}"
    if not capability:
        raise ValueError(f"{key}: missing (the prefill side granted no transfer)")
    if len(capability) > MAX_CAPABILITY_CHARS or not _CAPABILITY.fullmatch(capability):
        raise ValueError(f"{key}: malformed")
    parts = capability.split(".")
    if len(parts) != tp_size or not 0 <= tp_rank < tp_size:
        raise ValueError(f"{key}: {len(parts)} capabilities for tensor-parallel size {tp_size}")
    if parts[tp_rank] == UNREAD_CAPABILITY:
        raise ValueError(f"{key}: prefill rank {tp_rank} granted no transfer")
    return parts[tp_rank]


def tp_readers(
    kv_heads: int, src_tp: int, dst_tp: int, *, replicated: bool = False
) -> tuple[int, ...]:
    """Per source (prefill) rank, how many destination (decode) ranks read
    from it (``reshard.source_ranks``): what its grant admits and how many
    finished pulls free its blocks. Equal sizes need no head count: rank r
    reads rank r; nor a replicated (MLA, indexer) cache, where a rank may
    count 0. Raises ``ValueError`` for sizes the heads do not split over, and
    where a head-split source rank would be read by no one (its blocks would
    wait for the lease)."""
    if src_tp == dst_tp:
        return (1,) * src_tp
    if replicated:
        # MLA and indexer caches are whole on every rank: decode rank d reads
        # all of it from one prefill rank; a rank no one reads counts 0 (it
        # is granted nothing and frees its blocks at once).
        return _replicated_readers(src_tp, dst_tp)
    if kv_heads <= 0:
        raise ValueError(
            f"tensor-parallel sizes {src_tp} -> {dst_tp} need the model's KV head count"
        )
    counts = [0] * src_tp
    try:
        for r in range(dst_tp):
            for p, _ in source_ranks(kv_heads, src_tp, dst_tp, r, replicated=replicated):
                counts[p] += 1
    except KvmapError as err:
        raise ValueError(str(err)) from None
    if 0 in counts:
        raise ValueError(
            f"with {kv_heads} KV heads, prefill rank {counts.index(0)} of tensor-parallel size "
            f"{src_tp} holds no heads a decode rank of size {dst_tp} reads"
        )
    return tuple(counts)


def _replicated_readers(src_tp: int, dst_tp: int) -> tuple[int, ...]:
    counts = [0] * src_tp
    try:
        for r in range(dst_tp):
            for p, _ in source_ranks(0, src_tp, dst_tp, r, replicated=True):
                counts[p] += 1
    except KvmapError as err:
        raise ValueError(str(err)) from None
    return tuple(counts)


@dataclass(frozen=True)
class GroupWindows:
    """How many trailing blocks of each transfer group a transfer needs, in
    transfer-group order: 0 for a group that needs all of them (full
    attention). Empty (the default): no group is windowed.

    With vLLM's hybrid KV cache manager a sliding-window group's block list
    spans the whole sequence, the blocks that fell out of the window being
    the null block; only the last ``cdiv(window, block_size) + 1`` blocks can
    hold KV the window reads (the extra one because the window need not start
    on a block boundary), as NixlConnector clips them.

    ``states`` marks the state groups (Mamba / linear attention), whose
    blocks hold a recurrent state rather than tokens: per transfer group the
    speculative scratch slots vLLM allocates after the running-state slot,
    None for a token group (empty: no state group). A transfer moves only
    the running-state slot, as NixlConnector does."""

    blocks: tuple[int, ...] = ()
    states: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if any(n < 0 for n in self.blocks):
            raise ValueError(f"negative window in {self.blocks}")
        if self.states and len(self.states) != len(self.blocks):
            raise ValueError(f"{len(self.states)} state marks for {len(self.blocks)} groups")
        if any(n is not None and n < 0 for n in self.states):
            raise ValueError(f"negative scratch slots in {self.states}")

    @classmethod
    def from_windows(
        cls, windows: Sequence[tuple[int, int]], states: Sequence[int | None] = ()
    ) -> GroupWindows:
        """From (sliding window in tokens or 0, block size in tokens) per
        group, and the state groups' scratch slots (see ``states``)."""
        out = []
        for window, block_size in windows:
            if window < 0 or block_size <= 0:
                raise ValueError(f"bad window {window} / block size {block_size}")
            out.append(-(-window // block_size) + 1 if window else 0)
        return cls(tuple(out), tuple(states) if any(n is not None for n in states) else ())

    @property
    def windowed(self) -> bool:
        return any(self.blocks)

    @property
    def has_state(self) -> bool:
        """Whether some group holds recurrent state (Mamba)."""
        return bool(self.states)

    def clip(self, block_ids: Sequence[Sequence[int]]) -> BlockIds:
        """The blocks a transfer moves: each windowed group's last blocks,
        each state group's running-state slot; with the hybrid manager's
        lists (``blocks`` given) every group without its leading null
        blocks. Unchanged when ``blocks`` is empty. Raises ``ValueError``
        when the number of groups differs."""
        groups = tuple(tuple(int(b) for b in g) for g in block_ids)
        if not self.blocks or not groups:
            return groups
        if len(groups) != len(self.blocks):
            raise ValueError(f"{len(groups)} KV cache groups, {len(self.blocks)} known")
        states = self.states or (None,) * len(groups)
        return tuple(
            _state_slot(g, s) if s is not None else _strip_null(g[-n:] if n else g)
            for g, n, s in zip(groups, self.blocks, states, strict=True)
        )

    def fit(self, local: BlockIds, remote: BlockIds) -> BlockIds:
        """``local`` with each windowed group cut to at most as many (last)
        blocks as the remote group has: a local block before the remote
        window is out of the window (nothing to load into it). Full groups
        are left for ``pair_blocks`` to check."""
        if not self.windowed or len(local) != len(remote) or len(local) != len(self.blocks):
            return local
        return tuple(
            lg[len(lg) - len(rg) :] if n and len(lg) > len(rg) else lg
            for lg, rg, n in zip(local, remote, self.blocks, strict=True)
        )


def _state_slot(ids: tuple[int, ...], scratch: int) -> tuple[int, ...]:
    """A state group's running-state slot: the last block before its
    speculative scratch slots (vLLM's ``clip_ssm_state_blocks``); what comes
    before it is null or a superseded state."""
    if not ids:
        return ids
    kept = ids[: len(ids) - min(scratch, len(ids) - 1)]
    return kept[-1:]


def _strip_null(ids: tuple[int, ...]) -> tuple[int, ...]:
    start = 0
    while start < len(ids) and ids[start] == NULL_BLOCK_ID:
        start += 1
    return ids[start:]


@dataclass(frozen=True)
class RecvTask:
    """A decode request whose prompt KV the worker must pull."""

    request_id: str
    source: RemoteSource
    local_block_ids: BlockIds


@dataclass
class ConnectorMeta:
    """What the scheduler tells its workers for one step."""

    recv: list[RecvTask] = field(default_factory=list)
    # Prefill requests whose blocks now wait for a pull: lease seconds each.
    send: dict[str, float] = field(default_factory=dict)
    # Prefill requests scheduled this step (a pull may finish before their
    # lease starts); and requests that will not be sent (aborted).
    in_batch: set[str] = field(default_factory=set)
    not_processed: set[str] = field(default_factory=set)
    # Decode requests that load none of the remote blocks (all in the local
    # prefix cache, or ended before they were scheduled): each worker
    # releases its use of the prefill side's grants.
    release: list[RecvTask] = field(default_factory=list)


class SchedulerCore:
    def __init__(
        self,
        engine_id: str,
        options: ConnectorOptions,
        *,
        dp_rank: int = 0,
        pp_rank: int = 0,
        tp_size: int = 1,
        client: KvmapClient | None = None,
        windows: GroupWindows = GroupWindows(),
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
        # Offered with the KV, so a decode engine of another block size can
        # map the two block grids (0: not said).
        self.block_size = block_size
        # Sliding-window groups: only their last blocks are offered and loaded.
        self.windows = windows
        # This pod's kvmapd, which grants the transfers of kept blocks; None
        # on engines that only consume KV (they keep nothing).
        self.client = client
        self._meta = ConnectorMeta()

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
            RemoteSource.parse(params)
        except ValueError as err:
            log.warning("request %s: not loading remote KV: %s", request_id, err)
            return 0, False
        count = self.loaded_tokens(num_prompt_tokens) - num_computed_tokens
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
    ) -> None:
        """Blocks were allocated for the request (``update_state_after_alloc``)."""
        if not params:
            return
        if params.get("do_remote_decode"):
            self._meta.in_batch.add(request_id)
            return
        if not params.get("do_remote_prefill"):
            return
        if num_external_tokens > 0:
            try:
                source = RemoteSource.parse(params)
            except ValueError as err:  # num_new_matched_tokens said 0 already
                log.warning("request %s: not loading remote KV: %s", request_id, err)
            else:
                local = self._local_blocks(local_block_ids, source)
                self._meta.recv.append(RecvTask(request_id, source, local))
        else:
            self._release(request_id, params)
        # One transfer per request, even when vLLM calls this again.
        params["do_remote_prefill"] = False

    def _release(self, request_id: str, params: Mapping[str, Any]) -> None:
        """The workers release this decode request's uses of the prefill
        side's grants (it loads none of the blocks), so the prefill side
        frees them now rather than when its lease runs out."""
        try:
            source = RemoteSource.parse(params)
        except ValueError:
            return  # never a pull either: nothing to release
        if source.capability:
            self._meta.release.append(RecvTask(request_id, source, ()))

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
        meta, self._meta = self._meta, ConnectorMeta()
        return meta

    def request_finished(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        *,
        finished_normally: bool,
        block_ids: Sequence[Sequence[int]],
        num_computed_tokens: int,
    ) -> tuple[bool, dict[str, Any] | None]:
        """(keep the blocks for a pull?, kv_transfer_params for the client)."""
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
        if not finished_normally or not self.options.peer_address:
            if finished_normally:
                log.error("request %s: no peer_address configured; not offering KV", request_id)
            self._meta.not_processed.add(request_id)
            return False, None
        # Only the blocks a transfer needs are offered (and granted).
        groups = [list(g) for g in self.windows.clip(block_ids)]
        capability, open_grants = self._grant(request_id, groups) if any(groups) else ("", False)
        # Blocks nobody may pull are not kept.
        keep = bool(capability)
        if keep:
            self._meta.send[request_id] = self.options.lease_seconds
        else:
            self._meta.not_processed.add(request_id)
        host, port = _host_port(self.options.peer_address, "peer_address")
        offered: dict[str, Any] = {
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
        if self.decode_tp_size != self.tp_size:
            offered[READERS_TP_KEY] = self.decode_tp_size
        if open_grants:
            offered[OPEN_GRANTS_KEY] = True
        if self.block_size:
            offered["remote_block_size"] = self.block_size
        if capability:
            offered[CAPABILITY_KEY] = capability
        return keep, offered

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
        makes each a one-use grant: decode engines of this TP size only)."""
        if self.client is None:
            log.error("request %s: no kvmapd to grant the transfer; not offering KV", request_id)
            return "", False
        blocks = {g: ids for g, ids in enumerate(groups) if ids}
        # A lease longer than kvmapd's longest grant: the grant ends first,
        # and the blocks wait unreadable until the lease frees them.
        ttl_ms = min(int(self.options.lease_seconds * 1000), MAX_GRANT_TTL_MS)
        granted: list[types_pb2.WorkerId] = []
        capabilities: list[str] = []
        open_grants = self.open_grants
        try:
            for worker in self._rank_workers():
                if not self.readers[worker.tp_rank]:
                    # No decode rank reads this rank (a replicated cache
                    # read from fewer ranks): nothing to grant; its worker
                    # frees the blocks at once.
                    capabilities.append(UNREAD_CAPABILITY)
                    continue
                # Exactly as many completed pulls as decode ranks read this
                # rank (open: as the first decode rank declares): a replayed
                # capability beyond them is refused.
                grant = self.client.grant_transfer(
                    worker,
                    request_id,
                    blocks,
                    ttl_ms=ttl_ms,
                    max_uses=0 if self.open_grants else self.readers[worker.tp_rank],
                    open_uses=self.open_grants,
                )
                granted.append(worker)
                capabilities.append(grant.capability)
                open_grants &= grant.open_uses
        except KvmapClientError as err:
            log.error(
                "request %s: kvmapd did not grant the transfer (%s); not offering its KV",
                request_id,
                err.message,
            )
            for worker in granted:
                _revoke(self.client, worker, request_id)
            return "", False
        return ".".join(capabilities), open_grants


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


def pair_blocks(local: BlockIds, remote: BlockIds) -> tuple[BlockIds, BlockIds]:
    """Pair local and remote blocks group by group. The local side may hold
    fewer (its prefix cache has the leading ones): the remote list is trimmed
    from the front, as NIXL does. Raises ``ValueError`` when they cannot pair."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local KV cache groups, {len(remote)} remote")
    out_local, out_remote = [], []
    for g, (lg, rg) in enumerate(zip(local, remote, strict=True)):
        if len(lg) > len(rg):
            raise ValueError(f"group {g}: {len(lg)} local blocks for {len(rg)} remote blocks")
        out_local.append(tuple(lg))
        out_remote.append(tuple(rg[len(rg) - len(lg) :]) if lg else ())
    return tuple(out_local), tuple(out_remote)


def map_token_ranges(
    local: BlockIds,
    remote: BlockIds,
    *,
    num_tokens: int,
    local_tokens: int,
    remote_tokens: int,
) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """Token-mode groups (local blocks, remote blocks, tokens to move, the
    remote side's first token) between engines of different block sizes,
    for a ``num_tokens`` prompt.

    Each list holds a group's trailing blocks (the leading ones are in the
    local prefix cache, or out of a sliding window): they start where the
    blocks that would hold the prompt run out. Both lists are cut to the
    later of the two starts. A start inside a remote block (a local prefix
    hit ending inside a larger prefill block) keeps that block and reads from
    that token on (``GroupBlocks.remote_first_token``); a start inside a
    local block cannot be loaded into whole blocks and raises ``ValueError``
    (the request is recomputed), as do block lists that cannot end with the
    prompt."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local KV cache groups, {len(remote)} remote")
    if num_tokens <= 0:
        raise ValueError("kv_transfer_params.remote_num_tokens: needed when block sizes differ")
    out: list[tuple[tuple[int, ...], tuple[int, ...], int, int]] = []
    for g, (lg, rg) in enumerate(zip(local, remote, strict=True)):
        if not lg:
            out.append(((), (), 0, 0))
            continue
        l0 = (-(-num_tokens // local_tokens) - len(lg)) * local_tokens
        r0 = (-(-num_tokens // remote_tokens) - len(rg)) * remote_tokens
        if l0 < 0 or r0 < 0:
            raise ValueError(
                f"group {g}: {len(lg)} local blocks of {local_tokens} tokens and {len(rg)} "
                f"remote blocks of {remote_tokens} do not end with a {num_tokens}-token prompt"
            )
        start = max(l0, r0)
        if (start - l0) % local_tokens:
            raise ValueError(
                f"group {g}: the KV to load starts at token {start}, inside a local block "
                f"of {local_tokens} tokens"
            )
        skip, first = divmod(start - r0, remote_tokens)
        lcut, rcut = lg[(start - l0) // local_tokens :], rg[skip:]
        out.append((tuple(lcut), tuple(rcut), num_tokens - start, first))
    return out


def _pulled_remote_blocks(load: _Load) -> BlockIds:
    """The remote blocks a successful load read, per group."""
    spec = load.spec
    if spec is not None and any(g.num_tokens for g in spec.groups):
        by_group = {g.transfer_group: tuple(g.remote_block_ids) for g in spec.groups}
        return tuple(by_group.get(g, ()) for g in range(len(load.task.source.block_ids)))
    return pair_blocks(load.task.local_block_ids, load.task.source.block_ids)[1]


class WorkerCore:
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
        # The model's KV heads and whether the cache is replicated (MLA):
        # which prefill ranks hold this rank's heads when TP sizes differ.
        self.kv_heads = kv_heads
        self.replicated = replicated
        # Finished pulls that free a prefill request's blocks on this rank.
        self.send_readers = tp_readers(
            kv_heads, tp_size, options.decode_tp_size or tp_size, replicated=replicated
        )[worker.tp_rank]
        self.clock = clock
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
        self._to_process: set[str] = set()
        self._send_deadline: dict[str, float] = {}
        # Pulls finished so far of prefill requests read by several ranks.
        self._send_pulls: dict[str, int] = {}
        # Kept requests of a rank no decode rank reads, freed at the next poll.
        self._unread_sends: set[str] = set()
        self._load_errors: set[int] = set()

    # Registration ---------------------------------------------------------

    def register(
        self, request: registry_pb2.RegisterWorkerRequest, fds: Sequence[int]
    ) -> types_pb2.RegionMap:
        self.session = WorkerSession(
            self.client, request, fds, on_event=self.on_event, backoff=self.options.backoff
        )
        return self.session.start(self.options.register_timeout_s)

    def on_event(self, event: registry_pb2.AttachResponse) -> None:
        """Attach events (on the session's thread)."""
        if event.WhichOneof("event") != "transfer_finished":
            return
        done = event.transfer_finished
        if done.direction == registry_pb2.TRANSFER_DIRECTION_PULLED_FROM:
            self._events.put((done.request_id, done.exhausted if done.max_uses else None))

    # Steps ----------------------------------------------------------------

    def start(self, meta: ConnectorMeta) -> None:
        """Start this step's loads and track this step's sends."""
        now = self.clock()
        for task in meta.recv:
            self._submit(task, now)
        for task in meta.release:
            self._submit_release(task)
        self._to_process |= meta.in_batch
        for request_id in meta.not_processed:
            self._to_process.discard(request_id)
            self._send_pulls.pop(request_id, None)
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

    def specs_for(self, task: RecvTask) -> list[transfers_pb2.TransferSpec]:
        """The pulls of one load: one from each prefill rank holding some of
        this rank's heads (``reshard.source_ranks``); one, from the same
        rank, between equal TP sizes. Raises ``ValueError`` for params that
        must not become a pull."""
        src = task.source
        self._check_readers_tp(src)
        if src.tp_size == self.tp_size:
            return [self._spec(task, self.worker.tp_rank, token_mode=False)]
        if self.replicated:
            # Every prefill rank holds the whole cache: read it from one
            # (``reshard.source_ranks`` spreads decode ranks over them), by
            # blocks (by tokens where the block sizes differ).
            ((rank, _),) = source_ranks(
                0, src.tp_size, self.tp_size, self.worker.tp_rank, replicated=True
            )
            return [self._spec(task, rank, token_mode=False)]
        if not self.block_size:
            raise ValueError("tensor-parallel sizes differ: this engine's block size is needed")
        if self.kv_heads <= 0:
            raise ValueError(
                "tensor-parallel sizes differ: the model's KV head count is needed "
                "(a model mixing MLA with head-split layers needs equal TP sizes)"
            )
        try:
            rank_heads(self.kv_heads, src.tp_size, 0)  # the heads split over it
            pulls = source_ranks(
                self.kv_heads,
                src.tp_size,
                self.tp_size,
                self.worker.tp_rank,
                replicated=self.replicated,
            )
        except KvmapError as err:
            raise ValueError(str(err)) from None
        # Token mode: kvmapd moves the heads both ranks hold (their published
        # head layouts), each source rank's once.
        return [self._spec(task, rank, token_mode=True) for rank, _ in pulls]

    @property
    def daemon_features(self) -> frozenset[int]:
        """What this rank's kvmapd listed when the worker last registered."""
        return self.session.features if self.session is not None else frozenset()

    def _check_readers_tp(self, src: RemoteSource) -> None:
        """Refuse params whose grants were sized for another decode TP size
        (open grants fit any), and a TP size that is none."""
        if not 1 <= src.tp_size <= MAX_USES:
            # Hostile or broken params: never a division by zero further on.
            raise ValueError(f"kv_transfer_params.tp_size: {src.tp_size} is not a TP size")
        if not src.open_grants and (src.readers_tp_size or src.tp_size) != self.tp_size:
            # The prefill side waits for as many pulls as it was told decode
            # ranks: another count would hold its blocks until the lease.
            raise ValueError(
                f"the prefill engine expects decode engines of tensor-parallel size "
                f"{src.readers_tp_size or src.tp_size}, this one runs {self.tp_size}"
            )

    def readers_of(self, src: RemoteSource) -> tuple[int, ...]:
        """Per prefill rank, how many ranks of this (decode) engine read it
        (``reshard.source_readers``): what each pull declares, and 0 for a
        rank no one reads. Raises ``ValueError`` for sizes the heads do not
        split over."""
        self._check_readers_tp(src)
        if src.tp_size != self.tp_size and not (self.kv_heads > 0 or self.replicated):
            raise ValueError(
                "tensor-parallel sizes differ: the model's KV head count is needed "
                "(a model mixing MLA with head-split layers needs equal TP sizes)"
            )
        try:
            return source_readers(
                self.kv_heads, src.tp_size, self.tp_size, replicated=self.replicated
            )
        except KvmapError as err:
            raise ValueError(str(err)) from None

    def _spec(
        self, task: RecvTask, src_rank: int, *, token_mode: bool
    ) -> transfers_pb2.TransferSpec:
        """The pull from prefill rank ``src_rank``."""
        src = task.source
        remote_tokens = src.block_size or self.block_size
        if token_mode or (src.block_size and self.block_size and src.block_size != self.block_size):
            # Token mode: kvmapd maps each token's bytes between the block
            # grids with the head layouts both workers published.
            token_ranges = map_token_ranges(
                task.local_block_ids,
                src.block_ids,
                num_tokens=src.num_tokens,
                local_tokens=self.block_size,
                remote_tokens=remote_tokens,
            )
        else:
            local, remote = pair_blocks(task.local_block_ids, src.block_ids)
            token_ranges = [(lg, rg, 0, 0) for lg, rg in zip(local, remote, strict=True)]
        spec = self._spec_to(src, src_rank, self.readers_of(src)[src_rank])
        for g, (lg, rg, n, first) in enumerate(token_ranges):
            if lg:
                spec.groups.add(
                    transfer_group=g,
                    local_block_ids=lg,
                    remote_block_ids=rg,
                    num_tokens=n,
                    remote_first_token=first,
                )
        if not spec.groups:
            raise ValueError("no blocks to load")
        missing = missing_feature(spec, self.daemon_features)
        if missing:
            # An older kvmapd would drop the field and move the wrong bytes.
            raise ValueError(f"this pull needs {missing}, which the local kvmapd does not list")
        return spec

    def release_specs(self, task: RecvTask, *, pulling: bool) -> list[transfers_pb2.TransferSpec]:
        """The releases this rank sends for ``task``: its own uses of the
        prefill ranks it would read, unless it is ``pulling`` them; and, on
        rank 0 with open grants, the grants of the prefill ranks no decode
        rank reads (declaring 0 readers). Raises ``ValueError`` for params
        that must not become a pull."""
        src = task.source
        readers = self.readers_of(src)
        ranks: list[tuple[int, int]] = []
        if not pulling:
            ranks = [(rank, readers[rank]) for rank in self._source_ranks(src)]
        if src.open_grants and self.worker.tp_rank == 0:
            ranks += [(rank, 0) for rank, n in enumerate(readers) if n == 0]
        return [self._release_spec(src, rank, n) for rank, n in ranks]

    def _source_ranks(self, src: RemoteSource) -> list[int]:
        """The prefill ranks this rank pulls from."""
        if src.tp_size == self.tp_size:
            return [self.worker.tp_rank]
        try:
            return [
                rank
                for rank, _ in source_ranks(
                    self.kv_heads,
                    src.tp_size,
                    self.tp_size,
                    self.worker.tp_rank,
                    replicated=self.replicated,
                )
            ]
        except KvmapError as err:
            raise ValueError(str(err)) from None

    def _spec_to(
        self, src: RemoteSource, src_rank: int, readers: int
    ) -> transfers_pb2.TransferSpec:
        """A transfer (no groups yet) of ``src``'s request with prefill rank
        ``src_rank``, under that rank's capability, declaring ``readers``."""
        return transfers_pb2.TransferSpec(
            request_id=src.request_id,
            local_worker=self.worker,
            remote_target=src.target,
            remote_worker=types_pb2.WorkerId(
                engine_id=src.engine_id,
                dp_rank=src.dp_rank,
                tp_rank=src_rank,
                pp_rank=src.pp_rank,
            ),
            timeout_ms=int(self.options.transfer_timeout_s * 1000),
            capability=rank_capability(src.capability, src.tp_size, src_rank),
            readers=readers,
        )

    def _release_spec(
        self, src: RemoteSource, src_rank: int, readers: int
    ) -> transfers_pb2.TransferSpec:
        spec = self._spec_to(src, src_rank, readers)
        spec.release = True
        return spec

    def _submit_release(self, task: RecvTask, *, pulling: bool = False) -> None:
        """Send ``task``'s releases (``release_specs``) in the background:
        best effort, since the prefill side's lease frees the blocks anyway."""
        if registry_pb2.DAEMON_FEATURE_RELEASE not in self.daemon_features:
            # An older kvmapd would take the release for a pull of nothing.
            return
        try:
            specs = self.release_specs(task, pulling=pulling)
        except ValueError as err:
            log.info("request %s: not releasing remote KV: %s", task.request_id, err)
            return
        for spec in specs:
            self._pool.submit(self._release, spec)

    def _release(self, spec: transfers_pb2.TransferSpec) -> None:
        try:
            self.client.pull(spec, timeout_s=spec.timeout_ms / 1000 + 2.0)
            self.released += 1
        except KvmapClientError as err:
            log.info(
                "request %s: releasing prefill rank %d's grant failed: %s",
                spec.request_id,
                spec.remote_worker.tp_rank,
                err.message,
            )

    def _submit(self, task: RecvTask, now: float) -> None:
        deadline = now + self.options.transfer_timeout_s + WATCHDOG_GRACE_S
        try:
            specs = self.specs_for(task)
        except ValueError as err:
            log.warning("request %s: cannot load remote KV: %s", task.request_id, err)
            self._loading[task.request_id] = _Load(task, None, None, now, deadline, str(err))
            return
        # Prefill ranks no decode rank reads: their blocks are freed now.
        self._submit_release(task, pulling=True)
        until = now + self.options.transfer_timeout_s
        if len(specs) == 1:
            future = self._pool.submit(self._pull, specs[0], until)
        else:
            future = self._pool.submit(self._pull_all, specs, until)
        self._loading[task.request_id] = _Load(task, specs[0], future, now, deadline)

    def _pull_all(
        self, specs: Sequence[transfers_pb2.TransferSpec], deadline: float
    ) -> TransferResult:
        """The pulls of one load from several prefill ranks, one after the
        other within the load's deadline; the first failure fails the load."""
        results = []
        for spec in specs:
            results.append(self._pull(_with_timeout(spec, deadline - self.clock()), deadline))
        return TransferResult(
            descriptors=sum(r.descriptors for r in results),
            bytes=sum(r.bytes for r in results),
            post_seconds=sum(r.post_seconds for r in results),
            completion_seconds=sum(r.completion_seconds for r in results),
            remote_generation=results[-1].remote_generation,
            handshaked=any(r.handshaked for r in results),
        )

    def _pull(self, spec: transfers_pb2.TransferSpec, deadline: float) -> TransferResult:
        """Pull; a pull that broke because this pod's kvmapd restarted under
        it is issued again (same capability: the owner's grant outlives a
        failed attempt) after a backoff, while ``deadline`` allows."""
        opts = self.options
        # Asking this pod's own kvmapd again is cheap, and every second of
        # pause past its return is latency the request pays: a short cap.
        initial = min(opts.reconnect_initial_s, PULL_RETRY_MAX_S)
        policy = RetryPolicy(initial, max(min(opts.reconnect_max_s, PULL_RETRY_MAX_S), initial))
        attempt = 0
        while True:
            before = self._daemon_instance()
            try:
                # The gRPC deadline sits a little past the daemon's own deadline.
                timeout_s = spec.timeout_ms / 1000 + 2.0
                return self.client.pull(spec, timeout_s=timeout_s)
            except KvmapClientError as err:
                remaining = deadline - self.clock()
                pause = None
                if self._local_daemon_restarted(err, before):
                    pause = policy.next_delay(attempt, random.random(), remaining)
                if pause is None:
                    raise
                log.info(
                    "request %s: pull broke as kvmapd restarted (%s); again in %.2fs",
                    spec.request_id,
                    err.message,
                    pause,
                )
            time.sleep(pause)
            attempt += 1
            # The daemon's deadline is what is left of the load's.
            spec = _with_timeout(spec, deadline - self.clock())

    def _daemon_instance(self) -> str:
        """The kvmapd instance this worker is attached to ("" before any)."""
        return self.session.daemon_instance if self.session is not None else ""

    def _local_daemon_restarted(self, err: KvmapClientError, before: str) -> bool:
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
        except KvmapClientError:
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
        return TransferResults(sending, recving, failed)

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
                "request %s: no pull within the %ss lease; freeing its blocks",
                request_id,
                self.options.lease_seconds,
            )
            del self._send_deadline[request_id]
            self._to_process.discard(request_id)
            self._send_pulls.pop(request_id, None)
            _revoke(self.client, self.worker, request_id)
            self.leases_expired += 1
            self.stats.record_kv_expired_req()
            expired.add(request_id)
        return expired

    def _outcome(self, load: _Load, now: float) -> tuple[str, int] | None:
        """(error or "", bytes) of a load that ended, None while it runs;
        an ended load is counted in ``stats``."""
        if load.future is None:
            self.stats.record_failed_transfer("INVALID_PARAMS")
            return load.error, 0
        if load.future.done():
            exc = load.future.exception()
            if exc is not None:
                code = exc.code.name if isinstance(exc, KvmapClientError) else "UNKNOWN"
                self.stats.record_failed_transfer(code)
                return _describe(exc), 0
            result = load.future.result()
            self.stats.record_transfer(result)
            return "", result.bytes
        if now >= load.deadline:
            load.future.cancel()
            self.stats.record_failed_transfer("DEADLINE_EXCEEDED")
            return (
                f"no answer from kvmapd within {self.options.transfer_timeout_s}s "
                f"+ {WATCHDOG_GRACE_S}s"
            ), 0
        return None

    def _finish_load(self, load: _Load, error: str, nbytes: int, now: float) -> None:
        """Log and keep a record of an ended load; note a failed one's blocks."""
        local, remote = load.task.local_block_ids, load.task.source.block_ids
        if error:
            log.warning(
                "request %s: loading its KV from %s failed (%s); reported as a load failure",
                load.task.request_id,
                load.task.source.target,
                error,
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
        return len(self._loading)

    @property
    def pending_sends(self) -> int:
        return len(self._to_process)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.session is not None:
            self.session.stop(deregister=True, timeout_s=self.options.call_timeout_s)
        self.client.close()


def missing_feature(spec: transfers_pb2.TransferSpec, features: frozenset[int]) -> str:
    """The first field of ``spec`` in use that a daemon listing ``features``
    (``RegisterWorkerResponse.features``) does not understand, or ''."""
    needs = [
        (any(g.num_tokens for g in spec.groups), registry_pb2.DAEMON_FEATURE_TOKEN_MODE),
        (
            any(g.remote_first_token for g in spec.groups),
            registry_pb2.DAEMON_FEATURE_REMOTE_FIRST_TOKEN,
        ),
        # One reader is what a claim declaring none fixes an open grant at.
        (spec.readers > 1, registry_pb2.DAEMON_FEATURE_OPEN_GRANTS),
        (spec.release, registry_pb2.DAEMON_FEATURE_RELEASE),
    ]
    for used, feature in needs:
        if used and feature not in features:
            return registry_pb2.DaemonFeature.Name(feature)
    return ""


def _revoke(client: KvmapClient, worker: types_pb2.WorkerId, request_id: str) -> None:
    """Take back the grants of ``request_id`` on ``worker`` (its blocks are
    being freed): best effort, since a grant also ends with its time."""
    try:
        client.revoke_transfer(worker, request_id)
    except KvmapClientError as err:
        log.warning("request %s: revoking its transfer grant failed: %s", request_id, err.message)


def _with_timeout(spec: transfers_pb2.TransferSpec, seconds: float) -> transfers_pb2.TransferSpec:
    out = transfers_pb2.TransferSpec()
    out.CopyFrom(spec)
    out.timeout_ms = max(1, int(seconds * 1000))
    return out


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KvmapClientError):
        return exc.message
    return f"{type(exc).__name__}: {exc}"
