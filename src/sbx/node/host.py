"""What the parts of a node's sandbox lifecycle need of the manager, and nothing more: the narrow interfaces
checkpoints (suspend, snapshots, forks, schedules) and the warm pools are written against, so that neither
imports the manager and the manager imports them without a circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sbx.agent.client import AgentClient
    from sbx.api.requests import CreateSpec
    from sbx.images.store import InstalledImage
    from sbx.node.audit import AuditLog
    from sbx.node.pools import PooledSandbox
    from sbx.node.records import SandboxRecord
    from sbx.node.sandbox import Sandbox


class SandboxHost(Protocol):
    """The node's sandboxes as checkpoints and pools see them."""

    @property
    def audit(self) -> AuditLog:
        """Where sandbox events are recorded."""

    @property
    def node_id(self) -> str | None:
        """The node's ``--node-id`` (in ids it makes), or None."""

    def resolve(self, ref: str, touch: bool = True) -> Sandbox:
        """The sandbox with id or live name ``ref`` (404 otherwise); ``touch`` notes activity."""

    def resolve_or_none(self, ref: str) -> Sandbox | None:
        """Like resolve, without noting activity; None when there is no such sandbox."""

    def records(self, labels: dict[str, str] | None = None) -> list[SandboxRecord]:
        """Every sandbox known, newest first."""

    async def reattach_agent(self, sandbox: Sandbox) -> None:
        """Connect to the sandbox's agent again and take its processes back."""

    def state_changed(self, sandbox: Sandbox) -> None:
        """The sandbox's state changed (suspended, resumed): its idle timer and metrics follow."""

    async def terminate_locked(self, sandbox: Sandbox, reason: str) -> None:
        """Terminate a live sandbox; the caller holds its lock."""

    async def lose_locked(self, sandbox: Sandbox, reason: str) -> None:
        """A live sandbox crashed: a persistent one is stopped (disk kept), any other terminated; the caller
        holds its lock."""

    def forget_parked(self, sandbox: Sandbox) -> None:
        """The sandbox stops running: it is parked no longer."""

    async def connect_agent(self, sandbox_id: str) -> AgentClient:
        """A new connection to the sandbox's agent (waiting for it to listen)."""

    def watch_agent(self, sandbox: Sandbox, agent: AgentClient) -> None:
        """Watch the sandbox's new agent connection (reconnect or lose the sandbox when it closes)."""

    async def boot(self, record: SandboxRecord, image: InstalledImage) -> AgentClient:
        """Boot ``record``'s sandbox from ``image`` and connect to its agent; nothing is left on failure."""


class PoolSource(Protocol):
    """Where a create finds a sandbox booted ahead of it (the warm pools)."""

    def take(self, image: str, spec: CreateSpec) -> PooledSandbox | None:
        """A ready sandbox that is exactly what ``spec`` would boot from ``image``, or None."""
