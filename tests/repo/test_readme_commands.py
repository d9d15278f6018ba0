"""Every command the README shows works as shown.

The README's code fences that hold commands are untagged or tagged ``sh``;
output and diagrams are tagged ``text`` (code ``python``, ``json``, ``toml``).
Each command of them (comments dropped, ``\\`` continuations joined, ``&&``
chains split) is checked by the rule for its program:

- ``kvmapd`` and ``kvmapctl`` (as ``.venv/bin/NAME`` or bare; NAME must be a
  console script of pyproject.toml): commands that finish at once
  (``--help``, ``--version``, ``kvmapd plan``, ``kvmapd check-config``) run
  for real and must exit 0. The others (``kvmapd serve``, ``demo``,
  ``bench``, ``kvmapctl`` against a daemon) run in a fresh interpreter whose
  argparse stops, with exit 0, right after the command's own parser took
  every flag and value, so nothing starts; ``kvmapd serve``'s arguments must
  also pass ``kvmapd check-config``, which takes serve's file and flags and
  checks their values;
- ``python -m MODULE ...``: parsed in the same way;
- ``bash .ci/NAME``: the script exists and ``bash -n`` parses it.

A command that no rule covers fails: a new kind of command needs a rule
here. The figures in the trailing comment of a command that runs for real
(``# 2 regions, 64,044 descriptors``) must appear in its output. The
README's first block must stay the two commands CI and the front page
promise.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import textwrap
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
FIRST_COMMANDS = (
    "bash .ci/setup && .venv/bin/kvmapd demo     # set up .venv, run the P/D pull demo",
    "bash .ci/setup && bash .ci/check            "
    "# set up .venv, run the whole test suite (what CI runs)",
)
COMMAND_TAGS = {"", "sh", "bash", "shell"}
# Console script name -> "module:function", as pip installs them.
SCRIPTS: dict[str, str] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
# kvmapd subcommands that finish at once: run for real.
QUICK_SUBCOMMANDS = {"plan", "check-config"}
QUICK_FLAGS = {"-h", "--help", "--version"}
TIMEOUT_S = 60
PARSED = "README-CHECK: parsed by"
# Run as ``python -c``: argparse stops with exit 0 after the first
# parse_args that succeeds, then the program runs as its console script or
# ``python -m`` would run it; a mistake exits as the program's parser says.
_PARSE_ONLY = textwrap.dedent(
    f"""
    import argparse, importlib, runpy, sys

    def parse_only(self, args=None, namespace=None):
        _parse(self, args, namespace)
        print({PARSED!r}, self.prog)
        raise SystemExit(0)

    _parse = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = parse_only
    kind, target, *argv = sys.argv[1:]
    if kind == "module":
        sys.argv = [target, *argv]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        module, _, function = target.partition(":")
        sys.argv = [target, *argv]
        sys.exit(getattr(importlib.import_module(module), function)())
    sys.exit("README-CHECK: the program ended without parsing its arguments")
    """
)
# A figure as the README writes it: 64,044, 2^24, 98.0.
_FIGURE = re.compile(r"\d[\d,.^]*\d|\d")


@dataclass(frozen=True)
class Shown:
    """One simple command of the README: the line it starts on, its words,
    and the comment after it (shared by the commands of an ``&&`` chain)."""

    line: int
    argv: tuple[str, ...]
    comment: str = ""

    def __str__(self) -> str:
        return f"README.md:{self.line}: {shlex.join(self.argv)}"


def command_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(line number of the first line, lines) of each fence that holds commands."""
    blocks: list[tuple[int, list[str]]] = []
    tag: str | None = None
    start, body = 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if tag is None and stripped.startswith("```"):
            tag, start, body = stripped[3:].strip(), number + 1, []
        elif tag is not None and stripped == "```":
            if tag in COMMAND_TAGS:
                blocks.append((start, body))
            tag = None
        elif tag is not None:
            body.append(line)
    assert tag is None, "a code fence is never closed"
    return blocks


def _logical_lines(start: int, body: list[str]) -> list[tuple[int, str]]:
    """The lines with ``\\`` continuations joined, each with its first line's number."""
    out: list[tuple[int, str]] = []
    pending, first = "", start
    for number, line in enumerate(body, start=start):
        if not pending:
            first = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            out.append((first, pending + line))
            pending = ""
    assert not pending, f"line {first}: a continued line never ends"
    return out


def shown_commands(text: str) -> list[Shown]:
    """Every simple command of the command fences of ``text`` (a README)."""
    found = []
    for start, body in command_blocks(text):
        for number, line in _logical_lines(start, body):
            parts = re.split(r"\s#\s", line, maxsplit=1)
            code, comment = parts[0], (parts[1] if len(parts) == 2 else "")
            words = shlex.split(code)
            chain: list[list[str]] = [[]]
            for word in words:
                if word == "&&":
                    chain.append([])
                else:
                    chain[-1].append(word)
            found += [Shown(number, tuple(argv), comment.strip()) for argv in chain if argv]
    return found


def _run(argv: list[str]) -> tuple[int, str]:
    """Exit status and output (stdout, then stderr) of ``argv`` run in the repository."""
    try:
        done = subprocess.run(
            argv, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return -1, f"still running after {TIMEOUT_S} s"
    return done.returncode, done.stdout + done.stderr


def _ran(shown: Shown, argv: list[str], figures: bool = True) -> list[str]:
    """Run ``argv`` for real: it must exit 0 and print the comment's figures."""
    status, output = _run(argv)
    if status != 0:
        return [f"{shown}: exit {status}: {output[-2000:]}"]
    missing = [
        figure
        for figure in (_FIGURE.findall(shown.comment) if figures else [])
        if not re.search(rf"(?<![\d,.]){re.escape(figure)}(?![\d,])", output)
    ]
    return [f"{shown}: the comment says {m}, the output does not: {output[:2000]}" for m in missing]


def _parsed(shown: Shown, kind: str, target: str, args: tuple[str, ...]) -> list[str]:
    """Parse ``args`` with the program's own parser and stop there."""
    status, output = _run([sys.executable, "-c", _PARSE_ONLY, kind, target, *args])
    if status != 0 or PARSED not in output:
        return [f"{shown}: its parser refuses it (exit {status}): {output[-2000:]}"]
    return []


def _script(shown: Shown) -> list[str]:
    """``bash PATH [ARGS]``: PATH is a script of the repository that bash parses."""
    if len(shown.argv) < 2 or shown.argv[1].startswith("-"):
        return [f"{shown}: expected bash SCRIPT"]
    path = REPO / shown.argv[1]
    if not path.is_file() or not path.resolve().is_relative_to(REPO):
        return [f"{shown}: {shown.argv[1]} is not a script of the repository"]
    status, output = _run(["bash", "-n", str(path)])
    return [f"{shown}: bash -n: {output}"] if status != 0 else []


def _console_script(shown: Shown, name: str) -> list[str]:
    """kvmapd or kvmapctl: run when it finishes at once, else parse."""
    args = shown.argv[1:]
    executable = Path(sys.executable).parent / name
    if not executable.is_file():
        return [f"{shown}: {executable} is not installed"]
    if QUICK_FLAGS & set(args) or (name == "kvmapd" and args[:1] and args[0] in QUICK_SUBCOMMANDS):
        return _ran(shown, [str(executable), *args])
    found = _parsed(shown, "script", SCRIPTS[name], args)
    if name == "kvmapd" and args[:1] == ("serve",):
        found += _ran(shown, [str(executable), "check-config", *args[1:]], figures=False)
    return found


def problems(shown: Shown) -> list[str]:
    """What is untrue about ``shown``: [] when it works as the README shows it."""
    program, *rest = shown.argv
    if program == "bash":
        return _script(shown)
    name = program.removeprefix(".venv/bin/")
    if name in SCRIPTS:
        return _console_script(shown, name)
    if name in ("python", "python3") and rest[:1] == ["-m"] and len(rest) > 1:
        return _parsed(shown, "module", rest[1], tuple(rest[2:]))
    return [f"{shown}: no rule of tests/repo/test_readme_commands.py checks this command"]


SHOWN = shown_commands(README.read_text(encoding="utf-8"))


def test_the_readme_opens_with_the_two_commands() -> None:
    """The README's first code block, before any section, is exactly the demo
    command and the test-suite command, with their comments."""
    lines = README.read_text(encoding="utf-8").splitlines()
    fence = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert not [line for line in lines[:fence] if line.startswith("## ")]
    assert lines[fence + 1 : fence + 4] == [*FIRST_COMMANDS, "```"]


def test_the_readme_shows_commands_of_every_kind() -> None:
    """The extraction finds the README's commands: the two of its first block,
    kvmapd's and kvmapctl's (an empty list would make the next test vacuous)."""
    programs = {Path(s.argv[0]).name for s in SHOWN}
    assert {"bash", "kvmapd", "kvmapctl"} <= programs
    assert (".venv/bin/kvmapd", "demo") in {s.argv for s in SHOWN}
    assert ("bash", ".ci/check") in {s.argv for s in SHOWN}


@pytest.mark.parametrize("shown", SHOWN, ids=lambda s: f"line{s.line}:{' '.join(s.argv)[:70]}")
def test_each_command_works_as_shown(shown: Shown) -> None:
    """Each command of the README runs (exit 0, the figures of its comment in
    its output) or, where it would run for long, its own parser takes every
    flag and value it passes (and serve's pass check-config)."""
    assert problems(shown) == []


@pytest.mark.parametrize(
    "fence",
    [
        "```sh\n.venv/bin/kvmapd plan --example glm53-rank   # 3 regions, 64,044 descriptors\n```",
        "```sh\n.venv/bin/kvmapd plan --example no-such-geometry\n```",
        "```sh\n.venv/bin/kvmapd serve --plan coalesce\n```",
        "```sh\n.venv/bin/kvmapd serve --planner no-such-planner\n```",
        "```sh\n.venv/bin/kvmapd demo --blocks 1\n```",
        "```sh\n.venv/bin/kvmapd --no-such-flag\n```",
        "```sh\n.venv/bin/kvmapctl statuses\n```",
        "```sh\npython -m kvmap.tools.load --no-such-flag\n```",
        "```\nbash .ci/setup && bash .ci/no-such-script\n```",
        "```sh\ncurl https://example.com/kvmap\n```",
        "```\nkvmap demo: every byte verified\n```",
    ],
)
def test_untrue_lines_are_caught(fence: str) -> None:
    """A wrong figure, an unknown example, an abbreviated flag, a bad value, an
    unknown command or flag, a missing script, a program no rule checks and
    output in an untagged fence are each reported."""
    shown = shown_commands(fence)
    assert shown
    assert [p for s in shown for p in problems(s)]


def test_text_fences_and_comments_are_not_commands() -> None:
    """``text`` fences (output, diagrams) are skipped; comments and
    continuations are read as a shell reads them."""
    text = (
        "```text\nkvmapd serve --nonsense\n```\n"
        "```sh\nkvmapd plan \\\n  --example glm53-rank   # 2 regions # of them\n```\n"
    )
    assert shown_commands(text) == [
        Shown(5, ("kvmapd", "plan", "--example", "glm53-rank"), "2 regions # of them")
    ]
