"""What sandboxd and sandbox-gateway share to listen: a private unix socket, a TLS context, a /metrics port."""

from __future__ import annotations

import logging
import os
import socket
import ssl
from pathlib import Path
from typing import Protocol

from aiohttp import web

from sbx.net.loopback import is_loopback

log = logging.getLogger(__name__)


def check_loopback(host: str) -> None:
    """Raise ``ValueError`` unless ``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``.

    The metrics endpoint takes no credential, so it must not be reachable from other machines.
    """
    if is_loopback(host):
        return
    raise ValueError(
        f"metrics address {host!r} is not loopback: the metrics endpoint has no credential, so it listens "
        "only on 127.0.0.1, ::1 or localhost; put a proxy in front of it to expose it further"
    )


class Renders(Protocol):
    """Metrics that render the Prometheus exposition: ``(body, content type)``."""

    def render(self) -> tuple[bytes, str]: ...


def unix_listener(path: Path, backlog: int = 256) -> socket.socket:
    """A listening unix socket at ``path`` (a stale one replaced) with mode 0600 from the start: never open
    to other users, even briefly. Non-blocking, for an event loop."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


def server_tls(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """A server TLS context (TLS 1.2 at least) for ``cert`` and ``key``; None unless both are given."""
    if cert is None or key is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


async def start_metrics_server(metrics: Renders, host: str, port: int) -> web.AppRunner:
    """Serve ``GET /metrics`` on ``host:port`` (loopback only; port 0 picks a free one).

    Returns the started runner: ``runner.addresses`` tells the bound address, ``runner.cleanup()``
    stops it. Raises ``ValueError`` for a non-loopback host before anything is bound.
    """
    check_loopback(host)

    async def handle(request: web.Request) -> web.Response:
        try:
            body, content_type = metrics.render()
        except Exception:
            # A 500 makes the scrape fail visibly (up == 0) rather than drop the gauges silently.
            log.exception("metrics snapshot failed")
            return web.Response(status=500, text="metrics snapshot failed; see the server's log\n")
        return web.Response(body=body, headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get("/metrics", handle)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
