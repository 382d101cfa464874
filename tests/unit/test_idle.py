"""When an idle sandbox is terminated or parked (sbx.node.idle): the decision as tables of cases, the retry delay
of a refused park, and the timers (one per sandbox, re-armed lazily) on a fake clock and scheduler."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from sbx.node.idle import Decision, IdleAction, IdleTimers, IdleView, decide, park_retry_delay
from sbx.node.records import SandboxState

NOTHING, TERMINATE, PARK = IdleAction.NOTHING, IdleAction.TERMINATE, IdleAction.PARK


def view(now: float, last: float = 100.0, idle: int = 600, park: int = 30, **more: Any) -> IdleView:
    return IdleView(now=now, last_activity=last, idle_timeout_secs=idle, park_after_secs=park, **more)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        # Nothing due yet: the timer is set for the earliest deadline (the park, 30 s after the activity).
        (view(110), Decision(NOTHING, 130.0)),
        (view(129.9), Decision(NOTHING, 130.0)),
        (view(130), Decision(PARK)),
        (view(500), Decision(PARK)),  # late (a loaded loop): parked now
        # Past the idle timeout: terminated, parked or not.
        (view(700), Decision(TERMINATE)),
        (view(700, parked=True), Decision(TERMINATE)),
        (view(699.9, parked=True), Decision(NOTHING, 700.0)),  # parked: only its idle timeout is left
        # Parking off: only the idle timeout; both off: no timer at all.
        (view(110, park=0), Decision(NOTHING, 700.0)),
        (view(5000, idle=0), Decision(PARK)),
        (view(110, idle=0, park=0), Decision(NOTHING, None)),
        (view(110, idle=0, parked=True), Decision(NOTHING, None)),  # parked, never idles out: no timer
        # A process running: neither, and no timer (its exit is activity and looks again).
        (view(5000, processes=1), Decision(NOTHING, None)),
        (view(5000, processes=3, parked=True), Decision(NOTHING, None)),
        # A request in progress (a tunnel, an attach, followed output, a file transfer): activity for as long
        # as it lasts, neither parked nor idled out under it, and no timer (its end is activity).
        (view(200, holds=1), Decision(NOTHING, None)),
        (view(700, holds=2), Decision(NOTHING, None)),
        (view(5000, holds=1, parked=True), Decision(NOTHING, None)),
        (view(200, idle=0, holds=1), Decision(NOTHING, None)),
        # A park under way: not a second one.
        (view(200, parking=True), Decision(NOTHING, 700.0)),
        # A refused park waits for its retry time, which can be later than the idle timeout.
        (view(200, park_retry_at=260.0), Decision(NOTHING, 260.0)),
        (view(260, park_retry_at=260.0), Decision(PARK)),
        (view(200, park_retry_at=900.0), Decision(NOTHING, 700.0)),
        (view(130, park_retry_at=50.0), Decision(PARK)),  # an old retry time does not delay a new park
        # Not running: pending, suspended and terminated sandboxes neither idle out nor park.
        (view(5000, running=False), Decision(NOTHING, None)),
        # A short idle timeout before the park: terminated first.
        (view(110, idle=5, park=30), Decision(TERMINATE)),
        (view(103, idle=5, park=30), Decision(NOTHING, 105.0)),
    ],
)
def test_decide(case: IdleView, expected: Decision) -> None:
    assert decide(case) == expected


@pytest.mark.parametrize(
    ("park_after", "refusals", "delay"),
    [
        (30, 1, 30.0),
        (30, 2, 60.0),
        (30, 3, 120.0),
        (30, 4, 240.0),
        (30, 5, 300.0),  # at most five minutes
        (30, 40, 300.0),
        (2, 1, 2.0),
        (2, 6, 64.0),
        (600, 1, 600.0),  # never below park_after_secs itself
        (600, 3, 600.0),
        (30, 0, 30.0),
    ],
)
def test_park_retry_delay_doubles_up_to_a_ceiling(park_after: int, refusals: int, delay: float) -> None:
    assert park_retry_delay(park_after, refusals) == delay


# -- the timers ------------------------------------------------------------------------------------------------


class FakeHandle:
    def __init__(self, when: float, callback: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.when, self.callback, self.args, self.cancelled = when, callback, args, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeScheduler:
    """``call_at`` and a clock: timers fire when :meth:`advance` passes them."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.handles: list[FakeHandle] = []

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> FakeHandle:
        handle = FakeHandle(when, callback, args)
        self.handles.append(handle)
        return handle

    def armed(self) -> list[FakeHandle]:
        return [h for h in self.handles if not h.cancelled and h.when >= 0]

    def advance(self, secs: float) -> None:
        self.now += secs
        while due := sorted((h for h in self.armed() if h.when <= self.now), key=lambda h: h.when):
            handle = due[0]
            handle.cancelled = True  # fired
            handle.callback(*handle.args)


@dataclass
class FakeRecord:
    idle_timeout_secs: int = 600
    state: SandboxState = SandboxState.RUNNING


@dataclass
class FakeProcesses:
    running: int = 0


@dataclass
class FakeSandbox:
    """The attributes IdleTimers reads and sets on a sandbox."""

    last_activity: float
    record: FakeRecord = field(default_factory=FakeRecord)
    processes: FakeProcesses = field(default_factory=FakeProcesses)
    holds: int = 0
    parked: bool = False
    park_retry_at: float = 0.0
    park_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    timer: Any = None
    timer_at: float = 0.0


class Timers:
    """IdleTimers on a fake scheduler, recording what it decided."""

    def __init__(self, park_after: int = 30) -> None:
        self.clock = FakeScheduler()
        self.terminated: list[FakeSandbox] = []
        self.parks: list[FakeSandbox] = []
        self.timers = IdleTimers(
            park_after, self.terminated.append, self.parks.append,  # type: ignore[arg-type]
            clock=lambda: self.clock.now, call_at=self.clock.call_at,
        )  # fmt: skip

    def sandbox(self) -> FakeSandbox:
        return FakeSandbox(last_activity=self.clock.now)

    def touch(self, sandbox: FakeSandbox) -> None:
        sandbox.last_activity = self.clock.now
        self.timers.changed(sandbox)  # type: ignore[arg-type]


def test_an_idle_sandbox_is_parked_then_terminated_with_one_timer_at_a_time() -> None:
    t = Timers()
    sandbox = t.sandbox()
    t.timers.changed(sandbox)  # type: ignore[arg-type]
    assert [h.when for h in t.clock.armed()] == [1030.0]
    t.clock.advance(29)
    assert t.parks == []
    t.clock.advance(1)
    assert t.parks == [sandbox] and t.clock.armed() == []  # the park's end looks again
    sandbox.parked = True
    t.timers.changed(sandbox)  # type: ignore[arg-type]
    assert [h.when for h in t.clock.armed()] == [1600.0]  # only the idle timeout is left
    t.clock.advance(569)
    assert t.terminated == []
    t.clock.advance(1)
    assert t.terminated == [sandbox]


def test_activity_costs_no_timer_work_and_the_early_timer_looks_again() -> None:
    t = Timers()
    sandbox = t.sandbox()
    t.timers.changed(sandbox)  # type: ignore[arg-type]
    for _ in range(100):  # a busy client: each request only notes the time
        t.clock.advance(0.1)
        t.touch(sandbox)
    assert len(t.clock.handles) == 1  # no timer made or moved by the requests
    t.clock.advance(30 - 10)  # the first timer fires early (at 1030), finds activity, sets itself later
    assert t.parks == []
    assert [h.when for h in t.clock.armed()] == [sandbox.last_activity + 30]
    t.clock.advance(10)
    assert t.parks == [sandbox]


def test_a_shorter_deadline_replaces_a_later_timer() -> None:
    t = Timers()
    sandbox = t.sandbox()
    sandbox.parked = True
    t.timers.changed(sandbox)  # type: ignore[arg-type]
    assert [h.when for h in t.clock.armed()] == [1600.0]
    sandbox.parked = False  # woken by a request: its park deadline (earlier) comes back
    t.touch(sandbox)
    assert [h.when for h in t.clock.armed()] == [1030.0]
    sandbox.record.idle_timeout_secs = 10  # a PATCH making the idle timeout shorter than the park
    t.timers.changed(sandbox)  # type: ignore[arg-type]
    assert [h.when for h in t.clock.armed()] == [1010.0]
    t.clock.advance(10)
    assert t.terminated == [sandbox] and t.parks == []


def test_a_running_process_or_a_hold_waits_for_its_end_without_a_timer() -> None:
    t = Timers()
    sandbox = t.sandbox()
    sandbox.processes.running = 1
    t.timers.changed(sandbox)  # type: ignore[arg-type]
    assert t.clock.armed() == []
    t.clock.advance(10_000)
    assert t.parks == [] and t.terminated == []
    sandbox.processes.running = 0  # its exit is activity
    t.touch(sandbox)
    sandbox.holds = 1  # a request comes and stays open (an attach)
    t.touch(sandbox)
    assert t.clock.armed() == []
    t.clock.advance(10_000)  # far past the idle timeout (600 s)
    assert t.parks == [] and t.terminated == []  # neither parked nor idled out under it
    sandbox.holds = 0
    t.touch(sandbox)  # its end is activity: both deadlines count from it
    t.clock.advance(30)
    assert t.parks == [sandbox]
    sandbox.parked = True
    t.timers.changed(sandbox)  # type: ignore[arg-type]
    t.clock.advance(569)
    assert t.terminated == []
    t.clock.advance(1)
    assert t.terminated == [sandbox]


def test_a_terminated_sandbox_has_no_timer() -> None:
    t = Timers()
    sandbox = t.sandbox()
    t.timers.changed(sandbox)  # type: ignore[arg-type]
    sandbox.record.state = SandboxState.TERMINATED
    t.timers.changed(sandbox)  # type: ignore[arg-type]
    assert t.clock.armed() == []
    t.clock.advance(10_000)
    assert t.parks == [] and t.terminated == []


def test_a_thousand_idle_parked_sandboxes_cost_one_timer_each_and_nothing_per_tick() -> None:
    t = Timers()
    sandboxes = [t.sandbox() for _ in range(1000)]
    for sandbox in sandboxes:
        sandbox.parked = True
        t.timers.changed(sandbox)  # type: ignore[arg-type]
    assert len(t.clock.armed()) == 1000
    made = len(t.clock.handles)
    t.clock.advance(599)  # ten minutes of ticks: nothing fires, nothing is made
    assert len(t.clock.handles) == made and t.terminated == []
    t.clock.advance(1)
    assert len(t.terminated) == 1000
