"""Stream slots: the caps per sandbox and for the node, the refusals, the slot given back however a holder
ends, and the totals sized from the open-file limit."""

from __future__ import annotations

import pytest

from sbx.api.errors import Unavailable
from sbx.node.streams import MAX_ATTACHES, MAX_TUNNELS, StreamLimits, holding
from sbx.slots import Slots


def test_the_sandbox_cap_refuses_one_more_and_a_release_frees_a_slot() -> None:
    slots = Slots(per_sandbox=2, total=10)
    with holding(slots, "a", "tunnels"), holding(slots, "a", "tunnels"):
        with pytest.raises(Unavailable) as err, holding(slots, "a", "tunnels"):
            pass
        assert err.value.message == "2 tunnels are open in this sandbox; close one and retry"
        assert slots.held("a") == 2 and slots.in_use == 2  # the refusal took nothing
        with holding(slots, "b", "tunnels"):  # another sandbox is not held back by this one
            assert slots.held("b") == 1
    assert slots.in_use == 0


def test_the_node_cap_names_the_node() -> None:
    slots = Slots(per_sandbox=2, total=2)
    with holding(slots, "a", "attaches"), holding(slots, "b", "attaches"):
        with pytest.raises(Unavailable) as err, holding(slots, "c", "attaches"):
            pass
        assert err.value.message == "this node has 2 attaches open, its limit; retry when one has closed"


def test_a_failing_holder_gives_its_slot_back() -> None:
    slots = Slots(per_sandbox=1, total=1)
    with pytest.raises(OSError), holding(slots, "a", "attaches"):
        raise OSError("client went away")
    assert slots.in_use == 0


@pytest.mark.parametrize(
    ("open_files", "attaches", "tunnels"),
    [
        (1 << 20, (MAX_ATTACHES, 4096), (MAX_TUNNELS, 4096)),
        (20_000, (MAX_ATTACHES, 1000), (MAX_TUNNELS, 2000)),
        (1024, (51, 51), (102, 102)),
        (4, (1, 1), (1, 1)),
    ],
)
def test_totals_follow_the_open_file_limit(
    open_files: int, attaches: tuple[int, int], tunnels: tuple[int, int]
) -> None:
    limits = StreamLimits.for_descriptors(open_files)
    assert (limits.attaches.per_sandbox, limits.attaches.total) == attaches
    assert (limits.tunnels.per_sandbox, limits.tunnels.total) == tunnels
