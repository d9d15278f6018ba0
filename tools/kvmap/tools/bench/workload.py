"""What a profile's pulls move: the block ids of its 128K-token requests
(scattered, contiguous, concurrent), and the page divisors that fit each
series into its byte budget on this machine (``ProfilePlan``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvmap.core.geometry import WorkerGeometry
from kvmap.tools.bench import blockpool
from kvmap.tools.bench.options import Options
from kvmap.tools.bench.profiles import Profile
from kvmap.tools.bench.results import (
    BandwidthRequest,
    Fragmentation,
    ProfileInfo,
    TimingScale,
)

PREFILL_SEED, DECODE_SEED = 1, 2

Ids = list[list[int]]  # block ids per request group


@dataclass(frozen=True)
class Request:
    """Block ids per request group, on each side."""

    groups: tuple[int, ...]
    local: Ids
    remote: Ids

    def spec(self) -> list[dict[str, Any]]:
        return [
            {"group": g, "local": loc, "remote": rem}
            for g, loc, rem in zip(self.groups, self.local, self.remote, strict=True)
        ]

    def head(self, k: int) -> Request:
        """The first ``k`` blocks of every group."""
        return Request(self.groups, [ids[:k] for ids in self.local], [r[:k] for r in self.remote])


def own_counts(profile: Profile) -> tuple[list[int], list[bool]]:
    """Blocks per request group, and which groups draw ids of their own."""
    counts = [profile.group_blocks(g) for g in profile.request_groups]
    own = [i == 0 or g.own_blocks for i, g in enumerate(profile.request_groups)]
    return [n if o else 0 for n, o in zip(counts, own, strict=True)], own


def _complete(profile: Profile, drawn: Ids) -> Ids:
    # A group without its own block table uses the first group's ids; a
    # windowed one only the last blocks of them.
    counts = [profile.group_blocks(g) for g in profile.request_groups]
    _, own = own_counts(profile)
    return [d if o else drawn[0][-n:] for d, n, o in zip(drawn, counts, own, strict=True)]


def _request_ids(profile: Profile, draw: Callable[[list[int]], Ids]) -> Ids:
    return _complete(profile, draw(own_counts(profile)[0]))


def concurrent_requests(profile: Profile, n: int) -> tuple[int, list[tuple[int, Request]]]:
    """``n`` scattered requests in flight at once, with distinct block sets
    on each side: (worker pairs needed, [(worker pair, request)]). Request i
    goes to pair ``i % pairs``; a pair holds as many as its pool can."""
    counts, _ = own_counts(profile)
    groups = tuple(g.transfer_group for g in profile.request_groups)
    pairs = -(-n // blockpool.per_pool(profile.num_blocks, counts))
    per_pair: list[list[Request]] = []
    for w in range(pairs):
        k = len(range(w, n, pairs))
        local, remote = (
            blockpool.scattered_many(
                profile.num_blocks, profile.block_tokens, counts, k, seed + 1000 * (w + 1)
            )
            for seed in (DECODE_SEED, PREFILL_SEED)
        )
        per_pair.append(
            [
                Request(groups, _complete(profile, loc), _complete(profile, rem))
                for loc, rem in zip(local, remote, strict=True)
            ]
        )
    return pairs, [(i % pairs, per_pair[i % pairs][i // pairs]) for i in range(n)]


def requests(profile: Profile) -> tuple[Request, Request]:
    """(scattered, contiguous) 128K-token requests of ``profile``."""
    groups = tuple(g.transfer_group for g in profile.request_groups)

    def scattered(seed: int) -> Ids:
        return _request_ids(
            profile,
            lambda counts: blockpool.scattered(
                profile.num_blocks, profile.block_tokens, counts, seed
            ),
        )

    fresh = _request_ids(profile, lambda counts: blockpool.contiguous(profile.num_blocks, counts))
    return (
        Request(groups, scattered(DECODE_SEED), scattered(PREFILL_SEED)),
        Request(groups, fresh, [list(ids) for ids in fresh]),
    )


def _views_bytes(geometry: WorkerGeometry, group: int) -> int:
    """Bytes one block of ``group`` holds over all its views."""
    return sum(v.block_len_bytes for v in geometry.views if v.transfer_group == group)


def request_bytes(geometry: WorkerGeometry, req: Request) -> int:
    return sum(
        len(ids) * _views_bytes(geometry, g) for g, ids in zip(req.groups, req.local, strict=True)
    )


def timing_divisor(profile: Profile, req: Request, budget: int) -> int:
    """Smallest power of two the pages are divided by for ``req`` to fit ``budget``."""
    divisor = 1
    while request_bytes(profile.geometry(divisor), req) > budget and divisor < 1 << 20:
        divisor *= 2
    return divisor


def bandwidth_blocks(geometry: WorkerGeometry, req: Request, budget: int) -> int:
    """Most blocks per group whose full-page bytes fit ``budget`` (at least 1)."""
    k = 1
    longest = max(len(ids) for ids in req.local)
    while k < longest and request_bytes(geometry, req.head(k + 1)) <= budget:
        k += 1
    return k


@dataclass(frozen=True)
class ProfilePlan:
    """Everything about a profile that does not depend on the planner."""

    profile: Profile
    scattered: Request
    contiguous: Request
    bandwidth: Request
    first_contact: Request
    divisor: int
    info: ProfileInfo
    # The largest concurrency level's requests, as (worker pair, request);
    # level N pulls the first N.
    concurrent: list[tuple[int, Request]]
    concurrency_divisor: int
    descriptor_divisor: int

    @property
    def concurrency_pairs(self) -> int:
        return 1 + max(w for w, _ in self.concurrent)


def plan_profile(profile: Profile, opts: Options, memcpy: float = 0.0) -> ProfilePlan:
    """The requests of ``profile`` and their scale; ``memcpy`` (GB/s, measured
    next to the profile's pulls) goes into its info."""
    full = profile.geometry()
    scattered, contiguous = requests(profile)
    divisor = timing_divisor(profile, scattered, opts.request_budget)
    bandwidth = scattered.head(bandwidth_blocks(full, scattered, opts.bandwidth_budget))
    pairs, concurrent = concurrent_requests(profile, max(opts.concurrency))
    conc_div = timing_divisor(profile, scattered, opts.concurrency_budget // len(concurrent))
    desc_div = timing_divisor(profile, scattered, opts.descriptor_budget)
    info = ProfileInfo(
        title=profile.title,
        source=profile.source,
        kv_cache_layout=profile.kv_cache_layout,
        views=len(full.views),
        allocations=len(full.allocations),
        blocks=profile.num_blocks,
        block_tokens=profile.block_tokens,
        page_bytes=_page_bytes(full),
        allocated_bytes=sum(a.size_bytes for a in full.allocations),
        request_tokens=profile.request_tokens,
        request_blocks=[len(ids) for ids in scattered.local],
        request_bytes_full_scale=request_bytes(full, scattered),
        timing_scale=_timing_scale(profile, scattered, divisor),
        bandwidth_request=BandwidthRequest(
            blocks=[len(ids) for ids in bandwidth.local], bytes=request_bytes(full, bandwidth)
        ),
        fragmentation=_fragmentation(scattered),
        memcpy_gbps=memcpy,
        concurrency_divisor=conc_div,
        concurrency_workers=pairs,
        descriptor_cost_divisor=desc_div,
    )
    return ProfilePlan(
        profile=profile,
        scattered=scattered,
        contiguous=contiguous,
        bandwidth=bandwidth,
        first_contact=scattered.head(1),
        divisor=divisor,
        info=info,
        concurrent=concurrent,
        concurrency_divisor=conc_div,
        descriptor_divisor=desc_div,
    )


def _page_bytes(geometry: WorkerGeometry) -> list[int]:
    return sorted({v.block_len_bytes for v in geometry.views}, reverse=True)


def _timing_scale(profile: Profile, scattered: Request, divisor: int) -> TimingScale:
    timed = profile.geometry(divisor)
    return TimingScale(
        page_divisor=divisor,
        page_bytes=_page_bytes(timed),
        request_bytes=request_bytes(timed, scattered),
    )


def _fragmentation(scattered: Request) -> Fragmentation:
    local, remote = scattered.local[0], scattered.remote[0]
    return Fragmentation(
        model=blockpool.MODEL,
        ascending_pairs_local=blockpool.ascending_pairs(local),
        ascending_pairs_remote=blockpool.ascending_pairs(remote),
        ascending_pairs_both=blockpool.joint_ascending_pairs(local, remote),
    )
