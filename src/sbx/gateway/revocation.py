"""Open requests held to their key (spec: Revocation).

Every request relayed to a node is registered here while it runs. Revoking a key (or removing an org member,
or the 30-second recheck finding a key gone or without its scope) ends the matching ones before the call that
caused it returns: the relay task is cancelled, the node request with it; a request the node had not answered
yet gets 401; an answer already streaming (followed output, attach, tunnel) is cut off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

DEFAULT_RECHECK_SECS = 30.0


@dataclass(eq=False)
class OpenRequest:
    """One relayed request: who made it, what it needs, and how to end it."""

    key_id: str
    user: str
    key_tenant: str
    tenant: str
    scopes: tuple[str, ...]
    route: str
    sandbox: str | None
    node: str | None
    task: asyncio.Task[object] | None = None
    #: Set once the node's answer head was relayed to the client (an end then cuts the stream).
    answered: bool = False
    #: Set when revocation ended it (the handler then answers 401 or cuts the stream).
    ended: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    #: Extra closers (an upgraded connection's two sockets).
    closers: list[Callable[[], None]] = field(default_factory=list)
    #: Said to the client when revocation ends a stream already answering, before its connection is cut (a
    #: WebSocket's close frame with the reason).
    farewell: Callable[[], Awaitable[object]] | None = None


class OpenRequests:
    """The registry of open relayed requests."""

    def __init__(self) -> None:
        self._open: set[OpenRequest] = set()

    def add(self, op: OpenRequest) -> None:
        self._open.add(op)

    def remove(self, op: OpenRequest) -> None:
        self._open.discard(op)
        op.done.set()

    def __len__(self) -> int:
        return len(self._open)

    def cancel_all(self) -> None:
        """Cancel every open relay (the gateway is stopping): clients see their streams cut, not a 401."""
        for op in list(self._open):
            for close in op.closers:
                with contextlib.suppress(Exception):
                    close()
            if op.task is not None:
                op.task.cancel()

    async def end_where(self, predicate: Callable[[OpenRequest], bool]) -> list[OpenRequest]:
        """End every open request ``predicate`` selects and wait until each has finished."""
        chosen = [op for op in list(self._open) if not op.ended and predicate(op)]
        for op in chosen:
            op.ended = True
            for close in op.closers:
                with contextlib.suppress(Exception):  # a socket that is already gone
                    close()
            if op.task is not None:
                op.task.cancel()
        for op in chosen:
            try:
                async with asyncio.timeout(10):
                    await op.done.wait()
            except TimeoutError:
                log.error("an ended request did not finish within 10 s", extra={"route": op.route})
        return chosen
