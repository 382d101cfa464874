"""Catching up with what the other replicas wrote, once for all the requests waiting at the same time.

A replica answers from memory, which follows the database's commits a few milliseconds behind (the store's change
notifications, docs/ha.md). Before a read, and before a miss is answered, the gateway waits until memory holds
every write committed before then, through any replica: ``Store.caught_up`` (on PostgreSQL one query of the
commit counter, asked on the event loop, then a wait for the listener to have handed that far on; at once on
SQLite), awaited here.

``CatchUp`` shares those calls between concurrent callers without weakening what each is told: a call already
running may have read the counter before a newcomer arrived, so the newcomer waits for the next one, which starts
when the running one ends and serves everyone who arrived meanwhile. A replica so has one call in flight at most,
however many requests ask: its cost to the database is bounded by one query at a time, and at a high rate of
reads it is paid once per batch of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class CatchUp:
    """``await catch_up()``: True once a call of ``caught_up`` (awaited; True when caught up) that started after
    this await began has returned True; False when it returned False, raised, or did not return within
    ``timeout_secs``. Concurrent awaits share calls (see the module's docstring)."""

    def __init__(self, caught_up: Callable[[], Awaitable[bool]], timeout_secs: float) -> None:
        self._caught_up = caught_up
        self._timeout_secs = timeout_secs
        #: Who waits for the next call (not the running one).
        self._waiting: list[asyncio.Future[bool]] = []
        #: The task making the calls, while anyone waits.
        self._task: asyncio.Task[None] | None = None
        #: Calls made so far (tests and measurements count them).
        self.calls = 0

    async def __call__(self) -> bool:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bool] = loop.create_future()
        self._waiting.append(waiter)
        if self._task is None:
            self._task = asyncio.create_task(self._calls())
        # Not asyncio.wait_for: on Python 3.11 it returns the result when the caller is cancelled in the same turn
        # as the answer arrives, losing the cancellation (a service's control loop cancelled by a delete would then
        # run on, and the delete wait for it for good). Awaiting the future itself never swallows one, and a timer
        # of our own answers False at the timeout (0.6x the CPU of asyncio.wait here, paid whole by a lone read).
        timer = loop.call_later(self._timeout_secs, _too_late, waiter)
        try:
            return await waiter
        finally:
            timer.cancel()
            waiter.cancel()  # nothing once answered; else the next call need not answer it

    async def _calls(self) -> None:
        try:
            while self._waiting:
                # Everyone waiting now arrived before this call starts: it answers them all.
                waiting, self._waiting = self._waiting, []
                self.calls += 1
                try:
                    result = await self._caught_up()
                except Exception:
                    log.exception("catching up with the other replicas failed")
                    result = False
                for waiter in waiting:
                    if not waiter.done():  # not timed out or cancelled meanwhile
                        waiter.set_result(result)
        finally:
            self._task = None


def _too_late(waiter: asyncio.Future[bool]) -> None:
    """The timeout of ``CatchUp``'s caller: False, unless answered already."""
    if not waiter.done():
        waiter.set_result(False)
