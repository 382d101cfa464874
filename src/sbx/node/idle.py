"""When an idle sandbox is terminated (its idle timeout) or parked (``[parking] park_after_secs``), event-driven.

Nothing here runs per sandbox per tick. Each sandbox has at most one timer (``loop.call_at``, a heap in the
event loop) set for the earliest of its deadlines, and it is re-armed lazily: activity only moves a deadline
later, so a request just notes the time (:meth:`Sandbox.touch`) and the timer, when it fires early, looks again
and sets itself for the new deadline. A sandbox with a process running, or a request in progress (``holds``: a
tunnel, an attach, followed output, a file transfer, any request while it lasts), has no deadline at all until
the last of them ends (an exit, a request's end, is activity). An idle, parked sandbox thus costs sandboxd
nothing until its idle timeout, a single timer.

What is decided is one pure function, :func:`decide`, of what is known of the sandbox at that moment
(:class:`IdleView`), so its rules are tested as tables (tests/unit/test_idle.py):

- **terminate** (reason ``idle``; a persistent sandbox is suspended instead, sbx.node.persistent): running, no
  process running, no request in progress (``holds``), and
  ``idle_timeout_secs`` (> 0) since the last activity (spec: no request naming it and no process running for
  that long; a request names it for as long as it lasts, so a tunnel in use for an hour is an hour of
  activity, and the idle time counts from its end). Parked or not: a parked sandbox is destroyed like any
  other.
- **park**: running, not parked, ``park_after_secs`` (> 0) since the last activity, no process running, no
  request in progress, and no earlier refusal to wait for (``park_retry_at``). Whether the guest
  runs anything besides the agent is checked only then, by the parking itself (sbx.node.parking); when it
  does, the next try waits :func:`park_retry_delay`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from sbx.node.records import SandboxState

if TYPE_CHECKING:
    from sbx.node.sandbox import Sandbox

#: The longest wait between two park tries of a sandbox whose guest keeps running something, in seconds
#: (never below ``park_after_secs`` itself).
PARK_RETRY_MAX_SECS = 300.0


class IdleAction(Enum):
    """What to do with a sandbox now."""

    NOTHING = "nothing"
    TERMINATE = "terminate"
    PARK = "park"


@dataclass(frozen=True)
class IdleView:
    """What the decision needs to know of one sandbox. Times are time.monotonic seconds; ``idle_timeout_secs``
    and ``park_after_secs`` 0 mean never. ``running``: its state is running (pending, suspended and terminated
    sandboxes neither idle out nor park). ``processes``: API processes running in it. ``holds``: requests in
    progress naming it, streams included, and node operations holding it (sbx.node.activity), a count kept as
    they start and end. ``parking``: a park is under way."""

    now: float
    last_activity: float
    idle_timeout_secs: int
    park_after_secs: int
    running: bool = True
    processes: int = 0
    holds: int = 0
    parked: bool = False
    parking: bool = False
    park_retry_at: float = 0.0


@dataclass(frozen=True)
class Decision:
    """``action`` now, and when to look again (``check_at``, monotonic seconds): None when only an event can
    change the answer (activity, a process exiting, a hold released, a state change, a park ending)."""

    action: IdleAction
    check_at: float | None = None


def decide(view: IdleView) -> Decision:
    """What to do with the sandbox ``view`` describes, and when to look again (see the module's rules)."""
    if not view.running:
        return Decision(IdleAction.NOTHING)
    if view.processes > 0 or view.holds > 0:
        # The exit or the end of the last request is activity: looked at again then, from then on.
        return Decision(IdleAction.NOTHING)
    due: list[float] = []
    if view.idle_timeout_secs > 0:
        idle_at = view.last_activity + view.idle_timeout_secs
        if view.now >= idle_at:
            return Decision(IdleAction.TERMINATE)
        due.append(idle_at)
    if view.park_after_secs > 0 and not view.parked and not view.parking:
        park_at = max(view.last_activity + view.park_after_secs, view.park_retry_at)
        if view.now >= park_at:
            return Decision(IdleAction.PARK)  # the park's end is looked at again
        due.append(park_at)
    return Decision(IdleAction.NOTHING, min(due) if due else None)


def park_retry_delay(park_after_secs: int, refusals: int) -> float:
    """Seconds to wait before trying again to park a sandbox that ``refusals`` tries in a row found busy (a
    process in the guest besides the agent) or could not park: ``park_after_secs`` doubled per refusal, at
    most the larger of PARK_RETRY_MAX_SECS and ``park_after_secs``. A daemon left running in a sandbox thus
    costs one look (a listing of the guest's /proc) every five minutes at most, not every tick."""
    ceiling = max(PARK_RETRY_MAX_SECS, float(park_after_secs))
    return float(min(ceiling, park_after_secs * 2.0 ** max(0, refusals - 1)))


class IdleTimers:
    """One timer per sandbox at most, for its idle timeout and its park.

    ``on_terminate(sandbox)`` and ``on_park(sandbox)`` are called (synchronously, from the timer) when
    :func:`decide` says so; they start the work and, for a park, call :meth:`changed` when it has ended.
    ``clock`` and ``call_at`` (a loop's ``time`` and ``call_at`` by default) can be replaced in tests.
    """

    def __init__(
        self,
        park_after_secs: int,
        on_terminate: Callable[[Sandbox], None],
        on_park: Callable[[Sandbox], None],
        clock: Callable[[], float] = time.monotonic,
        call_at: Callable[..., asyncio.TimerHandle] | None = None,
    ) -> None:
        self.park_after_secs = park_after_secs
        self._on_terminate = on_terminate
        self._on_park = on_park
        self._clock = clock
        self._call_at = call_at

    def view(self, sandbox: Sandbox) -> IdleView:
        """What :func:`decide` is told of ``sandbox`` now."""
        return IdleView(
            now=self._clock(),
            last_activity=sandbox.last_activity,
            idle_timeout_secs=sandbox.record.idle_timeout_secs,
            park_after_secs=self.park_after_secs,
            running=sandbox.record.state is SandboxState.RUNNING,
            processes=sandbox.processes.running,
            holds=sandbox.holds,
            parked=sandbox.parked,
            parking=sandbox.park_lock.locked(),
            park_retry_at=sandbox.park_retry_at,
        )

    def changed(self, sandbox: Sandbox) -> None:
        """Look at ``sandbox`` again after something it is decided by changed (activity, holds, processes,
        its state, its parked flag, its idle timeout). An armed timer that fires no later than needed is kept
        (it looks again itself when it fires), so a request costs one :func:`decide` and no timer work."""
        decision = decide(self.view(sandbox))
        if decision.action is not IdleAction.NOTHING or decision.check_at is None:
            self.cancel(sandbox)
            if decision.action is IdleAction.TERMINATE:
                self._on_terminate(sandbox)
            elif decision.action is IdleAction.PARK:
                self._on_park(sandbox)
            return
        if sandbox.timer is not None and sandbox.timer_at <= decision.check_at:
            return
        self.cancel(sandbox)
        call_at = self._call_at
        if call_at is None:
            try:
                call_at = asyncio.get_running_loop().call_at
            except RuntimeError:  # no loop runs (a test building records): the manager's start arms it
                return
        sandbox.timer = call_at(decision.check_at, self._fire, sandbox)
        sandbox.timer_at = decision.check_at

    def idle_now(self, sandbox: Sandbox) -> bool:
        """Whether ``sandbox`` is to be terminated for idleness now (checked again before doing it)."""
        return decide(self.view(sandbox)).action is IdleAction.TERMINATE

    def cancel(self, sandbox: Sandbox) -> None:
        """Drop the sandbox's timer (it is terminated, or a new one is set)."""
        if sandbox.timer is not None:
            sandbox.timer.cancel()
            sandbox.timer = None

    def _fire(self, sandbox: Sandbox) -> None:
        sandbox.timer = None
        self.changed(sandbox)
