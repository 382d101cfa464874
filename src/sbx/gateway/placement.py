"""Placement: which node takes a new sandbox.

``choose_node(nodes, excluded, resources)`` is the interface; this module's strategy is least-loaded
first: among nodes taking new sandboxes, not excluded, with enough free CPUs, memory and disk for the
request (an amount the request leaves to the node's default counts as 0 here; the node itself refuses
when it lacks room, and the caller then excludes it and asks again), the one with the largest share of
its capacity free wins. Ties go to the fewest running sandboxes, then the name (so results are stable).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Resources:
    """What a create asks for; 0 where the request leaves it to the node (CPUs; memory and disk in MiB)."""

    cpus: int = 0
    memory_mb: int = 0
    disk_mb: int = 0


@dataclass(frozen=True)
class Candidate:
    """A node as placement sees it: its last reported capacity and free amounts."""

    name: str
    taking_new: bool
    capacity: Resources
    free: Resources
    running: int = 0


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
    nodes: Sequence[Candidate], excluded: Collection[str], resources: Resources
) -> Candidate | None:
    """The node to try next, or None when no node can take ``resources``."""
    eligible = [n for n in nodes if n.taking_new and n.name not in excluded and fits(n.free, resources)]
    if not eligible:
        return None
    return min(eligible, key=lambda n: (load_share(n), n.running, n.name))
