"""Metrics of services (registered in the gateway's private registry; no label carries a user, tenant or
service name)::

    sandbox_gateway_services                              gauge     services kept
    sandbox_gateway_service_replicas{state}               gauge     replicas by state (starting, healthy, ...)
    sandbox_gateway_service_replicas_created_total        counter   replicas made
    sandbox_gateway_service_restarts_total                counter   replicas replaced (unhealthy or lost)
    sandbox_gateway_rollouts_total{result}                counter   rollouts ended: done or failed
    sandbox_gateway_service_requests_total{code}          counter   proxied requests by status class (2xx ...)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from sbx.gateway.services.controller import ReplicaRuntime

STATES = ("starting", "healthy", "unhealthy", "lost")


class ServiceMetrics:
    def __init__(
        self,
        registry: CollectorRegistry,
        replicas: Callable[[], Iterable[ReplicaRuntime]],
        services: Callable[[], int],
    ) -> None:
        self.created = Counter("sandbox_gateway_service_replicas_created", "Service replicas made.",
                               registry=registry)  # fmt: skip
        self.restarts = Counter("sandbox_gateway_service_restarts", "Service replicas replaced (unhealthy or lost).",
                                registry=registry)  # fmt: skip
        self.rollouts = Counter("sandbox_gateway_rollouts", "Rollouts ended, by result (done, failed).", ["result"],
                                registry=registry)  # fmt: skip
        self.requests = Counter("sandbox_gateway_service_requests",
                                "Requests proxied to services, by status class (2xx, 3xx, 4xx, 5xx).", ["code"],
                                registry=registry)  # fmt: skip
        self._replicas = replicas
        self._services = services
        registry.register(self)

    def count_request(self, status: int) -> None:
        self.requests.labels(f"{status // 100}xx").inc()

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("sandbox_gateway_services", "Services kept.", value=self._services())
        counts = dict.fromkeys(STATES, 0)
        for replica in self._replicas():
            counts[replica.state] += 1
        family = GaugeMetricFamily(
            "sandbox_gateway_service_replicas", "Service replicas by state.", labels=["state"]
        )
        for state in STATES:
            family.add_metric([state], counts[state])
        yield family
