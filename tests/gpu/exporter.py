"""A GPU worker in miniature for tests/gpu: allocates uint8 tensors on a GPU,
fills tensor i with ``expected(i, n)``, exports them with the client's
``export_cuda_tensors`` and prints one JSON line describing the exported
storages; then answers JSON-line commands on stdin (``read``, ``exit``).

Run as ``python tests/gpu/exporter.py SIZE [SIZE ...]``: a separate process,
since CUDA IPC handles cannot be opened by the process that exported them.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from kvmap.client.cuda_export import export_cuda_tensors


def expected(i: int, n: int) -> bytes:
    """The bytes tensor ``i`` holds: a pattern that differs per tensor."""
    return bytes((k * 7 + i * 13) % 251 for k in range(n))


def main(argv: list[str]) -> int:
    sizes = [int(s) for s in argv]
    tensors = []
    for i, n in enumerate(sizes):
        t = torch.tensor(list(expected(i, n)), dtype=torch.uint8, device="cuda:0")
        tensors.append(t)
    torch.cuda.synchronize()
    storages, views = export_cuda_tensors(tensors)
    info = {
        "pid": os.getpid(),
        "storages": [
            {
                "uuid": s.device_uuid,
                "handle": s.handle.hex(),
                "offset": s.offset_bytes + views[i].offset_bytes,
                "size": s.storage_size_bytes,
                "block": s.block_size_bytes,
            }
            for i, s in enumerate(storages)
        ],
    }
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        if cmd["cmd"] == "read":
            t = tensors[cmd["i"]]
            data = bytes(t[cmd["off"] : cmd["off"] + cmd["n"]].cpu().tolist())
            print(json.dumps({"hex": data.hex()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
