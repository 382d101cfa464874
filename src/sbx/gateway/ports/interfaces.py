"""What the ports' traffic front is given of the rest of the gateway besides the shared interfaces of
``sbx.gateway.interfaces`` (issue 34): a look-up that catches up with other replicas before a miss, and the wake
of a persistent sandbox asleep; so a unit test builds the front from stand-ins, without a gateway."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from sbx.api.sandboxes import Sandbox
    from sbx.gateway.state import SandboxRecord

T = TypeVar("T")


class Fresh(Protocol):
    """Look-ups answered from memory that another replica's write may not have reached yet (the gateway's ``fresh``)."""

    async def fresh(self, lookup: Callable[[], T]) -> T:
        """``lookup()``; after a ``NotFound`` from it, once more when other replicas' changes were waited for."""


class Wakes(Protocol):
    """A persistent sandbox's wake, under its tenant's quota (``persistent.Wakes``)."""

    async def wake_from(self, rec: SandboxRecord) -> tuple[str, Sandbox] | None:
        """Wake ``rec`` when it is asleep: what it woke from (``suspended``, ``stopped``) and the sandbox; None
        when it was awake."""
