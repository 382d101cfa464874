"""The accept loop of the proxy's and the resolver's TCP listeners: a connection is admitted or refused as
soon as it is accepted, before the next one, so that refused connections never pile up in sandboxd."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from sbx.logratelimit import RateLimitFilter

log = logging.getLogger(__name__)
log.addFilter(RateLimitFilter())  # an accept failure (EMFILE) repeats at every try

#: Seconds to wait after a failed accept (out of descriptors, ...) before the next.
ACCEPT_RETRY_SECS = 0.1


def listen_tcp(port: int, backlog: int = 1024) -> socket.socket:
    """A non-blocking TCP socket listening on ``port`` (0: a free one) of every IPv4 address."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", port))
        listener.listen(backlog)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


async def accept_forever(
    listener: socket.socket, admit: Callable[[socket.socket, str], None], what: str
) -> None:
    """Accept connections on ``listener`` until cancelled, handing each (non-blocking) with its peer's
    address to ``admit``, which takes it over at once: starts a task serving it, or resets it. ``what``
    names the listener in logs."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            conn, peer = await loop.sock_accept(listener)
        except OSError as exc:
            log.warning("accept failed", extra={"listener": what, "error": str(exc)})
            await asyncio.sleep(ACCEPT_RETRY_SECS)
            continue
        conn.setblocking(False)
        admit(conn, str(peer[0]))
        # sock_accept does not yield while connections are queued: let the API run between two.
        await asyncio.sleep(0)
