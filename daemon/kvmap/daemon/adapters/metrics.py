"""Prometheus metrics of one daemon instance (own registry, so several
daemons can live in one process, as the benchmark does).

Conventions (docs/operate.md, "Metrics"): an outcome is always a gRPC status
code name (``OK``, ``PERMISSION_DENIED``, ...), in a ``code`` label on
transfer series and ``grpc_code`` on RPC series, which also carry
``grpc_service`` and ``grpc_method``; no ``_created`` series are exported."""

from __future__ import annotations

import platform
from typing import TypeVar

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics import MetricWrapperBase

from kvmap.core.config import parse_host_port
from kvmap.daemon.version import VERSION

# A ``_created`` series per counter and histogram child doubles what is
# scraped and stored, and no dashboard, alert or rate() needs it.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]  # untyped upstream

# Peers that get their own label value; the rest share "other", so a daemon
# that pulls from many prefill pods keeps a bounded number of series.
MAX_PEER_LABELS = 64
OTHER_PEERS = "other"
_DESCRIPTOR_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

_M = TypeVar("_M", bound=MetricWrapperBase)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.workers = Gauge("kvmap_registered_workers", "Registered workers", registry=r)
        self.regions = Gauge("kvmap_regions", "Registered regions, all workers", registry=r)
        self.descriptors = Gauge(
            "kvmap_descriptors", "Registered transfer descriptors, all workers", registry=r
        )
        self.baseline_descriptors = Gauge(
            "kvmap_baseline_descriptors",
            "Descriptors the baseline (per-layer) planner would register",
            registry=r,
        )
        self.registered_bytes = Gauge(
            "kvmap_registered_bytes", "Bytes registered with NIXL", registry=r
        )
        self.rpcs = Counter(
            "kvmap_rpcs", "RPCs served, by gRPC service, method and status code",
            ["grpc_service", "grpc_method", "grpc_code"], registry=r,
        )  # fmt: skip
        self.rpc_seconds = Histogram(
            "kvmap_rpc_seconds", "RPC latency, by gRPC service and method",
            ["grpc_service", "grpc_method"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.transfers = Counter(
            "kvmap_transfers", "Transfers this daemon made, by direction and status code",
            ["direction", "code"], registry=r,
        )  # fmt: skip
        self.transfers_in_flight = Gauge(
            "kvmap_transfers_in_flight", "Pulls, pushes and releases this daemon is making now",
            registry=r,
        )  # fmt: skip
        # Attempts of a transfer retried after its peer or this daemon met a
        # restart: during an upgrade this rises while kvmap_transfers stays
        # OK (a failure there means the retries ran out of deadline).
        self.transfer_retries = Counter(
            "kvmap_transfer_retries", "Transfer attempts retried, by the error that ended them",
            ["direction", "code"], registry=r,
        )  # fmt: skip
        self.transfer_bytes = Counter("kvmap_transfer_bytes", "Bytes moved", registry=r)
        self.transfer_descriptors = Counter(
            "kvmap_transfer_descriptors", "Descriptors posted", registry=r
        )
        self.post_seconds = Histogram(
            "kvmap_transfer_post_seconds", "Time to post a transfer", buckets=_LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.completion_seconds = Histogram(
            "kvmap_transfer_completion_seconds", "Post to completion", buckets=_LATENCY_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.remote_agents = Gauge("kvmap_remote_agents", "Loaded remote agents", registry=r)
        self._add_operator_metrics(r)
        self._add_peer_metrics(r)
        self._peers: dict[str, str] = {}
        # Labelled series once looked up (``labelled``): as many as the
        # registry holds, whose label values are bounded (peer_label).
        self._children: dict[tuple[MetricWrapperBase, tuple[str, ...]], MetricWrapperBase] = {}

    def _add_operator_metrics(self, r: CollectorRegistry) -> None:
        """What the alert rules compare against (deploy/k8s/components/alerts)."""
        self.registered_bytes_limit = Gauge(
            "kvmap_registered_bytes_limit",
            "Most bytes this daemon registers with NIXL (max_registered_bytes)", registry=r,
        )  # fmt: skip
        self.generations = Counter(
            "kvmap_generations", "Region map generations issued (registrations and replans)",
            registry=r,
        )  # fmt: skip
        self.ready = Gauge(
            "kvmap_ready", "1 while the daemon accepts transfers (its readiness health "
            "service, kvmap.v1.Peer, is SERVING), else 0", registry=r,
        )  # fmt: skip
        build = Gauge(
            "kvmap_build_info", "Always 1: the running build, in its labels",
            ["version", "python_version"], registry=r,
        )  # fmt: skip
        build.labels(VERSION, platform.python_version()).set(1)

    def _add_peer_metrics(self, r: CollectorRegistry) -> None:
        """Per-peer transfer series (bounded labels, ``peer_label``) and leases."""
        self._peer_transfers = Counter(
            "kvmap_peer_transfers", "Transfers by direction, peer (its address, at most "
            f"{MAX_PEER_LABELS}, then '{OTHER_PEERS}') and status code (OK when done)",
            ["direction", "peer", "code"], registry=r,
        )  # fmt: skip
        self._peer_seconds = Histogram(
            "kvmap_peer_transfer_seconds", "Whole transfers that succeeded (handshake, "
            "plan, post, completion), by direction and peer", ["direction", "peer"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self._peer_bytes = Counter(
            "kvmap_peer_transfer_bytes", "Bytes moved, by direction and peer",
            ["direction", "peer"], registry=r,
        )  # fmt: skip
        self._descriptors_per_transfer = Histogram(
            "kvmap_transfer_descriptors_per_transfer", "Descriptors posted per transfer",
            ["direction"], buckets=_DESCRIPTOR_BUCKETS, registry=r,
        )  # fmt: skip
        # Owner side: transfers served to each peer (the authenticated caller's
        # address, bounded as above), by how each ended.
        self._served = Counter(
            "kvmap_served_transfers", "Transfers peers announced to this daemon (the owner), by "
            "peer and status code: OK when its notification came, DEADLINE_EXCEEDED when its "
            "lease ran out, CANCELLED when the peer ended it, a refusal's code",
            ["peer", "code"], registry=r,
        )  # fmt: skip
        self._served_bytes = Counter(
            "kvmap_served_bytes", "Bytes of this daemon's workers that peers completed "
            "transfers of, by peer", ["peer"], registry=r,
        )  # fmt: skip
        # Owner side: transfers peers announced and have not finished.
        self.leases = Gauge("kvmap_leases", "Outstanding transfer leases", registry=r)
        self.leases_expired = Counter(
            "kvmap_leases_expired", "Leases that ran out before the peer finished", registry=r
        )

    def peer_label(self, target: str) -> str:
        """``target`` as a label value: its own for the first
        ``MAX_PEER_LABELS`` peers seen, ``other`` after that."""
        label = self._peers.get(target)
        if label is None:
            label = target if len(self._peers) < MAX_PEER_LABELS else OTHER_PEERS
            if label != OTHER_PEERS:
                self._peers[target] = label
        return label

    def labelled(self, metric: _M, *values: str) -> _M:
        """``metric.labels(*values)``, looked up once: the per-transfer
        series, where ``labels`` checks and locks on every call. Only for
        label values from a bounded set (directions, codes, peer labels)."""
        child = self._children.get((metric, values))
        if child is None:
            child = self._children[(metric, values)] = metric.labels(*values)
        return child  # type: ignore[return-value]  # stored as metric.labels made it

    def transfer_ended(
        self, direction: str, target: str, code: str, seconds: float | None = None
    ) -> None:
        """One transfer's outcome; ``seconds`` for one that succeeded."""
        peer = self.peer_label(target)
        self.labelled(self._peer_transfers, direction, peer, code).inc()
        if seconds is not None:
            self.labelled(self._peer_seconds, direction, peer).observe(seconds)

    def transfer_moved(self, direction: str, target: str, nbytes: int, descriptors: int) -> None:
        self.labelled(self._peer_bytes, direction, self.peer_label(target)).inc(nbytes)
        self.labelled(self._descriptors_per_transfer, direction).observe(descriptors)

    def served(self, peer: str, code: str, nbytes: int = 0) -> None:
        """Owner side: one transfer announced by ``peer`` ended (or was
        refused) with ``code``; ``nbytes`` moved when it completed."""
        label = self.peer_label(peer)
        self.labelled(self._served, label, code).inc()
        if nbytes:
            self.labelled(self._served_bytes, label).inc(nbytes)

    def serve(self, listen: str) -> None:
        host, port = parse_host_port(listen, "metrics_listen")
        start_http_server(port, addr=host, registry=self.registry)
