"""The vLLM KV connector (README.md here is the reading path). ``vllm``
holds ``KVMapConnector``, which vLLM loads through ``kvmap.client.vllm_connector``
and which adapts vLLM's objects to the modules below; it is the only one that
imports vLLM, and this package does not import it. Everything else takes
plain ids, lists and dicts, so it is tested against an in-process kvmapd
without vLLM.

- ``options``: ``kv_connector_extra_config`` (``ConnectorOptions``)
- ``model``: what the model's config means here (its identity's fields,
  the KV caches refused at start-up)
- ``params``: ``kv_transfer_params`` written by the prefill side, read by the
  decode side (``RemoteSource``, the capability per rank)
- ``metadata``: what the scheduler tells its workers each step
- ``tp_mapping``, ``blocks``, ``windows``: which ranks read which
  (``TpSplit``, one rule for grants, pulls and pushes), how block lists
  pair, which blocks of windowed and state groups move
- ``scheduler``: ``SchedulerCore`` (grants, params, per-step metadata)
- ``grants``: the prefill side's grants in its kvmapd
- ``pulls``: the decode side's transfer specs (``PullSpecs``)
- ``worker``: ``WorkerCore`` (registration, pulls, releases, kept blocks)
- ``registration``: a worker's KV caches exported and described for kvmapd
- ``stats``: the connector's transfer statistics and Prometheus series
- ``traces``: the connector's OpenTelemetry spans and how they join vLLM's
"""

from kvmap.client.connector.blocks import NULL_BLOCK_ID, BlockIds, map_token_ranges, pair_blocks
from kvmap.client.connector.grants import MAX_GRANT_TTL_MS
from kvmap.client.connector.metadata import ConnectorMeta, RecvTask
from kvmap.client.connector.options import ConnectorOptions, default_socket
from kvmap.client.connector.params import (
    CAPABILITY_KEY,
    MAX_CAPABILITY_CHARS,
    OPEN_GRANTS_KEY,
    PARAMS_VERSION,
    READERS_TP_KEY,
    TRUNCATED_KEY,
    UNREAD_CAPABILITY,
    RemoteSource,
    rank_capability,
)
from kvmap.client.connector.pulls import PullSpecs, missing_feature
from kvmap.client.connector.scheduler import SchedulerCore
from kvmap.client.connector.tp_mapping import TpSplit, tp_readers
from kvmap.client.connector.windows import GroupWindows
from kvmap.client.connector.worker import (
    PULL_RETRY_MAX_S,
    WATCHDOG_GRACE_S,
    LoadRecord,
    TransferResults,
    WorkerCore,
)

__all__ = [
    "CAPABILITY_KEY",
    "MAX_CAPABILITY_CHARS",
    "MAX_GRANT_TTL_MS",
    "NULL_BLOCK_ID",
    "OPEN_GRANTS_KEY",
    "PARAMS_VERSION",
    "PULL_RETRY_MAX_S",
    "READERS_TP_KEY",
    "TRUNCATED_KEY",
    "UNREAD_CAPABILITY",
    "WATCHDOG_GRACE_S",
    "BlockIds",
    "ConnectorMeta",
    "ConnectorOptions",
    "GroupWindows",
    "LoadRecord",
    "PullSpecs",
    "RecvTask",
    "RemoteSource",
    "SchedulerCore",
    "TpSplit",
    "TransferResults",
    "WorkerCore",
    "default_socket",
    "map_token_ranges",
    "missing_feature",
    "pair_blocks",
    "rank_capability",
    "tp_readers",
]
