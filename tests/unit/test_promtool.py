"""Both servers' metrics pass Prometheus's own linter, ``promtool check metrics`` (Debian's ``prometheus``)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from test_metrics import SNAPSHOT

from sbx.api.node import Resources
from sbx.gateway.jobs.metrics import JobMetrics
from sbx.gateway.metrics import GatewayMetrics, GatewaySnapshot, NodeGauges
from sbx.gateway.services.metrics import ServiceMetrics
from sbx.node.metrics import NodeMetrics

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is missing: install Debian's prometheus package (scripts/install.sh --test-deps does)",
)


def promtool(text: bytes) -> str:
    """What promtool finds wrong (empty: nothing)."""
    done = subprocess.run(
        ["promtool", "check", "metrics"], check=False, input=text, capture_output=True, timeout=30
    )
    return (done.stdout + done.stderr).decode()


def test_node_metrics_pass_promtool() -> None:
    metrics = NodeMetrics(lambda: SNAPSHOT)
    metrics.observe_create("created", 0.2)
    metrics.observe_create("unavailable", 0.01)
    assert promtool(metrics.render()[0]) == ""


def test_gateway_metrics_pass_promtool() -> None:
    node = NodeGauges("n1", True, False, 3, Resources(8, 16384, 100000), Resources(4, 8192, 50000))
    metrics = GatewayMetrics(lambda: GatewaySnapshot(recorded=3, lost=0, nodes=[node]))
    metrics.count_request("/v1/sandboxes", 201)
    metrics.created.inc()
    metrics.create_seconds.observe(0.3)
    metrics.refused.labels("quota").inc()
    metrics.scheduled.labels("n1").inc()
    metrics.terminated.inc()
    # The series of services and jobs, registered in the same registry by their controllers.
    services = ServiceMetrics(metrics.registry, list, lambda: 2)
    services.created.inc()
    services.restarts.inc()
    services.rollouts.labels("done").inc()
    services.count_request(502)
    jobs = JobMetrics(metrics.registry, lambda: (1, 2))
    jobs.count_run("succeeded")
    jobs.count_notification("failed")
    text = metrics.render()[0]
    assert b"sandbox_gateway_service_replicas{" in text and b"sandbox_gateway_job_runs_total{" in text
    assert promtool(text) == ""


def test_promtool_does_flag_abbreviated_units() -> None:
    """The check can fail: the names this change retired are what promtool refuses."""
    assert "abbreviated units" in promtool(
        b"# HELP sandboxd_free_memory_mb x\n# TYPE sandboxd_free_memory_mb gauge\nsandboxd_free_memory_mb 1\n"
    )
