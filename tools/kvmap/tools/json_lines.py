"""The child side of the JSON-lines protocol that ``launch`` drives: a
worker process prints one ready line, then answers each command line with
one line until ``{"cmd": "exit"}`` or end of input."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, TextIO


def serve(
    ready: dict[str, Any],
    handle: Callable[[dict[str, Any]], dict[str, Any]],
    answers: TextIO | None = None,
) -> None:
    out = answers or sys.stdout
    out.write(json.dumps(ready) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "exit":
            return
        out.write(json.dumps(handle(cmd)) + "\n")
        out.flush()
