"""Wire types of per-sandbox metrics (spec: Metrics sample, Per-sandbox metrics)."""

from __future__ import annotations

import msgspec


class MetricsSample(msgspec.Struct):
    """One sample: CPU share of the given vCPUs since the previous sample (0 to 100), resident memory and its
    limit in bytes, byte totals since start (network, disk), processes in the guest (0 where not seen)."""

    time: str
    cpu_percent: float
    memory_bytes: int
    memory_limit_bytes: int
    net_rx_bytes: int
    net_tx_bytes: int
    disk_read_bytes: int
    disk_write_bytes: int
    processes: int


class SandboxMetrics(msgspec.Struct):
    """``GET .../metrics``: the last hour, oldest first, a sample every ``interval_secs``."""

    interval_secs: int
    samples: list[MetricsSample]
