"""kvmap client library and vLLM connector.

- ``KvmapClient`` / ``AsyncKvmapClient``: the daemon's API over a transport
  (``transports.GrpcTransport`` to a live kvmapd, ``transports.MemoryTransport``
  to an in-process stand-in); errors are ``errors.KvmapClientError`` subclasses.
- ``WorkerSession``: keeps a worker registered and attached across daemon restarts.
- ``geometry``: KV cache tensors -> registration; ``shm_export`` / ``cuda_export``:
  memory handles.
- ``pd``: the P/D state machines; ``vllm_connector.KVMapConnector``: the vLLM
  connector (the only module that imports vLLM).
"""

from kvmap.client.aio import AsyncKvmapClient
from kvmap.client.client import KvmapClient, TransferResult
from kvmap.client.session import Backoff, WorkerSession

__all__ = ["AsyncKvmapClient", "Backoff", "KvmapClient", "TransferResult", "WorkerSession"]
