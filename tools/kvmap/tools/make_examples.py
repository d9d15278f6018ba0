"""Writes the example worker geometries shipped in ``kvmap.daemon.examples``
(RegisterWorkerRequest JSON).

    .venv/bin/python -m kvmap.tools.make_examples

Plain JSON numbers (not the strings proto3 JSON uses for int64) keep the files
readable; ``json_format.Parse`` accepts both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvmap.daemon.examples import example_path


def view(
    name: str,
    *,
    allocation: str,
    group: int,
    kind: str,
    offset: int,
    page: int,
    stride: int,
    blocks: int,
) -> dict[str, Any]:
    return {
        "layer_name": name,
        "allocation_id": allocation,
        "transfer_group": group,
        "cache_kind": f"CACHE_KIND_{kind}",
        "dtype": "uint8",
        "offset_bytes": offset,
        "block_len_bytes": page,
        "block_stride_bytes": stride,
        "num_blocks": blocks,
    }


def allocation(allocation_id: str, size: int, device: str) -> dict[str, Any]:
    return {
        "id": allocation_id,
        "size_bytes": size,
        "device": {"type": f"DEVICE_TYPE_{device}", "index": 0},
        "none": {},
    }


def block_outermost(
    engine: str,
    *,
    blocks: int,
    block_tokens: int,
    device: str,
    mla_layers: int,
    mla_page: int,
    indexer_layers: int,
    indexer_page: int,
) -> dict[str, Any]:
    """GLM-style BLHNC worker: every block holds all layers' pages back to back.

    Group 0 holds the MLA layers in one allocation, group 1 the sparse-attention
    indexer keys in another; within a block, layer i's page starts where layer
    i - 1's ends, so each allocation coalesces into one full-row region.
    """
    groups = [
        (0, "kv-mla", "MLA", "self_attn.attn", mla_layers, mla_page),
        (1, "kv-indexer", "INDEXER", "self_attn.indexer.k_cache", indexer_layers, indexer_page),
    ]
    allocations, views = [], []
    for group, alloc, kind, suffix, layers, page in groups:
        allocations.append(allocation(alloc, blocks * layers * page, device))
        views += [
            view(
                f"model.layers.{i}.{suffix}",
                allocation=alloc,
                group=group,
                kind=kind,
                offset=i * page,
                page=page,
                stride=layers * page,
                blocks=blocks,
            )
            for i in range(layers)
        ]
    return {
        "worker": {"engine_id": engine},
        "kv_cache_layout": "BLHNC",
        "block_size_tokens": block_tokens,
        "tp_size": 1,
        "allocations": allocations,
        "views": views,
    }


def llama_mha(*, layers: int, blocks: int, block_tokens: int, kv_heads: int) -> dict[str, Any]:
    """Layer-outermost Llama-style worker (bf16, head_dim 128): one allocation
    per layer holding all of K's blocks, then all of V's; K and V are separate
    MHA views, so nothing is adjacent and nothing may coalesce."""
    page = block_tokens * kv_heads * 128 * 2
    allocations, views = [], []
    for i in range(layers):
        alloc = f"layer.{i}"
        allocations.append(allocation(alloc, 2 * blocks * page, "CUDA"))
        views += [
            view(
                f"model.layers.{i}.self_attn.attn.{part}",
                allocation=alloc,
                group=0,
                kind="MHA",
                offset=j * blocks * page,
                page=page,
                stride=page,
                blocks=blocks,
            )
            for j, part in enumerate(("k", "v"))
        ]
    return {
        "worker": {"engine_id": "llama-mha"},
        "kv_cache_layout": "LBHNC",
        "block_size_tokens": block_tokens,
        "tp_size": 1,
        "allocations": allocations,
        "views": views,
    }


EXAMPLES = {
    # 16 tokens x 656 B (MLA latent + rope) and 16 x 132 B (indexer key + scale).
    "glm-tiny.json": block_outermost(
        "glm-tiny",
        blocks=64,
        block_tokens=16,
        device="CPU",
        mla_layers=4,
        mla_page=10_496,
        indexer_layers=2,
        indexer_page=2_112,
    ),
    # One GLM-5.3 rank as in vLLM PR 60851: 101 per-layer views x 32,022 blocks.
    "glm53-rank.json": block_outermost(
        "glm53-rank",
        blocks=32_022,
        block_tokens=64,
        device="CUDA",
        mla_layers=78,
        mla_page=41_984,
        indexer_layers=23,
        indexer_page=8_448,
    ),
    "llama-mha.json": llama_mha(layers=32, blocks=2048, block_tokens=16, kv_heads=8),
}


def main() -> None:
    for name, spec in EXAMPLES.items():
        target = Path(str(example_path(name.removesuffix(".json"))))
        target.write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
