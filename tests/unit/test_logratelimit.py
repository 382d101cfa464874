"""RateLimitFilter: at most a burst of one kind of record per window, the rest counted and reported."""

from __future__ import annotations

import logging

import pytest

from sbx.logratelimit import MAX_KINDS, RateLimitFilter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(
    msg: str = "limit reached", sandbox: str | None = "sbx_a", name: str = "sbx.net.dns"
) -> logging.LogRecord:
    rec = logging.LogRecord(name, logging.WARNING, __file__, 1, msg, None, None)
    if sandbox is not None:
        rec.sandbox = sandbox
    return rec


def test_a_burst_passes_then_records_are_counted_and_reported_with_the_next_window() -> None:
    clock = Clock()
    limit = RateLimitFilter(burst=3, interval_secs=10, clock=clock)
    passed = [r for r in (record() for _ in range(3)) if limit.filter(r)]
    assert len(passed) == 3
    assert not hasattr(passed[0], "rate_limited_secs") and passed[2].rate_limited_secs == 10
    clock.now += 4
    assert [limit.filter(record()) for _ in range(100)] == [False] * 100
    clock.now += 6  # the window is over
    first = record()
    assert limit.filter(first) and first.suppressed == 100
    second = record()
    assert limit.filter(second) and not hasattr(second, "suppressed")


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(record(sandbox="sbx_b"), id="another-sandbox"),
        pytest.param(record(msg="another message"), id="another-message"),
        pytest.param(record(name="sbx.net.proxy"), id="another-logger"),
        pytest.param(record(sandbox=None), id="no-sandbox"),
    ],
)
def test_kinds_are_limited_apart(other: logging.LogRecord) -> None:
    limit = RateLimitFilter(burst=1, interval_secs=10, clock=Clock())
    assert limit.filter(record()) and not limit.filter(record())
    assert limit.filter(other)


def test_arguments_do_not_make_a_new_kind() -> None:
    limit = RateLimitFilter(burst=1, interval_secs=10, clock=Clock())
    first = logging.LogRecord("x", logging.WARNING, __file__, 1, "failed: %s", ("a",), None)
    again = logging.LogRecord("x", logging.WARNING, __file__, 1, "failed: %s", ("b",), None)
    assert limit.filter(first) and not limit.filter(again)


def test_memory_is_bounded_by_forgetting_the_oldest_kinds() -> None:
    clock = Clock()
    limit = RateLimitFilter(burst=1, interval_secs=10, clock=clock)
    for n in range(MAX_KINDS * 3):
        assert limit.filter(record(sandbox=f"sbx_{n}"))
    assert len(limit._windows) <= MAX_KINDS
    assert not limit.filter(record(sandbox=f"sbx_{MAX_KINDS * 3 - 1}"))  # the newest are still known


def test_a_logger_with_the_filter_writes_a_bounded_log(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("sbx.test.ratelimited")
    limit = RateLimitFilter(burst=5, interval_secs=60)
    logger.addFilter(limit)
    try:
        with caplog.at_level(logging.WARNING, logger="sbx.test.ratelimited"):
            for _ in range(10_000):
                logger.warning("connection reset", extra={"sandbox": "sbx_a"})
        assert len(caplog.records) == 5
    finally:
        logger.removeFilter(limit)


@pytest.mark.parametrize(("burst", "interval_secs"), [(0, 10.0), (1, 0.0), (-1, 1.0)])
def test_bad_settings_are_refused(burst: int, interval_secs: float) -> None:
    with pytest.raises(ValueError):
        RateLimitFilter(burst, interval_secs)
