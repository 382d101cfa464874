"""choose_node: least-loaded first, skipping excluded, not-taking-new and too-small nodes (table-driven)."""

from __future__ import annotations

import pytest

from sbx.api.node import Defaults, Resources
from sbx.gateway.placement import Candidate, Requested, choose_node, load_share


def node(name: str, free_cpus: int, free_mem: int = 8192, *, cap_cpus: int = 8, cap_mem: int = 16384,
         taking: bool = True, running: int = 0, default_cpus: int | None = None) -> Candidate:  # fmt: skip
    defaults = Defaults(cpus=default_cpus) if default_cpus is not None else None
    return Candidate(name, taking, Resources(cap_cpus, cap_mem, 100_000), Resources(free_cpus, free_mem, 50_000),
                     running, defaults)  # fmt: skip


CASES = [
    # (description, nodes, excluded, wanted, expected)
    ("empty fleet", [], set(), Requested(), None),
    ("least loaded wins", [node("a", 2), node("b", 6), node("c", 4)], set(), Requested(), "b"),
    ("memory counts too", [node("a", 8, 1000), node("b", 4, 16000)], set(), Requested(), "b"),
    ("excluded skipped", [node("a", 2), node("b", 6)], {"b"}, Requested(), "a"),
    ("not taking new skipped", [node("a", 2), node("b", 6, taking=False)], set(), Requested(), "a"),
    ("too small skipped", [node("a", 1), node("b", 2)], set(), Requested(cpus=2), "b"),
    # By the last reports nothing fits: still tried, least loaded first (the node decides; it may have room now).
    ("nothing fits by the reports", [node("a", 1), node("b", 0)], set(), Requested(cpus=2), "a"),
    # An omitted amount is the node's own default (as it reports it): a node whose default is too big for
    # what it has free is skipped even though the request named no CPUs.
    (
        "the node's default counts",
        [node("a", 6, default_cpus=8), node("b", 2, default_cpus=1)],
        set(),
        Requested(),
        "b",
    ),
    (
        "a given amount beats the default",
        [node("a", 6, default_cpus=8), node("b", 2, default_cpus=1)],
        set(),
        Requested(cpus=4),
        "a",
    ),
    ("all excluded", [node("a", 4)], {"a"}, Requested(), None),
    ("tie: fewer running", [node("a", 4, running=3), node("b", 4, running=1)], set(), Requested(), "b"),
    ("tie: name", [node("b", 4), node("a", 4)], set(), Requested(), "a"),
    (
        "unknown capacity is full",
        [node("a", 0, 0, cap_cpus=0, cap_mem=0), node("b", 1)],
        set(),
        Requested(),
        "b",
    ),
]


@pytest.mark.parametrize(
    ("nodes", "excluded", "wanted", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_choose_node(
    nodes: list[Candidate], excluded: set[str], wanted: Requested, expected: str | None
) -> None:
    choice = choose_node(nodes, excluded, wanted)
    assert (choice.name if choice else None) == expected


def test_load_share_is_the_fullest_resource() -> None:
    assert load_share(node("a", 8, 4096)) == pytest.approx(0.75)
