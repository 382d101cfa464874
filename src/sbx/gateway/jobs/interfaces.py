"""What the jobs package needs of the gateway beyond ``sbx.gateway.interfaces``: the few calls of the sandbox
service a job's runs make (issue 34). ``sandboxes.Sandboxes`` provides them; a unit test gives a stand-in.

The rest is passed as it is: the store (``store.base.Store``), the node registry (``nodes.Registry``), the
secrets (``secrets.Secrets``), and the shared interfaces (``Writes``, ``AuditSink``, ``Leadership``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sbx.api.sandboxes import CreateRequest, Sandbox
    from sbx.gateway.auth import Principal
    from sbx.gateway.nodes import Node
    from sbx.gateway.sandboxes import Sandboxes
    from sbx.gateway.state import SandboxRecord


class RunSandboxes(Protocol):
    """Making, and ending, the sandboxes of job runs (``sandboxes.Sandboxes``)."""

    async def create(
        self, principal: Principal, req: CreateRequest, *, gateway_labels: Mapping[str, str] | None = None
    ) -> tuple[Sandbox, str]:
        """A sandbox made for ``principal`` with the create's quotas, placement and labels (``gateway_labels``
        besides the owner's); and its node's name. A run needs no spread, so no ``avoid``."""

    async def terminated(self, rec: SandboxRecord) -> None:
        """The node terminated ``rec``'s sandbox: count it, free its name."""

    async def end_orphan(self, node: Node, sandbox_id: str, why: str) -> None:
        """Terminate a sandbox made for a run that no longer holds it (best effort)."""


if TYPE_CHECKING:

    def _sandboxes_provide_them(s: Sandboxes) -> RunSandboxes:
        """Never run: mypy holds ``Sandboxes`` to :class:`RunSandboxes`."""
        return s
