"""Placement: which node takes a new sandbox.

``choose_node(nodes, excluded, requested)`` is the interface; this module's strategy is least-loaded
first: among nodes taking new sandboxes, not excluded, with enough free CPUs, memory and disk for what the
request will get there (an amount the request leaves to the node counts as that node's default, as it last
reported; 0 when it reports none, and the node itself then refuses when it lacks room, so the caller excludes
it and asks again), the one with the largest share of its capacity free wins. Ties go to the fewest running
sandboxes, then the name (so results are stable).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from sbx.api.node import Defaults, Resources


@dataclass(frozen=True)
class Candidate:
    """A node as placement sees it: its last reported capacity, free amounts and create defaults."""

    name: str
    taking_new: bool
    capacity: Resources
    free: Resources
    running: int = 0
    defaults: Defaults | None = None


@dataclass(frozen=True)
class Requested:
    """What a create asks for: CPUs, memory and disk in MiB; None where the request leaves it to the node."""

    cpus: int | None = None
    memory_mb: int | None = None
    disk_mb: int | None = None

    def on(self, node: Candidate) -> Resources:
        """What the request gets on ``node``: its own amounts, the node's defaults for the rest."""
        d = node.defaults
        return Resources(
            self.cpus if self.cpus is not None else (d.cpus if d else 0),
            self.memory_mb if self.memory_mb is not None else (d.memory_mb if d else 0),
            self.disk_mb if self.disk_mb is not None else (d.disk_mb if d else 0),
        )


def fits(free: Resources, wanted: Resources) -> bool:
    return free.cpus >= wanted.cpus and free.memory_mb >= wanted.memory_mb and free.disk_mb >= wanted.disk_mb


def load_share(node: Candidate) -> float:
    """The largest used share (0..1) across CPUs, memory and disk; an unknown capacity counts as full."""
    shares = []
    for cap, free in (
        (node.capacity.cpus, node.free.cpus),
        (node.capacity.memory_mb, node.free.memory_mb),
        (node.capacity.disk_mb, node.free.disk_mb),
    ):
        shares.append(1.0 if cap <= 0 else 1.0 - min(free, cap) / cap)
    return max(shares)


def choose_node(
    nodes: Sequence[Candidate], excluded: Collection[str], requested: Requested
) -> Candidate | None:
    """The node to try next, or None when no node can take what is ``requested``."""
    eligible = [n for n in nodes if n.taking_new and n.name not in excluded and fits(n.free, requested.on(n))]
    if not eligible:
        return None
    return min(eligible, key=lambda n: (load_share(n), n.running, n.name))
