"""The bytes the demo and bench workers write into a prefill KV cache, so that
a decode worker verifies what it pulled without seeing the prefill memory.

Each 8-byte word is splitmix64's finaliser applied to a key that packs
(view, block id, word index), xor a mask derived from a seed. The finaliser
is a bijection of 64-bit integers and the packing is injective within the
bounds below, so for one seed every 8-byte word of a whole cache is
distinct: a block pulled from the wrong block id, the wrong view (layer or
group) or the wrong offset never verifies, however far off it is.

``word_value`` is the reference, one word at a time; ``words_numpy`` computes
the words of many blocks at once (the bench worker), and
``kvmap.tools.demo_worker.pattern_rows`` the same bytes with torch on any
device (the demo workers). This module needs no torch.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

VIEW_BITS, BLOCK_BITS, WORD_BITS = 16, 24, 24
MAX_VIEWS, MAX_BLOCKS, MAX_WORDS = 1 << VIEW_BITS, 1 << BLOCK_BITS, 1 << WORD_BITS
WORD_BYTES = 8

_MASK64 = (1 << 64) - 1
# splitmix64's finaliser: x ^= x >> shift, then x *= multiplier (none last).
ROUNDS = ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB), (31, 1))


def _splitmix64(x: int) -> int:
    """splitmix64's finaliser on one Python integer (the reference)."""
    x &= _MASK64
    for shift, mul in ROUNDS:
        x = ((x ^ (x >> shift)) * mul) & _MASK64
    return x


def key_mask(view: int, seed: int) -> int:
    """What is xor-ed into ``block << 24 | word``: the view in the top bits,
    and a seed-dependent mask (a bijection per seed)."""
    if not 0 <= view < MAX_VIEWS:
        raise ValueError(f"view {view} outside 0..{MAX_VIEWS - 1}")
    seed_mask = _splitmix64(seed + 0x9E3779B97F4A7C15) if seed else 0
    return (view << (BLOCK_BITS + WORD_BITS)) ^ seed_mask


def check_bounds(min_block: int, max_block: int, words: int) -> None:
    """Raise ValueError where the packing of (view, block, word) into one key
    would stop being injective."""
    if min_block < 0:
        raise ValueError(f"negative block id {min_block}")
    if max_block >= MAX_BLOCKS:
        raise ValueError(f"block id {max_block} outside 0..{MAX_BLOCKS - 1}")
    if words > MAX_WORDS:
        raise ValueError(f"{words} words per block exceed {MAX_WORDS}")


def word_value(view: int, block: int, word: int, seed: int = 0) -> int:
    """Word ``word`` of block ``block`` of view ``view``, as an unsigned
    64-bit integer (the reference the vectorised forms agree with)."""
    check_bounds(block, block, word + 1)
    return _splitmix64(((block << WORD_BITS) | word) ^ key_mask(view, seed))


# numpy ----------------------------------------------------------------------


def words_numpy(
    view: int, blocks: npt.NDArray[np.int64], words: int, seed: int = 0
) -> npt.NDArray[np.uint64]:
    """A ``[len(blocks), words]`` array: the 8-byte words of those blocks."""
    if blocks.size:
        check_bounds(int(blocks.min()), int(blocks.max()), words)
    b = blocks.astype(np.uint64)[:, None] << np.uint64(WORD_BITS)
    x: npt.NDArray[np.uint64] = b | np.arange(words, dtype=np.uint64)[None, :]
    x ^= np.uint64(key_mask(view, seed))
    tmp = np.empty_like(x)
    for shift, mul in ROUNDS:
        np.right_shift(x, np.uint64(shift), out=tmp)
        x ^= tmp
        if mul != 1:
            # uint64 array arithmetic wraps modulo 2**64.
            x *= np.uint64(mul)
    return x


def words32_numpy(
    view: int, blocks: npt.NDArray[np.int64], words32: int, seed: int = 0
) -> npt.NDArray[np.uint32]:
    """The same bytes as 32-bit (little-endian) words: ``[len(blocks), words32]``."""
    wide = words_numpy(view, blocks, -(-words32 // 2), seed).astype("<u8", copy=False)
    out: npt.NDArray[np.uint32] = wide.view("<u4")[:, :words32]
    return out
