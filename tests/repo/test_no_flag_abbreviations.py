"""No command line of the project takes an abbreviated flag (argparse's
default would read ``--plan`` as ``--planner``): every parser and
subparser is made with ``allow_abbrev=False``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE_ROOTS = ("core", "daemon", "client", "tools")
PARSER_CALLS = {"ArgumentParser", "OneLineParser", "add_parser"}


def _parser_calls(tree: ast.AST) -> list[ast.Call]:
    calls = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        # A helper of ours named add_parser (``plan_cmd.add_parser(sub)``)
        # takes the subparsers alone; argparse's takes a name and options.
        named = (
            name != "add_parser"
            or bool(node.keywords)
            or (bool(node.args) and isinstance(node.args[0], ast.Constant))
        )
        if name in PARSER_CALLS and named:
            calls.append(node)
    return calls


def _forbids_abbreviations(call: ast.Call) -> bool:
    return any(
        k.arg == "allow_abbrev" and isinstance(k.value, ast.Constant) and k.value.value is False
        for k in call.keywords
    )


def test_every_parser_refuses_abbreviated_flags() -> None:
    """Every ArgumentParser, OneLineParser and add_parser call in the
    source roots passes allow_abbrev=False; the failure names each one that
    does not (file and line)."""
    found, missing = 0, []
    for root in SOURCE_ROOTS:
        for path in sorted((ROOT / root).rglob("*.py")):
            for call in _parser_calls(ast.parse(path.read_text(), str(path))):
                found += 1
                if not _forbids_abbreviations(call):
                    missing.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert found > 10, "no parsers found: the source roots moved"
    assert not missing, "parsers that accept abbreviated flags:\n" + "\n".join(missing)
