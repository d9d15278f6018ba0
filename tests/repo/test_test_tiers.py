"""The suite's own organisation: every test in exactly one tier, the serial
phase naming files that exist, and the Hypothesis profiles keeping CI's
example counts (``tests/support/tiers.py``, ``hypothesis_profiles.py``)."""

from __future__ import annotations

from pathlib import Path

import hypothesis_profiles as hp
import pytest
import tiers
from hypothesis import given, settings
from hypothesis import strategies as st

TESTS = Path(__file__).resolve().parents[1]


def test_tiers_follow_directories_and_explicit_marks() -> None:
    """tests/vllm and tests marked vllm are the vllm tier; process directories and tests marked
    integration the integration tier; the rest fast, whatever else they are marked."""
    assert tiers.tier_of("vllm/test_vllm_pd.py", set()) == "vllm"
    assert tiers.tier_of("client/test_vllm_adapter.py", {"vllm"}) == "vllm"
    assert tiers.tier_of("fuzz/test_fuzz_support.py", set()) == "integration"
    assert tiers.tier_of("deploy/test_upgrade_script.py", {"integration"}) == "integration"
    assert tiers.tier_of("unit/test_planner.py", {"timeout", "parametrize"}) == "fast"
    assert tiers.tier_of("engine/test_engine_leases.py", set()) == "fast"


def test_serial_phase_takes_vllm_engines_listed_files_and_marked_tests() -> None:
    """Every test of tests/vllm, the listed files and tests marked serial run alone; an
    in-process test and a daemon test that keeps its ports do not."""
    assert tiers.is_serial("vllm/test_vllm_tp.py", set())
    assert tiers.is_serial("integration/test_restart.py", set())
    assert tiers.is_serial("unit/test_planner.py", {"serial"})
    assert not tiers.is_serial("unit/test_planner.py", set())
    assert not tiers.is_serial("integration/test_transfers.py", {"integration"})
    assert not tiers.is_serial("client/test_vllm_adapter.py", {"vllm"})


def test_serial_files_and_directories_exist() -> None:
    """A renamed or moved file would silently leave the serial phase (or the front of the run
    order): each listed file and directory is in the tree."""
    missing = [f for f in [*tiers.SERIAL_FILES, *tiers.LONGEST_FIRST] if not (TESTS / f).is_file()]
    missing += [
        d for d in tiers.PROCESS_DIRECTORIES | tiers.SERIAL_DIRECTORIES if not (TESTS / d).is_dir()
    ]
    assert not missing, missing


def test_the_longest_files_run_first() -> None:
    """``LONGEST_FIRST`` files rank by their place in it, ahead of every other file."""
    ranks = [tiers.start_rank(f) for f in [*tiers.LONGEST_FIRST, "unit/test_config.py"]]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)


def test_collected_tests_carry_exactly_their_tier(request: pytest.FixtureRequest) -> None:
    """Every test of this session carries one tier marker, the one the rules give."""
    for item in request.session.items:
        names = {m.name for m in item.iter_markers()}
        assert len(names & set(tiers.TIERS)) == 1, (item.nodeid, names)


def test_profile_is_ci_on_ci_machines_and_when_asked() -> None:
    """``KVMAP_HYPOTHESIS_PROFILE`` wins; without it a CI machine runs ci and any other dev;
    an unknown profile is refused."""
    assert hp.profile_name("", on_ci_machine=True) == "ci"
    assert hp.profile_name("", on_ci_machine=False) == "dev"
    assert hp.profile_name("ci", on_ci_machine=False) == "ci"
    assert hp.profile_name(" DEV ", on_ci_machine=True) == "dev"
    with pytest.raises(ValueError, match="expected 'ci' or 'dev'"):
        hp.profile_name("quick", on_ci_machine=False)


def test_ci_keeps_every_count_and_dev_runs_a_tenth() -> None:
    """ci runs a test's full count; dev a tenth of it, at least 10 and never more than asked."""
    assert [hp.scaled(n, "ci") for n in (1, 10, 150, 3000)] == [1, 10, 150, 3000]
    assert [hp.scaled(n, "dev") for n in (1, 10, 150, 3000)] == [1, 10, 15, 300]


def test_ci_profile_is_what_hypothesis_chose_by_itself() -> None:
    """The ci profile is Hypothesis' own choice on import (its default profile, or its ci
    profile on a CI machine), so CI checks exactly what it did before the profiles; dev
    differs from it only in the example count."""
    built_in = settings.get_profile(hp.BUILT_IN)
    ci, dev = settings.get_profile(hp.CI_PROFILE), settings.get_profile(hp.DEV_PROFILE)
    assert repr(ci) == repr(built_in)
    assert dev.max_examples == hp.scaled(built_in.max_examples, "dev")
    assert repr(settings(dev, max_examples=built_in.max_examples)) == repr(built_in)


RUNS: list[int] = []


@settings(max_examples=hp.examples(40), database=None)
@given(st.integers())
def _forty_examples(value: int) -> None:
    RUNS.append(value)


def test_a_named_count_runs_as_the_profile_scales_it() -> None:
    """A test that names its count through ``examples`` runs exactly that many examples under
    the loaded profile (40 under ci, 10 under dev)."""
    RUNS.clear()
    _forty_examples()
    assert len(RUNS) == hp.examples(40) == hp.scaled(40, hp.PROFILE)


def test_the_profile_asked_for_is_loaded() -> None:
    """Tests that name no count run the loaded profile's, and that profile is the one this run
    asked for."""
    assert settings.get_current_profile_name() == hp.PROFILE
    assert settings().max_examples == settings.get_profile(hp.PROFILE).max_examples
