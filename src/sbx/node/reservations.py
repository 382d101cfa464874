"""Where a node's capacity goes: one object every holder reports to, which answers what is free and refuses a
create that does not fit.

Holders are sources the object asks when it is asked (never a count kept beside them, so it cannot drift): the
live sandboxes (the manager's), the pooled ones ready or booting (the pools'). ``free`` is capacity less what
they hold, never negative (spec: NodeStatus).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sbx.api.errors import Unavailable
from sbx.api.node import Resources

#: A holder: what each of its sandboxes holds, asked afresh every time.
Holder = Callable[[], Iterable[Resources]]


class Reservations:
    """The node's capacity and who holds what of it."""

    def __init__(self, capacity: Resources) -> None:
        self.capacity = capacity
        self._holders: dict[str, Holder] = {}

    def add_holder(self, name: str, holder: Holder) -> None:
        """Count what ``holder`` reports under ``name`` (the pools, the manager's live sandboxes)."""
        self._holders[name] = holder

    def used(self) -> Resources:
        """What every holder holds."""
        cpus = memory = disk = 0
        for holder in self._holders.values():
            for held in holder():
                cpus, memory, disk = cpus + held.cpus, memory + held.memory_mb, disk + held.disk_mb
        return Resources(cpus, memory, disk)

    def free(self) -> Resources:
        """Capacity less what is held, never negative."""
        used = self.used()
        return Resources(
            max(0, self.capacity.cpus - used.cpus),
            max(0, self.capacity.memory_mb - used.memory_mb),
            max(0, self.capacity.disk_mb - used.disk_mb),
        )

    def fits(self, wanted: Resources) -> bool:
        free = self.free()
        return (
            wanted.cpus <= free.cpus and wanted.memory_mb <= free.memory_mb and wanted.disk_mb <= free.disk_mb
        )

    def check(self, wanted: Resources) -> None:
        """503 naming what is short when ``wanted`` does not fit in what is free."""
        free = self.free()
        short = [
            f"{what} (asked {asked}, free {have})"
            for what, asked, have in (
                ("cpus", wanted.cpus, free.cpus),
                ("memory_mb", wanted.memory_mb, free.memory_mb),
                ("disk_mb", wanted.disk_mb, free.disk_mb),
            )
            if asked > have
        ]
        if short:
            raise Unavailable("not enough free capacity on this node: " + ", ".join(short))
