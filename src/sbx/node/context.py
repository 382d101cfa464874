"""What every sandboxd request handler needs: the manager, the config and the node's fixed facts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sbx import __version__
from sbx.backends.base import Backend
from sbx.node.audit import AuditLog
from sbx.node.config import NodeConfig
from sbx.node.images import ImageService
from sbx.node.manager import SandboxManager
from sbx.node.pools import Pools
from sbx.node.sampler import MetricsSampler


@dataclass
class NodeContext:
    """Shared by the route modules; built once by the server."""

    config: NodeConfig
    backend: Backend
    manager: SandboxManager
    audit: AuditLog
    node_name: str = ""
    version: str = __version__
    #: Called after every create with its status (``created`` or an error code) and duration in seconds.
    on_create: Callable[[str, float], None] = field(default=lambda status, secs: None)
    #: The warm pools; None on a node built without them (tests).
    pools: Pools | None = None
    #: Per-sandbox metrics; None on a node that keeps none.
    sampler: MetricsSampler | None = None
    #: The backend's runtime (runsc release, platform, limitations); reported by GET /v1/node.
    runtime: dict[str, Any] = field(default_factory=dict)

    @property
    def images(self) -> ImageService:
        return self.manager.image_service

    def capabilities(self) -> dict[str, Any]:
        """The spec's Capabilities body; only what this node really does is true."""
        limits = self.config.limits
        net = self.config.network
        return {
            "api_version": "v1",
            "backend": self.backend.name,
            "capabilities": {
                # PATCH network is applied live wherever egress is enforced (modes beyond none).
                "network_policy_update": len(self.backend.network_modes) > 1,
                "suspend": self.manager.checkpoints is not None,
                "memory_snapshot": self.manager.checkpoints is not None,
                "disk_snapshot": self.manager.checkpoints is not None,
                "tunnel": True,
                "metrics": self.sampler is not None,
                "audit": self.config.audit.enabled,
                "images": True,
            },
            "limits": {
                "max_cpus": limits.max_cpus,
                "max_memory_mb": limits.max_memory_mb,
                "max_disk_mb": limits.max_disk_mb,
                "max_idle_timeout_secs": limits.max_idle_timeout_secs,
                "min_snapshot_every_secs": limits.min_snapshot_every_secs,
                "max_snapshot_keep": limits.max_snapshot_keep,
            },
            "network": {
                "default": net.default.to_wire(),
                "ceiling": net.ceiling,
                "may_allow": list(net.may_allow),
            },
        }

    def node_status(self) -> dict[str, Any]:
        """The spec's NodeStatus body."""
        manager = self.manager
        return {
            "name": self.node_name,
            "version": self.version,
            "capabilities": self.capabilities(),
            "capacity": asdict(manager.capacity),
            "free": asdict(manager.free()),
            "running": manager.count_by_state()["running"],
            "pooled": self.pools.ready() if self.pools is not None else {},
            "images": sorted(i.reference for i in manager.images.list()),
            "labels": {},
            "cordoned": manager.cordoned,
            "runtime": self.runtime,
        }
