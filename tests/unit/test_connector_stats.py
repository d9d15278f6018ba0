"""kvmap.client.connector.stats: the connector's transfer statistics behave as vLLM's
KV connector stats interface expects (aggregate across workers and steps,
reduce to a log line, reset/take per interval) and feed the vllm:kvmap_*
Prometheus series."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import examples
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmap.client.client import TransferResult
from kvmap.client.connector.stats import (
    BYTES,
    DESCRIPTORS,
    EXPIRED,
    FAILED,
    FAILURE_CODES,
    HANDSHAKES,
    POST_S,
    TRANSFER_S,
    PromMetrics,
    TransferStatsBook,
)

results = st.builds(
    TransferResult,
    descriptors=st.integers(1, 10_000),
    bytes=st.integers(1, 2**34),
    post_seconds=st.floats(0.0, 1.0),
    completion_seconds=st.floats(1e-6, 5.0),
    remote_generation=st.just(1),
    handshaked=st.booleans(),
)
# An event of a worker: a finished load, a failed one (by code) or an expiry.
events = st.one_of(
    results,
    st.sampled_from(sorted(FAILURE_CODES)),
    st.just("expired"),
)


def record(book: TransferStatsBook, event: Any) -> None:
    if isinstance(event, TransferResult):
        book.record_transfer(event)
    elif event == "expired":
        book.record_kv_expired_req()
    else:
        book.record_failed_transfer(event)


def book_of(evs: list[Any]) -> TransferStatsBook:
    book = TransferStatsBook()
    for e in evs:
        record(book, e)
    return book


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.lists(events, max_size=8), max_size=6))
def test_aggregating_books_equals_one_book_of_everything(chunks: list[list[Any]]) -> None:
    """Books of several workers/steps aggregated (as vLLM's output aggregator
    and logger do, through to_dict and build) hold exactly the observations
    of one book that saw everything, and reduce to the same summary."""
    everything = book_of([e for chunk in chunks for e in chunk])
    total = TransferStatsBook()
    for chunk in chunks:
        total = total.aggregate(TransferStatsBook(book_of(chunk).to_dict()))
    assert total.data == everything.data
    assert total.is_empty() == (not any(chunks[i] for i in range(len(chunks))))
    assert total.reduce() == pytest.approx(everything.reduce())


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(results, min_size=1, max_size=20))
def test_reduce_summarises_successful_loads(rs: list[TransferResult]) -> None:
    """The log line's numbers are the loads' counts, means and byte totals."""
    out = book_of(rs).reduce()
    n = len(rs)
    assert out["Num successful transfers"] == n
    xfer = [r.post_seconds + r.completion_seconds for r in rs]
    assert out["Avg xfer time (ms)"] == pytest.approx(sum(xfer) / n * 1e3, abs=1e-3)
    assert out["Avg post time (ms)"] == pytest.approx(
        sum(r.post_seconds for r in rs) / n * 1e3, abs=1e-3
    )
    assert out["Avg MB per transfer"] == pytest.approx(
        sum(r.bytes for r in rs) / n / 2**20, abs=1e-3
    )
    assert out["Avg number of descriptors"] == pytest.approx(
        sum(r.descriptors for r in rs) / n, abs=0.06
    )
    assert out["Num handshakes"] == sum(r.handshaked for r in rs)
    assert min(xfer) * 1e3 - 1e-3 <= out["P90 xfer time (ms)"] <= max(xfer) * 1e3 + 1e-3
    assert out["Num failed transfers"] == 0 and out["Num KV expired reqs"] == 0


def test_failures_only_interval_is_not_empty_and_reports_counts() -> None:
    """An interval with only failures and expiries is still reported (not
    empty), with zero successes; an unknown code is counted as UNKNOWN."""
    book = TransferStatsBook()
    assert book.is_empty() and book.take() is None
    book.record_failed_transfer("FAILED_PRECONDITION")
    book.record_failed_transfer("a code no one knows")
    book.record_kv_expired_req()
    assert not book.is_empty()
    assert book.data[FAILED] == ["FAILED_PRECONDITION", "UNKNOWN"]
    assert book.reduce() == {
        "Num successful transfers": 0,
        "Num failed transfers": 2,
        "Num KV expired reqs": 1,
    }


def test_take_hands_over_the_interval_and_starts_over() -> None:
    """take() returns this interval's observations and leaves the book empty
    (what get_kv_connector_stats does every step); reset() empties it too."""
    book = book_of([TransferResult(4, 4096, 0.001, 0.002, 1, True)])
    taken = book.take()
    assert taken is not None and taken.data[BYTES] == [4096]
    assert book.is_empty() and book.data[BYTES] == []
    assert book.take() is None
    taken.reset()
    assert taken.is_empty()


def test_data_pickles_and_ignores_unknown_keys() -> None:
    """The payload vLLM ships from workers to the scheduler pickles; a book
    built from a payload with keys this version does not know keeps its own."""
    book = book_of([TransferResult(4, 4096, 0.001, 0.002, 1, False), "INTERNAL"])
    again = TransferStatsBook(pickle.loads(pickle.dumps(book.to_dict())) | {"future": [1]})
    assert again.data == book.data


def _prom(engines: dict[int, list[object]]) -> tuple[PromMetrics, CollectorRegistry]:
    registry = CollectorRegistry()

    def bound(cls: type) -> Any:
        return lambda **kw: cls(registry=registry, **kw)

    types: dict[type, Any] = {c: bound(c) for c in (Gauge, Counter, Histogram)}
    return PromMetrics(None, types, ["model_name", "engine"], engines), registry


def test_prom_metrics_observe_each_engines_data() -> None:
    """Observed data lands in the vllm:kvmap_* series of its engine:
    histograms count each load, counters the failures by code and expiries;
    every engine's series exist at zero before any data."""
    prom, reg = _prom({0: ["m", "0"], 1: ["m", "1"]})
    assert (
        reg.get_sample_value("vllm:kvmap_num_descriptors_count", {"model_name": "m", "engine": "1"})
        == 0
    )
    book = book_of(
        [
            TransferResult(10, 2048, 0.001, 0.004, 1, True),
            TransferResult(30, 8192, 0.002, 0.006, 1, False),
            "FAILED_PRECONDITION",
            "expired",
        ]
    )
    prom.observe(book.to_dict(), engine_idx=1)
    e1 = {"model_name": "m", "engine": "1"}
    assert reg.get_sample_value("vllm:kvmap_xfer_time_seconds_count", e1) == 2
    assert reg.get_sample_value("vllm:kvmap_bytes_transferred_sum", e1) == 2048 + 8192
    assert reg.get_sample_value("vllm:kvmap_num_descriptors_sum", e1) == 40
    assert reg.get_sample_value("vllm:kvmap_post_time_seconds_sum", e1) == pytest.approx(0.003)
    assert reg.get_sample_value("vllm:kvmap_num_handshakes_total", e1) == 1
    assert reg.get_sample_value("vllm:kvmap_num_kv_expired_reqs_total", e1) == 1
    assert (
        reg.get_sample_value(
            "vllm:kvmap_num_failed_transfers_total", {**e1, "code": "FAILED_PRECONDITION"}
        )
        == 1
    )
    e0 = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm:kvmap_xfer_time_seconds_count", e0) == 0


def test_keys_are_the_documented_ones() -> None:
    """The payload's keys (a wire format between vLLM processes) are fixed."""
    assert set(TransferStatsBook().data) == {
        TRANSFER_S,
        POST_S,
        BYTES,
        DESCRIPTORS,
        HANDSHAKES,
        FAILED,
        EXPIRED,
    }
