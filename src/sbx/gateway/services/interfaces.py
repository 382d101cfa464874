"""What the services' parts are given of the rest of the gateway besides the shared interfaces of
``sbx.gateway.interfaces`` (issue 34): the few calls of the sandbox service and of the secrets they make, so the
controller is built from stand-ins in a unit test and reading it needs nothing of the gateway object."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sbx.api.sandboxes import CreateRequest, Sandbox
    from sbx.gateway.auth import Principal
    from sbx.gateway.nodes import Node
    from sbx.gateway.state import SandboxRecord


class ReplicaSandboxes(Protocol):
    """The sandbox service as the controller uses it: replicas are sandboxes made and ended through it (quotas,
    placement, owner labels, the records' bookkeeping), never through a node directly. ``sandboxes.Sandboxes``."""

    async def create(
        self,
        principal: Principal,
        req: CreateRequest,
        *,
        gateway_labels: Mapping[str, str] | None = None,
        avoid: Collection[str] = (),
    ) -> tuple[Sandbox, str]:
        """Make a sandbox for ``principal``; it and its node's name."""

    async def terminated(self, rec: SandboxRecord) -> None:
        """The node terminated ``rec``'s sandbox for us: count it, free its name."""

    async def end_orphan(self, node: Node, sandbox_id: str, why: str) -> None:
        """Terminate a sandbox of no current replica (best effort; ``why`` goes in the log)."""


class SecretValues(Protocol):
    """The tenants' secrets as a spec names them. ``secrets.Secrets``."""

    def check_names(self, tenant: str, names: Iterable[str], field: str = "secrets") -> list[str]:
        """501 without a key (when any is given), 400 for a name the tenant does not have."""

    def values(self, tenant: str, names: Iterable[str]) -> dict[str, str]:
        """The values of ``names`` in ``tenant``, for a replica's environment (``InvalidRequest`` for one gone)."""
