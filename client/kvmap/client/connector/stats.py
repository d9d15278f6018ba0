"""The connector's transfer statistics, in the shape vLLM's KV connector
stats interface expects (``KVConnectorStats``, ``KVConnectorPromMetrics``),
without importing vLLM: ``kvmap.client.connector.vllm`` mixes these into
vLLM's base classes.

Each worker records what its loads did (``record_*``) into a
``TransferStatsBook``; vLLM takes the book every step
(``get_kv_connector_stats``: ``take``), sends its ``data`` (plain lists, so
it pickles) to the scheduler, ``aggregate``s the books of all workers and
steps, ``reduce``s them to one log line per logging interval (the engine's
"KV Transfer metrics: ..." line) and hands each step's data to
``PromMetrics.observe``, which feeds the ``vllm:kvmap_*`` series of the
engine's ``/metrics`` (see ``docs/vllm.md``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from kvmap.client.client import TransferResult

# Keys of ``data``: each a list of observations of one interval.
TRANSFER_S = "transfer_duration"  # post + completion, seconds
POST_S = "post_duration"
BYTES = "bytes_transferred"
DESCRIPTORS = "num_descriptors"
HANDSHAKES = "num_handshakes"  # 1 per load that needed a handshake
FAILED = "failed_transfers"  # the status code name of each failed load
EXPIRED = "num_kv_expired_reqs"  # 1 per prefill request whose lease ran out
KEYS = (TRANSFER_S, POST_S, BYTES, DESCRIPTORS, HANDSHAKES, FAILED, EXPIRED)

# The status a failed load is counted under: gRPC's code names, what the
# connector refuses before asking kvmapd, and nothing else (a label's values
# stay few, whatever an error says).
FAILURE_CODES = frozenset(
    {
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
        # kv_transfer_params the connector would not turn into a pull.
        "INVALID_PARAMS",
    }
)

# Buckets, as vLLM's NIXL connector's (seconds, 2 KiB..8 GiB, descriptors).
_TIME_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0]
_BYTE_BUCKETS = [float(2 ** (10 + i)) for i in range(1, 25, 2)]
_DESCRIPTOR_BUCKETS = [10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000]


def failure_code(name: str) -> str:
    """``name`` when it is one of ``FAILURE_CODES``, else ``UNKNOWN``."""
    return name if name in FAILURE_CODES else "UNKNOWN"


class TransferStatsBook:
    """vLLM's ``KVConnectorStats`` protocol over ``data`` (lists per key)."""

    def __init__(self, data: Mapping[str, Sequence[Any]] | None = None) -> None:
        self.data: dict[str, list[Any]] = {k: [] for k in KEYS}
        for key, values in (data or {}).items():
            if key in self.data:  # a newer peer's extra keys are ignored
                self.data[key].extend(values)

    # Recording (a worker) ----------------------------------------------------

    def record_transfer(self, result: TransferResult) -> None:
        self.data[TRANSFER_S].append(result.post_seconds + result.completion_seconds)
        self.data[POST_S].append(result.post_seconds)
        self.data[BYTES].append(result.bytes)
        self.data[DESCRIPTORS].append(result.descriptors)
        if result.handshaked:
            self.data[HANDSHAKES].append(1)

    def record_failed_transfer(self, code: str) -> None:
        self.data[FAILED].append(failure_code(code))

    def record_kv_expired_req(self) -> None:
        self.data[EXPIRED].append(1)

    def take(self) -> TransferStatsBook | None:
        """This interval's book (None when nothing happened); this one starts over."""
        if self.is_empty():
            return None
        out = type(self)(self.data)
        self.reset()
        return out

    # vLLM's KVConnectorStats -------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def reset(self) -> None:
        self.data = {k: [] for k in KEYS}

    @property
    def num_successful_transfers(self) -> int:
        return len(self.data[TRANSFER_S])

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in (TRANSFER_S, FAILED, EXPIRED))

    def aggregate(self, other: Any) -> Any:
        """Add ``other``'s observations to this book (vLLM keeps the result)."""
        if not other.is_empty():
            for key, values in other.data.items():
                if key in self.data:
                    self.data[key].extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """One interval in a few numbers, for the engine's log line."""
        failures: dict[str, int | float] = {
            "Num failed transfers": len(self.data[FAILED]),
            "Num KV expired reqs": len(self.data[EXPIRED]),
        }
        n = self.num_successful_transfers
        if n == 0:
            return {"Num successful transfers": 0, **failures}
        xfer = np.asarray(self.data[TRANSFER_S], dtype=np.float64)
        post = np.asarray(self.data[POST_S], dtype=np.float64)
        mb = np.asarray(self.data[BYTES], dtype=np.float64) / 2**20
        descs = np.asarray(self.data[DESCRIPTORS], dtype=np.float64)
        seconds = float(xfer.sum())
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(float(xfer.mean()) * 1e3, 3),
            "P90 xfer time (ms)": round(float(np.percentile(xfer, 90)) * 1e3, 3),
            "Avg post time (ms)": round(float(post.mean()) * 1e3, 3),
            "P90 post time (ms)": round(float(np.percentile(post, 90)) * 1e3, 3),
            "Avg MB per transfer": round(float(mb.mean()), 3),
            "Throughput (MB/s)": round(float(mb.sum()) / seconds, 3) if seconds > 0 else 0.0,
            "Avg number of descriptors": round(float(descs.mean()), 1),
            "Num handshakes": len(self.data[HANDSHAKES]),
            **failures,
        }


class PromMetrics:
    """The ``vllm:kvmap_*`` series (vLLM's ``KVConnectorPromMetrics``
    protocol): ``metric_types`` maps prometheus_client's Gauge, Counter and
    Histogram to the classes vLLM wants used; every series carries vLLM's
    per-engine labels, and the failure counter a ``code`` label too."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Mapping[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        from prometheus_client import Counter, Histogram  # noqa: PLC0415 - the keys only

        self.per_engine_labelvalues = per_engine_labelvalues
        hist, counter = metric_types[Histogram], metric_types[Counter]
        self.histograms = _histograms(hist, labelnames)
        self.counters = {
            HANDSHAKES: counter(
                name="vllm:kvmap_num_handshakes",
                documentation="kvmap KV loads that needed a handshake with the peer's kvmapd.",
                labelnames=labelnames,
            ),
            EXPIRED: counter(
                name="vllm:kvmap_num_kv_expired_reqs",
                documentation="Prefill requests whose KV lease ran out before any pull "
                "(counted on the prefill instance).",
                labelnames=labelnames,
            ),
        }
        self.failed = counter(
            name="vllm:kvmap_num_failed_transfers",
            documentation="kvmap KV loads that failed (vLLM recomputes or fails the "
            "request), by status code.",
            labelnames=[*labelnames, "code"],
        )
        # Every engine's series exist from the start, at zero.
        for labels in per_engine_labelvalues.values():
            for metric in (*self.histograms.values(), *self.counters.values()):
                metric.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, histogram in self.histograms.items():
            child = histogram.labels(*labels)
            for value in transfer_stats_data.get(key, ()):
                child.observe(value)
        for key, counter in self.counters.items():
            count = len(transfer_stats_data.get(key, ()))
            if count:
                counter.labels(*labels).inc(count)
        for code in transfer_stats_data.get(FAILED, ()):
            self.failed.labels(*labels, failure_code(str(code))).inc()


def _histograms(hist: type, labelnames: list[str]) -> dict[str, Any]:
    """The per-load histograms, by the data key they observe."""
    return {
        TRANSFER_S: hist(
            name="vllm:kvmap_xfer_time_seconds",
            documentation="kvmap KV loads: post to completion, seconds.",
            buckets=_TIME_BUCKETS[1:],
            labelnames=labelnames,
        ),
        POST_S: hist(
            name="vllm:kvmap_post_time_seconds",
            documentation="kvmap KV loads: time to post the descriptors, seconds.",
            buckets=_TIME_BUCKETS,
            labelnames=labelnames,
        ),
        BYTES: hist(
            name="vllm:kvmap_bytes_transferred",
            documentation="kvmap KV loads: bytes moved per load.",
            buckets=_BYTE_BUCKETS,
            labelnames=labelnames,
        ),
        DESCRIPTORS: hist(
            name="vllm:kvmap_num_descriptors",
            documentation="kvmap KV loads: transfer descriptors per load.",
            buckets=_DESCRIPTOR_BUCKETS,
            labelnames=labelnames,
        ),
    }
