"""Example worker geometries (proto3 JSON of ``RegisterWorkerRequest``), shipped
with the package: ``kvmapd plan --example NAME`` and ``kvmapd demo`` read them
through ``example_path``. ``kvmap.tools.make_examples`` writes them."""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable

NAMES = ("glm-tiny", "glm53-rank", "llama-mha")


def example_path(name: str) -> Traversable:
    """The bundled example ``NAME.json``; ``KeyError`` for an unknown name."""
    if name not in NAMES:
        raise KeyError(name)
    return resources.files(__name__).joinpath(f"{name}.json")
