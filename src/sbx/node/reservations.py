"""Where a node's capacity goes: one object every holder reports to, which answers what is free and refuses a
create that does not fit.

Holders are sources the object asks when it is asked (never a count kept beside them, so it cannot drift): the
live sandboxes (the manager's), the pooled ones ready or booting (the pools'). ``free`` is capacity less what
they hold, never negative (spec: NodeStatus).

A new sandbox must also fit in ``max_sandboxes`` (0: no cap), counting every holder's sandboxes, and the host
must have room for it now (``host_check``, sbx.node.capacity: memory available, tasks, open files), so the pools
and creates stop before the host suffers whatever the accounting says. Each refusal is 503 ``unavailable``
naming what is short.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sbx.api.errors import Unavailable
from sbx.api.node import Resources

#: A holder: what each of its sandboxes holds, asked afresh every time.
Holder = Callable[[], Iterable[Resources]]
#: Why the host cannot take one more sandbox now, or None.
HostCheck = Callable[[], str | None]


def _host_ok() -> str | None:
    return None


class Reservations:
    """The node's capacity and who holds what of it."""

    def __init__(self, capacity: Resources, max_sandboxes: int = 0, host_check: HostCheck = _host_ok) -> None:
        self.capacity = capacity
        self.max_sandboxes = max_sandboxes
        self.host_check = host_check
        self._holders: dict[str, Holder] = {}
        #: Holders whose sandboxes take no place among ``max_sandboxes`` (dormant persistent ones).
        self._uncounted: set[str] = set()

    def add_holder(self, name: str, holder: Holder, counted: bool = True) -> None:
        """Count what ``holder`` reports under ``name`` (the pools, the manager's live sandboxes); its sandboxes
        count among ``max_sandboxes`` unless ``counted`` is False."""
        self._holders[name] = holder
        if not counted:
            self._uncounted.add(name)

    def used(self) -> Resources:
        """What every holder holds."""
        return self._count()[0]

    def sandboxes(self) -> int:
        """How many sandboxes the holders hold (pooled ones included)."""
        return self._count()[1]

    def _count(self) -> tuple[Resources, int]:
        cpus = memory = disk = count = 0
        for name, holder in self._holders.items():
            counted = name not in self._uncounted
            for held in holder():
                cpus, memory, disk = cpus + held.cpus, memory + held.memory_mb, disk + held.disk_mb
                count += counted
        return Resources(cpus, memory, disk), count

    def free(self) -> Resources:
        """Capacity less what is held, never negative."""
        used = self.used()
        return Resources(
            max(0, self.capacity.cpus - used.cpus),
            max(0, self.capacity.memory_mb - used.memory_mb),
            max(0, self.capacity.disk_mb - used.disk_mb),
        )

    def fits(self, wanted: Resources) -> bool:
        return self._shortage(wanted) is None

    def check(self, wanted: Resources) -> None:
        """503 naming what is short when one more sandbox of ``wanted`` does not fit: in what is free, in
        ``max_sandboxes``, or in what the host has left now."""
        shortage = self._shortage(wanted)
        if shortage is not None:
            raise Unavailable(shortage)

    def _shortage(self, wanted: Resources) -> str | None:
        used, count = self._count()
        free = Resources(
            max(0, self.capacity.cpus - used.cpus),
            max(0, self.capacity.memory_mb - used.memory_mb),
            max(0, self.capacity.disk_mb - used.disk_mb),
        )
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
            return "not enough free capacity on this node: " + ", ".join(short)
        if 0 < self.max_sandboxes <= count:
            return (
                f"this node holds {count} sandboxes (pooled ones included), its limit [capacity] max_sandboxes "
                f"= {self.max_sandboxes}: delete one or retry on another node"
            )
        host = self.host_check()
        if host is not None:
            return f"this node takes no new sandbox now: {host}"
        return None
