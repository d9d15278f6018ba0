"""Prometheus metrics of one daemon instance (own registry, so several
daemons can live in one process, as the benchmark does)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvmap.daemon.core.config import parse_host_port

_LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


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
            "kvmap_rpcs", "RPCs by method and status", ["method", "code"], registry=r
        )
        self.rpc_seconds = Histogram(
            "kvmap_rpc_seconds", "RPC latency", ["method"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.transfers = Counter(
            "kvmap_transfers", "Transfers by direction and outcome", ["direction", "outcome"],
            registry=r,
        )  # fmt: skip
        # Attempts of a transfer retried after its peer or this daemon met a
        # restart: during an upgrade this rises while kvmap_transfers stays
        # "done" (a failure there means the retries ran out of deadline).
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

    def serve(self, listen: str) -> None:
        host, port = parse_host_port(listen, "metrics_listen")
        start_http_server(port, addr=host, registry=self.registry)
