"""What the ports' traffic front is given of the rest of the gateway besides the shared interfaces of
``sbx.gateway.interfaces`` (issue 34; there, ``Freshness`` is its catching up with other replicas): the wake of a
persistent sandbox asleep; so a unit test builds the front from stand-ins, without a gateway."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sbx.api.sandboxes import Sandbox
    from sbx.gateway.state import SandboxRecord


class Wakes(Protocol):
    """A persistent sandbox's wake, under its tenant's quota (``persistent.Wakes``)."""

    async def wake_from(self, rec: SandboxRecord) -> tuple[str, Sandbox] | None:
        """Wake ``rec`` when it is asleep: what it woke from (``suspended``, ``stopped``) and the sandbox; None
        when it was awake."""
