"""The egress caps: Slots per sandbox and in all, and the totals sized from the open-file limit."""

from __future__ import annotations

import pytest

from sbx.net.limits import DNS_TCP_DESCRIPTORS, EGRESS_SHARE, PROXY_DESCRIPTORS, EgressLimits
from sbx.slots import Slots


def test_slots_refuse_past_the_per_sandbox_cap_and_give_back() -> None:
    slots = Slots(per_sandbox=2, total=10)
    assert [slots.acquire("a") for _ in range(3)] == [True, True, False]
    assert slots.held("a") == 2 and slots.in_use == 2
    assert slots.acquire("b")  # another sandbox is not held back
    slots.release("a")
    assert slots.acquire("a") and slots.held("a") == 2 and slots.in_use == 3


def test_slots_refuse_past_the_total_whoever_asks() -> None:
    slots = Slots(per_sandbox=2, total=3)
    assert [slots.acquire(s) for s in ("a", "a", "b", "b", "c")] == [True, True, True, False, False]
    assert slots.in_use == 3 and slots.held("c") == 0
    slots.release("b")
    assert slots.held("b") == 0 and slots.acquire("c")


@pytest.mark.parametrize("open_files", [64, 1024, 20_000, 65_536, 1 << 20])
def test_totals_fit_in_a_share_of_the_open_file_limit(open_files: int) -> None:
    limits = EgressLimits.for_descriptors(open_files)
    held = (
        limits.proxy_total * PROXY_DESCRIPTORS
        + limits.dns_tcp_total * DNS_TCP_DESCRIPTORS
        + limits.dns_pending_total
    )
    assert held <= max(open_files * EGRESS_SHARE, 3 * PROXY_DESCRIPTORS)
    default = EgressLimits()
    assert 1 <= limits.proxy_per_sandbox <= min(limits.proxy_total, default.proxy_per_sandbox)
    assert 1 <= limits.dns_tcp_per_sandbox <= min(limits.dns_tcp_total, default.dns_tcp_per_sandbox)
    assert (
        1 <= limits.dns_pending_per_sandbox <= min(limits.dns_pending_total, default.dns_pending_per_sandbox)
    )


def test_a_large_limit_keeps_the_defaults() -> None:
    assert EgressLimits.for_descriptors(1 << 20) == EgressLimits()


def test_the_test_machines_limit() -> None:
    # 20,000 open files (this machine's hard limit): the proxy total is what the limit allows.
    limits = EgressLimits.for_descriptors(20_000)
    assert (limits.proxy_per_sandbox, limits.proxy_total) == (512, 1600)
    assert (limits.dns_tcp_per_sandbox, limits.dns_tcp_total) == (16, 512)
    assert (limits.dns_pending_per_sandbox, limits.dns_pending_total) == (64, 1024)
