"""How long a worker is unreachable while its kvmapd is restarted on the same
state dir and port, gracefully (SIGTERM, as in an upgrade) and with
``kill -9``, while a decode worker pulls from it in a loop.

    python -m kvmap.tools.upgrade_gap [--pulls-before 20] [--out gap.json]

The prefill worker's memory is a file (the daemon reopens it by path after a
restart); its grants are minted up front, one per pull, so that pulls can go
on while its daemon is down. Each case prints one JSON line: ``gap_s`` (from
the stop until a pull succeeds again), ``exit_s`` and ``ready_s`` (the old
daemon's exit, the new one's start until ready), ``pull_s`` (median pull latency
before the stop), ``added_s`` (the slowest pull across the gap minus that
median) and ``failed`` (pulls that failed: 0 while the decode daemon retries
within the transfer deadline). A measurement, not a test: the figures depend
on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from kvmap.client.fd_handoff import credential_metadata
from kvmap.tools.launch import DaemonProc, WorkerProc, start_daemon, start_worker
from kvmap.v1 import registry_pb2, registry_pb2_grpc, types_pb2

BLOCKS, TOKENS, LAYERS = 16, 32, 3
PAGE = TOKENS * 656  # the demo worker's MLA page
GEO = ("--blocks", str(BLOCKS), "--block-tokens", str(TOKENS), "--mla-layers", str(LAYERS))
PREFILL = types_pb2.WorkerId(engine_id="prefill")


def _registration(kv_file: Path) -> registry_pb2.RegisterWorkerRequest:
    req = registry_pb2.RegisterWorkerRequest(
        worker=PREFILL, kv_cache_layout="BLHNC", block_size_tokens=TOKENS
    )
    req.allocations.add(
        id="kv",
        size_bytes=BLOCKS * LAYERS * PAGE,
        shm_path=types_pb2.ShmPathHandle(path=str(kv_file)),
    )
    for i in range(LAYERS):
        req.views.add(
            layer_name=f"model.layers.{i}.self_attn.attn", allocation_id="kv", transfer_group=0,
            cache_kind=types_pb2.CACHE_KIND_MLA, dtype="uint8", offset_bytes=i * PAGE,
            block_len_bytes=PAGE, block_stride_bytes=LAYERS * PAGE, num_blocks=BLOCKS,
        )  # fmt: skip
    return req


class Prefill:
    """The prefill daemon and its file-backed worker, attached so that it
    can grant (a worker with no Attach stream open grants nothing)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.kv_file = root / "kv.bin"
        self.kv_file.write_bytes(bytes(range(256)) * (BLOCKS * LAYERS * PAGE // 256))
        self.daemon = self._start("127.0.0.1:0")
        with self.daemon.channel() as ch:
            # The registering uid's credentials: a path registration needs them,
            # and the worker's Attach and grants are honoured from that uid only.
            registry_pb2_grpc.RegistryStub(ch).RegisterWorker(
                _registration(self.kv_file), timeout=10, metadata=self._me()
            )
        self._attach()

    def _attach(self) -> None:
        """Hold the worker's Attach stream open, as its client would: a
        worker whose stream ends is released (and its grants with it)."""
        channel = self.daemon.channel()
        stream: Any = registry_pb2_grpc.RegistryStub(channel).Attach(
            registry_pb2.AttachRequest(worker=PREFILL), metadata=self._me()
        )
        next(stream)  # the attached event: granting may start
        threading.Thread(target=_drain, args=(stream,), daemon=True).start()
        self._channel = channel

    def _me(self) -> tuple[tuple[str, str]]:
        """A fresh credential token of this process (a restarted daemon forgot the last)."""
        return credential_metadata(self.daemon.socket)

    def _start(self, listen: str) -> DaemonProc:
        state = str(self.root / "state")
        # The KV file is a path registration: its directory must be an allowed prefix.
        return start_daemon(
            self.root / "p", "--state-dir", state, "--shm-path-prefix", str(self.root),
            name="prefill", listen=listen,
        )  # fmt: skip

    def grants(self, prefix: str, count: int) -> list[tuple[str, str]]:
        """(request id, capability) for ``count`` pulls of block 5."""
        with self.daemon.channel() as ch:
            registry = registry_pb2_grpc.RegistryStub(ch)
            me = self._me()
            out = []
            for i in range(count):
                rid = f"{prefix}-{i}"
                grant = registry.GrantTransfer(
                    registry_pb2.GrantTransferRequest(
                        worker=PREFILL, request_id=rid,
                        groups=[types_pb2.BlockGrant(transfer_group=0, block_ids=[5])],
                    ),
                    timeout=10, metadata=me,
                )  # fmt: skip
                out.append((rid, grant.capability))
        return out

    def restart(self, how: str) -> tuple[float, float]:
        """Stop the daemon (``SIGTERM`` or ``kill -9``), start it again on
        the same state dir and port; returns how long the old one took to
        exit and the new one to be ready."""
        target = self.daemon.tcp_target
        t0 = time.monotonic()
        if how == "SIGTERM":
            self.daemon.terminate()
        else:
            self.daemon.kill()
        t1 = time.monotonic()
        self._channel.close()
        self.daemon = self._start(target)
        self._attach()
        return t1 - t0, time.monotonic() - t1

    def stop(self) -> None:
        self._channel.close()
        self.daemon.stop()


def _drain(stream: Any) -> None:
    """Read the worker's events until its daemon goes away."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError:
        pass  # the daemon stopped (or the stream was closed): expected


def _pull(dw: WorkerProc, target: str, rid: str, capability: str) -> dict[str, Any]:
    return dw.call(
        {
            "cmd": "pull", "request_id": rid, "remote_target": target,
            "remote_worker": {"engine_id": "prefill"},
            "groups": [{"group": 0, "local": [0], "remote": [5]}],
            "capability": capability, "verify": False,
        }
    )  # fmt: skip


def measure(prefill: Prefill, dw: WorkerProc, how: str, pulls_before: int) -> dict[str, Any]:
    """One restart of the prefill daemon while the decode worker pulls."""
    tickets = prefill.grants(how.replace(" ", ""), pulls_before + 200)
    target = prefill.daemon.tcp_target
    before = []
    for rid, cap in tickets[:pulls_before]:
        t0 = time.monotonic()
        res = _pull(dw, target, rid, cap)
        assert res["ok"], res
        before.append(time.monotonic() - t0)
    # (start, end, ok) of each pull from here on, by the pulling thread.
    during: list[tuple[float, float, bool]] = []
    stop_at: list[float] = []
    recovered = threading.Event()

    def loop() -> None:
        for rid, cap in tickets[pulls_before:]:
            t0 = time.monotonic()
            ok = bool(_pull(dw, target, rid, cap).get("ok"))
            during.append((t0, time.monotonic(), ok))
            if ok and stop_at and t0 > stop_at[0]:
                recovered.set()
                return

    puller = threading.Thread(target=loop, daemon=True)
    puller.start()
    stop_at.append(time.monotonic())
    exit_s, ready_s = prefill.restart(how)
    puller.join(120)
    across = [end - start for start, end, _ in during if end >= stop_at[0]]
    first_ok = min(end for start, end, ok in during if ok and start > stop_at[0])
    median = statistics.median(before)
    return {
        "case": how,
        "gap_s": round(first_ok - stop_at[0], 3),
        "exit_s": round(exit_s, 3),
        "ready_s": round(ready_s, 3),
        "pull_s": round(median, 4),
        "added_s": round(max(across) - median, 3),
        "pulls_across": len(across),
        "failed": sum(1 for _, _, ok in during if not ok),
        "recovered": recovered.is_set(),
    }


CASES = ("SIGTERM", "kill -9")


def run_cases(
    cases: tuple[str, ...] = CASES,
    pulls_before: int = 20,
    report: Callable[[dict[str, Any]], None] = lambda result: None,
) -> list[dict[str, Any]]:
    """Each case (``CASES``) once, on one prefill and one decode daemon
    started here; each result also goes to ``report`` as it comes."""
    results = []
    with tempfile.TemporaryDirectory(prefix="kvmap-gap-") as tmp:
        root = Path(tmp)
        prefill = Prefill(root)
        decode = start_daemon(root / "q", name="decode")
        dw = start_worker(decode, "decode", *GEO, "--indexer-layers", "0")
        try:
            for how in cases:
                results.append(measure(prefill, dw, how, pulls_before))
                report(results[-1])
        finally:
            dw.stop()
            decode.stop()
            prefill.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvmap.tools.upgrade_gap", description=__doc__, allow_abbrev=False
    )
    p.add_argument("--pulls-before", type=int, default=20, help="pulls timed before each stop")
    p.add_argument("--out", help="also write the results here (JSON)")
    args = p.parse_args(argv)
    try:
        results = run_cases(
            pulls_before=args.pulls_before, report=lambda r: print(json.dumps(r), flush=True)
        )
    except grpc.RpcError as err:
        print(json.dumps({"error": str(err)}), flush=True)
        return 1
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
