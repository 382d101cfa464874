"""The node's Prometheus metrics (spec: Fleet operation tools, Node metrics) and their endpoint.

Exactly these series, in a private registry (never the process-global one)::

    sandboxd_sandboxes{state}             gauge      sandboxes by state
    sandboxd_processes_running            gauge      processes running
    sandboxd_pool_target{image}           gauge      pool sizes by image
    sandboxd_pool_ready{image}            gauge
    sandboxd_pool_booting{image}          gauge
    sandboxd_capacity_cpus|memory_bytes|disk_bytes   gauge  what the node offers (CPUs, bytes, bytes)
    sandboxd_free_cpus|memory_bytes|disk_bytes       gauge  capacity less what live sandboxes hold
    sandboxd_cordoned                     gauge      1 while cordoned
    sandboxd_sandboxes_parked             gauge      running sandboxes parked for idleness (counted as running too)
    sandboxd_parks_total                  counter    sandboxes parked since start
    sandboxd_unparks_total                counter    parked sandboxes woken since start
    sandboxd_creates_total{status}        counter    creates by status (``created`` or an error code)
    sandboxd_create_seconds               histogram  create latency, seconds

Gauges are read from a snapshot callback at scrape time, so they can never drift from the
server's own state. No label carries a user, tenant or sandbox name. The endpoint listens on
loopback only and takes no credential.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

#: Upper bounds of the create latency buckets, in seconds: a pooled create takes tens of
#: milliseconds, a cold boot a few seconds; beyond 10 s only +Inf.
CREATE_SECONDS_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0)
#: Bytes in a MiB: the node counts MiB (as the API does); metrics are in base units (Prometheus convention).
MIB = 1024 * 1024


@dataclass(frozen=True)
class NodeSnapshot:
    """What the gauges show, taken by the server at scrape time.

    CPUs are counts; memory and disk are MiB. Mappings are keyed by sandbox state or image
    reference; a state missing from ``sandboxes_by_state`` is simply not exported.
    """

    sandboxes_by_state: Mapping[str, int]
    processes_running: int
    capacity_cpus: int
    capacity_memory_mb: int
    capacity_disk_mb: int
    free_cpus: int
    free_memory_mb: int
    free_disk_mb: int
    cordoned: bool
    pool_target: Mapping[str, int] = field(default_factory=dict)
    pool_ready: Mapping[str, int] = field(default_factory=dict)
    pool_booting: Mapping[str, int] = field(default_factory=dict)
    sandboxes_parked: int = 0
    parks: int = 0
    unparks: int = 0


class NodeMetrics:
    """The node metrics over a private registry; gauges come from ``snapshot`` at each scrape.

    ``snapshot`` runs on the thread that renders (the event loop for :func:`start_metrics_server`),
    so it must be quick and must not block.
    """

    def __init__(self, snapshot: Callable[[], NodeSnapshot]) -> None:
        self._snapshot = snapshot
        self._lock = threading.Lock()
        self._creates: dict[str, int] = {}
        self._bucket_counts = [0] * (len(CREATE_SECONDS_BUCKETS) + 1)  # the last is +Inf
        self._seconds_sum = 0.0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def observe_create(self, status: str, secs: float) -> None:
        """Count one create with its ``status`` (``created`` or the error code) and latency in seconds."""
        with self._lock:
            self._creates[status] = self._creates.get(status, 0) + 1
            self._bucket_counts[bisect.bisect_left(CREATE_SECONDS_BUCKETS, secs)] += 1
            self._seconds_sum += secs

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type; raises whatever the snapshot callback raises."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _families(self, describe_only: bool) -> Iterator[Metric]:
        # Describing must not call the server back (it runs at registration), so it uses zeros.
        snap = _ZERO if describe_only else self._snapshot()
        yield _labelled("sandboxd_sandboxes", "Sandboxes by state.", "state", snap.sandboxes_by_state)
        yield _gauge("sandboxd_processes_running", "Processes running.", snap.processes_running)
        yield _labelled("sandboxd_pool_target", "Pool size wanted, by image.", "image", snap.pool_target)
        yield _labelled("sandboxd_pool_ready", "Pooled sandboxes ready, by image.", "image", snap.pool_ready)
        yield _labelled(
            "sandboxd_pool_booting", "Pooled sandboxes booting, by image.", "image", snap.pool_booting
        )
        yield _gauge("sandboxd_capacity_cpus", "CPUs the node offers.", snap.capacity_cpus)
        yield _gauge(
            "sandboxd_capacity_memory_bytes", "Memory the node offers, bytes.", snap.capacity_memory_mb * MIB
        )
        yield _gauge(
            "sandboxd_capacity_disk_bytes", "Disk the node offers, bytes.", snap.capacity_disk_mb * MIB
        )
        yield _gauge("sandboxd_free_cpus", "CPUs not given to a live sandbox.", snap.free_cpus)
        yield _gauge(
            "sandboxd_free_memory_bytes",
            "Memory not given to a live sandbox, bytes.",
            snap.free_memory_mb * MIB,
        )
        yield _gauge(
            "sandboxd_free_disk_bytes", "Disk not given to a live sandbox, bytes.", snap.free_disk_mb * MIB
        )
        yield _gauge("sandboxd_cordoned", "1 while the node is cordoned.", 1 if snap.cordoned else 0)
        yield _gauge(
            "sandboxd_sandboxes_parked",
            "Running sandboxes parked for idleness (their processes stopped; counted as running too).",
            snap.sandboxes_parked,
        )
        yield CounterMetricFamily("sandboxd_parks", "Sandboxes parked since start.", value=snap.parks)
        yield CounterMetricFamily(
            "sandboxd_unparks", "Parked sandboxes woken since start.", value=snap.unparks
        )

        with self._lock:
            creates = dict(self._creates)
            counts = list(self._bucket_counts)
            total_secs = self._seconds_sum
        counter = CounterMetricFamily("sandboxd_creates", "Sandbox creates by status.", labels=["status"])
        for status in sorted(creates):
            counter.add_metric([status], creates[status])
        yield counter
        cumulative: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip((*map(str, CREATE_SECONDS_BUCKETS), "+Inf"), counts, strict=True):
            running += count
            cumulative.append((bound, running))
        yield HistogramMetricFamily(
            "sandboxd_create_seconds",
            "Sandbox create latency in seconds.",
            buckets=cumulative,
            sum_value=total_secs,
        )


_ZERO = NodeSnapshot(
    sandboxes_by_state={},
    processes_running=0,
    capacity_cpus=0,
    capacity_memory_mb=0,
    capacity_disk_mb=0,
    free_cpus=0,
    free_memory_mb=0,
    free_disk_mb=0,
    cordoned=False,
)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _labelled(name: str, doc: str, label: str, values: Mapping[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for key in sorted(values):
        family.add_metric([key], values[key])
    return family


class _Collector:
    """Adapter for the registry: ``describe`` names the series without calling the snapshot."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[Metric]:
        return self._metrics._families(describe_only=True)

    def collect(self) -> Iterator[Metric]:
        return self._metrics._families(describe_only=False)
