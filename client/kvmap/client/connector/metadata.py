"""What the scheduler tells its workers each step (vLLM pickles it from the
scheduler process to every worker as the connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmap.client.connector.blocks import BlockIds
from kvmap.client.connector.params import RemoteSource


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
    # Decode requests that load none of the remote blocks (all in the local
    # prefix cache, or ended before they were scheduled): each worker
    # releases its use of the prefill side's grants.
    release: list[RecvTask] = field(default_factory=list)
