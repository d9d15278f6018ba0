"""Loading NIXL without torch.

``import nixl`` is a meta package that picks a CUDA-specific wheel
(``nixl_cu13``, ``nixl_cu12``) and, where torch is installed without CUDA
(the CPU wheel), imports torch to ask it: about 2 s of kvmapd's start-up and
some hundred MB of memory for a library the daemon never uses. NIXL's API
lives in the CUDA-specific package and imports no torch, so ``nixl_module``
imports that directly, choosing it as ``import nixl`` would, and falls back to
the meta package only where none of those packages is installed.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

# NIXL's CUDA-specific packages, in the order ``import nixl`` tries them when
# no CUDA stack is loaded (nixl/__init__.py, _load_cuda_backend).
_CUDA_PACKAGES = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def _preferred_packages() -> list[str]:
    """``_CUDA_PACKAGES``, led by the one matching the CUDA build of an installed
    torch, read from its files as ``import nixl`` reads it (nothing imported)."""
    try:
        from nixl_meta_utils import (  # noqa: PLC0415
            _torch_cuda_version_from_disk,
        )
    except ImportError:  # a NIXL wheel installed without the meta package
        return list(_CUDA_PACKAGES)
    cuda = _torch_cuda_version_from_disk()
    first = [f"nixl_cu{cuda.split('.')[0]}"] if cuda else []
    return first + [name for name in _CUDA_PACKAGES if name not in first]


@functools.cache
def _nixl_package() -> str:
    """The name of the installed package that holds NIXL's ``_api`` and ``_bindings``.

    Raises ImportError when none is installed.
    """
    for name in _preferred_packages():
        try:
            importlib.import_module(f"{name}._api")
        except ModuleNotFoundError as e:
            if e.name != name:
                raise  # the package is there but broken: say so
            continue
        return name
    # None of them: the meta package (which may import torch) decides.
    importlib.import_module("nixl._api")
    return "nixl"


def nixl_module(submodule: str) -> ModuleType:
    """NIXL's ``_api`` or ``_bindings``, imported without torch where possible
    (raw NIXL users, such as the harness's benchmarks, load it through here too)."""
    return importlib.import_module(f"{_nixl_package()}.{submodule}")


UCX_MEMORY_EVENTS = "UCX_MEM_EVENTS"


def disable_ucx_memory_events() -> None:
    """Tell UCX not to hook the process's memory calls, unless the operator
    set ``UCX_MEM_EVENTS`` already. The hooks (patched mmap, munmap, brk and
    their kin) feed UCX's registration caches, which let UCX register user
    buffers on the fly and notice when they are unmapped. kvmapd registers
    every region once, explicitly, keeps it mapped until it deregisters it,
    and transfers only registered memory, so it never uses them; installing
    them costs ~0.4 s of spinning CPU at every start (measured here: the
    UCX backend's creation took 0.40 s with them and 0.002 s without), on
    the path of a restart's unreachable gap."""
    os.environ.setdefault(UCX_MEMORY_EVENTS, "no")
