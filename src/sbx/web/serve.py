"""How sandboxd and sandbox-gateway listen and run: a private unix socket or TCP (with TLS), a loopback
``/metrics`` port, and one run loop with the same start-up and shutdown for both.

A server is an aiohttp application whose components start and stop as ``cleanup_ctx`` generators, in the
order they were appended (and stop in reverse). :func:`run` serves it until SIGTERM or SIGINT, then stops
taking connections, runs the ``on_shutdown`` hooks (a server ends its long-lived requests there), gives
requests still open ``shutdown_timeout_secs`` to finish, and only then stops the components.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from aiohttp import web

from sbx.net.loopback import is_loopback
from sbx.web.connections import IDLE_TIMEOUT_SECS, MAX_UNAUTHENTICATED, ConnectionGate, GatedRunner

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


#: Connections the kernel queues for a listener until the server accepts them (listen(2)'s backlog), on the unix
#: socket and TCP alike. Past it a nonblocking unix connect fails with EAGAIN (a blocking one waits) and a TCP SYN
#: is dropped (the client retries after 1 s, 3 s, ...), so a burst must fit: 4096 takes a burst of 1,000 connects with room
#: to spare. The kernel caps it at ``net.core.somaxconn`` (4096 since Linux 5.4; :func:`listen_backlog` warns
#: when it is lower). A queued connection costs the kernel about a socket's worth of memory, nothing before.
LISTEN_BACKLOG = 4096
SOMAXCONN_PATH = Path("/proc/sys/net/core/somaxconn")


def listen_backlog(wanted: int = LISTEN_BACKLOG, somaxconn_path: Path = SOMAXCONN_PATH) -> int:
    """The backlog the kernel gives a listener asking for ``wanted``: at most ``net.core.somaxconn`` (read from
    ``somaxconn_path``; ``wanted`` when it cannot be read). Logs a warning, saying what to change, when the kernel
    cuts it."""
    try:
        cap = int(somaxconn_path.read_text().strip())
    except (OSError, ValueError):
        return wanted
    if cap >= wanted:
        return wanted
    log.warning(
        "the kernel caps the listen backlog below what this server asks for: a burst of more simultaneous "
        "connects than the cap is refused (EAGAIN on a unix socket); raise it with "
        f"sysctl -w net.core.somaxconn={wanted}",
        extra={"somaxconn": cap, "backlog": wanted},
    )
    return max(cap, 0)


def unix_listener(path: Path, backlog: int = LISTEN_BACKLOG) -> socket.socket:
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


def parse_host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT``; ``ValueError`` saying so otherwise."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host, int(port)


def metrics_server(
    metrics: Renders, address: tuple[str, int]
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A ``cleanup_ctx`` generator serving ``metrics`` on the loopback ``address`` while the app runs."""

    async def serving(app: web.Application) -> AsyncIterator[None]:
        runner = await start_metrics_server(metrics, *address)
        yield
        await runner.cleanup()

    return serving


#: Seconds requests still open at a stop (followed output, attach, tunnel) are given before they are cut.
SHUTDOWN_TIMEOUT_SECS = 5.0


@dataclass(frozen=True)
class Listen:
    """Where a server listens: a unix socket (mode 0600), TCP (with TLS when ``tls`` is set), or both."""

    socket_path: Path | None = None
    address: tuple[str, int] | None = None
    tls: ssl.SSLContext | None = None
    backlog: int = LISTEN_BACKLOG


async def run(
    app: web.Application,
    listen: Listen,
    *,
    ready: Callable[[], None] = lambda: None,
    shutdown_timeout_secs: float = SHUTDOWN_TIMEOUT_SECS,
    cancel_on_disconnect: bool = False,
    idle_timeout_secs: float = IDLE_TIMEOUT_SECS,
    max_unauthenticated: int = MAX_UNAUTHENTICATED,
    drain_secs: float = 0.0,
    draining: Callable[[], None] = lambda: None,
) -> None:
    """Start ``app`` (its ``cleanup_ctx`` in order), listen, call ``ready``, serve until SIGTERM or SIGINT,
    then stop as the module says. ``drain_secs`` (over 0): at SIGTERM first call ``draining`` (a readiness
    check turns 503, so a load balancer sends new connections elsewhere) and go on serving that long; SIGINT,
    or a second SIGTERM, stops at once. ``cancel_on_disconnect``: a client going away cancels its handler (and what
    it waits on), as a relay wants; otherwise a handler finishes its work (a node's run, a snapshot). What a
    connection may do before it authenticates (``idle_timeout_secs``, ``max_unauthenticated``) and the answer
    to a malformed request: ``sbx.web.connections``."""
    runner = GatedRunner(
        app, ConnectionGate(max_unauthenticated), access_log=None, handle_signals=False,
        handler_cancellation=cancel_on_disconnect, shutdown_timeout=shutdown_timeout_secs,
        keepalive_timeout=idle_timeout_secs,
    )  # fmt: skip
    await runner.setup()
    listen_backlog(listen.backlog)  # a warning when the kernel cuts it
    try:
        if listen.socket_path is not None:
            # The backlog goes to the site too: asyncio calls listen() again with the backlog it is given
            # (aiohttp's default 128), replacing the socket's own.
            sock = unix_listener(listen.socket_path, backlog=listen.backlog)
            await web.SockSite(runner, sock, backlog=listen.backlog).start()
        if listen.address is not None:
            host, port = listen.address
            await web.TCPSite(runner, host, port, ssl_context=listen.tls, backlog=listen.backlog).start()
        ready()
        stop = asyncio.Event()
        term = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, lambda: stop.set() if term.is_set() else term.set())
        await _first(stop.wait(), term.wait())
        if drain_secs > 0 and not stop.is_set():
            draining()
            log.info("draining: not ready, serving on", extra={"drain_secs": drain_secs})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), drain_secs)
        log.info("stopping")
    finally:
        await runner.cleanup()
        if listen.socket_path is not None:
            listen.socket_path.unlink(missing_ok=True)


async def _first(*waits: Coroutine[object, object, object]) -> None:
    """Wait until the first of ``waits`` ends; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
