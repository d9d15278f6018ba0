"""``KVMapConnector``: vLLM's KV connector for kvmap (the only module of the
client that imports vLLM).

Load it with

    KVTransferConfig(
        kv_connector="KVMapConnector",
        kv_connector_module_path="kvmap.client.vllm_connector",
        kv_role="kv_both",  # or kv_producer (prefill) / kv_consumer (decode)
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"socket": "/run/kvmap/kvmapd.sock",
                                   "peer_address": "10.0.0.7:50051"},
    )

A thin adapter: vLLM's requests, block lists and KV cache config become
plain ids and lists for ``kvmap.client.pd`` (the P/D state machines), and
each worker's KV tensors become a ``RegisterWorkerRequest`` through
``kvmap.client.geometry``. See ``docs/vllm.md``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import RequestStatus

from kvmap.client.client import KvmapClient
from kvmap.client.geometry import LayerSpec, build_registration
from kvmap.client.pd import ConnectorMeta, ConnectorOptions, LoadRecord, SchedulerCore, WorkerCore
from kvmap.v1 import types_pb2

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.request import Request

log = logging.getLogger("kvmap.client.vllm_connector")

__all__ = ["KVMapConnector", "KVMapConnectorMetadata", "cache_kind_of", "layer_specs"]


class KVMapConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc,unused-ignore]
    def __init__(self, meta: ConnectorMeta) -> None:
        self.meta = meta


def cache_kind_of(spec: KVCacheSpec) -> int:
    """The kvmap cache kind of a vLLM KV cache spec."""
    if isinstance(spec, MLAAttentionSpec):
        role = getattr(spec, "cache_role", None)
        if role is not None and str(getattr(role, "value", role)) == "indexer":
            return types_pb2.CACHE_KIND_INDEXER
        return types_pb2.CACHE_KIND_MLA
    if isinstance(spec, MambaSpec):
        return types_pb2.CACHE_KIND_MAMBA
    if isinstance(spec, AttentionSpec):
        return types_pb2.CACHE_KIND_MHA
    return types_pb2.CACHE_KIND_OTHER


def layer_specs(kv_cache_config: KVCacheConfig) -> dict[str, LayerSpec]:
    """Transfer group, cache kind and block count of every transferable layer."""
    out: dict[str, LayerSpec] = {}
    for group_index, group in enumerate(kv_cache_config.transfer_groups):
        spec = group.kv_cache_spec
        per_layer = (
            dict(spec.kv_cache_specs)
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else dict.fromkeys(group.layer_names, spec)
        )
        num_blocks = kv_cache_config.num_blocks
        if getattr(group, "host_resident", False):
            num_blocks = kv_cache_config.hisparse_host_num_blocks or num_blocks
        for name, layer_spec in per_layer.items():
            out[name] = LayerSpec(
                transfer_group=group_index,
                cache_kind=cache_kind_of(layer_spec),
                num_blocks=num_blocks,
                page_size_bytes=int(layer_spec.page_size_bytes),
            )
    return out


class KVMapConnector(KVConnectorBase_V1):  # type: ignore[misc,unused-ignore]
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None, "KVMapConnector needs a kv_transfer_config"
        producer = str(transfer.kv_role) in ("kv_producer", "kv_both")
        self.options = ConnectorOptions.from_extra_config(
            transfer.kv_connector_extra_config, producer=producer
        )
        self.engine_id: str = str(transfer.engine_id)
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        self.dp_rank = int(getattr(parallel, "data_parallel_rank", 0) or 0)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.scheduler: SchedulerCore | None = None
        self.worker: WorkerCore | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        if role == KVConnectorRole.SCHEDULER:
            # The scheduler grants the transfers of the blocks it keeps (it
            # writes the kv_transfer_params that carry the capability).
            client = (
                KvmapClient.connect(self.options.socket, self.options.call_timeout_s)
                if producer
                else None
            )
            self.scheduler = SchedulerCore(
                self.engine_id,
                self.options,
                dp_rank=self.dp_rank,
                tp_size=self.tp_size,
                client=client,
            )
        else:
            worker = types_pb2.WorkerId(
                engine_id=self.engine_id,
                dp_rank=self.dp_rank,
                tp_rank=int(get_tensor_model_parallel_rank()),
                pp_rank=int(get_pp_group().rank_in_group),
            )
            client = KvmapClient.connect(self.options.socket, self.options.call_timeout_s)
            self.worker = WorkerCore(client, worker, self.options, tp_size=self.tp_size)

    # Scheduler side ---------------------------------------------------------

    def _sched(self) -> SchedulerCore:
        assert self.scheduler is not None, "called on a worker-side connector"
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().num_new_matched_tokens(
            request.request_id,
            request.kv_transfer_params,
            request.num_prompt_tokens,
            num_computed_tokens,
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        local: tuple[list[int], ...] = ()
        if num_external_tokens > 0:
            local = self._kv_cache_config.select_transfer_block_ids(
                blocks.get_unhashed_block_ids_all_groups()
            )
        self._sched().after_alloc(
            request.request_id, request.kv_transfer_params, local, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return KVMapConnectorMetadata(self._sched().build_meta())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(
            request.request_id,
            request.kv_transfer_params,
            finished_normally=request.status
            in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED),
            block_ids=(list(block_ids),),
            num_computed_tokens=int(request.num_computed_tokens),
        )

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The request's own blocks of every transfer group are loaded.
        return tuple(self._kv_cache_config.transfer_group_ids)

    # Worker side ----------------------------------------------------------

    def _work(self) -> WorkerCore:
        assert self.worker is not None, "called on a scheduler-side connector"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        worker = self._work()
        specs = layer_specs(self._kv_cache_config)
        # Informational: the engine core's resolved layout name (e.g. LBHNC).
        layout = str(getattr(self._kv_cache_config, "kv_cache_layout", None) or "")
        req, fds = build_registration(
            worker.worker,
            kv_caches,
            specs,
            block_size_tokens=self.block_size,
            kv_cache_layout=layout,
            tp_size=self.tp_size,
        )
        self.kv_caches = kv_caches
        region_map = worker.register(req, fds)
        log.info(
            "kvmap: registered %d layer views in %d allocation(s) with kvmapd at %s: "
            "generation %d, %d regions, %d descriptors",
            len(req.views),
            len(req.allocations),
            self.options.socket,
            region_map.generation,
            len(region_map.regions),
            region_map.descriptor_count,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVMapConnectorMetadata)
        self._work().start(meta.meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish between steps (asynchronous, whole requests)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # prefill blocks stay where they are until pulled

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        r = self._work().poll()
        return KVConnectorTransferResults(
            finished_sending=r.finished_sending,
            finished_recving=r.finished_recving,
            failed_recving=r.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None:
            return set()
        if len(self._kv_cache_config.kv_cache_groups) > 1:
            # Block ids are per group; vLLM learns of the failures from
            # failed_recving instead.
            self.worker.load_error_blocks()
            return set()
        return self.worker.load_error_blocks()

    @property
    def recent_loads(self) -> list[LoadRecord]:
        return list(self.worker.loads) if self.worker is not None else []

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None and self.scheduler.client is not None:
            self.scheduler.client.close()
