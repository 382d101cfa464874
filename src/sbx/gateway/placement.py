"""Placement: which node takes a new sandbox.

``choose_node(nodes, excluded, requested)`` is the interface; this module's strategy is least-loaded
first: among nodes taking new sandboxes and not excluded, those with enough free CPUs, memory and disk for what
the request will get there (an amount the request leaves to the node counts as that node's default, as it last
reported) come first, and the one with the largest share of its capacity free wins. When by the last reports no
node has room, the others are still tried in the same order: the node is the authority on its room (it refuses
with 503 when it has none, and the caller excludes it and asks again). Ties go to the fewest running sandboxes,
then the name (so results are stable).
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
    """The node to try next, or None when no node is left to try.

    Nodes that have room for what is ``requested`` (by their last report) come first; when none has, the others
    taking new sandboxes are still tried, least loaded first: a report is a few seconds old, a sandbox may have
    ended since, and the node itself is the authority on its room (it answers 503 when it has none)."""
    taking = [n for n in nodes if n.taking_new and n.name not in excluded]
    roomy = [n for n in taking if fits(n.free, requested.on(n))]
    eligible = roomy or taking
    if not eligible:
        return None
    return min(eligible, key=lambda n: (load_share(n), n.running, n.name))
