"""Push offers on the prefill side's daemon: a decode daemon offers a decode
worker's blocks, granted for writing, to one of this daemon's engines
(Peer.OfferPush); the offer is checked (``core.push_offers``, as the api
reads it off the wire) and relayed to every attached worker of that engine
as a live ``push_offered`` event.

Offers are not stored. The prefill worker that needs one (its request was
given the offer's push id) keeps it until it pushes; one that no worker
heard (none attached, the daemon restarting) ends in the decode side's
timeout, which revokes the grant and recomputes: never wrong KV, only a
slower request.
"""

from __future__ import annotations

import structlog

from kvmap.core.errors import NotFound
from kvmap.core.push_offers import Offer
from kvmap.core.worker_events import PushOffered
from kvmap.daemon.engine.workers import WorkerTable

log = structlog.get_logger("kvmapd.push_offers")


class PushOfferRelay:
    def __init__(self, table: WorkerTable) -> None:
        self._table = table
        # Offers relayed and refused since start (Admin stats, logs).
        self.relayed = 0
        self.refused = 0

    def refuse_malformed(self) -> None:
        """An offer failed its checks (``core.push_offers``) on its way in:
        counted among the refused."""
        self.refused += 1

    def relay(self, offer: Offer, *, peer: str) -> int:
        """Hand a checked ``offer`` (from the authenticated ``peer``) to the
        attached workers of its prefill engine: how many. NOT_FOUND when
        none is attached (the decode side gives up at once rather than
        waiting out its timeout)."""
        keys = [
            r.key
            for r in self._table.records()
            if r.key.engine_id == offer.prefill_engine_id and self._table.subscriber_count(r.key)
        ]
        if not keys:
            self.refused += 1
            raise NotFound(f"no attached worker of engine {offer.prefill_engine_id!r}")
        event = PushOffered(offer=offer, peer=peer)
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
