"""What a service's controller does next, decided from what its replicas are now (a pure function, so the rules
can be read, and tested, as a table).

Outside a rollout (or after a failed one) the service keeps ``desired`` replicas of the serving revision:
missing ones are made all at once, surplus ones ended (those still starting first, then the newest), and any
replica of another revision ended.

During a rollout (the revision asked for is not the serving one) one step at a time, so the healthy replicas
taking traffic never drop below what the service had:

1. while fewer than ``desired`` replicas run the new revision and none of them is still starting, one more is
   made;
2. an old replica is ended only for a new one that is healthy: at most ``desired`` minus the healthy new ones
   are kept (the unhealthy and starting ones go first, then the oldest);
3. once ``desired`` new replicas are healthy and no old one is left, the rollout is done.

Unhealthy replicas are always ended (and so replaced). Lost ones (on a node that stopped answering) count for
nothing: they are replaced at once and ended when their node answers again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sbx.api.services import ReplicaState


@dataclass(frozen=True)
class ReplicaView:
    """What the plan needs of one replica."""

    sandbox: str
    revision: int
    state: ReplicaState
    created: str


@dataclass
class Plan:
    """Replicas to make (by revision) and to end; ``done``: the rollout may be marked done."""

    create: dict[int, int] = field(default_factory=dict)
    terminate: list[str] = field(default_factory=list)
    done: bool = False


def _surplus_first(replicas: list[ReplicaView]) -> list[ReplicaView]:
    """Replicas in the order they are ended when too many: not healthy before healthy, then the newest."""
    newest_first = sorted(replicas, key=lambda r: r.created, reverse=True)
    return sorted(newest_first, key=lambda r: r.state == "healthy")


def plan(desired: int, target: int, serving: int, rolling: bool, replicas: list[ReplicaView]) -> Plan:
    """The next step for a service wanting ``desired`` replicas of revision ``target`` (``rolling``: a rollout
    from ``serving`` is in progress)."""
    result = Plan()
    result.terminate = [r.sandbox for r in replicas if r.state == "unhealthy"]
    active = [r for r in replicas if r.state in ("starting", "healthy")]
    if not rolling:
        mine = _surplus_first([r for r in active if r.revision == serving])
        result.terminate += [r.sandbox for r in active if r.revision != serving]
        if len(mine) < desired:
            result.create[serving] = desired - len(mine)
        result.terminate += [r.sandbox for r in mine[: max(0, len(mine) - desired)]]
        return result
    new = _surplus_first([r for r in active if r.revision == target])
    old = [r for r in active if r.revision != target]
    if len(new) > desired:
        result.terminate += [r.sandbox for r in new[: len(new) - desired]]
        new = new[len(new) - desired :]
    healthy_new = sum(1 for r in new if r.state == "healthy")
    if len(new) < desired and not any(r.state == "starting" for r in new):
        result.create[target] = 1
    keep_old = max(0, desired - healthy_new)
    # Old ones to end first: not healthy, then the oldest revision, then the oldest replica.
    old.sort(key=lambda r: (r.state == "healthy", r.revision, r.created))
    ending = old[: max(0, len(old) - keep_old)]
    result.terminate += [r.sandbox for r in ending]
    result.done = healthy_new >= desired and len(old) == len(ending)
    return result
