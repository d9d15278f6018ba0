"""Push offers on the prefill side's daemon: a decode daemon offers a decode
worker's blocks, granted for writing, to one of this daemon's engines
(Peer.OfferPush); the offer is checked (``core.push_offers``) and relayed
to every attached worker of that engine as a live ``push_offered`` event.

Offers are not stored. The prefill worker that needs one (its request was
given the offer's push id) keeps it until it pushes; one that no worker
heard (none attached, the daemon restarting) ends in the decode side's
timeout, which revokes the grant and recomputes: never wrong KV, only a
slower request.
"""

from __future__ import annotations

import structlog

from kvmap.core.errors import KvmapError, NotFound
from kvmap.core.push_offers import offer_from_proto
from kvmap.daemon.engine.workers import WorkerTable
from kvmap.v1 import registry_pb2, types_pb2

log = structlog.get_logger("kvmapd.push_offers")


class PushOfferRelay:
    def __init__(self, table: WorkerTable) -> None:
        self._table = table
        # Offers relayed and refused since start (Admin stats, logs).
        self.relayed = 0
        self.refused = 0

    def relay(self, msg: types_pb2.PushOffer, *, peer: str) -> int:
        """Check ``msg`` (from the authenticated ``peer``) and hand it to the
        attached workers of its prefill engine: how many. NOT_FOUND when
        none is attached (the decode side gives up at once rather than
        waiting out its timeout)."""
        try:
            offer = offer_from_proto(msg)
        except KvmapError:
            self.refused += 1
            raise
        keys = [
            r.key
            for r in self._table.records()
            if r.key.engine_id == offer.prefill_engine_id and self._table.subscriber_count(r.key)
        ]
        if not keys:
            self.refused += 1
            raise NotFound(f"no attached worker of engine {offer.prefill_engine_id!r}")
        event = registry_pb2.AttachResponse(
            push_offered=registry_pb2.PushOfferedEvent(offer=msg, peer=peer)
        )
        for key in keys:
            self._table.publish(key, event)
        self.relayed += 1
        log.debug(
            "push_offered",
            push_id=offer.push_id[:8],
            engine=offer.prefill_engine_id,
            decode_worker=offer.decode_worker.engine_id,
            blocks=offer.blocks,
            workers=len(keys),
            peer=peer,
        )
        return len(keys)
