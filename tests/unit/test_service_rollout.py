"""The services controller's next step (``rollout.plan``) as a table: what it makes and ends for each state of a
service's replicas, in and out of a rollout (docs/services.md, "Rollouts")."""

from __future__ import annotations

import pytest

from sbx.gateway.services.rollout import Plan, ReplicaView, plan


def r(sandbox: str, revision: int, state: str, created: str = "") -> ReplicaView:
    return ReplicaView(sandbox, revision, state, created or sandbox)  # type: ignore[arg-type]


CASES = [
    # (desired, target, serving, rolling, replicas) -> create, terminate, done
    ("fresh service", 3, 1, 1, False, [], {1: 3}, [], False),
    ("steady", 2, 1, 1, False, [r("a", 1, "healthy"), r("b", 1, "starting")], {}, [], False),
    ("unhealthy replaced", 2, 1, 1, False, [r("a", 1, "healthy"), r("b", 1, "unhealthy")], {1: 1}, ["b"], False),
    ("lost replaced, kept listed", 2, 1, 1, False, [r("a", 1, "healthy"), r("b", 1, "lost")], {1: 1}, [], False),
    ("scale down: starting first, then newest", 1, 1, 1, False,
     [r("a", 1, "healthy", "1"), r("b", 1, "healthy", "2"), r("c", 1, "starting", "0")], {}, ["c", "b"], False),
    ("after a failed rollout the new revision goes", 2, 2, 1, False,
     [r("a", 1, "healthy"), r("n", 2, "healthy")], {1: 1}, ["n"], False),
    ("rollout begins with one new replica", 2, 2, 1, True, [r("a", 1, "healthy"), r("b", 1, "healthy")],
     {2: 1}, [], False),
    ("one new starting: nothing else", 2, 2, 1, True,
     [r("a", 1, "healthy"), r("b", 1, "healthy"), r("n", 2, "starting")], {}, [], False),
    ("a new one healthy: one old one goes and the next new one is made", 2, 2, 1, True,
     [r("a", 1, "healthy", "1"), r("b", 1, "healthy", "2"), r("n", 2, "healthy")], {2: 1}, ["a"], False),
    ("unhealthy old ones go first", 2, 2, 1, True,
     [r("a", 1, "healthy"), r("b", 1, "unhealthy"), r("n", 2, "healthy")], {2: 1}, ["b"], False),
    ("last step", 2, 2, 1, True, [r("b", 1, "healthy"), r("n", 2, "healthy"), r("m", 2, "healthy")],
     {}, ["b"], True),
    ("done", 2, 2, 1, True, [r("n", 2, "healthy"), r("m", 2, "healthy")], {}, [], True),
    ("superseded revision counts as old", 2, 3, 1, True,
     [r("a", 1, "healthy"), r("x", 2, "healthy"), r("n", 3, "healthy")], {3: 1}, ["a"], False),
    ("rollout to zero replicas ends the old ones", 0, 2, 1, True, [r("a", 1, "healthy")], {}, ["a"], True),
    ("too many new ones: the surplus goes", 1, 2, 1, True, [r("n", 2, "healthy", "1"), r("m", 2, "starting", "2")],
     {}, ["m"], True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("desired", "target", "serving", "rolling", "replicas", "create", "terminate", "done"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_plan(
    desired: int, target: int, serving: int, rolling: bool, replicas: list[ReplicaView], create: dict[int, int],
    terminate: list[str], done: bool,
) -> None:  # fmt: skip
    assert plan(desired, target, serving, rolling, replicas) == Plan(create, terminate, done)


def test_the_healthy_count_never_drops_during_a_rollout() -> None:
    """Walk a rollout of 3 replicas step by step (each new replica becoming healthy before the next step): the
    healthy replicas never fall below 3 and it ends with 3 new ones."""
    replicas = {f"o{i}": r(f"o{i}", 1, "healthy", f"0{i}") for i in range(3)}
    made = 0
    for _ in range(20):
        step = plan(3, 2, 1, True, list(replicas.values()))
        for sandbox in step.terminate:
            replicas.pop(sandbox)
        assert sum(1 for x in replicas.values() if x.state == "healthy") >= 3
        if step.done:
            break
        for _ in range(step.create.get(2, 0)):
            made += 1
            replicas[f"n{made}"] = r(f"n{made}", 2, "healthy", f"1{made}")
    assert step.done and sorted(x.revision for x in replicas.values()) == [2, 2, 2] and made == 3
