"""Metrics of services (registered in the gateway's private registry; no label carries a user, tenant or
service name)::

    sandbox_gateway_services                              gauge     services kept
    sandbox_gateway_service_replicas{state}               gauge     replicas by state (starting, healthy, ...)
    sandbox_gateway_service_replicas_created_total        counter   replicas made
    sandbox_gateway_service_restarts_total                counter   replicas replaced (unhealthy or lost)
    sandbox_gateway_rollouts_total{result}                counter   rollouts ended: done or failed
    sandbox_gateway_service_requests_total{code}          counter   proxied requests by status class (2xx ...)
    sandbox_gateway_service_public_connections            gauge     connections without a key to public services
    sandbox_gateway_service_public_connections_shed_total{how}  counter  past a cap: closed_idle (an idle one
        closed to make room) or refused (a request answered 503, none could be)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from sbx.gateway.services.controller import ReplicaRuntime
    from sbx.gateway.services.public import PublicConnections

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
        #: The traffic front's count of connections without a key (set by the front).
        self.public: PublicConnections | None = None
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
        public = self.public
        yield GaugeMetricFamily("sandbox_gateway_service_public_connections",
                                "Connections without a key counted against the public services' caps.",
                                value=len(public) if public is not None else 0)  # fmt: skip
        shed = CounterMetricFamily("sandbox_gateway_service_public_connections_shed",
                                   "Connections without a key past a public services' cap: an idle one closed to "
                                   "make room (closed_idle), or a request refused 503 (refused).", labels=["how"])  # fmt: skip
        shed.add_metric(["closed_idle"], public.closed_idle if public is not None else 0)
        shed.add_metric(["refused"], public.refused if public is not None else 0)
        yield shed
