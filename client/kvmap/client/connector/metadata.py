"""What the scheduler tells its workers each step (vLLM pickles it from the
scheduler process to every worker as the connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmap.client.connector.blocks import BlockIds
from kvmap.client.connector.params import PushSource, RemoteSource
from kvmap.client.connector.windows import GroupWindows


@dataclass(frozen=True)
class RecvTask:
    """A decode request whose prompt KV the worker must pull."""

    request_id: str
    source: RemoteSource
    local_block_ids: BlockIds
    # The parent of the worker's span of the load, and a span it links to
    # (connector.traces.load_parent).
    traceparent: str = ""
    trace_link: str = ""


@dataclass(frozen=True)
class PushRecvTask:
    """A push-mode decode request: the worker grants the prefill side a
    write of these blocks and offers them (they will hold prompt tokens
    [first_token, first_token + num_tokens))."""

    request_id: str
    source: PushSource
    local_block_ids: BlockIds
    first_token: int
    num_tokens: int


@dataclass(frozen=True)
class PushSendTask:
    """A push-mode prefill request whose KV the workers write into the
    decode side's offered blocks: its blocks (windowed groups clipped) and
    the prompt tokens they hold."""

    request_id: str
    push_id: str
    block_ids: BlockIds
    num_tokens: int
    windows: GroupWindows = field(default_factory=GroupWindows)


@dataclass
class ConnectorMeta:
    """What the scheduler tells its workers for one step."""

    recv: list[RecvTask] = field(default_factory=list)
    # Prefill requests whose blocks now wait for a pull: lease seconds each.
    send: dict[str, float] = field(default_factory=dict)
    # Their grant spans' traceparents (tracing on): their frees' parents.
    send_traces: dict[str, str] = field(default_factory=dict)
    # Prefill requests scheduled this step (a pull may finish before their
    # lease starts); and requests that will not be sent (aborted).
    in_batch: set[str] = field(default_factory=set)
    not_processed: set[str] = field(default_factory=set)
    # Kept prefill requests whose grants failed after they were offered
    # (connector.granter): freed at once, no pull can come.
    ungranted: set[str] = field(default_factory=set)
    # Decode requests that load none of the remote blocks (all in the local
    # prefix cache, or ended before they were scheduled): each worker
    # releases its use of the prefill side's grants.
    release: list[RecvTask] = field(default_factory=list)
    # Push mode. Decode: requests whose blocks are offered. Prefill: the
    # requests whose prompt completes in this step (their layer groups are
    # pushed as the layers are saved), and the requests that finished (every
    # layer group not pushed yet goes now; their blocks wait for the pushes).
    push_recv: list[PushRecvTask] = field(default_factory=list)
    push_ready: list[PushSendTask] = field(default_factory=list)
    push_send: list[PushSendTask] = field(default_factory=list)
