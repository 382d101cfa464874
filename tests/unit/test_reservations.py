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
