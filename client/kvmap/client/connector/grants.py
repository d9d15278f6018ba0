"""The prefill side's grants in this pod's kvmapd: how long one may live,
and taking one back (blocks freed before they were pulled)."""

from __future__ import annotations

import logging

from kvmap.client.client import KvmapClient
from kvmap.client.connector.logids import ids
from kvmap.core.errors import KvmapError
from kvmap.v1 import types_pb2

log = logging.getLogger("kvmap.client.connector")

# The longest grant kvmapd gives (GrantTransferRequest.ttl_ms).
MAX_GRANT_TTL_MS = 3_600_000


def revoke(client: KvmapClient, worker: types_pb2.WorkerId, request_id: str) -> None:
    """Take back the grants of ``request_id`` on ``worker`` (its blocks are
    being freed): best effort, since a grant also ends with its time."""
    try:
        client.revoke_transfer(worker, request_id)
    except KvmapError as err:
        log.warning(
            "%s: revoking its transfer grant failed: %s",
            ids(request_id, worker=worker),
            err.message,
        )
