"""Functions stay short: no function in daemon/, client/ or tools/ is longer
than MAX_LINES lines (its ``def`` line to its last line, docstring and nested
functions included) unless it says why.

A function that genuinely reads better whole carries a comment
``# long-function: <reason>`` on its ``def`` line or on the line just above
it (above its decorators, if it has any). Files are parsed with ``ast``, not
imported, so modules that cannot import on this machine (GPU, vLLM) are
checked too.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("core", "daemon", "client", "tools")
MAX_LINES = 60
_MARK = re.compile(r"#\s*long-function:\s*\S")

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _marked(lines: list[str], node: Function) -> bool:
    """Whether the ``def`` line or the line above the function (above its
    decorators) carries a ``# long-function: <reason>`` comment."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    candidates = {node.lineno, node.lineno - 1, first - 1}
    return any(1 <= n <= len(lines) and _MARK.search(lines[n - 1]) for n in candidates)


def long_functions(name: str, source: str, limit: int = MAX_LINES) -> Iterator[str]:
    """``name:line function (N lines)`` for each function of ``source`` (the
    text of the file ``name``) longer than ``limit`` lines and not marked."""
    lines = source.splitlines()
    for node in ast.walk(ast.parse(source, filename=name)):
        if not isinstance(node, Function):
            continue
        length = (node.end_lineno or node.lineno) - node.lineno + 1
        if length > limit and not _marked(lines, node):
            yield f"{name}:{node.lineno} {node.name} ({length} lines)"


def _sources() -> Iterator[Path]:
    for root in ROOTS:
        yield from sorted((REPO / root).rglob("*.py"))


def test_no_unmarked_function_is_over_the_limit() -> None:
    """No function under daemon/, client/ or tools/ is over MAX_LINES lines
    without a ``# long-function: <reason>`` comment; the failure lists each
    one with its file, line and length."""
    found = [
        hit
        for path in _sources()
        for hit in long_functions(path.relative_to(REPO).as_posix(), path.read_text())
    ]
    assert not found, f"functions over {MAX_LINES} lines (split them, or mark why not):\n" + (
        "\n".join(found)
    )


def _function(body_lines: int, above: str = "", on_def: str = "", decorator: bool = False) -> str:
    head = [above] if above else []
    head += ["@staticmethod"] if decorator else []
    head.append(f"def f() -> None:{'  ' + on_def if on_def else ''}")
    return "\n".join(head + ["    x = 1"] * body_lines) + "\n"


def test_the_check_counts_lines_and_honours_only_a_reasoned_mark() -> None:
    """The checker reports a function one line over the limit and not one at
    the limit, and accepts the mark above the def, above its decorators or on
    the def line, but not a mark without a reason."""
    assert list(long_functions("a.py", _function(4), limit=5)) == []
    assert list(long_functions("a.py", _function(5), limit=5)) == ["a.py:1 f (6 lines)"]
    reason = "# long-function: one branch per rule"
    assert list(long_functions("a.py", _function(5, above=reason), limit=5)) == []
    assert list(long_functions("a.py", _function(5, on_def=reason), limit=5)) == []
    marked_above_decorator = _function(5, above=reason, decorator=True)
    assert list(long_functions("a.py", marked_above_decorator, limit=5)) == []
    unreasoned = _function(5, above="# long-function:")
    assert list(long_functions("a.py", unreasoned, limit=5)) == ["a.py:2 f (6 lines)"]
