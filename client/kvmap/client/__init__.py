"""kvmap client library and vLLM connector.

- ``KvmapClient`` / ``AsyncKvmapClient``: the daemon's API over a transport
  (``transports.GrpcTransport`` to a live kvmapd); errors are the project's one tree,
  ``kvmap.core.errors.KvmapError`` subclasses (``errors.from_rpc_error``).
- ``WorkerSession``: keeps a worker registered and attached across daemon restarts.
- ``geometry``: KV cache tensors -> registration; ``shm_export`` / ``cuda_export``:
  memory handles.
- ``connector``: the vLLM connector's P/D state machines, without vLLM
  (``SchedulerCore``, ``WorkerCore``; its README.md is the reading path);
  ``vllm_connector.KVMapConnector``: the vLLM connector (the only module that
  imports vLLM).
"""

from kvmap.client.aio import AsyncKvmapClient
from kvmap.client.client import KvmapClient, TransferResult
from kvmap.client.session import Backoff, WorkerSession

__all__ = ["AsyncKvmapClient", "Backoff", "KvmapClient", "TransferResult", "WorkerSession"]
