"""One vLLM engine in its own process, driven by JSON lines on stdin (one
JSON answer per line on stdout), for the end-to-end test.

    python engine_proc.py build MODEL_DIR            # the tiny random Llama
    python engine_proc.py serve MODEL_DIR --role plain|prefill|decode ...

The engine core and its single worker run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the worker-side connector and the
KV cache tensors it registered are at hand for the test's questions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
BLOCK_SIZE = 32
NUM_BLOCKS = 512


def build(model_dir: str) -> None:
    """A small Llama with well-spread random weights (std 0.2, not vLLM's
    near-zero dummy weights), so that greedy decoding is well conditioned."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**json.loads((HERE / "tiny_llama.json").read_text()))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(model_dir)


def make_llm(args: argparse.Namespace) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if args.role != "plain":
        extra: dict[str, Any] = {
            "socket": args.socket,
            "transfer_timeout_s": 20,
            "lease_seconds": 60,
        }
        if args.peer_address:
            extra["peer_address"] = args.peer_address
        kv = KVTransferConfig(
            kv_connector="KVMapConnector",
            kv_connector_module_path="kvmap.client.vllm_connector",
            kv_role="kv_producer" if args.role == "prefill" else "kv_consumer",
            engine_id=f"{args.role}-engine",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    return LLM(
        model=args.model,
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_BLOCKS,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=4,
        seed=0,
        kv_transfer_config=kv,
    )


def connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def block_digests(block_ids: list[int]) -> dict[str, list[str]]:
    """Per layer: a digest of all the bytes of each block, in order."""
    out: dict[str, list[str]] = {}
    for name, cache in sorted(connector().kv_caches.items()):
        assert cache.shape[0] == NUM_BLOCKS, cache.shape  # block-major per layer
        out[name] = [
            hashlib.sha1(cache[b].contiguous().numpy().tobytes()).hexdigest() for b in block_ids
        ]
    return out


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
                PULLED[record.remote_request_id] = block_digests(list(record.local_block_ids[0]))
        return results

    worker.poll = poll_and_digest


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
        outs = llm.generate(prompts, params, use_tqdm=False)
        return {
            "seconds": time.monotonic() - start,
            "outputs": [
                {
                    "token_ids": list(o.outputs[0].token_ids),
                    "kv_transfer_params": o.kv_transfer_params,
                }
                for o in outs
            ],
        }
    if op == "blocks":
        return {"digests": block_digests(cmd["block_ids"])}
    if op == "pulled":
        return {"digests": PULLED.get(cmd["remote_request_id"])}
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
                }
                for r in connector().recent_loads
            ]
        }
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


def serve(args: argparse.Namespace) -> int:
    # Answers go to the original stdout; everything vLLM prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    start = time.monotonic()
    llm = make_llm(args)
    if args.role == "decode":
        watch_loads()
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
            out = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(out), file=answers, flush=True)
    if args.role != "plain":
        connector().shutdown()  # deregister from kvmapd before the process goes
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["build", "serve"])
    p.add_argument("model")
    p.add_argument("--role", choices=["plain", "prefill", "decode"], default="plain")
    p.add_argument("--socket", default="")
    p.add_argument("--peer-address", default="")
    args = p.parse_args()
    if args.action == "build":
        build(args.model)
        return 0
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
