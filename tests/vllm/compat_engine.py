"""One vLLM engine in its own process for test_vllm_compat.py, driven by JSON
lines on stdin (one JSON answer per line on stdout).

    python compat_engine.py build MODEL_DIR CONFIG_JSON   # a tiny random model
    python compat_engine.py serve MODEL_DIR --role prefill|decode ...

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
with statistics on (``disable_log_stats=False``), so the decode side can
answer with what vLLM's own stat loggers made of the connector's stats:
the ``vllm:kvmap_*`` series of the Prometheus registry that ``vllm serve``
exposes on ``/metrics``, and the "KV Transfer metrics" log line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

BLOCK_SIZE = 32
NUM_BLOCKS = 256


def build(model_dir: str, config_path: str) -> None:
    """A small Llama with well-spread random weights (std 0.2)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(**json.loads(Path(config_path).read_text()))
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(model_dir)


def make_llm(args: argparse.Namespace) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra: dict[str, Any] = {"socket": args.socket, "transfer_timeout_s": 20.0}
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
        # The reference run must not reuse the P/D run's blocks.
        enable_prefix_caching=False,
        disable_log_stats=False,
        kv_transfer_config=kv,
    )


class _Lines(logging.Handler):
    """vLLM's log lines about KV transfers, kept for the test."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "KV Transfer metrics" in text:
            self.lines.append(text)


def generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

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
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {
        "outputs": [
            {"token_ids": list(o.outputs[0].token_ids), "kv_transfer_params": o.kv_transfer_params}
            for o in outs
        ]
    }


def handle(llm: Any, lines: _Lines, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    op = cmd["cmd"]
    if op == "generate":
        return generate(llm, cmd)
    if op == "loads":
        return {
            "loads": [
                {"request_id": r.request_id, "ok": r.ok, "error": r.error}
                for r in get_kv_transfer_group().recent_loads
            ]
        }
    if op == "metrics":
        # What vllm serve's /metrics shows: the process's default registry.
        import prometheus_client

        text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
        return {"lines": [x for x in text.splitlines() if x.startswith("vllm:kvmap_")]}
    if op == "log_stats":
        llm.llm_engine.do_log_stats()
        return {"lines": list(lines.lines)}
    raise ValueError(f"unknown command {op}")


def serve(args: argparse.Namespace) -> int:
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    lines = _Lines()
    llm = make_llm(args)
    logging.getLogger("vllm").addHandler(lines)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "exit":
            break
        try:
            out = handle(llm, lines, cmd)
        except Exception as err:
            out = {"error": f"{type(err).__name__}: {err}"}
        print(json.dumps(out), file=answers, flush=True)
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().shutdown()  # deregister from kvmapd before the process goes
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["build", "serve"])
    p.add_argument("model")
    p.add_argument("config", nargs="?", default="")
    p.add_argument("--role", choices=["prefill", "decode"], default="decode")
    p.add_argument("--socket", default="")
    p.add_argument("--peer-address", default="")
    args = p.parse_args()
    if args.action == "build":
        build(args.model, args.config)
        return 0
    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
