"""``kv_transfer_params``: what a prefill request returns and a decode
request brings back (vLLM's NixlConnector's keys, plus kvmap's own), and
how the decode side reads them. Everything here is untrusted input (it
travels through the client's HTTP body), so it is bounded and checked
before it becomes a pull."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmap.client.connector.blocks import BlockIds
from kvmap.client.connector.options import host_port
from kvmap.core.errors import KvmapError
from kvmap.core.push_offers import check_push_id
from kvmap.tracing import traceparent_of

# Version of the kv_transfer_params this connector writes and reads.
PARAMS_VERSION = 1
# kv_transfer_params key of the capability(ies) the prefill side granted.
CAPABILITY_KEY = "kvmap_capability"
# kv_transfer_params key of the decode TP size the prefill side's grants
# (and its wait for pulls) were sized for; absent: the prefill's own TP size.
READERS_TP_KEY = "kvmap_decode_tp_size"
# kv_transfer_params mark of open grants (no decode TP size configured): each
# decode rank declares how many decode ranks read the prefill rank it pulls
# from, and the owner's kvmapd fixes each grant's use count from that.
OPEN_GRANTS_KEY = "kvmap_open_grants"
# One capability per prefill tensor-parallel rank, in rank order, joined by
# ".": each is kvmapd's URL-safe token. The bounds keep a hostile HTTP body
# from making the connector carry (or log) anything big or odd.
# Stands in ``kvmap_capability`` for a prefill rank that no decode rank
# reads (so granted nothing); never a capability kvmapd issues.
UNREAD_CAPABILITY = "-"
_CAPABILITY = re.compile(r"[A-Za-z0-9_-]{1,128}(?:\.[A-Za-z0-9_-]{1,128})*")
MAX_CAPABILITY_CHARS = 8192

# kv_transfer_params key of the prefill grant span's W3C traceparent
# (connector.traces): the decode side's spans join the grant's trace.
TRACEPARENT_KEY = "kvmap_traceparent"

# Push mode (connector.push_*): the router sends a request to the prefill
# and the decode engine at once, both with ``transfer_mode`` "push" and one
# push id; the decode request also names the prefill engine and its kvmapd.
TRANSFER_MODE_KEY = "transfer_mode"
PUSH_MODE = "push"
PUSH_ID_KEY = "kvmap_push_id"
PUSH_TARGET_KEY = "kvmap_push_target"

# kv_transfer_params mark of a prefill request whose prompt the connector
# cut short (private: the params a prefill request returns are built anew).
TRUNCATED_KEY = "_kvmap_prefill_truncated"


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
    # The prefill grant span's traceparent ("" when absent or malformed).
    traceparent: str = ""

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> RemoteSource:
        def need(key: str, kind: type) -> Any:
            value = params.get(key)
            if not isinstance(value, kind) or isinstance(value, bool) or value == "":
                raise ValueError(f"kv_transfer_params.{key}: missing or not a {kind.__name__}")
            return value

        target = need("remote_target", str)
        host_port(target, "remote_target")
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
            traceparent=traceparent_of(params.get(TRACEPARENT_KEY)),
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


def is_push(params: Mapping[str, Any] | None) -> bool:
    """Whether the request's KV moves by push (``transfer_mode`` "push")."""
    return bool(params) and params.get(TRANSFER_MODE_KEY) == PUSH_MODE  # type: ignore[union-attr]


def push_id_of(params: Mapping[str, Any]) -> str:
    """The router's push id of a request; ``ValueError`` when it is not one."""
    value = params.get(PUSH_ID_KEY)
    try:
        return check_push_id(value, f"kv_transfer_params.{PUSH_ID_KEY}")
    except KvmapError as err:
        raise ValueError(err.message) from None


@dataclass(frozen=True)
class PushSource:
    """Who writes a push-mode decode request's prompt KV: parsed
    ``kv_transfer_params`` (untrusted, as ``RemoteSource``)."""

    push_id: str
    # The prefill engine's kvmapd (its peer address) and engine id.
    target: str
    engine_id: str

    @classmethod
    def parse(cls, params: Mapping[str, Any]) -> PushSource:
        target = params.get(PUSH_TARGET_KEY)
        if not isinstance(target, str) or not target:
            raise ValueError(f"kv_transfer_params.{PUSH_TARGET_KEY}: missing or not a str")
        host_port(target, PUSH_TARGET_KEY)
        engine = params.get("remote_engine_id")
        if not isinstance(engine, str) or not 0 < len(engine) <= 256:
            raise ValueError("kv_transfer_params.remote_engine_id: missing or not a str")
        return cls(push_id=push_id_of(params), target=target, engine_id=engine)
