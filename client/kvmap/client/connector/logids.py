"""How the connector's log lines name a transfer: ``key=value`` words with
the field names of kvmapd's JSON log lines (``request_id``, ``transfer_id``,
``peer``, ``worker``), so that one id found in vLLM's log finds the same
transfer in both daemons' logs (docs/runbook.md, "Following one request")."""

from __future__ import annotations

from kvmap.v1 import types_pb2


def worker_name(worker: types_pb2.WorkerId) -> str:
    """A worker as kvmapd logs it (``ENGINE/dpN/tpN/ppN``)."""
    return f"{worker.engine_id}/dp{worker.dp_rank}/tp{worker.tp_rank}/pp{worker.pp_rank}"


def ids(
    request_id: str,
    *,
    local_request_id: str = "",
    transfer_id: str = "",
    peer: str = "",
    worker: types_pb2.WorkerId | None = None,
    trace_id: str = "",
) -> str:
    """``request_id=... [transfer_id=...] [peer=...] [worker=...]
    [trace_id=...]``: the ids this line has (``trace_id``: its trace's, when
    traced). ``request_id`` is the id the daemons know the transfer
    by (the prefill request's, which the grant names); ``local_request_id``
    this engine's own id of the request, where it differs."""
    words = [f"request_id={request_id}"]
    if local_request_id and local_request_id != request_id:
        words.append(f"local_request_id={local_request_id}")
    if transfer_id:
        words.append(f"transfer_id={transfer_id}")
    if peer:
        words.append(f"peer={peer}")
    if worker is not None:
        words.append(f"worker={worker_name(worker)}")
    if trace_id:
        words.append(f"trace_id={trace_id}")
    return " ".join(words)
