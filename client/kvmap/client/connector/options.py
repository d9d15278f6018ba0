"""The connector's settings: ``kv_connector_extra_config``, parsed and checked
once at start-up, so a typo fails the engine rather than a request."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvmap.client.session import Backoff
from kvmap.core.grants import MAX_USES
from kvmap.core.push_offers import MAX_LAYER_GROUPS


def default_socket() -> str:
    """kvmapd's default socket: $XDG_RUNTIME_DIR/kvmap/kvmapd.sock, else
    /tmp/kvmap-<uid>/kvmapd.sock (as ``kvmapd serve`` without --socket)."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "kvmap", "kvmapd.sock")
    return f"/tmp/kvmap-{os.getuid()}/kvmapd.sock"


def host_port(value: str, key: str) -> tuple[str, int]:
    """``HOST:PORT`` split (brackets of an IPv6 host dropped); ``ValueError``
    naming ``key`` otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"kv_connector_extra_config.{key}: expected HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


def _typed(key: str, value: Any, default: object) -> Any:
    """``value`` as the type of the option's ``default``; a wrong type (a
    bool for a number, a fraction for an int) raises ``ValueError`` naming the key."""
    try:
        if isinstance(default, str):
            if not isinstance(value, str):
                raise TypeError
            return value
        if isinstance(value, bool):
            raise TypeError
        if isinstance(default, int) and not isinstance(default, bool):
            if int(value) != value:
                raise TypeError
            return int(value)
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"kv_connector_extra_config.{key}: expected {type(default).__name__}, got {value!r}"
        ) from None


_POSITIVE_OPTIONS = (
    "transfer_timeout_s",
    "lease_seconds",
    "register_timeout_s",
    "call_timeout_s",
    "reconnect_initial_s",
    "reconnect_max_s",
    "max_parallel_pulls",
    "push_timeout_s",
)


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` of the kvmap connector."""

    # kvmapd's Unix socket (its fd hand-off socket is "<socket>.fds").
    socket: str = field(default_factory=default_socket)
    # This pod's kvmapd TCP address as peers reach it ("$(POD_IP):50051");
    # required where the engine produces KV (kv_producer, kv_both).
    peer_address: str = ""
    # Deadline of one pull (handshake + post + completion), in seconds.
    transfer_timeout_s: float = 30.0
    # How long a prefill request's blocks wait for a pull before being freed.
    lease_seconds: float = 120.0
    # How long a worker waits for its kvmapd at start-up.
    register_timeout_s: float = 60.0
    # Deadline of the unary calls (register, deregister, stats).
    call_timeout_s: float = 10.0
    # Pulls a worker runs at once.
    max_parallel_pulls: int = 8
    # Reconnection backoff after the daemon went away.
    reconnect_initial_s: float = 0.1
    reconnect_max_s: float = 5.0
    # Tensor-parallel size of the decode engines that load this (prefill)
    # engine's KV; 0: any (open grants: each decode rank declares how many
    # decode ranks read a prefill rank, and kvmapd fixes the count from the
    # first). Set, each rank's grant admits exactly as many pulls as decode
    # ranks read from it, and decode engines of another size are refused.
    # Either way a rank's blocks are freed once its grant is used up (or
    # the lease ran out).
    decode_tp_size: int = 0
    # OTLP/gRPC endpoint of the connector's spans; "" falls back to the
    # standard OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT (connector.traces).
    otlp_traces_endpoint: str = ""
    # Push mode, decode side: how long a request's offered blocks wait for
    # the prefill side's pushes (its queue, its prefill and the writes);
    # then the write grant is revoked and the request recomputed.
    push_timeout_s: float = 60.0
    # Push mode, prefill side: the layer groups a request's KV is pushed in,
    # each as soon as its layers are computed (1: the whole request when it
    # finishes). Descriptors per request: blocks x groups.
    push_layer_groups: int = 4

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, *, producer: bool = False
    ) -> ConnectorOptions:
        """Parse and check; unknown keys and wrong types raise ``ValueError``
        naming the key."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"kv_connector_extra_config: unknown keys {unknown} for the kvmap connector "
                f"(known: {sorted(known)})"
            )
        defaults = cls()
        values = {key: _typed(key, value, getattr(defaults, key)) for key, value in extra.items()}
        opts = cls(**values)
        opts._check(producer)
        return opts

    def _check(self, producer: bool) -> None:
        """Ranges and required keys, once the types are right."""
        for key in _POSITIVE_OPTIONS:
            if getattr(self, key) <= 0:
                raise ValueError(f"kv_connector_extra_config.{key}: must be positive")
        if not 1 <= self.push_layer_groups <= MAX_LAYER_GROUPS:
            raise ValueError(
                f"kv_connector_extra_config.push_layer_groups: must be in [1, {MAX_LAYER_GROUPS}]"
            )
        if not self.socket:
            raise ValueError("kv_connector_extra_config.socket: must not be empty")
        if not 0 <= self.decode_tp_size <= MAX_USES:
            raise ValueError(
                f"kv_connector_extra_config.decode_tp_size: must be in [0, {MAX_USES}]"
            )
        if self.otlp_traces_endpoint:
            scheme, sep, rest = self.otlp_traces_endpoint.partition("://")
            if sep and scheme not in ("http", "https"):
                raise ValueError("kv_connector_extra_config.otlp_traces_endpoint: http or https")
            host_port((rest if sep else scheme).rstrip("/"), "otlp_traces_endpoint")
        if self.peer_address:
            host_port(self.peer_address, "peer_address")
        elif producer:
            raise ValueError(
                "kv_connector_extra_config.peer_address: required on engines that produce KV "
                "(kv_producer, kv_both): this pod's kvmapd TCP address, e.g. $(POD_IP):50051"
            )
        Backoff(self.reconnect_initial_s, max(self.reconnect_max_s, self.reconnect_initial_s))

    @property
    def backoff(self) -> Backoff:
        return Backoff(
            self.reconnect_initial_s, max(self.reconnect_max_s, self.reconnect_initial_s)
        )
