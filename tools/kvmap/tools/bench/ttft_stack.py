"""The P/D stacks of ``kvmapd bench --ttft``: for each way of moving the KV,
a prefill and a decode vLLM OpenAI server (``kvmap.tools.vllm_servers``,
each on its own half of the cores), kvmapds where the connector is kvmap's,
and the project's proxy in front routing as that connector needs.

- ``kvmap-pull``: KVMapConnector, the proxy in pull mode (prefill first,
  then decode with the prefill's kv_transfer_params).
- ``kvmap-push``: the same servers, the proxy in push mode (both at once,
  the prefill kvmapd named by --prefill-params), layer-group push.
- ``nixl-pull``: vLLM's NixlConnector (``kv_buffer_device: cpu``), pull mode.
- ``nixl-push``: vLLM's NixlPushConnector, push mode (the prefill's NIXL
  side channel named by --prefill-params).

kvmap's two share one pair of servers (their prefix caches are reset in
between); each of vLLM's connectors needs servers of its own.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmap.tools import vllm_servers as vs
from kvmap.tools.launch import DaemonProc, start_daemon

CONNECTORS = ("kvmap-pull", "kvmap-push", "nixl-pull", "nixl-push")
SERVER_START_S = 400.0
PREFILL_ENGINE = "prefill-engine"


@dataclass(frozen=True)
class Stack:
    """Running servers and the proxy of one connector (or of kvmap's two)."""

    prefill: vs.Proc
    decode: vs.Proc
    # Proxy by connector name.
    proxies: dict[str, vs.Proc]
    daemons: tuple[DaemonProc, ...] = ()

    def reset_prefix_caches(self) -> None:
        """Both servers forget their prefix caches (vLLM's dev endpoint)."""
        for server in (self.prefill, self.decode):
            reply = vs.request(server.port, "POST", "/reset_prefix_cache", b"", timeout=60)
            if reply.status != 200:
                raise RuntimeError(f"reset_prefix_cache: {reply.status} {reply.body[:300]!r}")


def _kvmap_config(role: str, daemon: DaemonProc, push_layer_groups: int) -> dict[str, Any]:
    extra = {
        "socket": daemon.socket,
        "peer_address": daemon.tcp_target,
        "push_layer_groups": push_layer_groups,
    }
    return {
        "kv_connector": "KVMapConnector",
        "kv_connector_module_path": "kvmap.client.vllm_connector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": f"{role}-engine",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def _nixl_config(connector: str, role: str) -> dict[str, Any]:
    return {
        "kv_connector": connector,
        "kv_buffer_device": "cpu",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": f"{role}-engine",
        "kv_load_failure_policy": "recompute",
    }


def _servers(
    tmp: Path,
    model: Path,
    configs: tuple[dict[str, Any], dict[str, Any]],
    serve_args: Sequence[str],
    nixl_port: int = 0,
) -> tuple[vs.Proc, vs.Proc]:
    """A prefill and a decode server, healthy; both stopped if either fails."""
    prefill = vs.start_vllm_server(
        tmp, "prefill", model, configs[0], "prefill", serve_args=serve_args, nixl_port=nixl_port
    )
    decode = vs.start_vllm_server(tmp, "decode", model, configs[1], "decode", serve_args=serve_args)
    try:
        vs.wait_healthy(prefill, SERVER_START_S)
        vs.wait_healthy(decode, SERVER_START_S)
    except BaseException:
        decode.stop()
        prefill.stop()
        raise
    return prefill, decode


@contextlib.contextmanager
def kvmap_stack(
    tmp: Path, model: Path, serve_args: Sequence[str], push_layer_groups: int
) -> Iterator[Stack]:
    """kvmap's pull and push proxies over one pair of servers and kvmapds."""
    pd = start_daemon(tmp / "kp", "--planner", "coalesce", name="p")
    dd = start_daemon(tmp / "kd", "--planner", "coalesce", name="d")
    started: list[vs.Proc] = []
    try:
        configs = (
            _kvmap_config("prefill", pd, push_layer_groups),
            _kvmap_config("decode", dd, push_layer_groups),
        )
        prefill, decode = _servers(tmp, model, configs, serve_args)
        started += [prefill, decode]
        pair = ("--prefill", prefill.url, "--decode", decode.url)
        started.append(vs.start_proxy(tmp, "proxy-pull", *pair, "--mode", "pull"))
        push_params = {"kvmap_push_target": pd.tcp_target, "remote_engine_id": PREFILL_ENGINE}
        push = ("--mode", "push", "--prefill-params", json.dumps(push_params))
        started.append(vs.start_proxy(tmp, "proxy-push", *pair, *push))
        proxies = {"kvmap-pull": started[2], "kvmap-push": started[3]}
        yield Stack(prefill, decode, proxies, (pd, dd))
    finally:
        for proc in reversed(started):
            proc.stop()
        for daemon in (dd, pd):
            daemon.stop()


@contextlib.contextmanager
def nixl_stack(tmp: Path, model: Path, serve_args: Sequence[str], push: bool) -> Iterator[Stack]:
    """vLLM's NixlConnector (pull) or NixlPushConnector (push) behind the proxy."""
    connector = "NixlPushConnector" if push else "NixlConnector"
    nixl_port = vs.free_port()
    configs = (_nixl_config(connector, "prefill"), _nixl_config(connector, "decode"))
    prefill, decode = _servers(tmp, model, configs, serve_args, nixl_port=nixl_port)
    started = [prefill, decode]
    try:
        pair = ("--prefill", prefill.url, "--decode", decode.url)
        mode: tuple[str, ...]
        if push:
            side_channel = {
                "remote_engine_id": PREFILL_ENGINE,
                "remote_host": vs.HOST,
                "remote_port": nixl_port,
                "tp_size": 1,
            }
            mode = ("--mode", "push", "--prefill-params", json.dumps(side_channel))
        else:
            mode = ("--mode", "pull")
        started.append(vs.start_proxy(tmp, "proxy", *pair, *mode))
        yield Stack(prefill, decode, {"nixl-push" if push else "nixl-pull": started[-1]})
    finally:
        for proc in reversed(started):
            proc.stop()
