"""The gRPC health service, whose readiness is also a metric: ``kvmap_ready``
is 1 while the readiness service is SERVING, so that an alert
(KvmapDaemonNotReady, deploy/k8s/components/alerts) sees what Kubernetes'
readiness probe sees, whoever turns it."""

from __future__ import annotations

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer
from prometheus_client import Gauge


class ObservedHealth(HealthServicer):  # type: ignore[misc]  # grpc_health has no type hints
    def __init__(self, ready: Gauge, readiness_service: str) -> None:
        super().__init__()
        self._ready = ready
        self._readiness_service = readiness_service
        ready.set(0)  # not ready until the daemon says so

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        await super().set(service, status)
        if service == self._readiness_service:
            self._ready.set(1 if status == health_pb2.HealthCheckResponse.SERVING else 0)
