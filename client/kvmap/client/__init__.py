"""kvmap client library and vLLM connector.

- ``KvmapClient`` / ``AsyncKvmapClient``: the daemon's API over a transport
  (``transports.KvmapdTransport`` to a live kvmapd); errors are the project's one tree,
  ``kvmap.core.errors.KvmapError`` subclasses (``errors.from_rpc_error``).
- ``WorkerSession``: keeps a worker registered and attached across daemon restarts.
- ``memory_export``: a worker's KV memory exported for its daemon (CPU storages
  moved into shared memory, ``shm_export``; CUDA IPC handles, ``cuda_export``);
  ``geometry``: KV cache tensors and that export -> the registration.
- ``connector``: the vLLM connector (its README.md is the reading path): its
  P/D state machines and rules without vLLM (``SchedulerCore``,
  ``WorkerCore``), and ``connector.vllm.KVMapConnector``, the only module that
  imports vLLM, which vLLM loads from ``vllm_connector``.
"""

from kvmap.client.aio import AsyncKvmapClient
from kvmap.client.client import KvmapClient, TransferResult
from kvmap.client.session import Backoff, WorkerSession

__all__ = ["AsyncKvmapClient", "Backoff", "KvmapClient", "TransferResult", "WorkerSession"]
