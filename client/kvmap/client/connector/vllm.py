"""``KVMapConnector``: vLLM's KV connector for kvmap (the only module of the
client that imports vLLM). vLLM loads it from ``kvmap.client.vllm_connector``,
which re-exports this module.

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
plain ids, lists and values for the rest of this package (the P/D state
machines ``SchedulerCore`` and ``WorkerCore``, the rules of ``model``,
``tp_mapping`` and ``windows``; README.md here is the reading path), and
each worker's KV tensors are registered through ``registration``. What is
here only reads vLLM's types. See ``docs/vllm.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from vllm.v1.request import RequestStatus

from kvmap.client.client import KvmapClient
from kvmap.client.connector.metadata import ConnectorMeta
from kvmap.client.connector.model import architecture_of, check_cache_supported
from kvmap.client.connector.options import ConnectorOptions
from kvmap.client.connector.registration import CacheDescription, register_caches
from kvmap.client.connector.scheduler import SchedulerCore
from kvmap.client.connector.stats import PromMetrics, TransferStatsBook
from kvmap.client.connector.tp_mapping import TpSplit
from kvmap.client.connector.windows import GroupWindows
from kvmap.client.connector.worker import LoadRecord, WorkerCore
from kvmap.client.geometry import LayerSpec, dtype_name, model_identity
from kvmap.v1 import types_pb2

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "KVMapConnector",
    "KVMapConnectorMetadata",
    "cache_kind_of",
    "check_hybrid_supported",
    "check_kv_cache_supported",
    "group_windows",
    "layer_specs",
    "model_identity_of",
    "tp_split_of",
]


def model_identity_of(vllm_config: VllmConfig) -> types_pb2.ModelIdentity:
    """What this engine's KV cache means, for the peer's compatibility check
    (``model.architecture_of`` its text config)."""
    mc = vllm_config.model_config
    text = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    return model_identity(
        str(mc.model),
        revision=str(mc.revision or ""),
        dtype=dtype_name(mc.dtype),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        architecture=architecture_of(text),
    )


class KVMapConnectorStats(TransferStatsBook, KVConnectorStats):  # type: ignore[misc,unused-ignore]
    """vLLM's connector stats over kvmap's book (``kvmap.client.connector.stats``)."""


class KVMapPromMetrics(PromMetrics, KVConnectorPromMetrics):  # type: ignore[misc,unused-ignore]
    """The ``vllm:kvmap_*`` Prometheus series (``kvmap.client.connector.stats``)."""


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


def check_kv_cache_supported(
    kv_cache_config: KVCacheConfig, *, hybrid: bool, mamba_cache_mode: str = "none"
) -> None:
    """``model.check_cache_supported`` on vLLM's KV cache config: refuse, at
    start-up, caches kvmap cannot hand over correctly."""
    groups = kv_cache_config.kv_cache_groups
    replaying = [
        group_id
        for group_id in (kv_cache_config.transfer_group_ids if hybrid else ())
        if int(getattr(groups[group_id].kv_cache_spec, "prefix_replay_tokens", 0) or 0) > 0
    ]
    check_cache_supported(
        has_state=bool(kv_cache_config.has_mamba_layers),
        hybrid=hybrid,
        mamba_cache_mode=mamba_cache_mode,
        replaying_groups=replaying,
    )


# The name it had (it checks more than the hybrid manager's groups).
check_hybrid_supported = check_kv_cache_supported


def group_windows(kv_cache_config: KVCacheConfig, *, hybrid: bool) -> GroupWindows:
    """Per transfer group, the trailing blocks a transfer needs (sliding
    windows), when vLLM's hybrid KV cache manager hands out the block lists;
    without it no group is windowed (and no list holds null blocks)."""
    if not hybrid:
        return GroupWindows()
    specs = [g.kv_cache_spec for g in kv_cache_config.transfer_groups]
    return GroupWindows.from_windows(
        [
            (int(spec.sliding_window), int(spec.block_size))
            if isinstance(spec, SlidingWindowSpec)
            else (0, int(spec.block_size))
            for spec in specs
        ],
        # State groups move only their running-state slot.
        [
            int(spec.num_speculative_blocks) if isinstance(spec, MambaSpec) else None
            for spec in specs
        ],
    )


def tp_split_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> TpSplit:
    """How this engine's KV cache splits over its TP ranks
    (``TpSplit.of_model``): the model's KV heads, none for MLA; replicated
    when every transferable layer is MLA or indexer."""
    model = vllm_config.model_config
    return TpSplit.of_model(
        use_mla=bool(model.use_mla),
        total_kv_heads=int(model.get_total_num_kv_heads()),
        cache_kinds=[spec.cache_kind for spec in layer_specs(kv_cache_config).values()],
    )


class KVMapConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc,unused-ignore]
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
        self.model = model_identity_of(vllm_config)
        # Engines of another TP size are refused by the cores' start-up
        # checks (``TpSplit.check_sizes``).
        self.split = tp_split_of(vllm_config, kv_cache_config)
        # vLLM keeps its hybrid KV cache manager with this connector (SupportsHMA)
        # unless told otherwise.
        hybrid = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        check_kv_cache_supported(
            kv_cache_config,
            hybrid=hybrid,
            mamba_cache_mode=str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none")),
        )
        self.scheduler: SchedulerCore | None = None
        self.worker: WorkerCore | None = None
        # As vLLM hands them (a Mamba layer's: its list of state tensors).
        self.kv_caches: dict[str, Any] = {}
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
                windows=group_windows(kv_cache_config, hybrid=hybrid),
                block_size=self.block_size,
                kv_heads=self.split.kv_heads,
                replicated=self.split.replicated,
            )
        else:
            self.worker = self._make_worker()

    def _make_worker(self) -> WorkerCore:
        worker = types_pb2.WorkerId(
            engine_id=self.engine_id,
            dp_rank=self.dp_rank,
            tp_rank=int(get_tensor_model_parallel_rank()),
            pp_rank=int(get_pp_group().rank_in_group),
        )
        client = KvmapClient.connect(self.options.socket, self.options.call_timeout_s)
        return WorkerCore(
            client,
            worker,
            self.options,
            tp_size=self.tp_size,
            block_size=self.block_size,
            kv_heads=self.split.kv_heads,
            replicated=self.split.replicated,
        )

    # Scheduler side ---------------------------------------------------------

    def _scheduler_core(self) -> SchedulerCore:
        assert self.scheduler is not None, "called on a worker-side connector"
        return self.scheduler

    def on_new_request(self, request: Request) -> None:
        # A prefill request with recurrent state stops short of its last
        # prompt token(s) (SchedulerCore.prefill_backoff), cut as
        # NixlConnector cuts it.
        if request.prompt_token_ids is None and request.prompt_embeds is None:
            return
        drop = self._scheduler_core().prefill_truncation(
            request.kv_transfer_params,
            request.num_prompt_tokens,
            reads_prefix_cache=not request.get_skip_reading_prefix_cache(),
        )
        if not drop:
            return
        if request.prompt_token_ids is not None:
            del request.prompt_token_ids[-drop:]
        elif request.prompt_embeds is not None:
            request.prompt_embeds = request.prompt_embeds[:-drop]
        del request._all_token_ids[-drop:]
        request.num_prompt_tokens -= drop
        request.max_tokens = 1

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_core().num_new_matched_tokens(
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
        self._scheduler_core().after_alloc(
            request.request_id,
            request.kv_transfer_params,
            local,
            num_external_tokens,
            # vLLM's trace context of the request (where it traces): the
            # load's span joins that trace.
            trace_headers=request.trace_headers,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        sched = self._scheduler_core()
        # Push mode: the prefill requests whose whole prompt this step
        # computes have their layer groups pushed as the layers are saved.
        for new in scheduler_output.scheduled_new_reqs:
            if not sched.layer_push_wanted(new.req_id):
                continue
            scheduled = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            prompt = len(new.prompt_token_ids or ())
            if prompt and new.num_computed_tokens + scheduled >= prompt:
                blocks = self._kv_cache_config.select_transfer_block_ids(new.block_ids)
                sched.prompt_scheduled(new.req_id, blocks, prompt)
        return KVMapConnectorMetadata(sched.build_meta())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Without the hybrid manager: the one KV cache group's blocks.
        return self._finished(request, (list(block_ids),))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # With it (SupportsHMA): every KV cache group's blocks, in vLLM's group
        # order; the transfer groups' are offered, windowed groups clipped.
        return self._finished(request, self._kv_cache_config.select_transfer_block_ids(block_ids))

    def _finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_core().request_finished(
            request.request_id,
            request.kv_transfer_params,
            finished_normally=request.status
            in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED),
            block_ids=block_ids,
            num_computed_tokens=int(request.num_computed_tokens),
            trace_headers=request.trace_headers,
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_core().freed(connector_output.finished_sending or ())

    def has_pending_push_work(self) -> bool:
        # Push mode: kept blocks wait for their pushes; vLLM steps on.
        return self.scheduler is not None and self.scheduler.pushing

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The request's own blocks of every transfer group are loaded.
        return tuple(self._kv_cache_config.transfer_group_ids)

    # Worker side ----------------------------------------------------------

    def _worker_core(self) -> WorkerCore:
        assert self.worker is not None, "called on a scheduler-side connector"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        model = self._vllm_config.model_config
        cache = CacheDescription(
            block_size=self.block_size,
            tp_size=self.tp_size,
            model=self.model,
            total_kv_heads=int(model.get_total_num_kv_heads()),
            head_size=int(model.get_head_size()),
            # Informational: the engine core's resolved layout name (e.g. LBHNC).
            kv_cache_layout=str(getattr(self._kv_cache_config, "kv_cache_layout", None) or ""),
        )
        self.kv_caches = kv_caches
        register_caches(self._worker_core(), kv_caches, layer_specs(self._kv_cache_config), cache)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVMapConnectorMetadata)
        self._worker_core().start(meta.meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish between steps (asynchronous, whole requests)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Pull mode: prefill blocks stay where they are until pulled. Push
        # mode: a finished layer group goes now; on a GPU once the layer's
        # kernels are done (an event on the current stream).
        worker = self._worker_core()
        if not worker.pushing_layers:
            return
        sync = None
        if isinstance(kv_layer, torch.Tensor) and kv_layer.is_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch stubs lack it
            event.record()
            sync = event.synchronize
        worker.layer_saved(layer_name, sync)

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        r = self._worker_core().poll()
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

    # Statistics (vllm:kvmap_* series and the engine's transfer log line) ----

    def get_kv_connector_stats(self) -> KVMapConnectorStats | None:
        """What this worker's loads (and leases) did since the last step."""
        if self.worker is None:
            return None
        book = self.worker.stats.take()
        return None if book is None else KVMapConnectorStats(book.data)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVMapConnectorStats | None:
        return KVMapConnectorStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVMapPromMetrics:
        return KVMapPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def recent_loads(self) -> list[LoadRecord]:
        return list(self.worker.loads) if self.worker is not None else []

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
            if self.scheduler.client is not None:
                self.scheduler.client.close()
