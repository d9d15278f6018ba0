"""What a caller of the TCP listener can make the daemon hold: each method's
largest request, and the listener's connection, stream and idle limits.

The TCP port faces the network, strangers included, so every bound here is
computed from what a legitimate peer sends, not from the 16 MiB the Unix
socket's workers may send. A refused caller never gets that far: its calls
are refused before their requests are read (``handlers.read_after``), and
gRPC holds at most a flow-control window of each meanwhile.
"""

from __future__ import annotations

from typing import Any

from kvmap.core.config import MAX_MESSAGE_BYTES
from kvmap.core.transfer_plan import MAX_BLOCKS_PER_TRANSFER, MAX_GROUPS_PER_TRANSFER
from kvmap.core.validation import MAX_BLOCKS

# A request that names a worker, a token or nothing at all: worker ids,
# request ids, agent names and capabilities are a few hundred bytes each.
SMALL_REQUEST_BYTES = 64 * 1024
# A block id (below MAX_BLOCKS) as a protobuf varint (7 bits a byte), and
# what one group of a BeginTransfer costs beside its ids (tags, lengths, the
# group number).
_BLOCK_ID_BYTES = -(-(MAX_BLOCKS - 1).bit_length() // 7)
_GROUP_BYTES = 32
# A transfer names at most MAX_BLOCKS_PER_TRANSFER owner's blocks, in at most
# MAX_GROUPS_PER_TRANSFER groups, beside small fields (352 KiB).
BEGIN_TRANSFER_BYTES = (
    MAX_BLOCKS_PER_TRANSFER * _BLOCK_ID_BYTES
    + MAX_GROUPS_PER_TRANSFER * _GROUP_BYTES
    + SMALL_REQUEST_BYTES
)

# Each kvmap method served on TCP and its largest request. PlanPreview takes
# a worker registration: one of thousands of views fits, the largest (up to
# 16 MiB) are previewed over the Unix socket.
TCP_REQUEST_LIMITS: dict[str, int] = {
    "/kvmap.v1.Peer/GetAgentMetadata": SMALL_REQUEST_BYTES,
    "/kvmap.v1.Peer/BeginTransfer": BEGIN_TRANSFER_BYTES,
    # Callers send at most MAX_BEGIN_CALLS_BYTES of calls (peer_batches).
    "/kvmap.v1.Peer/BeginTransfers": BEGIN_TRANSFER_BYTES,
    # Each message of the stream, as a BeginTransfers request.
    "/kvmap.v1.Peer/BeginTransferStream": BEGIN_TRANSFER_BYTES,
    "/kvmap.v1.Peer/EndTransfer": SMALL_REQUEST_BYTES,
    # An offer names at most a transfer's blocks, as BeginTransfer does.
    "/kvmap.v1.Peer/OfferPush": BEGIN_TRANSFER_BYTES,
    "/kvmap.v1.RegionMaps/ListWorkers": SMALL_REQUEST_BYTES,
    "/kvmap.v1.RegionMaps/GetRegionMap": SMALL_REQUEST_BYTES,
    "/kvmap.v1.RegionMaps/PlanPreview": BEGIN_TRANSFER_BYTES,
}
# What gRPC reads of any one request on TCP: health and reflection, open to
# everyone, are read before any handler runs, so this bounds them too.
TCP_MAX_RECEIVE_BYTES = max(TCP_REQUEST_LIMITS.values())


def tcp_request_limit(method: str) -> int:
    """The largest request of ``method`` on TCP (a method added later and not
    listed gets the small limit until it is)."""
    return TCP_REQUEST_LIMITS.get(method, SMALL_REQUEST_BYTES)


# Open TCP connections at once; more are closed as soon as they are accepted.
# Each is a file descriptor and gRPC's buffers: with RLIMIT_NOFILE raised to
# its hard limit, this keeps strangers from filling the fd table.
MAX_TCP_CONNECTIONS = 512
# Calls at once on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS):
# a peer daemon has a handful in flight. No cap on the listener's calls in
# all: long health watches would fill it and lock peers and probes out.
MAX_STREAMS_PER_CONNECTION = 32
# A connection with no call for this long is closed (a peer reconnects on its
# next call); one that has not finished its HTTP/2 (and TLS) handshake in
# HANDSHAKE_MS is dropped; a connection whose peer stopped answering
# keepalive pings is closed after KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS.
IDLE_MS = 120_000
HANDSHAKE_MS = 10_000
KEEPALIVE_MS = 60_000
KEEPALIVE_TIMEOUT_MS = 20_000
# Request headers of one call (gRPC's default is 8 KiB; a peer sends few).
MAX_METADATA_BYTES = 16 * 1024


def tcp_server_options() -> list[tuple[str, Any]]:
    """The TCP listener's gRPC channel arguments."""
    return [
        ("grpc.max_receive_message_length", TCP_MAX_RECEIVE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Without BDP probing the receive window stays at its initial 64 KiB
        # (a pending read of a larger message still widens it): a stream
        # whose request is not read holds no more than that.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.max_allowed_incoming_connections", MAX_TCP_CONNECTIONS),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.max_connection_idle_ms", IDLE_MS),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_MS),
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.so_reuseport", 0),
    ]
