"""Every test says what behaviour it pins: each test function that pytest
collects from tests/**/test_*.py (module level, or a method of a class) has a
docstring.

A test's name is too short to say what it asserts and what it leaves out; the
docstring is where a reader, or a reviewer deciding whether a failure matters,
finds the behaviour the test holds the code to. Files are parsed with ``ast``,
not imported, so those that cannot import on this machine (GPU, vLLM) are
checked too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"

Function = ast.FunctionDef | ast.AsyncFunctionDef


def collected_tests(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, Function]]:
    """(qualified name, node) of the ``test_*`` functions pytest collects from
    ``body``: functions of the module and methods of its classes (nested
    classes too), not functions defined inside other functions."""
    for node in body:
        if isinstance(node, Function) and node.name.startswith("test_"):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from collected_tests(node.body, f"{prefix}{node.name}.")


def missing_docstrings(name: str, source: str) -> list[str]:
    """``name:function`` for each collected test function of ``source`` (the
    text of the file ``name``) that has no docstring."""
    tree = ast.parse(source, filename=name)
    return [
        f"{name}:{qualname}"
        for qualname, node in collected_tests(tree.body)
        if ast.get_docstring(node) is None
    ]


def test_every_test_function_has_a_docstring() -> None:
    """Every collected test function under tests/ has a docstring; the failure
    lists file:function of each one that lacks it."""
    files = sorted(TESTS.rglob("test_*.py"))
    assert files, f"no test files under {TESTS}"
    missing = [
        entry
        for path in files
        for entry in missing_docstrings(
            path.relative_to(REPO).as_posix(), path.read_text(encoding="utf-8")
        )
    ]
    listing = "\n".join(missing)
    assert not missing, f"{len(missing)} test functions without a docstring:\n{listing}"


@pytest.mark.parametrize(
    ("source", "missing"),
    [
        ("def test_a():\n    assert True\n", ["t.py:test_a"]),
        ("async def test_a():\n    assert True\n", ["t.py:test_a"]),
        ("class TestX:\n    def test_m(self):\n        pass\n", ["t.py:TestX.test_m"]),
        (
            "class TestX:\n    class TestY:\n        def test_m(self):\n            pass\n",
            ["t.py:TestX.TestY.test_m"],
        ),
        # A comment, or a string that is not the first statement, is no docstring.
        ("def test_a():\n    # pins nothing\n    pass\n", ["t.py:test_a"]),
        ("def test_a():\n    x = 1\n    'late'\n", ["t.py:test_a"]),
        ("@decorated\ndef test_a():\n    pass\n", ["t.py:test_a"]),
    ],
    ids=["function", "async", "method", "nested-class", "comment", "late-string", "decorated"],
)
def test_a_test_without_a_docstring_is_reported(source: str, missing: list[str]) -> None:
    """The checker reports, as file:qualified name, a test function, async test
    or test method whose first statement is not a string."""
    assert missing_docstrings("t.py", source) == missing


@pytest.mark.parametrize(
    "source",
    [
        'def test_a():\n    """Pins a."""\n',
        'async def test_a():\n    """Pins a."""\n',
        'class TestX:\n    def test_m(self):\n        """Pins m."""\n',
        # Helpers are not tests, nor are test_* functions nested in a test.
        "def helper():\n    pass\n",
        'def test_a():\n    """Pins a."""\n\n    def test_inner():\n        pass\n',
    ],
    ids=["function", "async", "method", "helper", "nested-function"],
)
def test_documented_tests_and_non_tests_pass(source: str) -> None:
    """The checker accepts documented tests and ignores functions pytest does
    not collect as tests (helpers, test_* functions nested in another function)."""
    assert missing_docstrings("t.py", source) == []
