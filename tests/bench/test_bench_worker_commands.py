"""The bench worker's pull commands: block ids as packed int64 read back
exactly as the JSON lists they replace, and the staged pull protocol
(``stage_pulls`` then ``release_pulls``) refusing calls out of order."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmap.tools.bench.worker import BenchWorker, _id_list, _ids, handle, packed_ids

IDS = st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=500)


@given(IDS)
def test_packed_ids_read_back_as_the_list(values: list[int]) -> None:
    """Packed or as a JSON list, the same ids come back, in order, as an
    int64 array and as the list a spec takes."""
    packed = packed_ids(values)
    assert _id_list(packed) == values
    assert _id_list(values) == values
    assert _ids(packed).tolist() == _ids(values).tolist() == values


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[BenchWorker]:
    # No daemon is needed: a gRPC channel connects only when first used.
    w = BenchWorker(str(tmp_path / "none.sock"))
    yield w
    w.close()


def test_release_before_stage_is_refused(worker: BenchWorker) -> None:
    """release_pulls with nothing staged answers NOT_STAGED."""
    assert handle(worker, {"cmd": "release_pulls"})["code"] == "NOT_STAGED"


def test_stage_twice_is_refused_and_release_answers_in_order(worker: BenchWorker) -> None:
    """A second stage_pulls before the release is refused; the release then
    answers the staged (here: no) pulls and a new stage is accepted."""
    assert handle(worker, {"cmd": "stage_pulls", "pulls": []}) == {"ok": True, "staged": 0}
    assert handle(worker, {"cmd": "stage_pulls", "pulls": []})["code"] == "ALREADY_STAGED"
    released = handle(worker, {"cmd": "release_pulls"})
    assert released["ok"] and released["pulls"] == [] and released["wall_seconds"] >= 0
    assert handle(worker, {"cmd": "release_pulls"})["code"] == "NOT_STAGED"
    assert handle(worker, {"cmd": "pull_many", "pulls": []})["pulls"] == []
    # Streams stage like pulls, and are refused the same way while staged.
    assert handle(worker, {"cmd": "stage_streams", "streams": [[], []]}) == {
        "ok": True,
        "staged": 0,
    }
    assert handle(worker, {"cmd": "stage_pulls", "pulls": []})["code"] == "ALREADY_STAGED"
    assert handle(worker, {"cmd": "release_pulls"})["pulls"] == []
