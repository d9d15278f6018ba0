"""The README's main job (``kvmapd demo``), the operator CLI and the metrics
endpoint, run as a user would run them."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kvmap.tools.launch import local_env, start_daemon, start_worker
from kvmap.tools.peers import session_peer_secret

pytestmark = pytest.mark.integration

SMALL = ["--blocks", "24", "--mla-layers", "4", "--indexer-layers", "2", "--requests", "3"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _torch_shm(pids: list[int]) -> list[str]:
    """torch's shared-memory objects in /dev/shm named after one of ``pids``."""
    return [n for n in os.listdir("/dev/shm") if any(f"torch_{p}_" in n for p in pids)]


def _mapped_kv_memfds(pid: int) -> set[str]:
    """Names of the sealed KV memfds (kvmap.client.shm_export) process ``pid`` maps."""
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split(maxsplit=5)[-1].strip() for line in f if "/memfd:kvmap-kv-" in line}
    return {p.removeprefix("/memfd:").removesuffix(" (deleted)") for p in paths}


def test_demo_verifies_every_byte(tmp_path: Path) -> None:
    """kvmapd demo, run as a user would, exits 0 reporting its start-up steps as they happen, every
    byte verified, every request's owner told, and the GLM-5.3 descriptor counts, and both its
    daemons are gone afterwards."""
    out = subprocess.run(
        [sys.executable, "-m", "kvmap.daemon.cli.kvmapd", "demo", *SMALL],
        capture_output=True, text=True, timeout=180, env=local_env(tmp_path), check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "kvmap demo: every byte verified" in out.stdout
    # Progress while it starts: each daemon and worker is named before it is waited for.
    steps = re.findall(r"^kvmap demo: starting (\d)/4 .* up in [\d.]+s$", out.stdout, re.M)
    assert steps == ["1", "2", "3", "4"], out.stdout
    assert out.stdout.index("starting 4/4") < out.stdout.index("two daemons and two workers up")
    assert "prefill worker told the pull finished for 3/3 requests" in out.stdout
    assert re.search(r"baseline 3,234,222 vs coalesce 64,044", out.stdout)
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", out.stdout)]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)


# ``kvmapd`` with SIGINT raising KeyboardInterrupt, as in a terminal. A
# process inherits an ignored SIGINT, and Python then leaves it ignored: a
# suite started in the background of a non-interactive shell (`cmd &`) gave
# the demo an ignored SIGINT, and the "interrupted" demo ran every request.
_CTRL_C_ARMED = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('kvmap.daemon.cli.kvmapd', run_name='__main__', alter_sys=True)"
)


def test_interrupted_demo_leaves_nothing_behind(tmp_path: Path) -> None:
    """A demo interrupted with SIGINT mid-pulls exits non-zero, and its two daemons, its two
    workers, the torch shared-memory objects its workers' KV caches live in and its temporary
    directory are all gone."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CTRL_C_ARMED, "demo", *SMALL, "--requests", "1000000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=local_env(tmp_path),
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "request " in line:  # pulls are running
            break
    # The workers' command lines name their socket, in the demo's temporary
    # directory under tmp_path (its TMPDIR).
    worker_pids = [int(p) for p in _pgrep(f"kvmap.tools.demo_worker.*{tmp_path}").split()]
    assert len(worker_pids) == 2, "".join(lines)
    # Their KV caches are sealed memfds (named after their pids), which have no
    # name in /dev/shm at all; nothing of torch's may be left there either.
    segments = set().union(*(_mapped_kv_memfds(p) for p in worker_pids))
    assert segments and all(any(f"kvmap-kv-{p}-" in n for p in worker_pids) for n in segments)
    proc.send_signal(signal.SIGINT)
    try:
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # a demo deaf to SIGINT must not load the later tests
            proc.kill()
            proc.wait(10)
    text = "".join(lines) + rest
    assert proc.returncode != 0  # interrupted: not a success
    pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", text)]
    assert len(pids) == 2, text
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids):
        assert time.monotonic() < deadline, "daemons outlived the interrupted demo"
        time.sleep(0.1)
    assert _pgrep(f"kvmap.tools.demo_worker.*{tmp_path}") == ""
    assert _torch_shm([proc.pid, *pids, *worker_pids]) == []
    assert segments.isdisjoint(os.listdir("/dev/shm"))
    assert not list(tmp_path.glob("kvmap-demo-*")), "temporary directory left behind"


def _pgrep(pattern: str) -> str:
    """pgrep -f's output: the pids of processes whose command line matches."""
    return subprocess.run(
        ["pgrep", "-f", pattern], capture_output=True, text=True, check=False
    ).stdout


def test_kvmapctl_tables_and_metrics(tmp_path: Path) -> None:
    """kvmapctl lists workers and a worker's coalesced regions over both Unix and TCP targets, exits
    1 with NOT_FOUND for an unknown worker, and /metrics reports workers, regions, descriptors
    and RPC counts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    daemon = start_daemon(tmp_path / "d", "--metrics-listen", f"127.0.0.1:{metrics_port}")
    worker = start_worker(daemon, "engine-x", "--blocks", "16", "--mla-layers", "4")
    try:
        ctl = [sys.executable, "-m", "kvmap.daemon.cli.kvmapctl"]
        # On TCP, kvmapctl presents the peer secret launch gave the daemon.
        tcp = [daemon.tcp_target, "--peer-secret-file", str(session_peer_secret())]
        for target in ([f"unix://{daemon.socket}"], tcp):
            workers = subprocess.run(
                [*ctl, "--target", *target, "workers"], capture_output=True, text=True, timeout=30,
                check=False,
            )  # fmt: skip
            assert workers.returncode == 0, workers.stderr
            assert "engine-x" in workers.stdout and "coalesce" in workers.stdout
            regions = subprocess.run(
                [*ctl, "--target", *target, "regions", "engine-x"], capture_output=True, text=True,
                timeout=30, check=False,
            )  # fmt: skip
            assert regions.returncode == 0, regions.stderr
            # 4 MLA + 3 indexer layers x 16 blocks, coalesced to two full rows.
            assert "descriptors  32 in 2 regions (baseline 112" in regions.stdout
        missing = subprocess.run(
            [*ctl, "--target", *tcp, "regions", "nobody"], capture_output=True,
            text=True, timeout=30, check=False,
        )  # fmt: skip
        assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
        text = body.decode()
        assert re.search(r"^kvmap_registered_workers 1\.0$", text, re.M)
        assert re.search(r"^kvmap_regions 2\.0$", text, re.M)
        assert re.search(r"^kvmap_descriptors 32\.0$", text, re.M)
        assert re.search(
            r'^kvmap_rpcs_total\{grpc_code="OK",grpc_method="RegisterWorker",'
            r'grpc_service="kvmap.v1.Registry"\} 1\.0$',
            text,
            re.M,
        )
        assert "kvmap_rpc_seconds_bucket" in text
    finally:
        worker.stop()
        assert daemon.terminate() == 0, daemon.log()
