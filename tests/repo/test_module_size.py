"""Modules stay small: no Python module under core/, daemon/, client/ or
tools/ is longer than MAX_LINES lines, the module-sized sibling of the
function budget (tests/repo/test_function_length.py). A module over it holds
more than one responsibility: split it by responsibility, not by cutting it
in half. The generated code under protos/gen is not covered."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("core", "daemon", "client", "tools")
MAX_LINES = 600


def oversized(name: str, source: str, limit: int = MAX_LINES) -> str | None:
    """``name (N lines)`` when the text of the module ``name`` has more than
    ``limit`` lines, else None."""
    length = len(source.splitlines())
    return f"{name} ({length} lines)" if length > limit else None


def _modules() -> Iterator[Path]:
    for root in ROOTS:
        yield from sorted((REPO / root).rglob("*.py"))


def test_no_module_is_over_the_limit() -> None:
    """Every module under core/, daemon/, client/ and tools/ has at most
    MAX_LINES lines; the failure lists each one over it with its length."""
    modules = list(_modules())
    assert len(modules) > 50, "the source roots moved: update ROOTS"
    found = [
        hit
        for path in modules
        if (hit := oversized(path.relative_to(REPO).as_posix(), path.read_text())) is not None
    ]
    assert not found, f"modules over {MAX_LINES} lines (split them by responsibility):\n" + (
        "\n".join(found)
    )


def test_the_check_counts_every_line_up_to_the_limit() -> None:
    """A module of exactly the limit passes and one line more fails, whatever
    the lines hold (code, comments, blank lines, a missing final newline)."""
    assert oversized("m.py", "x = 1\n" * MAX_LINES) is None
    assert oversized("m.py", "x = 1\n" * (MAX_LINES + 1)) == f"m.py ({MAX_LINES + 1} lines)"
    mixed = "# why\n\n" * 300 + "x = 1"
    assert oversized("m.py", mixed) == f"m.py ({MAX_LINES + 1} lines)"
    assert oversized("m.py", mixed, limit=MAX_LINES + 1) is None
