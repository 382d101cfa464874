"""What the job notifier's tests share: a loopback HTTP receiver for its POSTs and the writer it needs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

Hook = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Writer:
    """What the notifier needs of the gateway: its writer (a store call off the event loop)."""

    async def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)


@contextlib.asynccontextmanager
async def receiver(hook: Hook) -> AsyncIterator[str]:
    """A loopback receiver (a free port) answering ``POST /hook`` with ``hook``; yields that URL."""
    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
    finally:
        await runner.cleanup()
