"""Block ids for the benchmark's requests: a fresh contiguous request, and one
scattered the way a long-running vLLM block pool leaves them.

The fragmentation model follows vLLM v1's block pool: free blocks sit in a
FIFO queue (``FreeKVCacheBlockQueue``) that starts in id order with block 0
reserved as the null block; a new request takes blocks from the head; a
finished request's blocks go back to the tail *last block first*
(``SingleTypeKVCacheManager.free`` frees ``reversed(blocks)`` so that tail
blocks are evicted first). The workload: requests of log-uniformly random
length between 1K and 160K tokens (the upstream agentic replay ran 110-160K
inputs, mixed with shorter turns) are admitted while free blocks last;
otherwise a random running request finishes. After the pool has been turned
over ``TURNOVER`` times, the measured request takes its blocks from the head
of the queue. Prefill and decode run independent pools (separate seeds), as
two engines do. Prefix-cache hits and eviction order beyond FIFO are not
modelled.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import deque
from dataclasses import dataclass

# How many times the pool's blocks are handed out before the measured request.
TURNOVER = 3
MIN_TOKENS = 1024
MAX_TOKENS = 160 * 1024

MODEL = (
    "vLLM FIFO free-block queue, finished requests returned last block first; "
    f"log-uniform {MIN_TOKENS // 1024}K-{MAX_TOKENS // 1024}K-token requests until the "
    f"pool turned over {TURNOVER}x; independent pools on prefill and decode"
)


@dataclass
class BlockPool:
    """A simulated vLLM block pool (ids 1..num_blocks-1; 0 is the null block)."""

    num_blocks: int
    block_tokens: int
    seed: int

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._free: deque[int] = deque(range(1, self.num_blocks))
        self._running: list[list[int]] = []

    def _finish_one(self) -> None:
        blocks = self._running.pop(self._rng.randrange(len(self._running)))
        self._free.extend(reversed(blocks))

    def take(self, n: int) -> list[int]:
        """Allocate ``n`` blocks from the head, finishing requests as needed."""
        if n > self.num_blocks - 1:
            raise ValueError(f"{n} blocks requested from a pool of {self.num_blocks - 1}")
        while len(self._free) < n:
            self._finish_one()
        blocks = [self._free.popleft() for _ in range(n)]
        self._running.append(blocks)
        return blocks

    def hold(self, n: int) -> list[int]:
        """Allocate ``n`` blocks that stay allocated (never finished)."""
        blocks = self.take(n)
        self._running.pop()
        return blocks

    def churn(self, turnover: int = TURNOVER) -> None:
        """Run the workload until ``turnover`` x the pool's blocks were allocated."""
        lo, hi = math.log(MIN_TOKENS), math.log(MAX_TOKENS)
        cap = max(1, (self.num_blocks - 1) // 2)  # a request never takes most of the pool
        allocated = 0
        while allocated < turnover * (self.num_blocks - 1):
            tokens = math.exp(self._rng.uniform(lo, hi))
            n = min(cap, max(1, math.ceil(tokens / self.block_tokens)))
            self.take(n)
            allocated += n


def scattered(num_blocks: int, block_tokens: int, counts: list[int], seed: int) -> list[list[int]]:
    """Block ids of one request after churn: ``counts[i]`` ids for group i
    (a group with count 0 gets none), all from one pool, in the order taken."""
    pool = BlockPool(num_blocks, block_tokens, seed)
    pool.churn()
    return [pool.take(n) if n else [] for n in counts]


def contiguous(num_blocks: int, counts: list[int]) -> list[list[int]]:
    """Block ids of the first request on a fresh pool: 1, 2, 3, ..."""
    if sum(counts) > num_blocks - 1:
        raise ValueError(f"{sum(counts)} blocks requested from a pool of {num_blocks - 1}")
    out: list[list[int]] = []
    start = 1
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def ascending_pairs(ids: list[int]) -> float:
    """Share of neighbours (i, i+1) in ``ids`` whose ids are consecutive."""
    if len(ids) < 2:
        return 0.0
    return sum(b == a + 1 for a, b in itertools.pairwise(ids)) / (len(ids) - 1)


def joint_ascending_pairs(local: list[int], remote: list[int]) -> float:
    """Share of neighbours consecutive on both sides: only those can merge
    into one descriptor of a full-row region."""
    if len(local) < 2:
        return 0.0
    both = sum(
        lb == la + 1 and rb == ra + 1
        for la, lb, ra, rb in zip(local, local[1:], remote, remote[1:], strict=False)
    )
    return both / (len(local) - 1)


def scattered_many(
    num_blocks: int, block_tokens: int, counts: list[int], n: int, seed: int
) -> list[list[list[int]]]:
    """``n`` requests in flight at once on one pool after churn: each takes
    ``counts[i]`` ids for group i and keeps them (a request in flight is never
    the one the workload finishes), so their block sets are disjoint."""
    if n * sum(counts) > num_blocks - 1:
        raise ValueError(f"{n} requests of {sum(counts)} blocks exceed a pool of {num_blocks - 1}")
    pool = BlockPool(num_blocks, block_tokens, seed)
    pool.churn()
    out: list[list[list[int]]] = []
    for _ in range(n):
        out.append([pool.hold(c) if c else [] for c in counts])
    return out


def per_pool(num_blocks: int, counts: list[int]) -> int:
    """How many requests of ``counts`` blocks one pool holds at once."""
    return max(1, (num_blocks - 1) // max(1, sum(counts)))
