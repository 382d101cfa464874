"""What every sandboxd request handler needs: the manager, the config and the node's fixed facts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sbx import __version__
from sbx.api.node import (
    PERSISTENT,
    SECRET_ENV,
    WEBSOCKET_ATTACH,
    Capabilities,
    NodeStatus,
    Resources,
    SandboxCapacity,
)
from sbx.api.ports import LISTENING_PORTS
from sbx.backends.base import Backend
from sbx.node.audit import AuditLog
from sbx.node.capacity import read_host, sandbox_capacity
from sbx.node.config import NodeConfig
from sbx.node.images import ImageService
from sbx.node.manager import SandboxManager
from sbx.node.pools import Pools
from sbx.node.sampler import MetricsSampler
from sbx.node.streams import StreamLimits


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
    #: Attach and tunnel slots, per sandbox and for the node.
    streams: StreamLimits = field(default_factory=StreamLimits.for_descriptors)

    @property
    def images(self) -> ImageService:
        return self.manager.image_service

    def capabilities(self) -> Capabilities:
        """The spec's Capabilities body; only what this node really does is true."""
        return Capabilities(
            api_version="v1",
            backend=self.backend.name,
            capabilities={
                # PATCH network is applied live wherever egress is enforced (modes beyond none).
                "network_policy_update": len(self.backend.network_modes) > 1,
                "suspend": self.manager.checkpoints is not None,
                "memory_snapshot": self.manager.checkpoints is not None,
                "disk_snapshot": self.manager.checkpoints is not None,
                "tunnel": True,
                "metrics": self.sampler is not None,
                "audit": self.config.audit.enabled,
                "images": True,
                WEBSOCKET_ATTACH: True,
                SECRET_ENV: True,
                PERSISTENT: self.manager.persistent is not None,
                LISTENING_PORTS: True,
            },
            limits=self.config.limits,
            network=self.config.network,
        )

    def node_status(self) -> NodeStatus:
        """The spec's NodeStatus body, with the node's create defaults (an addition)."""
        manager = self.manager
        capacity, free = manager.capacity, manager.free()
        return NodeStatus(
            name=self.node_name,
            version=self.version,
            capabilities=self.capabilities(),
            capacity=Resources(capacity.cpus, capacity.memory_mb, capacity.disk_mb),
            free=Resources(free.cpus, free.memory_mb, free.disk_mb),
            running=manager.count_by_state()["running"],
            pooled=self.pools.ready() if self.pools is not None else {},
            images=sorted(i.reference for i in manager.images.list()),
            labels={},
            cordoned=manager.cordoned,
            defaults=self.config.defaults,
            runtime=self.backend.runtime_report(),
            parked=manager.parked_count(),
            sandbox_capacity=self.sandbox_capacity(),
        )

    def sandbox_capacity(self) -> SandboxCapacity:
        """How many sandboxes of the default size this node can hold, and why (sbx.node.capacity)."""
        cap, defaults = self.config.capacity, self.config.defaults
        return sandbox_capacity(
            self.manager.capacity, Resources(defaults.cpus, defaults.memory_mb, defaults.disk_mb),
            cap.max_sandboxes, (cap.cpu_overcommit, cap.memory_overcommit, cap.disk_overcommit),
            self.manager.reservations.sandboxes(), read_host(),
        )  # fmt: skip
