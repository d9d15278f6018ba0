"""Hypothesis profiles: ``ci`` runs every property test with its full number
of examples (what CI has always checked), ``dev`` with a tenth of them for a
quick local iteration.

The profile is ``ci`` where ``KVMAP_HYPOTHESIS_PROFILE=ci`` (``.ci/check``
sets it) or where Hypothesis finds itself on a CI machine (``CI=true``,
``GITHUB_ACTIONS``, ...), ``dev`` otherwise; ``KVMAP_HYPOTHESIS_PROFILE=dev``
asks for ``dev`` even there. ``ci`` is exactly the settings Hypothesis chose
by itself before these profiles existed: its ``default`` profile, or on a CI
machine its own ``ci`` profile (derandomized, no deadline, no database).
``tests/conftest.py`` loads the profile before any test module is collected.

A test's own ``@settings(max_examples=N)`` wins over any profile (that is
how Hypothesis merges settings), so a test that names its count writes
``max_examples=examples(N)``: N under ``ci``, a tenth (at least
``DEV_MIN_EXAMPLES``) under ``dev``. Tests that name no count take the
profile's.
"""

from __future__ import annotations

import os

from hypothesis import settings

CI_PROFILE, DEV_PROFILE = "ci", "dev"
DEV_DIVISOR = 10
DEV_MIN_EXAMPLES = 10


# What Hypothesis loaded by itself on import: "ci" on a CI machine, else
# "default". Read before load_profile replaces it.
BUILT_IN = settings.get_current_profile_name()


def profile_name(asked: str, on_ci_machine: bool) -> str:
    """``ci`` or ``dev``: ``asked`` (``KVMAP_HYPOTHESIS_PROFILE``) if set,
    else ``ci`` on a CI machine and ``dev`` elsewhere."""
    asked = asked.strip().lower()
    if asked:
        if asked not in (CI_PROFILE, DEV_PROFILE):
            raise ValueError(f"KVMAP_HYPOTHESIS_PROFILE={asked!r}: expected 'ci' or 'dev'")
        return asked
    return CI_PROFILE if on_ci_machine else DEV_PROFILE


def scaled(full: int, profile: str) -> int:
    """The examples a test that asks for ``full`` runs under ``profile``."""
    if profile == CI_PROFILE:
        return full
    return min(full, max(DEV_MIN_EXAMPLES, full // DEV_DIVISOR))


PROFILE = profile_name(os.environ.get("KVMAP_HYPOTHESIS_PROFILE", ""), BUILT_IN == "ci")


def examples(full: int) -> int:
    """``max_examples`` for a test whose full (CI) count is ``full``."""
    return scaled(full, PROFILE)


def load_profile() -> None:
    """Register both profiles and load the one this run asks for."""
    today = settings.get_profile(BUILT_IN)
    settings.register_profile(CI_PROFILE, today)
    settings.register_profile(
        DEV_PROFILE, today, max_examples=scaled(today.max_examples, DEV_PROFILE)
    )
    settings.load_profile(PROFILE)
