"""Reservations: one object the manager and the pools report to; free never negative; a create that does not fit
is 503 naming what is short."""

from __future__ import annotations

import pytest

from sbx.api.errors import Unavailable
from sbx.api.node import Resources
from sbx.node.reservations import Reservations


def test_free_is_capacity_less_every_holder_asked_afresh() -> None:
    reservations = Reservations(Resources(8, 8192, 100_000))
    live = [Resources(2, 1024, 2048)]
    pooled = [Resources(1, 512, 2048), Resources(1, 512, 2048)]
    reservations.add_holder("sandboxes", lambda: live)
    reservations.add_holder("pools", lambda: pooled)
    assert reservations.free() == Resources(4, 6144, 100_000 - 6144)
    live.append(Resources(4, 6000, 1))  # no count kept beside the holders: asked again, it moves at once
    assert reservations.free() == Resources(0, 144, 100_000 - 6145)
    live.append(Resources(1, 1, 1))
    assert reservations.free().cpus == 0  # never negative


@pytest.mark.parametrize(
    ("wanted", "message"),
    [
        (Resources(5, 1, 1), "cpus (asked 5, free 4)"),
        (Resources(1, 9000, 1), "memory_mb (asked 9000, free 7168)"),
        (Resources(5, 9000, 1), "cpus (asked 5, free 4), memory_mb (asked 9000, free 7168)"),
    ],
)
def test_a_create_that_does_not_fit_is_503_naming_what_is_short(wanted: Resources, message: str) -> None:
    reservations = Reservations(Resources(8, 8192, 10_000))
    reservations.add_holder("sandboxes", lambda: [Resources(4, 1024, 0)])
    with pytest.raises(Unavailable) as info:
        reservations.check(wanted)
    assert info.value.message == f"not enough free capacity on this node: {message}"
    assert not reservations.fits(wanted)
    reservations.check(Resources(4, 7168, 10_000))  # exactly what is free fits


def test_max_sandboxes_counts_every_holder_and_refuses_the_next() -> None:
    reservations = Reservations(Resources(100, 100_000, 1_000_000), max_sandboxes=3)
    live = [Resources(1, 512, 2048), Resources(1, 512, 2048)]
    reservations.add_holder("sandboxes", lambda: live)
    reservations.add_holder("pools", lambda: [Resources(1, 512, 2048)])
    assert reservations.sandboxes() == 3
    with pytest.raises(Unavailable) as info:
        reservations.check(Resources(1, 512, 2048))
    assert info.value.message == (
        "this node holds 3 sandboxes (pooled ones included), its limit [capacity] max_sandboxes = 3: delete one "
        "or retry on another node"
    )
    assert not reservations.fits(Resources(1, 512, 2048))
    live.pop()
    reservations.check(Resources(1, 512, 2048))  # room for one again
    assert Reservations(Resources(100, 100_000, 1_000_000)).fits(Resources(1, 1, 1))  # 0: no cap


def test_an_uncounted_holder_takes_capacity_but_no_place_among_max_sandboxes() -> None:
    """Dormant persistent sandboxes: their disk is held, their place among max_sandboxes is not."""
    reservations = Reservations(Resources(4, 4096, 10_000), max_sandboxes=1)
    reservations.add_holder("sandboxes", list)
    reservations.add_holder("dormant", lambda: [Resources(0, 0, 2048)] * 3, counted=False)
    assert reservations.sandboxes() == 0
    assert reservations.free() == Resources(4, 4096, 10_000 - 3 * 2048)
    reservations.check(Resources(4, 4096, 0))  # a wake: cpus and memory, its disk already held
    with pytest.raises(Unavailable, match="disk_mb"):
        reservations.check(Resources(1, 512, 4096))


def test_the_host_check_refuses_after_the_accounting() -> None:
    why: list[str | None] = ["the host has 100 MiB of memory available ..."]
    reservations = Reservations(Resources(8, 8192, 10_000), host_check=lambda: why[0])
    with pytest.raises(Unavailable) as info:
        reservations.check(Resources(1, 512, 2048))
    assert (
        info.value.message
        == "this node takes no new sandbox now: the host has 100 MiB of memory available ..."
    )
    assert not reservations.fits(Resources(1, 512, 2048))
    with pytest.raises(Unavailable) as info:  # what the accounting finds short is named first
        reservations.check(Resources(9, 512, 2048))
    assert info.value.message.startswith("not enough free capacity on this node: cpus")
    why[0] = None
    reservations.check(Resources(1, 512, 2048))
    assert reservations.fits(Resources(1, 512, 2048))
