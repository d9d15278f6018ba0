"""The verification pattern of the demo and bench workers: no two (view,
block) pairs of a realistic cache share contents, so a pull that lands any
other block, group or layer where a block was expected fails verification;
and the numpy, torch and one-word reference forms write the same bytes."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
import torch

from kvmap.tools import block_pattern
from kvmap.tools.bench.profiles import get_profile
from kvmap.tools.bench.worker import pattern as bench_pattern
from kvmap.tools.demo_worker import (
    DemoGeometry,
    count_bad,
    fill_rows,
    pattern,
    pattern_rows,
)

pytestmark = pytest.mark.timeout(120)

BLOCKS = 2048
# GLM-like demo cache: 6 MLA + 3 indexer layers, 8-token blocks (about 71 MB).
DEMO = DemoGeometry(num_blocks=BLOCKS, block_tokens=8, mla_layers=6, indexer_layers=3)


def _filled(geo: DemoGeometry, seed: int = 0) -> list[torch.Tensor]:
    rows = []
    for gi, g in enumerate(geo.groups):
        r = torch.zeros(geo.num_blocks, g.layers * g.page_bytes, dtype=torch.uint8)
        fill_rows(r, gi, seed)
        rows.append(r)
    return rows


def _distinct_rows(rows: npt.NDArray[np.uint32]) -> int:
    """How many distinct rows (compared byte for byte) ``rows`` has."""
    whole = np.ascontiguousarray(rows)
    return len(np.unique(whole.view(np.dtype((np.void, whole.shape[1] * 4))).ravel()))


def test_every_word_of_a_2048_block_demo_cache_is_distinct() -> None:
    """Over both groups of a 2,048-block GLM-like demo cache, every 8-byte word
    differs from every other: so do any two blocks, any two groups and any two
    layers (the old pattern repeated every 251 blocks)."""
    rows = _filled(DEMO)
    words = np.concatenate([r.numpy().view("<u8").ravel() for r in rows])
    assert words.size == sum(r.numel() for r in rows) // 8
    words.sort()
    assert bool((words[1:] != words[:-1]).all())


def test_bench_pattern_rows_of_a_2048_block_glm_cache_all_differ() -> None:
    """The bench worker's pattern: the (view, block) rows of 2,048 blocks of
    every view of the GLM-5.3 profile (pages scaled down) are pairwise
    different, across views too."""
    geometry = get_profile("glm53").geometry(256, "prefill")
    blocks = np.arange(BLOCKS, dtype=np.int64)
    by_len: dict[int, list[npt.NDArray[np.uint32]]] = {}
    for vi, view in enumerate(geometry.views):
        words = view.block_len_bytes // 4
        by_len.setdefault(words, []).append(bench_pattern(vi, blocks, words))
    assert len(geometry.views) == 101
    for words, arrays in by_len.items():
        stacked = np.concatenate(arrays)
        assert _distinct_rows(stacked) == len(arrays) * BLOCKS, words


def test_a_pull_shifted_by_any_block_offset_fails_verification() -> None:
    """Local block ``(i + k) % n`` holding remote block ``i``'s bytes, for every
    offset k of a 2,048-block cache (251 and its multiples included): every
    such block is counted bad; unshifted, none is."""
    (mla, _) = _filled(DemoGeometry(BLOCKS, 1, 6, 3))
    whole = [(0, mla.shape[1])]
    ids = list(range(BLOCKS))
    assert count_bad(mla, 0, local=ids, remote=ids, slices=whole) == 0
    starts = (0, 250, BLOCKS // 2, BLOCKS - 1)
    local = [(i + k) % BLOCKS for k in range(1, BLOCKS) for i in starts]
    remote = [i for _ in range(1, BLOCKS) for i in starts]
    assert count_bad(mla, 0, local=local, remote=remote, slices=whole) == len(local)


def test_another_layer_or_group_at_a_layers_offset_fails_verification() -> None:
    """A block whose layer 1 holds layer 0's bytes, or the other group's bytes,
    fails the check of layer 1 alone, and passes the check of layer 0."""
    geo = DemoGeometry(num_blocks=4, block_tokens=2, mla_layers=3, indexer_layers=2)
    page = geo.groups[0].page_bytes
    mla, idx = _filled(geo)
    mla[2, page : 2 * page] = mla[2, 0:page]  # layer 1 of block 2 <- layer 0
    mla[3, page : page + idx.shape[1]] = idx[3]  # layer 1 of block 3 <- indexer row
    layer0, layer1 = [(0, page)], [(page, page)]
    assert count_bad(mla, 0, local=[2, 3], remote=[2, 3], slices=layer0) == 0
    assert count_bad(mla, 0, local=[2, 3], remote=[2, 3], slices=layer1) == 2


def test_another_seed_differs_in_every_word() -> None:
    """Memory written with another seed (a re-registered worker's) differs from
    the first seed's in every 8-byte word, so no stale byte verifies."""
    blocks = np.arange(256, dtype=np.int64)
    first = block_pattern.words_numpy(0, blocks, 512, seed=0)
    again = block_pattern.words_numpy(0, blocks, 512, seed=5)
    assert np.array_equal(first, block_pattern.words_numpy(0, blocks, 512, seed=0))
    assert bool((first != again).all())


@pytest.mark.parametrize("seed", [0, 3])
def test_numpy_torch_and_reference_forms_agree(seed: int) -> None:
    """numpy's words, torch's bytes (any row length, odd ones included) and the
    one-word reference are the same little-endian bytes, up to the largest
    view and block ids the packing allows."""
    views = (0, 1, block_pattern.MAX_VIEWS - 1)
    blocks = np.array([0, 1, 251, 4096, block_pattern.MAX_BLOCKS - 1], dtype=np.int64)
    for view in views:
        words = block_pattern.words_numpy(view, blocks, 13, seed)
        for i, b in enumerate(blocks.tolist()):
            for w in (0, 1, 12):
                assert int(words[i, w]) == block_pattern.word_value(view, b, w, seed)
        as_bytes = words.astype("<u8").view(np.uint8)
        got = pattern_rows(view, torch.from_numpy(blocks), 101, seed)
        assert np.array_equal(got.numpy(), as_bytes[:, :101])
        assert torch.equal(pattern(view, int(blocks[2]), 101, seed), got[2])
        w32 = block_pattern.words32_numpy(view, blocks, 25, seed)
        assert np.array_equal(w32.astype("<u4").view(np.uint8), as_bytes[:, :100])


def test_ids_beyond_the_packing_are_refused() -> None:
    """Block ids, views and row lengths that would make two keys collide are
    refused rather than silently aliased."""
    too_far = np.array([block_pattern.MAX_BLOCKS], dtype=np.int64)
    with pytest.raises(ValueError, match="block id"):
        block_pattern.words_numpy(0, too_far, 1)
    with pytest.raises(ValueError, match="negative block id"):
        pattern_rows(0, torch.tensor([-1]), 8)
    with pytest.raises(ValueError, match="view"):
        block_pattern.word_value(block_pattern.MAX_VIEWS, 0, 0)
    with pytest.raises(ValueError, match="words per block"):
        block_pattern.words_numpy(0, np.array([0]), block_pattern.MAX_WORDS + 1)
