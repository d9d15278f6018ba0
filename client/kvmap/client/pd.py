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
    blocks are freed when this worker's kvmapd reports that a peer finished
    pulling them (``TransferFinishedEvent``), or when the lease runs out,
    whichever comes first; the grant is revoked when they are freed for any
    reason but a finished pull. A grant that fails frees the blocks at once
    and the params carry no capability (the decode side recomputes).
decode (those params, with ``do_remote_prefill: true``)
    the scheduler learns that the prompt's tokens will be loaded
    asynchronously; once blocks are allocated the worker asks its kvmapd to
    pull the remote blocks into them, presenting the capability, and reports
    the request as received when the pull is done. Params without a
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

from kvmap.client.client import KvmapClient
from kvmap.client.errors import KvmapClientError, NotFound, Unavailable
from kvmap.client.session import Backoff, WorkerSession
from kvmap.daemon.core.retry import RetryPolicy
from kvmap.v1 import registry_pb2, transfers_pb2, types_pb2

log = logging.getLogger("kvmap.client.pd")

# Version of the kv_transfer_params this connector writes and reads.
PARAMS_VERSION = 1
# A pull that has not ended this long after its own deadline is given up.
WATCHDOG_GRACE_S = 5.0
# kv_transfer_params key of the capability(ies) the prefill side granted.
CAPABILITY_KEY = "kvmap_capability"
# The longest grant kvmapd gives (GrantTransferRequest.ttl_ms).
MAX_GRANT_TTL_MS = 3_600_000
# One capability per prefill tensor-parallel rank, in rank order, joined by
# ".": each is kvmapd's URL-safe token. The bounds keep a hostile HTTP body
# from making the connector carry (or log) anything big or odd.
_CAPABILITY = re.compile(r"[A-Za-z0-9_-]{1,128}(?:\.[A-Za-z0-9_-]{1,128})*")
MAX_CAPABILITY_CHARS = 8192

BlockIds = tuple[tuple[int, ...], ...]


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
    return parts[tp_rank]


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
    ) -> None:
        self.engine_id = engine_id
        self.options = options
        self.dp_rank = dp_rank
        self.pp_rank = pp_rank
        self.tp_size = tp_size
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
        count = num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

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
                local = tuple(tuple(int(b) for b in g) for g in local_block_ids)
                self._meta.recv.append(RecvTask(request_id, source, local))
        # One transfer per request, even when vLLM calls this again.
        params["do_remote_prefill"] = False

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
            # pull; the prefill side frees its blocks when its lease runs out.
            params["do_remote_prefill"] = False
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if not finished_normally or not self.options.peer_address:
            if finished_normally:
                log.error("request %s: no peer_address configured; not offering KV", request_id)
            self._meta.not_processed.add(request_id)
            return False, None
        groups = [list(map(int, g)) for g in block_ids]
        capability = self._grant(request_id, groups) if any(groups) else ""
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
        if capability:
            offered[CAPABILITY_KEY] = capability
        return keep, offered

    def _rank_workers(self) -> list[types_pb2.WorkerId]:
        """This engine's workers that hold a request's blocks: one per
        tensor-parallel rank (the decode rank r pulls from rank r)."""
        return [
            types_pb2.WorkerId(
                engine_id=self.engine_id, dp_rank=self.dp_rank, tp_rank=r, pp_rank=self.pp_rank
            )
            for r in range(self.tp_size)
        ]

    def _grant(self, request_id: str, groups: list[list[int]]) -> str:
        """Grant a pull of exactly ``groups`` (block ids per transfer group)
        on every rank's worker for the lease's time: the capabilities joined
        in rank order, or "" (logged) when any grant fails; then the grants
        already made are revoked, since no one will be told of them."""
        if self.client is None:
            log.error("request %s: no kvmapd to grant the transfer; not offering KV", request_id)
            return ""
        blocks = {g: ids for g, ids in enumerate(groups) if ids}
        # A lease longer than kvmapd's longest grant: the grant ends first,
        # and the blocks wait unreadable until the lease frees them.
        ttl_ms = min(int(self.options.lease_seconds * 1000), MAX_GRANT_TTL_MS)
        granted: list[types_pb2.WorkerId] = []
        capabilities: list[str] = []
        try:
            for worker in self._rank_workers():
                grant = self.client.grant_transfer(
                    worker, request_id, blocks, ttl_ms=ttl_ms, max_uses=1
                )
                granted.append(worker)
                capabilities.append(grant.capability)
        except KvmapClientError as err:
            log.error(
                "request %s: kvmapd did not grant the transfer (%s); not offering its KV",
                request_id,
                err.message,
            )
            for worker in granted:
                _revoke(self.client, worker, request_id)
            return ""
        return ".".join(capabilities)


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
    future: concurrent.futures.Future[int] | None
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
    ) -> None:
        self.client = client
        self.worker = worker
        self.options = options
        self.tp_size = tp_size
        self.clock = clock
        self.session: WorkerSession | None = None
        self.loads: collections.deque[LoadRecord] = collections.deque(maxlen=history)
        self.leases_expired = 0
        self._events: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=options.max_parallel_pulls, thread_name_prefix="kvmap-pull"
        )
        self._loading: dict[str, _Load] = {}
        self._to_process: set[str] = set()
        self._send_deadline: dict[str, float] = {}
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
            self._events.put(done.request_id)

    # Steps ----------------------------------------------------------------

    def start(self, meta: ConnectorMeta) -> None:
        """Start this step's loads and track this step's sends."""
        now = self.clock()
        for task in meta.recv:
            self._submit(task, now)
        self._to_process |= meta.in_batch
        for request_id in meta.not_processed:
            self._to_process.discard(request_id)
        for request_id, lease_s in meta.send.items():
            # A pull may already have finished: then it is no longer listed.
            if request_id in self._to_process:
                self._send_deadline[request_id] = now + lease_s

    def spec_for(self, task: RecvTask) -> transfers_pb2.TransferSpec:
        src = task.source
        if src.tp_size != self.tp_size:
            raise ValueError(
                f"the prefill engine runs tensor-parallel size {src.tp_size}, this one "
                f"{self.tp_size}: kvmap pulls between equal sizes only"
            )
        capability = rank_capability(src.capability, src.tp_size, self.worker.tp_rank)
        local, remote = pair_blocks(task.local_block_ids, src.block_ids)
        spec = transfers_pb2.TransferSpec(
            request_id=src.request_id,
            local_worker=self.worker,
            remote_target=src.target,
            remote_worker=types_pb2.WorkerId(
                engine_id=src.engine_id,
                dp_rank=src.dp_rank,
                tp_rank=self.worker.tp_rank,
                pp_rank=src.pp_rank,
            ),
            timeout_ms=int(self.options.transfer_timeout_s * 1000),
            capability=capability,
        )
        for g, (lg, rg) in enumerate(zip(local, remote, strict=True)):
            if lg:
                spec.groups.add(transfer_group=g, local_block_ids=lg, remote_block_ids=rg)
        if not spec.groups:
            raise ValueError("no blocks to load")
        return spec

    def _submit(self, task: RecvTask, now: float) -> None:
        deadline = now + self.options.transfer_timeout_s + WATCHDOG_GRACE_S
        try:
            spec = self.spec_for(task)
        except ValueError as err:
            log.warning("request %s: cannot load remote KV: %s", task.request_id, err)
            self._loading[task.request_id] = _Load(task, None, None, now, deadline, str(err))
            return
        future = self._pool.submit(self._pull, spec, now + self.options.transfer_timeout_s)
        self._loading[task.request_id] = _Load(task, spec, future, now, deadline)

    def _pull(self, spec: transfers_pb2.TransferSpec, deadline: float) -> int:
        """Pull; a pull that broke because this pod's kvmapd restarted under
        it is issued again (same capability: the owner's grant outlives a
        failed attempt) after a backoff, while ``deadline`` allows."""
        opts = self.options
        policy = RetryPolicy(
            opts.reconnect_initial_s, max(opts.reconnect_max_s, opts.reconnect_initial_s)
        )
        attempt = 0
        while True:
            before = self._daemon_instance()
            try:
                # The gRPC deadline sits a little past the daemon's own deadline.
                timeout_s = spec.timeout_ms / 1000 + 2.0
                return self.client.pull(spec, timeout_s=timeout_s).bytes
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
        the worker was attached to when the pull began; from the same
        instance they are the peer's (the daemon already retried those) or
        final. Everything else (PERMISSION_DENIED, INVALID_ARGUMENT, ...)
        never is."""
        if not isinstance(err, Unavailable | NotFound):
            return False
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
        sending = self._pulled_sends() | self._expired_sends(now)
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
                request_id = self._events.get_nowait()
            except queue.Empty:
                return done
            if request_id in self._to_process:
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
            _revoke(self.client, self.worker, request_id)
            self.leases_expired += 1
            expired.add(request_id)
        return expired

    def _outcome(self, load: _Load, now: float) -> tuple[str, int] | None:
        """(error or "", bytes) of a load that ended, None while it runs."""
        if load.future is None:
            return load.error, 0
        if load.future.done():
            exc = load.future.exception()
            if exc is not None:
                return _describe(exc), 0
            return "", load.future.result()
        if now >= load.deadline:
            load.future.cancel()
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
                remote_block_ids=pair_blocks(local, remote)[1] if not error else remote,
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
