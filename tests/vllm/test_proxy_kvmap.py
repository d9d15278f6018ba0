"""kvmap's connector behind the P/D proxy, as users run it: two real vLLM
OpenAI servers (``python -m kvmap.tools.serve``, KVMapConnector), a real
kvmapd next to each, and the proxy in front, once in pull mode and once in
push mode (both at once, one push id, the prefill's kvmapd named by
``--prefill-params``).

Every prompt of test_vllm_pd decodes to a single engine's greedy tokens (its
golden reference), streamed or not, and the decode server took the whole
prompt from the connector (its /metrics count the prompt's tokens as
external, not computed). The daemons' counters show which way the KV went:
pulls are served by the prefill's daemon, pushes are pushed by it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import proxy_support as ps
import pytest
from vllm_harness import PD_MAX_TOKENS, build_model, kvmapd_pair, pd_prompts, single_engine, stats

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

SERVER_START_S = 240.0
REQUEST_S = 180.0
CONNECTOR = {
    "kv_connector": "KVMapConnector",
    "kv_connector_module_path": "kvmap.client.vllm_connector",
    # A load that fails recomputes: the tests tell a loaded prompt from a
    # recomputed one by the server's counters, not by an error.
    "kv_load_failure_policy": "recompute",
}


@dataclass
class KvmapServers:
    prefill: ps.Proc
    decode: ps.Proc
    proxies: dict[str, ps.Proc]
    daemons: Any
    prompts: dict[str, list[int]]
    reference: dict[str, list[int]]


def kv_config(role: str, socket: str, peer_address: str = "") -> dict[str, Any]:
    extra: dict[str, Any] = {"socket": socket, "transfer_timeout_s": 60, "push_timeout_s": 60}
    if peer_address:
        extra["peer_address"] = peer_address
    return {
        **CONNECTOR,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "engine_id": f"{role}-engine",
        "kv_connector_extra_config": extra,
    }


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvmapServers]:
    tmp: Path = tmp_path_factory.mktemp("proxy-kvmap")
    model = build_model(tmp)
    prompts, spare = pd_prompts()
    prompts["spare"] = spare
    reference = dict(
        zip(prompts, single_engine(tmp, model, list(prompts.values()), PD_MAX_TOKENS), strict=True)
    )
    with kvmapd_pair(tmp / "kvmapd-prefill", tmp / "kvmapd-decode") as (pd, dd):
        prefill = ps.start_vllm_server(
            tmp, "prefill", model, kv_config("prefill", pd.socket, pd.tcp_target), "prefill"
        )
        # Push mode: the decode worker names its own kvmapd to the prefill side.
        decode = ps.start_vllm_server(
            tmp, "decode", model, kv_config("decode", dd.socket, dd.tcp_target), "decode"
        )
        started = [prefill, decode]
        try:
            ps.wait_healthy(prefill, SERVER_START_S)
            ps.wait_healthy(decode, SERVER_START_S)
            pair = ("--prefill", prefill.url, "--decode", decode.url)
            started.append(ps.start_proxy(tmp, "proxy-pull", *pair, "--mode", "pull"))
            push_params = json.dumps(
                {"kvmap_push_target": pd.tcp_target, "remote_engine_id": "prefill-engine"}
            )
            started.append(
                ps.start_proxy(
                    tmp, "proxy-push", *pair, "--mode", "push", "--prefill-params", push_params
                )
            )
            proxies = {"pull": started[2], "push": started[3]}
            yield KvmapServers(prefill, decode, proxies, (pd, dd), prompts, reference)
        finally:
            for proc in reversed(started):
                proc.stop()


def completion(
    servers: KvmapServers, mode: str, prompt: list[int], stream: bool = False
) -> ps.Reply:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": PD_MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
        "stream": stream,
    }
    return ps.request(
        servers.proxies[mode].port, "POST", "/v1/completions", body, timeout=REQUEST_S
    )


def forget_prefixes(servers: KvmapServers) -> None:
    """Both servers drop their prefix caches (vLLM's dev endpoint), so a
    prompt seen before is neither a prefix hit on decode (nothing to load)
    nor on prefill."""
    for server in (servers.prefill, servers.decode):
        reply = ps.request(server.port, "POST", "/reset_prefix_cache", b"", timeout=30)
        assert reply.status == 200, reply.body[:500]


def transfers(d: Any) -> tuple[int, int]:
    """A daemon's (pushes done, transfers served) counters, settled: the
    owner counts a transfer when the peer's notification arrives."""
    return ps.settled(lambda: (stats(d).transfers.pushes_done, stats(d).transfers.served_done))


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_every_prompt_is_loaded_and_decodes_as_a_single_engine(
    servers: KvmapServers, mode: str
) -> None:
    """Each prompt through the proxy: the single engine's tokens, and the
    decode server counts the prompt's tokens as external (vLLM computes at
    most the last one itself); the prefill's daemon served one pull per
    prompt (pull) or pushed every one (push), and the decode's daemon took
    them."""
    pd, dd = servers.daemons
    names = [n for n in servers.prompts if n != "spare"]
    pushed_before, served_before = transfers(pd)
    decode_served_before = transfers(dd)[1]
    for name in names:
        forget_prefixes(servers)
        prompt = servers.prompts[name]
        seen = ps.external_prompt_tokens(servers.decode)
        reply = completion(servers, mode, prompt)
        assert ps.tokens_of(reply, stream=False) == servers.reference[name], (name, mode)
        loaded = ps.external_prompt_tokens(servers.decode) - seen
        assert len(prompt) - 1 <= loaded <= len(prompt), (name, mode, loaded)
    pushed, served = transfers(pd)
    if mode == "pull":
        assert (pushed - pushed_before, served - served_before) == (0, len(names))
    else:
        # A push is one or more layer groups (Push calls), each served by
        # the decode's daemon; no pull reached the prefill's.
        assert pushed - pushed_before >= len(names)
        assert served == served_before
        assert transfers(dd)[1] - decode_served_before == pushed - pushed_before


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_streamed_completion_is_loaded_too(servers: KvmapServers, mode: str) -> None:
    """Streamed: the SSE events carry the single engine's tokens and end
    with [DONE]; the prompt was loaded, not computed."""
    forget_prefixes(servers)
    prompt = servers.prompts["spare"]
    seen = ps.external_prompt_tokens(servers.decode)
    reply = completion(servers, mode, prompt, stream=True)
    assert ps.tokens_of(reply, stream=True) == servers.reference["spare"], mode
    assert ps.external_prompt_tokens(servers.decode) - seen >= len(prompt) - 1
