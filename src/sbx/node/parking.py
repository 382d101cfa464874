"""Parking: an idle sandbox's processes are stopped on the host (the backend's :meth:`~Backend.park`, a frozen
cgroup for gVisor), so it costs no CPU, and woken transparently, in a few milliseconds, before anything reaches
it (docs/node-api.md, "Parking").

Why: an idle gVisor sandbox on systrap keeps 2-4 % of a core busy with nothing running inside (docs/backends.md,
"Parking"), so a node saturates at a few dozen idle sandboxes per core. Parked, it uses none, and the API does
not change: its state stays ``running``, and the first request after a park pays the wake-up.

A sandbox is parked when :mod:`sbx.node.idle` says so (``[parking] park_after_secs`` without activity, no API
process running, no request or stream open) **and** its guest runs nothing but the agent: the guest's ``/proc``
is listed through the agent (one directory listing) right before, so a daemon left running (``nohup server &``)
or a ``sleep 300 && ...`` is never stopped (a parked guest's timers do not fire). Those checks are made again,
without waiting on anything, right before the park, and the sandbox is marked parked in that same step: a
request arriving later finds it parked and waits for the park to end, then wakes it.

Every path that reaches a sandbox's agent or the backend's commands about it holds the sandbox (a request holds
it from the moment it names it; see sbx.node.activity) and calls :meth:`Sandbox.wake` first. A sandboxd that
restarts finds parked sandboxes parked (the backend reads it from the host) and leaves them so; their agent is
connected again at their first wake.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from sbx.agent.client import AgentClient, AgentError
from sbx.api.errors import Internal
from sbx.backends.base import Backend, BackendError
from sbx.node.idle import park_retry_delay
from sbx.node.records import SandboxState
from sbx.node.sandbox import Sandbox

log = logging.getLogger(__name__)

#: How long the listing of the guest's processes may take before a park is given up, in seconds.
GUEST_CHECK_TIMEOUT_SECS = 10.0
#: The agent's pid in the guest: the only process a parked guest may run.
AGENT_GUEST_PID = "1"


async def guest_processes(agent: AgentClient, uid: int, gid: int) -> list[int]:
    """The guest's processes other than the agent (pid 1), read from a listing of its ``/proc``."""
    entries = await agent.list_dir("/proc", uid, gid)
    return sorted(int(e.name) for e in entries if e.name.isdigit() and e.name != AGENT_GUEST_PID)


class Parking:
    """Parks the node's idle sandboxes and wakes them. ``park_after_secs``: the idle time before a park (0:
    never). ``on_change(sandbox)`` is called whenever a sandbox's parked flag changes; ``reattach(sandbox)``
    connects the agent of a sandbox woken after a restart. ``on_parked`` hooks are awaited after a park (the
    sampler reads the frozen counters once), ``on_unparked`` ones called after a wake or when a parked sandbox
    is terminated."""

    def __init__(
        self,
        backend: Backend,
        park_after_secs: int,
        on_change: Callable[[Sandbox], None],
        reattach: Callable[[Sandbox], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.park_after_secs = park_after_secs
        self._on_change = on_change
        self._reattach = reattach
        self._clock = clock
        #: Ids of the parked sandboxes.
        self.parked: set[str] = set()
        #: Parks and wakes since start.
        self.parks = 0
        self.unparks = 0
        self.on_parked: list[Callable[[Sandbox], Coroutine[Any, Any, None]]] = []
        self.on_unparked: list[Callable[[Sandbox], None]] = []
        self._hooks: set[asyncio.Task[None]] = set()

    def _why_not_idle(self, sandbox: Sandbox, seen: float) -> str | None:
        """Why ``sandbox`` must not be parked now (None: it may), without waiting on anything. ``seen``: its
        last activity when the park began; any activity since cancels it."""
        processes = sandbox.processes
        if sandbox.record.state is not SandboxState.RUNNING:
            return f"it is {sandbox.record.state.value}"
        if sandbox.parked:
            return "it is parked"
        if sandbox.last_activity != seen or self._clock() - seen < self.park_after_secs:
            return "it was used meanwhile"
        if sandbox.holds:
            return "a request or stream is open"
        if processes.running:
            return "a process runs"
        return None

    @staticmethod
    def _agent_missing(sandbox: Sandbox) -> bool:
        processes = sandbox.processes
        return (
            processes.paused_reason is not None or processes.agent is None or processes.agent.closed.is_set()
        )

    async def try_park(self, sandbox: Sandbox) -> str | None:
        """Park ``sandbox`` if it is idle and its guest runs nothing but the agent; None when it was parked,
        else why not (a refusal because of the guest or a failure delays the next try)."""
        if self.park_after_secs <= 0 or sandbox.park_lock.locked():
            return "parking is off or under way"
        sandbox_id = sandbox.record.id
        async with sandbox.park_lock:
            seen = sandbox.last_activity
            why = self._why_not_idle(sandbox, seen)
            if why is not None:
                return why  # its timer knows when to look again
            agent = sandbox.processes.agent
            if agent is None or self._agent_missing(sandbox):
                # Being snapshotted or reconnected: nothing the timer sees, so the retry is delayed here.
                return self._refused(sandbox, "its agent is not connected")
            guest = sandbox.processes.guest
            try:
                others = await asyncio.wait_for(
                    guest_processes(agent, guest.uid, guest.gid), GUEST_CHECK_TIMEOUT_SECS
                )
            except (AgentError, TimeoutError) as exc:
                return self._refused(sandbox, f"the guest's processes could not be listed: {exc}")
            if others:
                return self._refused(
                    sandbox, f"{len(others)} process(es) besides the agent run in the guest (pid "
                    f"{', '.join(map(str, others[:5]))}{', ...' if len(others) > 5 else ''})",
                )  # fmt: skip
            why = self._why_not_idle(sandbox, seen)  # again: the listing let other work in
            if why is not None:
                return why
            if self._agent_missing(sandbox):
                return self._refused(sandbox, "its agent is not connected")
            # From here a request naming it finds it parked and waits for this lock, then wakes it.
            sandbox.parked = True
            self.parked.add(sandbox_id)
            self._on_change(sandbox)
            started = self._clock()
            try:
                await self.backend.park(sandbox_id)
            except BackendError as exc:
                sandbox.parked = False
                self.parked.discard(sandbox_id)
                self._on_change(sandbox)
                log.warning("sandbox could not be parked", extra={"sandbox": sandbox_id, "error": str(exc)})
                return self._refused(sandbox, str(exc))
            sandbox.park_refusals = 0
            self.parks += 1
            for hook in self.on_parked:
                await hook(sandbox)
            log.debug("sandbox parked", extra={"sandbox": sandbox_id,
                                               "ms": round((self._clock() - started) * 1000, 2)})  # fmt: skip
            return None

    def _refused(self, sandbox: Sandbox, why: str) -> str:
        sandbox.park_refusals += 1
        delay = park_retry_delay(self.park_after_secs, sandbox.park_refusals)
        sandbox.park_retry_at = self._clock() + delay
        log.debug("sandbox not parked", extra={"sandbox": sandbox.record.id, "why": why, "retry_secs": delay})
        return why

    async def wake(self, sandbox: Sandbox) -> None:
        """Unpark ``sandbox`` if it is parked (waiting for a park under way to end first); nothing otherwise.
        Internal (500) when the backend cannot wake it or, after a restart, its agent cannot be reached."""
        if not sandbox.parked:
            return
        sandbox_id = sandbox.record.id
        async with sandbox.park_lock:
            if not sandbox.parked:
                return
            started = self._clock()
            try:
                await self.backend.unpark(sandbox_id)
            except BackendError as exc:
                raise Internal(f"sandbox {sandbox_id} could not be woken from parking: {exc}") from exc
            self._unparked(sandbox)
            if sandbox.processes.agent is None and sandbox.processes.paused_reason is None:
                # Taken back parked by a restarted sandboxd: its agent was never connected.
                try:
                    await self._reattach(sandbox)
                except (AgentError, OSError) as exc:
                    raise Internal(f"the agent of sandbox {sandbox_id} could not be reached: {exc}") from exc
            log.debug("sandbox unparked", extra={"sandbox": sandbox_id,
                                                 "ms": round((self._clock() - started) * 1000, 2)})  # fmt: skip

    def _unparked(self, sandbox: Sandbox) -> None:
        sandbox.parked = False
        sandbox.park_refusals = 0
        sandbox.park_retry_at = 0.0
        self.parked.discard(sandbox.record.id)
        self.unparks += 1
        for hook in self.on_unparked:
            hook(sandbox)
        self._on_change(sandbox)

    async def take_back(self, sandbox: Sandbox) -> bool:
        """At start: whether the backend holds ``sandbox`` parked; if so it is marked parked (its agent is
        connected at its first wake). A park a crash left half done is undone (the sandbox then runs)."""
        sandbox_id = sandbox.record.id
        if await self.backend.is_parked(sandbox_id):
            sandbox.parked = True
            self.parked.add(sandbox_id)
            for hook in self.on_parked:
                await hook(sandbox)
            self._on_change(sandbox)
            log.debug("parked sandbox taken back", extra={"sandbox": sandbox_id})
            return True
        await self.backend.unpark(sandbox_id)
        return False

    def adopt(self, sandbox: Sandbox) -> None:
        """Count ``sandbox``, handed over parked (a pooled sandbox), as parked; the ``on_parked`` hooks run in
        the background (the caller does not wait)."""
        sandbox.parked = True
        self.parked.add(sandbox.record.id)
        for hook in self.on_parked:
            task = asyncio.get_running_loop().create_task(hook(sandbox))
            self._hooks.add(task)
            task.add_done_callback(self._hooks.discard)
        self._on_change(sandbox)

    def forget(self, sandbox: Sandbox) -> None:
        """The sandbox is terminated: it is no longer counted as parked (the backend's destroy unparks it)."""
        if sandbox.parked:
            sandbox.parked = False
            self.parked.discard(sandbox.record.id)
            for hook in self.on_unparked:
                hook(sandbox)
