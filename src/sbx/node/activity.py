"""A request holds every sandbox it names until it ends, so that no sandbox is parked (sbx.node.parking) or idled
out (sbx.node.idle) under a request in progress: a file transfer, an attach, followed output or a tunnel is
activity for the whole time it lasts, and its end counts as the latest activity.

A sandbox's holds are a counter (:attr:`Sandbox.holds`) raised when a request names it and lowered in a
``finally`` when the request ends, so the idle timer reads "a request is in progress" in O(1), whatever the
sandbox has done before.

The middleware opens a scope per request; :meth:`SandboxManager.resolve` (every lookup that notes activity)
calls :func:`hold_for_request`, which holds the sandbox in the current request's scope (once per request); the
scope releases them all when the handler returns or fails. Upgraded connections (attach, tunnel) run inside
their handler, so they hold their sandbox for as long as they are open. Outside a request (background work,
tests calling the manager directly) nothing is held here: such work holds the sandbox itself.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.typedefs import Handler

if TYPE_CHECKING:
    from sbx.node.sandbox import Sandbox

_HELD: ContextVar[list[Sandbox] | None] = ContextVar("sbx_node_request_holds", default=None)


def hold_for_request(sandbox: Sandbox) -> None:
    """Hold ``sandbox`` until the current request ends; nothing outside a request or when already held."""
    held = _HELD.get()
    if held is None or any(s is sandbox for s in held):
        return
    sandbox.hold()
    held.append(sandbox)


@web.middleware
async def activity_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Release the sandboxes a request held when it ends (its end is their latest activity)."""
    held: list[Sandbox] = []
    token = _HELD.set(held)
    try:
        return await handler(request)
    finally:
        _HELD.reset(token)
        for sandbox in held:
            sandbox.release()
