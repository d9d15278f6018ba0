"""The wire features this daemon understands beyond the API's first release.

A field an older daemon does not know is dropped by protobuf without an
error, so a connector that sent ``remote_first_token`` to such a daemon
would get the wrong tokens' bytes rather than a refusal. The daemon lists
what it understands in ``RegisterWorkerResponse.features``, and the
connector uses a newer field only where its own daemon listed it.
"""

from __future__ import annotations

from kvmap.v1 import registry_pb2

DAEMON_FEATURES: tuple[registry_pb2.DaemonFeature.ValueType, ...] = (
    registry_pb2.DAEMON_FEATURE_TOKEN_MODE,
    registry_pb2.DAEMON_FEATURE_REMOTE_FIRST_TOKEN,
    registry_pb2.DAEMON_FEATURE_OPEN_GRANTS,
    # TransferSpec.release, deprecated by Transfers.Release: still honoured
    # for the connectors of the previous release.
    registry_pb2.DAEMON_FEATURE_RELEASE,
    registry_pb2.DAEMON_FEATURE_RELEASE_RPC,
    registry_pb2.DAEMON_FEATURE_UNREAD_RELEASE,
    registry_pb2.DAEMON_FEATURE_WRITE_GRANTS,
    registry_pb2.DAEMON_FEATURE_PUSH_OFFERS,
    registry_pb2.DAEMON_FEATURE_CALLER_CAPABILITIES,
)
