"""Benchmark profiles: the KV-cache geometries ``kvmapd bench`` measures.

Each profile is one worker rank's KV cache, at full scale, plus the shape of a
request against it. Every number has a comment saying where it comes from;
where a figure is an assumption (the size of a rank's KV pool), it says so.

A profile's geometry can be built with its pages divided by a power of two
(``Profile.geometry(divisor)``): layers, allocations, block counts, block
ids and therefore every descriptor count stay exactly as at full scale, only
the bytes per descriptor shrink. The runner uses that to time 128K-token
requests whose full-scale bytes would not fit this machine, and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmap.core.geometry import (
    AllocationSpec,
    CacheKind,
    DeviceRef,
    ViewSpec,
    WorkerGeometry,
    WorkerKey,
)

# Descriptor lengths, offsets and strides stay multiples of this when pages
# are scaled down: the bench worker fills and verifies memory as 32-bit words.
WORD = 4

# The request the issue asks for: 128K tokens (131,072).
REQUEST_TOKENS = 128 * 1024

Layout = tuple[tuple[AllocationSpec, ...], tuple[ViewSpec, ...]]


def scaled(page: int, divisor: int) -> int:
    """``page`` bytes divided by ``divisor``, kept a positive multiple of WORD."""
    return max(WORD, page // divisor // WORD * WORD)


@dataclass(frozen=True)
class RequestGroup:
    """How a request fills one transfer group with block ids.

    ``window_tokens`` 0 means the whole request; otherwise only the blocks that
    cover the last ``window_tokens`` tokens move (a sliding-window group: vLLM
    keeps ``ceil(window / block) + 1`` blocks of it). ``own_blocks`` False: the
    group uses the first group's block ids (one block table, as GLM's MLA and
    indexer caches do); True: it draws its own ids from the same block pool
    (vLLM's hybrid allocator, where groups share the rows of one pool).
    """

    transfer_group: int
    window_tokens: int = 0
    own_blocks: bool = False


@dataclass(frozen=True)
class Profile:
    name: str
    title: str
    # Where the numbers come from (printed with the results).
    source: str
    kv_cache_layout: str
    block_tokens: int
    num_blocks: int
    request_groups: tuple[RequestGroup, ...]
    # divisor -> (allocations, views) with every page divided by it.
    build: Callable[[int], Layout]
    request_tokens: int = REQUEST_TOKENS
    default: bool = True  # part of a plain ``kvmapd bench`` run

    def geometry(self, divisor: int = 1, engine_id: str | None = None) -> WorkerGeometry:
        allocations, views = self.build(divisor)
        return WorkerGeometry(
            worker=WorkerKey(engine_id or self.name),
            kv_cache_layout=self.kv_cache_layout,
            block_size_tokens=self.block_tokens,
            allocations=allocations,
            views=views,
        )

    def group_blocks(self, group: RequestGroup) -> int:
        """Blocks one request moves in ``group``."""
        full = -(-self.request_tokens // self.block_tokens)
        if not group.window_tokens:
            return full
        return min(full, -(-group.window_tokens // self.block_tokens) + 1)


@dataclass(frozen=True)
class _Group:
    transfer_group: int
    allocation: str
    kind: CacheKind
    name: str  # layer name pattern with one {} for the layer number
    layers: int
    page: int  # bytes of one layer's block
    first_layer: int = 0


def _block_outermost(num_blocks: int, groups: Sequence[_Group], divisor: int) -> Layout:
    """vLLM's cross-layer BLHNC layout: one allocation per transfer group; a
    block's row holds every layer's page of that group back to back."""
    allocations: list[AllocationSpec] = []
    views: list[ViewSpec] = []
    for g in groups:
        page = scaled(g.page, divisor)
        row = g.layers * page
        allocations.append(AllocationSpec(g.allocation, num_blocks * row, DeviceRef()))
        views += [
            ViewSpec(
                layer_name=g.name.format(g.first_layer + i),
                allocation_id=g.allocation,
                transfer_group=g.transfer_group,
                cache_kind=g.kind,
                dtype="uint8",
                offset_bytes=i * page,
                block_len_bytes=page,
                block_stride_bytes=row,
                num_blocks=num_blocks,
            )
            for i in range(g.layers)
        ]
    return tuple(allocations), tuple(views)


def _kv_views(
    names: Sequence[tuple[str, int]], allocation: str, page: int, num_blocks: int
) -> list[ViewSpec]:
    """K then V of one layer-outermost attention tensor, shape
    (2, num_blocks, block_size, kv_heads, head_dim): K's blocks, then V's."""
    return [
        ViewSpec(
            layer_name=f"{name}.{part}",
            allocation_id=allocation,
            transfer_group=group,
            cache_kind=CacheKind.MHA,
            dtype="uint8",
            offset_bytes=j * num_blocks * page,
            block_len_bytes=page,
            block_stride_bytes=page,
            num_blocks=num_blocks,
        )
        for name, group in names
        for j, part in enumerate(("k", "v"))
    ]


# --- glm53 -----------------------------------------------------------------
# The upstream figure's shape (vLLM PR 60851, GLM-5.3 on GB200, BLHNC layout;
# the same rank as kvmap.daemon.examples' glm53-rank.json):
# 32,022 blocks of 64 tokens; transfer group 0 is 78 MLA layers, 64 tokens x
# 656 B (512 latent + 64 rope values, fp8 with scales) = 41,984 B per page;
# transfer group 1 is 23 sparse-attention indexer layers, 64 x 132 B = 8,448 B.
# baseline: 101 x 32,022 = 3,234,222 descriptors, upstream's "before".
GLM53_BLOCKS = 32_022


def _glm53(divisor: int) -> Layout:
    return _block_outermost(
        GLM53_BLOCKS,
        [
            _Group(0, "kv-mla", CacheKind.MLA, "model.layers.{}.self_attn.attn", 78, 64 * 656),
            _Group(
                1,
                "kv-indexer",
                CacheKind.INDEXER,
                "model.layers.{}.self_attn.indexer.k_cache",
                23,
                64 * 132,
                first_layer=78,
            ),
        ],
        divisor,
    )


# --- dsv3 ------------------------------------------------------------------
# DeepSeek-V3 (config.json: num_hidden_layers 61, kv_lora_rank 512,
# qk_rope_head_dim 64): 61 MLA layers of 576 bf16 values = 1,152 B per token,
# blocks of 64 tokens (FlashMLA's block size) -> 73,728 B pages, laid out
# block-outermost. Pool size is an assumption: 32 GiB of KV cache per rank
# (an H200 EP rank after FP8 weights), 32 GiB / (64 x 61 x 1,152 B) = 7,639.
DSV3_BLOCKS = 7_639


def _dsv3(divisor: int) -> Layout:
    return _block_outermost(
        DSV3_BLOCKS,
        [_Group(0, "kv-mla", CacheKind.MLA, "model.layers.{}.self_attn.attn", 61, 64 * 1152)],
        divisor,
    )


# --- llama-mha ---------------------------------------------------------------
# Llama-3.1-8B (32 layers, 8 KV heads x head_dim 128, bf16), vLLM's default
# layer-outermost FlashAttention layout and 16-token blocks: one allocation
# per layer, K's blocks then V's, 16 x 8 x 128 x 2 B = 32 KiB per page (as
# kvmapd plan --example llama-mha). MHA is split by heads: nothing coalesces.
# Pool size is an assumption: 40 GiB of KV cache = 20,480 blocks of 2 MiB.
LLAMA_BLOCKS = 20_480
LLAMA_LAYERS = 32


def _llama(divisor: int) -> Layout:
    page = scaled(16 * 8 * 128 * 2, divisor)
    allocations = tuple(
        AllocationSpec(f"layer.{i}", 2 * LLAMA_BLOCKS * page, DeviceRef())
        for i in range(LLAMA_LAYERS)
    )
    views = tuple(
        v
        for i in range(LLAMA_LAYERS)
        for v in _kv_views(
            [(f"model.layers.{i}.self_attn.attn", 0)], f"layer.{i}", page, LLAMA_BLOCKS
        )
    )
    return allocations, views


# --- hybrid ------------------------------------------------------------------
# gpt-oss-120b (36 layers alternating sliding-window, window 128, and full
# attention; 8 KV heads x head_dim 64, bf16) as vLLM's hybrid allocator lays
# it out: two KV-cache groups (18 full, 18 sliding layers) and 18 tensors,
# each shared by one full and one sliding layer, so both groups' views cover
# the same rows and draw block ids from one pool. FlashAttention layout, 16-
# token blocks: 16 x 8 x 64 x 2 B = 16 KiB pages, K's blocks then V's. Pool
# size is an assumption: 40 GiB = 72,817 blocks of 18 x 2 x 16 KiB.
HYBRID_BLOCKS = 72_817
HYBRID_TENSORS = 18
SLIDING_WINDOW = 128


def _hybrid(divisor: int) -> Layout:
    page = scaled(16 * 8 * 64 * 2, divisor)
    allocations = tuple(
        AllocationSpec(f"kv.{t}", 2 * HYBRID_BLOCKS * page, DeviceRef())
        for t in range(HYBRID_TENSORS)
    )
    views = tuple(
        v
        for t in range(HYBRID_TENSORS)
        for v in _kv_views(
            [
                (f"model.layers.{2 * t + 1}.self_attn.attn", 0),  # full attention
                (f"model.layers.{2 * t}.self_attn.attn", 1),  # sliding window
            ],
            f"kv.{t}",
            page,
            HYBRID_BLOCKS,
        )
    )
    return allocations, views


# --- tiny --------------------------------------------------------------------
# For tests: GLM-shaped (kvmapd plan --example glm-tiny) with 4 MLA and 2
# indexer layers, 256 blocks of 16 tokens and a 1,024-token request.
TINY_BLOCKS = 256


def _tiny(divisor: int) -> Layout:
    return _block_outermost(
        TINY_BLOCKS,
        [
            _Group(0, "kv-mla", CacheKind.MLA, "model.layers.{}.self_attn.attn", 4, 16 * 656),
            _Group(
                1,
                "kv-indexer",
                CacheKind.INDEXER,
                "model.layers.{}.self_attn.indexer.k_cache",
                2,
                16 * 132,
                first_layer=4,
            ),
        ],
        divisor,
    )


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="glm53",
            title="GLM-5.3 rank, block-outermost MLA + indexer",
            source="vLLM PR 60851 (GLM-5.3, BLHNC): 78 MLA x 41,984 B + 23 indexer x 8,448 B "
            "pages, 32,022 blocks of 64 tokens",
            kv_cache_layout="BLHNC",
            block_tokens=64,
            num_blocks=GLM53_BLOCKS,
            request_groups=(RequestGroup(0), RequestGroup(1)),
            build=_glm53,
        ),
        Profile(
            name="dsv3",
            title="DeepSeek-V3 rank, block-outermost MLA",
            source="DeepSeek-V3 config: 61 MLA layers x 576 bf16 values/token, 64-token blocks; "
            "assumed 32 GiB KV pool = 7,639 blocks",
            kv_cache_layout="BLHNC",
            block_tokens=64,
            num_blocks=DSV3_BLOCKS,
            request_groups=(RequestGroup(0),),
            build=_dsv3,
        ),
        Profile(
            name="llama-mha",
            title="Llama-3.1-8B, layer-outermost MHA (nothing to coalesce)",
            source="Llama-3.1-8B: 32 layers, 8 KV heads x 128, bf16, 16-token blocks, K and V "
            "per layer; assumed 40 GiB KV pool = 20,480 blocks",
            kv_cache_layout="LBHNC",
            block_tokens=16,
            num_blocks=LLAMA_BLOCKS,
            request_groups=(RequestGroup(0),),
            build=_llama,
        ),
        Profile(
            name="hybrid",
            title="gpt-oss-120b, full + sliding-window groups sharing rows",
            source="gpt-oss-120b: 18 full + 18 sliding-window (128) layers sharing 18 tensors, "
            "8 KV heads x 64, bf16, 16-token blocks; assumed 40 GiB KV pool = 72,817 blocks",
            kv_cache_layout="LBHNC",
            block_tokens=16,
            num_blocks=HYBRID_BLOCKS,
            request_groups=(
                RequestGroup(0),
                RequestGroup(1, window_tokens=SLIDING_WINDOW, own_blocks=True),
            ),
            build=_hybrid,
        ),
        Profile(
            name="tiny",
            title="tiny GLM-shaped worker (tests)",
            source="the glm-tiny example's shape (kvmapd plan --example glm-tiny): 4 MLA + 2 "
            "indexer layers, 256 blocks of "
            "16 tokens; a 1,024-token request",
            kv_cache_layout="BLHNC",
            block_tokens=16,
            num_blocks=TINY_BLOCKS,
            request_groups=(RequestGroup(0), RequestGroup(1)),
            build=_tiny,
            request_tokens=1024,
            default=False,
        ),
    )
}

DEFAULT_PROFILES = tuple(name for name, p in PROFILES.items() if p.default)


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(PROFILES)
        raise ValueError(f"unknown profile {name!r} (known: {known})") from None
