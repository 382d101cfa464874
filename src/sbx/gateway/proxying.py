"""HTTP/1.1 to a port in a guest, through its node's tunnel: what the services' traffic front
(``services/proxy.py``) and the exposed ports' front (``ports/front.py``) share.

One request at a time per connection, spoken with ``h11`` over a ``sbx-tunnel/1`` stream; connections are kept
alive per destination (:class:`UpstreamPool`: at most :data:`IDLE_PER_TARGET` idle, closed after
:data:`IDLE_SECS`). Hop-by-hop headers are dropped and ``X-Forwarded-For``, ``-Host`` and ``-Proto`` set
(:func:`request_head`, whose ``keep`` decides what else is dropped: the fronts' credentials). The destination has
an answer timeout to take each part of the request and begin its answer (504 after, the tunnel closed; no limit
once it has begun: server-sent events, long downloads). An upgrade answered 101 switches both sides and copies
bytes until both ends close. Request bodies are capped at 64 MiB (413).

A request being proxied is a :class:`Proxied`: ending it (revocation, the gateway stopping) closes its
connections and cancels its task; :func:`serve_proxied` turns that into the error answer (before an answer began)
or a cut connection (after).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import h11
from aiohttp import web

from sbx.api.errors import BadGateway, GatewayTimeout, PayloadTooLarge, SandboxError
from sbx.gateway.nodeclient import NodeClient, Refusal
from sbx.gateway.relay import copy_stream
from sbx.web.http import FILE_BODY_CAP
from sbx.web.upgrade import finished_response, take_over

log = logging.getLogger(__name__)

#: Idle connections kept per destination (a replica, a sandbox's port), and how long (seconds).
IDLE_PER_TARGET = 8
IDLE_SECS = 30.0
READ_CHUNK = 64 * 1024
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "expect",
})  # fmt: skip

#: Decides a request header for the destination: the value to pass on (changed or not), or None to drop it.
HeaderFilter = Callable[[str, str], str | None]


@dataclass(eq=False)
class Upstream:
    """One HTTP/1.1 connection to a port in a guest, through its node's tunnel."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    conn: h11.Connection = field(default_factory=lambda: h11.Connection(h11.CLIENT))
    idle_since: float = 0.0

    def usable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof() and self.conn.our_state is h11.IDLE

    def close(self) -> None:
        self.writer.close()

    async def send(self, event: Any) -> None:
        data = self.conn.send(event)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def next_event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await self.reader.read(READ_CHUNK))


class UpstreamPool:
    """Connections kept alive per destination (``key``: a replica's sandbox, a sandbox's port), each closed once
    idle for ``idle_secs`` (an open tunnel keeps its sandbox from its idle timeout, so none is held longer)."""

    def __init__(self, idle_secs: float = IDLE_SECS) -> None:
        self.idle_secs = idle_secs
        self._idle: dict[str, list[Upstream]] = {}

    async def connect(self, key: str, client: NodeClient, sandbox: str, port: int) -> Upstream | Refusal:
        """An idle connection to ``key``, else a new tunnel to ``sandbox``'s ``port``; the node's refusal of the
        tunnel as it answered."""
        idle = self._idle.get(key, [])
        while idle:
            up = idle.pop()
            if up.usable() and time.monotonic() - up.idle_since < self.idle_secs:
                return up
            up.close()
        opened = await client.open_tunnel(sandbox, port)
        if isinstance(opened, Refusal):
            return opened
        return Upstream(*opened)

    def release(self, key: str, up: Upstream) -> None:
        """Keep ``up`` for the next request to ``key`` when its exchange ended cleanly; else close it."""
        if up.conn.our_state is h11.DONE and up.conn.their_state is h11.DONE:
            up.conn.start_next_cycle()
            idle = self._idle.setdefault(key, [])
            if len(idle) < IDLE_PER_TARGET:
                up.idle_since = time.monotonic()
                idle.append(up)
                asyncio.get_running_loop().call_later(self.idle_secs, self._expire, key, up, up.idle_since)
                return
        up.close()

    def _expire(self, key: str, up: Upstream, since: float) -> None:
        """Close ``up`` when it is still idle in the pool since ``since`` (not taken and released again)."""
        idle = self._idle.get(key, [])
        if up in idle and up.idle_since == since:
            idle.remove(up)
            up.close()
            if not idle:
                self._idle.pop(key, None)

    def drop(self, prefix: str) -> None:
        """Close the idle connections of every key beginning with ``prefix``."""
        for key in [k for k in self._idle if k.startswith(prefix)]:
            for up in self._idle.pop(key):
                up.close()

    def close(self) -> None:
        self.drop("")


@dataclass(eq=False)
class Proxied:
    """A request being proxied: its task, whether its answer began, why it was ended, how to close it."""

    task: asyncio.Task[Any] | None = None
    answered: bool = False
    why: SandboxError | None = None
    closers: list[Callable[[], Any]] = field(default_factory=list)

    def end(self, why: SandboxError) -> None:
        """Close its connections and cancel its task; :func:`serve_proxied` answers ``why``."""
        if self.why is not None:
            return
        self.why = why
        for close in self.closers:
            with contextlib.suppress(Exception):
                close()
        if self.task is not None:
            self.task.cancel()


def end_where(ops: Iterable[Proxied], chosen: Callable[[Any], bool], why: SandboxError) -> None:
    """End every open request of ``ops`` that ``chosen`` picks."""
    for op in [o for o in list(ops) if o.why is None and chosen(o)]:
        op.end(why)


async def serve_proxied(
    request: web.Request, op: Proxied, ops: set[Any], forward: Callable[[], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Run ``forward`` as the open request ``op`` (kept in ``ops`` meanwhile): when it is ended, its error is
    the answer if none began yet, else the client's connection is cut."""
    task = asyncio.current_task()
    assert task is not None
    op.task = task
    ops.add(op)
    try:
        return await forward()
    except asyncio.CancelledError:
        if op.why is None or task.cancelling() != 1:
            raise
        task.uncancel()
        if not op.answered:
            raise op.why from None
        if request.transport is not None:
            request.transport.close()
        return finished_response()
    finally:
        ops.discard(op)


def request_head(
    request: web.Request, prefix: str, keep: HeaderFilter, extra: Iterable[tuple[str, str]] = ()
) -> list[tuple[str, str]]:
    """The headers sent on: the client's but hop-by-hop ones, ``X-Forwarded-*`` and what ``keep`` drops;
    the upgrade asked for; ``X-Forwarded-For/Host/Proto`` (and ``-Prefix`` when ``prefix``) set."""
    named = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    headers: list[tuple[str, str]] = [("Host", request.headers.get("Host", "localhost"))]
    for name, value in request.headers.items():
        lowered = name.lower()
        if lowered in HOP_BY_HOP or lowered in named or lowered.startswith("x-forwarded-"):
            continue
        kept = keep(lowered, value)
        if kept is not None:
            headers.append((name, kept))
    upgrade = request.headers.get("Upgrade")
    if upgrade and "upgrade" in named:
        headers += [("Connection", "Upgrade"), ("Upgrade", upgrade)]
    if request.body_exists and request.content_length is None:
        headers.append(("Transfer-Encoding", "chunked"))
    headers += [
        ("X-Forwarded-For", request.remote or ""), ("X-Forwarded-Host", request.headers.get("Host", "")),
        ("X-Forwarded-Proto", request.scheme), *extra,
    ]  # fmt: skip
    if prefix:
        headers.append(("X-Forwarded-Prefix", prefix))
    return [(n, v) for n, v in headers if v]


def check_length(request: web.Request) -> None:
    """413 for a request whose declared body is over the cap (a chunked one is counted as it comes)."""
    if request.content_length is not None and request.content_length > FILE_BODY_CAP:
        raise PayloadTooLarge(
            f"request body of {request.content_length} bytes is over the {FILE_BODY_CAP}-byte limit"
        )


@dataclass(frozen=True)
class Destination:
    """Where one exchange goes: the pool's ``key`` for its connection, the sandbox (for logs), the answer
    timeout (seconds) and the 504's message."""

    key: str
    sandbox: str
    answer_timeout_secs: float
    timeout_message: str


async def exchange(
    request: web.Request, pool: UpstreamPool, up: Upstream, target: str, head: list[tuple[str, str]],
    dest: Destination, op: Proxied,
) -> web.StreamResponse:  # fmt: skip
    """One request over ``up``. The destination has ``answer_timeout_secs`` to take each part of the request and
    then to begin its answer (the final status line, or a 101); once it has, there is no limit (server-sent
    events, long downloads). Past it the client gets 504 and the tunnel is closed. :class:`NothingSent` when
    the destination failed before any of its answer came (another may take the request)."""
    released = False
    try:
        try:
            event = await _ask(request, up, target, head, dest.answer_timeout_secs)
        except TimeoutError:
            log.info("a guest did not answer in time",
                     extra={"sandbox": dest.sandbox, "timeout_secs": dest.answer_timeout_secs})  # fmt: skip
            raise GatewayTimeout(dest.timeout_message) from None
        if isinstance(event, h11.ConnectionClosed):
            raise NothingSent("the guest closed the connection")
        if isinstance(event, h11.InformationalResponse):
            return await _switch(request, up, event, op)
        assert isinstance(event, h11.Response)
        out = web.StreamResponse(status=event.status_code, reason=event.reason.decode("latin-1") or None)
        named = {t.strip().lower() for t in header_of(event.headers, b"connection").split(",")}
        for raw_name, raw_value in event.headers:
            name = raw_name.decode("latin-1")
            if name.lower() in HOP_BY_HOP or name.lower() in named:
                continue
            out.headers.add(name, raw_value.decode("latin-1"))
        length = header_of(event.headers, b"content-length")
        if length.isdigit() and request.method != "HEAD":
            out.content_length = int(length)
        await out.prepare(request)
        op.answered = True
        while True:
            event = await up.next_event()
            if isinstance(event, h11.Data):
                await out.write(bytes(event.data))
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        await out.write_eof()
        pool.release(dest.key, up)
        released = True
        return out
    except (OSError, h11.ProtocolError) as exc:
        log.info("proxied request cut", extra={"sandbox": dest.sandbox, "error": type(exc).__name__})
        if op.answered:
            if request.transport is not None:
                request.transport.close()
            return finished_response()
        raise BadGateway("the guest did not finish its answer") from None
    finally:
        if not released:
            up.close()


async def _ask(
    request: web.Request, up: Upstream, target: str, head: list[tuple[str, str]], answer_timeout: float
) -> Any:
    """Send the request (head, body, end) and read up to the answer: its status line, a 101, or the connection
    closed. Only time spent waiting on the guest counts against ``answer_timeout`` (a client sending its body
    slowly is not the guest's fault); TimeoutError past it."""
    loop = asyncio.get_running_loop()
    async with asyncio.timeout_at(loop.time() + answer_timeout) as deadline:
        try:
            await up.send(h11.Request(method=request.method, target=target, headers=head))
        except (OSError, h11.LocalProtocolError) as exc:
            raise NothingSent(type(exc).__name__) from None
        if request.body_exists:
            sent = 0
            deadline.reschedule(None)
            async for chunk in request.content.iter_chunked(READ_CHUNK):
                sent += len(chunk)
                if sent > FILE_BODY_CAP:
                    raise PayloadTooLarge(f"request body over the {FILE_BODY_CAP}-byte limit")
                deadline.reschedule(loop.time() + answer_timeout)
                await up.send(h11.Data(data=chunk))
                deadline.reschedule(None)
            deadline.reschedule(loop.time() + answer_timeout)
        await up.send(h11.EndOfMessage())
        try:
            event = await up.next_event()
            while isinstance(event, h11.InformationalResponse) and event.status_code != 101:
                event = await up.next_event()
        except (OSError, h11.RemoteProtocolError) as exc:
            raise NothingSent(type(exc).__name__) from None
        return event


async def _switch(
    request: web.Request, up: Upstream, event: h11.InformationalResponse, op: Proxied
) -> web.StreamResponse:
    """The guest agreed to switch protocols: pass its 101 on and copy bytes both ways."""
    lines = [f"HTTP/1.1 101 {event.reason.decode('latin-1') or 'Switching Protocols'}"]
    lines += [f"{n.decode('latin-1')}: {v.decode('latin-1')}" for n, v in event.headers]
    client = await take_over(request, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    op.answered = True
    op.closers.append(client.writer.close)
    leftover, _ = up.conn.trailing_data
    try:
        if leftover:
            client.writer.write(bytes(leftover))
        await asyncio.gather(copy_stream(client.reader, up.writer), copy_stream(up.reader, client.writer))
    finally:
        up.close()
        await client.close()
    return finished_response()


class NothingSent(Exception):
    """The destination failed before any of its answer arrived (another may take the request)."""


def header_of(headers: Any, name: bytes) -> str:
    """The first value of header ``name`` (lowercase) among h11's raw headers; ``''`` when absent."""
    for key, value in headers:
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return ""
