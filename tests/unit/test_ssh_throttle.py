"""Failed SSH logins by source address (sbx.gateway.ssh.throttle): answered at once, then late, then refused for
the rest of the window; one source's failures never touch another's; memory stays bounded."""

from __future__ import annotations

import pytest

from sbx.gateway.ssh import throttle
from sbx.gateway.ssh.throttle import LoginLimits, SourceThrottle, source_of


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("address", "source"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("::ffff:203.0.113.7", "203.0.113.7"),  # IPv4-mapped: the IPv4 address
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),  # the same /64
        ("fe80::1%eth0", "fe80::/64"),
        ("not an address", "not an address"),
    ],
)
def test_the_source_of_an_address(address: str, source: str) -> None:
    assert source_of(address) == source


def test_failures_are_answered_at_once_then_late_then_the_source_is_refused() -> None:
    clock = Clock()
    t = SourceThrottle(LoginLimits(source_failures=20, window_secs=600), clock)
    delays = []
    for _ in range(19):
        delays.append(t.failed("a"))
        assert t.refused_for("a") == 0
        clock.now += 1
    # Ten at once, then 0.5 s doubling up to 4 s.
    assert delays == [0.0] * 10 + [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    t.failed("a")
    assert t.refused_for("a") == pytest.approx(600 - 19)  # until the oldest of the twenty leaves the window
    assert t.refused_sources() == 1
    # Another source is untouched.
    assert (t.refused_for("b"), t.failed("b")) == (0.0, 0.0)
    # The oldest failure leaves the window: the source may try again, and is answered late at once.
    clock.now += 600 - 19
    assert t.refused_for("a") == 0
    assert t.refused_sources() == 0
    assert t.failed("a") == 4.0
    # A whole window later every failure is forgotten.
    clock.now += 601
    assert (t.refused_for("a"), t.failed("a")) == (0.0, 0.0)


@pytest.mark.parametrize(("limit", "first_late"), [(1, 1), (2, 2), (3, 2), (6, 4)])
def test_small_limits_slow_from_half(limit: int, first_late: int) -> None:
    t = SourceThrottle(LoginLimits(source_failures=limit), Clock())
    delays = [t.failed("a") for _ in range(limit)]
    assert delays.index(0.5) + 1 == first_late
    assert t.refused_for("a") > 0


def test_memory_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(throttle, "MAX_SOURCES", 100)
    clock = Clock()
    t = SourceThrottle(LoginLimits(source_failures=3), clock)
    for i in range(250):
        for _ in range(5):
            t.failed(f"10.0.{i // 256}.{i % 256}")
        clock.now += 0.01
    assert len(t._failures) == 100
    assert all(len(times) == 3 for times in t._failures.values())
    assert t.refused_for("10.0.0.249") > 0 and t.refused_for("10.0.0.0") == 0  # the oldest were forgotten
