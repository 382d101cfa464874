"""Metrics of jobs (registered in the gateway's private registry; no label carries a user, tenant or job)::

sandbox_gateway_jobs_queued                       gauge     jobs waiting for their first sandbox
sandbox_gateway_job_runs_running                  gauge     attempts running now
sandbox_gateway_job_runs_total{result}            counter   attempts ended: succeeded, failed, cancelled
sandbox_gateway_job_notifications_total{result}   counter   notifications delivered or given up (failed)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric


class JobMetrics:
    def __init__(self, registry: CollectorRegistry, counts: Callable[[], tuple[int, int]]) -> None:
        self.runs = Counter("sandbox_gateway_job_runs", "Job attempts ended, by result.", ["result"],
                            registry=registry)  # fmt: skip
        self.notifications = Counter(
            "sandbox_gateway_job_notifications", "Job notifications, by result (delivered, failed).", ["result"],
            registry=registry,
        )  # fmt: skip
        self._counts = counts
        registry.register(self)

    def count_run(self, result: str) -> None:
        self.runs.labels(result).inc()

    def count_notification(self, result: str) -> None:
        self.notifications.labels(result).inc()

    def collect(self) -> Iterator[Metric]:
        queued, running = self._counts()
        yield GaugeMetricFamily(
            "sandbox_gateway_jobs_queued", "Jobs waiting for their first sandbox.", value=queued
        )
        yield GaugeMetricFamily(
            "sandbox_gateway_job_runs_running", "Job attempts running now.", value=running
        )
