"""Property-based fuzzing of Transfers.Pull and Transfers.Push between two
live daemons with real workers: a prefill daemon (``coalesce``, 32 blocks,
filled with the demo pattern) and a decode daemon (``baseline``, 24 blocks),
so the two sides are planned differently and their block ranges differ.

Every example carries the prefill worker's grant of the valid spec's prefill
blocks (the owner's side of a pull and of a push) unless a fault replaced
the capability: a missing, fuzzed or other request's capability is never
accepted. For every example the status is in the closed set, never UNKNOWN/INTERNAL,
never a hang; both daemons' region maps and generations are unchanged (a
transfer never changes them); the side a transfer reads is never written;
the side it writes is untouched unless the transfer was accepted (or ran
into its own ``timeout_ms`` after posting), and every accepted pull's bytes
verify. After the fuzzing a plain pull still works and verifies: nothing
the fuzzer did poisoned a cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fuzz_support import (
    DEADLINE,
    OK,
    SCALE,
    Live,
    Outcome,
    call_stream,
    check_status,
    fuzz_settings,
    int64s,
    odd_strings,
    short,
    uint32s,
    uint64s,
    worker_ids,
)
from hypothesis import event, given
from hypothesis import strategies as st

from kvmap.tools.grants import grant, granted
from kvmap.tools.launch import WorkerProc, start_daemon, start_worker
from kvmap.v1 import transfers_pb2, types_pb2

pytestmark = [pytest.mark.integration, pytest.mark.timeout(int(240 * max(1.0, SCALE)))]

P_BLOCKS, D_BLOCKS = 32, 24
GEO = ("--block-tokens", "4", "--mla-layers", "3", "--indexer-layers", "2")
MLA = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
IDX = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in (3, 4)]


class Cluster:
    def __init__(self, p: Live, pw: WorkerProc, d: Live, dw: WorkerProc) -> None:
        self.p, self.pw, self.d, self.dw = p, pw, d, dw

    def __repr__(self) -> str:
        return f"Cluster(prefill={self.p.daemon.tcp_target}, decode={self.d.daemon.tcp_target})"

    def digests(self) -> tuple[list[str], list[str]]:
        """sha256 of every group of the prefill and the decode worker's memory."""
        return self.pw.call({"cmd": "digest"})["digest"], self.dw.call({"cmd": "digest"})["digest"]

    def snapshots(self) -> tuple[str, str]:
        return self.p.snapshot(), self.d.snapshot()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("fuzz-transfers")
    p = start_daemon(tmp / "p", "--planner", "coalesce", name="p")
    d = None
    try:
        pw = start_worker(p, "prefill", "--blocks", str(P_BLOCKS), *GEO, "--fill")
        d = start_daemon(tmp / "d", "--planner", "baseline", name="d")
        dw = start_worker(d, "decode", "--blocks", str(D_BLOCKS), *GEO)
        c = Cluster(Live(p), pw, Live(d), dw)
        yield c
        for live in (c.p, c.d):
            live.assert_healthy()
        dw.stop()
        pw.stop()
        for live in (c.d, c.p):
            live.close()
            assert live.daemon.terminate() == 0, live.daemon.log()[-4000:]
    finally:
        p.kill()
        if d is not None:
            d.kill()


# Strategies ---------------------------------------------------------------------


def bad_block_ids(limit: int) -> st.SearchStrategy[int]:
    return st.one_of(
        st.sampled_from([-1, limit, limit + 1, P_BLOCKS, 2**31, 2**62, 2**63 - 1, -(2**63)]),
        int64s,
    )


LAYER_CHOICES = [*MLA, *IDX, "nope", "", "model.layers.0.self_attn.attn "]


@st.composite
def valid_group(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 8))
    local = draw(st.lists(st.integers(0, D_BLOCKS - 1), min_size=n, max_size=n, unique=True))
    remote = draw(st.lists(st.integers(0, P_BLOCKS - 1), min_size=n, max_size=n, unique=True))
    group = draw(st.sampled_from([0, 1]))
    names = MLA if group == 0 else IDX
    layers = draw(st.just([]) | st.lists(st.sampled_from(names), min_size=1, unique=True))
    return {"transfer_group": group, "local": local, "remote": remote, "layers": layers}


FAULTS = [
    "request_id", "local_worker", "target", "remote_worker", "group_id", "local_id",
    "remote_id", "lengths", "layers", "duplicate", "generation", "timeout", "no_groups",
    "extra_group", "capability", "num_tokens", "remote_first_token",
]  # fmt: skip


def _fault(draw: st.DrawFn, spec: dict[str, Any], fault: str) -> None:
    g = spec["groups"][draw(st.integers(0, len(spec["groups"]) - 1))]
    if fault == "request_id":
        spec["request_id"] = draw(odd_strings)
    elif fault == "local_worker":
        spec["local_worker"] = draw(worker_ids(["decode", "prefill"]))
    elif fault == "remote_worker":
        spec["remote_worker"] = draw(worker_ids(["prefill", "decode"]))
    elif fault == "target":
        spec["remote_target"] = draw(
            st.sampled_from(["<self>", "<refused>", "", "nocolon", "127.0.0.1:99999",
                             "<unix-p>", "[::1]:1", "localhost:1", "127.0.0.1:0"])
        )  # fmt: skip
    elif fault == "group_id":
        g["transfer_group"] = draw(st.sampled_from([0, 1, 2, 7]) | uint32s)
    elif fault in ("local_id", "remote_id", "lengths", "duplicate") and not (
        g["local"] and g["remote"]
    ):
        return  # an earlier fault emptied the group
    elif fault in ("local_id", "remote_id"):
        side = "local" if fault == "local_id" else "remote"
        limit = D_BLOCKS if side == "local" else P_BLOCKS
        i = draw(st.integers(0, len(g[side]) - 1))
        g[side][i] = draw(bad_block_ids(limit))
    elif fault == "lengths":
        side = draw(st.sampled_from(["local", "remote"]))
        g[side] = g[side][: draw(st.integers(0, len(g[side]) - 1))]
    elif fault == "layers":
        g["layers"] = draw(st.lists(st.sampled_from(LAYER_CHOICES), min_size=1, max_size=4))
    elif fault == "duplicate":
        side = draw(st.sampled_from(["local", "remote"]))
        g[side] = [*g[side], g[side][0]]
        other = "remote" if side == "local" else "local"
        g[other] = [*g[other], draw(st.integers(0, D_BLOCKS - 1))]
    elif fault == "generation":
        spec["remote_generation"] = draw(st.sampled_from([2, 3]) | uint64s)
    elif fault == "timeout":
        spec["timeout_ms"] = draw(st.sampled_from([1, 2, 5, 50]) | uint32s)
    elif fault == "no_groups":
        spec["groups"] = []
    elif fault == "extra_group":
        spec["groups"].append(dict(g))
    elif fault == "num_tokens":
        # Token mode (GroupBlocks.num_tokens) with a count no block list here
        # can hold (4 tokens a block, with room for faults that add one), or
        # out of range: always refused; in one group of two, also a mix of modes.
        most = 4 * max(len(g["local"]), len(g["remote"]))
        g["num_tokens"] = draw(
            st.sampled_from([-1, -(2**63), 2**63 - 1, 2**40]) | st.integers(most + 64, 2**62)
        )
    elif fault == "remote_first_token":
        # A token offset (GroupBlocks.remote_first_token): in a block-pair
        # group, or with a count no block list here can hold (the num_tokens
        # fault), or out of range: always refused.
        g["remote_first_token"] = draw(
            st.sampled_from([-1, -(2**63), 2**63 - 1, 2**40]) | st.integers(1, 2**62)
        )
    elif fault == "capability":
        spec["capability"] = draw(
            st.sampled_from(["", "<other-request>", "A" * 43, "x" * 5000]) | odd_strings
        )


@st.composite
def specs(draw: st.DrawFn, write: bool) -> dict[str, Any]:
    """A valid TransferSpec with up to two faults injected, in symbolic form
    (targets are resolved per example). A push reads the local (decode, 24
    blocks) and writes the remote (prefill, 32); a pull the other way."""
    groups = draw(st.lists(valid_group(), min_size=1, max_size=2))
    spec: dict[str, Any] = {
        "request_id": "fz",
        "local_worker": types_pb2.WorkerId(engine_id="decode"),
        "remote_target": "<prefill>",
        "remote_worker": types_pb2.WorkerId(engine_id="prefill"),
        "groups": groups,
        "remote_generation": draw(st.sampled_from([0, 0, 1])),
        "timeout_ms": 0,
        "write": write,
        # The prefill worker's blocks the valid spec touches, granted per example.
        "grant": _owner_blocks(groups),
        "capability": "<granted>",
    }
    faults = draw(st.sampled_from([0, 1, 1, 1, 2, 2]))
    for fault in draw(st.lists(st.sampled_from(FAULTS), min_size=faults, max_size=faults)):
        if spec["groups"]:
            _fault(draw, spec, fault)
    return spec


def _owner_blocks(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    blocks: dict[int, dict[int, None]] = {}
    for g in groups:
        blocks.setdefault(g["transfer_group"], {}).update(dict.fromkeys(g["remote"]))
    return [{"group": group, "blocks": list(ids)} for group, ids in blocks.items()]


def capability(c: Cluster, s: dict[str, Any]) -> str:
    """The example's capability: the prefill worker's grant of ``s["grant"]``
    for request "fz" (or, for "<other-request>", for another request)."""
    if s["capability"] == "<granted>":
        return grant(c.pw, "fz", s["grant"], write=s["write"])
    if s["capability"] == "<other-request>":
        return grant(c.pw, "fz-other", s["grant"], write=s["write"])
    return str(s["capability"])


def build(c: Cluster, s: dict[str, Any]) -> transfers_pb2.TransferSpec:
    target = {
        "<prefill>": c.p.daemon.tcp_target,
        "<self>": c.d.daemon.tcp_target,
        "<refused>": "127.0.0.1:1",
        "<unix-p>": f"unix:{c.p.daemon.socket}",
    }.get(s["remote_target"], s["remote_target"])
    spec = transfers_pb2.TransferSpec(
        request_id=s["request_id"],
        local_worker=s["local_worker"],
        remote_target=target,
        remote_worker=s["remote_worker"],
        remote_generation=s["remote_generation"],
        timeout_ms=s["timeout_ms"],
        capability=capability(c, s),
    )
    for g in s["groups"]:
        spec.groups.add(
            transfer_group=g["transfer_group"],
            local_block_ids=g["local"],
            remote_block_ids=g["remote"],
            layer_names=g["layers"],
            num_tokens=g.get("num_tokens", 0),
            remote_first_token=g.get("remote_first_token", 0),
        )
    return spec


def run_transfer(c: Cluster, spec: transfers_pb2.TransferSpec, write: bool) -> Outcome:
    d = c.d
    if write:
        method = "/kvmap.v1.Transfers/Push"
        out = call_stream(d.transfers.Push, transfers_pb2.PushRequest(spec=spec), method, 60)
    else:
        method = "/kvmap.v1.Transfers/Pull"
        out = call_stream(d.transfers.Pull, transfers_pb2.PullRequest(spec=spec), method, 60)
    check_status(d, method, out, spec)
    if out.code is OK:
        assert out.response.status.state == transfers_pb2.TRANSFER_STATE_DONE, out
    return out


def verify_pull(c: Cluster, spec: transfers_pb2.TransferSpec) -> None:
    for g in spec.groups:
        got = c.dw.call(
            {
                "cmd": "verify",
                "group": g.transfer_group,
                "local": list(g.local_block_ids),
                "remote": list(g.remote_block_ids),
                "layers": list(g.layer_names),
            }
        )
        assert got["ok"] and got["bad_blocks"] == 0, (got, short(spec))


def _check_example(c: Cluster, s: dict[str, Any]) -> None:
    write = s["write"]
    spec = build(c, s)
    maps_before = c.snapshots()
    (p_before, d_before) = c.digests()
    out = run_transfer(c, spec, write)
    # Grants the example did not use must not pile up (nor be used later).
    for request_id in ("fz", "fz-other"):
        assert c.pw.call({"cmd": "revoke", "request_id": request_id})["ok"]
    event(f"{'Push' if write else 'Pull'} {out.code.name}: {out.details[:50]}")
    if s["capability"] != "<granted>":
        assert out.code is not OK, f"accepted with a fuzzed capability: {short(spec)}"
    assert c.snapshots() == maps_before, f"a transfer changed a region map: {short(spec)}"
    p_after, d_after = c.digests()
    source, dest = ("decode", "prefill") if write else ("prefill", "decode")
    src_same = (d_after == d_before) if write else (p_after == p_before)
    dst_same = (p_after == p_before) if write else (d_after == d_before)
    assert src_same, f"the {source} side (read) changed: {out.code.name} {short(spec)}"
    if out.code not in (OK, DEADLINE):
        assert dst_same, (
            f"rejected with {out.code.name} ({out.details}) but the {dest} side changed: "
            f"{short(spec)}"
        )
    if write and not dst_same:
        # Put the prefill pattern back so later pulls can verify.
        assert c.pw.call({"cmd": "fill"})["ok"]
    if out.code is OK and not write:
        verify_pull(c, spec)
    c.d.assert_healthy()
    c.p.assert_healthy()


@fuzz_settings(150)
@given(s=specs(write=False))
def test_pull(cluster: Cluster, s: dict[str, Any]) -> None:
    """Fuzzed pulls (valid specs with up to two injected faults): closed-set statuses, never a hang;
    region maps unchanged; the prefill side (read) never changes; the decode side changes only if
    the pull was accepted or ran into its own timeout; accepted pulls verify."""
    _check_example(cluster, s)


@fuzz_settings(100)
@given(s=specs(write=True))
def test_push(cluster: Cluster, s: dict[str, Any]) -> None:
    """Fuzzed pushes: the same rules with the roles swapped (the decode side is read and never
    changes; the prefill side is written only by an accepted push or one that ran into its own
    timeout)."""
    _check_example(cluster, s)


def test_plain_pull_still_verifies_after_the_fuzzing(cluster: Cluster) -> None:
    """After all the fuzzing a plain pull still succeeds and every block verifies: nothing the
    fuzzer did poisoned either cache or daemon."""
    assert cluster.pw.call({"cmd": "fill"})["ok"]
    pull = {
        "cmd": "pull",
        "request_id": "after-fuzz",
        "remote_target": cluster.p.daemon.tcp_target,
        "remote_worker": {"engine_id": "prefill"},
        "groups": [
            {"group": 0, "local": [0, 5, 6, 23], "remote": [31, 2, 3, 0]},
            {"group": 1, "local": [0, 5, 6, 23], "remote": [31, 2, 3, 0]},
        ],
    }
    out = cluster.dw.call(granted(cluster.pw, pull))
    assert out["ok"] and out["bad_blocks"] == 0, out
