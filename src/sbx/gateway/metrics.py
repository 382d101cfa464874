"""The gateway's Prometheus metrics (spec: Fleet operation tools, Gateway metrics), in a private registry.

Series::

    sandbox_gateway_http_requests_total{route,status}   counter   route is the path's shape
    sandbox_gateway_sandboxes_created_total             counter
    sandbox_gateway_create_seconds                      histogram create latency through the gateway, seconds
    sandbox_gateway_creates_refused_total{reason}       counter   reason: quota or capacity
    sandbox_gateway_scheduled_total{node}               counter   placement decisions, by node chosen
    sandbox_gateway_sandboxes_recorded                  gauge     ownership records held
    sandbox_gateway_sandboxes_lost                      gauge     records on lost nodes
    sandbox_gateway_sandboxes_terminated_total          counter   terminations through the gateway
    sandbox_gateway_node_up|node_cordoned|node_running{node}               gauges
    sandbox_gateway_node_capacity_{cpus,memory_bytes,disk_bytes}{node}     gauges
    sandbox_gateway_node_free_{cpus,memory_bytes,disk_bytes}{node}         gauges
    sandbox_gateway_ssh_connections_open, _ssh_sessions_open               gauges (0 without --ssh-listen)
    sandbox_gateway_ssh_auth_failures_total{reason}                        counter   connections that tried
        to log in and closed without: unknown_key, unknown_token, expired_token, no_access, wrong_sandbox
    sandbox_gateway_ssh_credentials_refused_total{reason}                  counter   each key or token refused
    sandbox_gateway_ssh_login_limits_total{action}                         counter   what the login limits did:
        too_many_tries (a connection disconnected), delayed (a refusal answered late), source_refused (a
        connection of a refused source disconnected)
    sandbox_gateway_ssh_sources_refused                                    gauge     source addresses refused now

No label carries a user, tenant or sandbox name; node names are the operator's. Node gauges are read from the
registry at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sbx.api.node import Resources

#: Why an SSH login failed (the label of sandbox_gateway_ssh_auth_failures_total; ``sbx.gateway.ssh.auth``).
SSH_AUTH_FAILURE_REASONS = ("unknown_key", "unknown_token", "expired_token", "no_access", "wrong_sandbox")
#: What the SSH login limits did (the label of sandbox_gateway_ssh_login_limits_total; ``sbx.gateway.ssh.throttle``).
SSH_LOGIN_LIMIT_ACTIONS = ("too_many_tries", "delayed", "source_refused")
CREATE_SECONDS_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0)
#: Bytes in a MiB: nodes report MiB (as the API does); metrics are in base units (Prometheus convention).
MIB = 1024 * 1024


@dataclass(frozen=True)
class NodeGauges:
    name: str
    up: bool
    cordoned: bool
    running: int
    capacity: Resources
    free: Resources


@dataclass(frozen=True)
class GatewaySnapshot:
    recorded: int
    lost: int
    nodes: list[NodeGauges]
    #: Whether this replica runs the work done once (always with SQLite; docs/ha.md).
    leading: bool = True


class GatewayMetrics:
    """Counters updated by the server; gauges from ``snapshot`` at scrape time."""

    def __init__(self, snapshot: Callable[[], GatewaySnapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.requests = Counter(
            "sandbox_gateway_http_requests", "Requests by route and status.", ["route", "status"], registry=r
        )
        #: The request counter's children by (route, status): ``labels()`` takes a lock and checks its
        #: arguments on every call. Bounded like the labels themselves (route shapes times statuses).
        self._request_counts: dict[tuple[str, int], Any] = {}
        self.created = Counter("sandbox_gateway_sandboxes_created", "Sandboxes created.", registry=r)
        self.create_seconds = Histogram(
            "sandbox_gateway_create_seconds", "Create latency through the gateway, seconds.",
            buckets=CREATE_SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.refused = Counter(
            "sandbox_gateway_creates_refused",
            "Creates refused for quota or capacity.",
            ["reason"],
            registry=r,
        )
        self.scheduled = Counter(
            "sandbox_gateway_scheduled", "Scheduler decisions, by node chosen.", ["node"], registry=r
        )
        self.terminated = Counter(
            "sandbox_gateway_sandboxes_terminated", "Sandboxes terminated through the gateway.", registry=r
        )
        self.ssh_auth_failures = Counter(
            "sandbox_gateway_ssh_auth_failures", "Failed SSH logins, by reason.", ["reason"], registry=r
        )
        self.ssh_credentials_refused = Counter(
            "sandbox_gateway_ssh_credentials_refused", "SSH keys and tokens refused, each, by reason.", ["reason"],
            registry=r,
        )  # fmt: skip
        for reason in SSH_AUTH_FAILURE_REASONS:
            self.ssh_auth_failures.labels(reason)  # every series from the start, at 0
            self.ssh_credentials_refused.labels(reason)
        self.ssh_login_limits = Counter(
            "sandbox_gateway_ssh_login_limits",
            "What the SSH login limits did, by action.",
            ["action"],
            registry=r,
        )
        for action in SSH_LOGIN_LIMIT_ACTIONS:
            self.ssh_login_limits.labels(action)
        #: Source addresses refused now; the SSH server sets it while it serves.
        self.ssh_sources_refused: Callable[[], int] = lambda: 0
        #: (open SSH connections, open SSH sessions); the SSH server sets it while it serves.
        self.ssh_counts: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self._snapshot = snapshot
        r.register(_Gauges(self))

    def count_request(self, route: str, status: int) -> None:
        """One request answered ``status`` on ``route`` (a bounded route label, see ``server.metric_route``)."""
        child = self._request_counts.get((route, status))
        if child is None:
            child = self._request_counts[(route, status)] = self.requests.labels(route, str(status))
        child.inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def gauges(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield GaugeMetricFamily("sandbox_gateway_sandboxes_recorded", "Sandboxes with recorded owners.",
                                value=snap.recorded)  # fmt: skip
        yield GaugeMetricFamily("sandbox_gateway_sandboxes_lost", "Sandboxes on lost nodes.", value=snap.lost)
        yield GaugeMetricFamily("sandbox_gateway_leader", "1 while this replica leads (runs the work done once).",
                                value=1 if snap.leading else 0)  # fmt: skip
        connections, sessions = self.ssh_counts()
        yield GaugeMetricFamily(
            "sandbox_gateway_ssh_connections_open", "Open SSH connections.", value=connections
        )
        yield GaugeMetricFamily("sandbox_gateway_ssh_sessions_open", "Open SSH sessions.", value=sessions)
        yield GaugeMetricFamily("sandbox_gateway_ssh_sources_refused",
                                "Source addresses refused SSH logins now, for too many failures.",
                                value=self.ssh_sources_refused())  # fmt: skip
        per_node: list[tuple[str, str, Callable[[NodeGauges], float]]] = [
            ("node_up", "1 while the node answers polls.", lambda n: 1 if n.up else 0),
            ("node_cordoned", "1 while the node is cordoned.", lambda n: 1 if n.cordoned else 0),
            ("node_running", "Sandboxes running on the node.", lambda n: n.running),
            ("node_capacity_cpus", "CPUs the node offers.", lambda n: n.capacity.cpus),
            (
                "node_capacity_memory_bytes",
                "Memory the node offers, bytes.",
                lambda n: n.capacity.memory_mb * MIB,
            ),
            ("node_capacity_disk_bytes", "Disk the node offers, bytes.", lambda n: n.capacity.disk_mb * MIB),
            ("node_free_cpus", "CPUs free on the node.", lambda n: n.free.cpus),
            ("node_free_memory_bytes", "Memory free on the node, bytes.", lambda n: n.free.memory_mb * MIB),
            ("node_free_disk_bytes", "Disk free on the node, bytes.", lambda n: n.free.disk_mb * MIB),
        ]
        for suffix, doc, value in per_node:
            family = GaugeMetricFamily(f"sandbox_gateway_{suffix}", doc, labels=["node"])
            for node in sorted(snap.nodes, key=lambda n: n.name):
                family.add_metric([node.name], value(node))
            yield family


class _Gauges:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.gauges()
