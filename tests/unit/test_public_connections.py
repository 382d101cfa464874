"""Connections without a key to public services (sbx.gateway.services.public) on a real listening socket: the
caps per service and in all hold whatever clients send, an idle keep-alive connection makes room and a busy one
never does, and a connection that authenticates or closes stops counting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from sbx.gateway.services.public import PublicConnections
from sbx.web.connections import ConnectionGate, GatedRunner, anonymous_connection, mark_authenticated

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Server:
    def __init__(self, runner: GatedRunner, public: PublicConnections, release: asyncio.Event) -> None:
        self.runner = runner
        self.gate = runner.gate
        self.public = public
        self.release = release
        self.port = int(runner.addresses[0][1])

    async def connect(self) -> Stream:
        return await asyncio.open_connection("127.0.0.1", self.port)

    async def ask(self, stream: Stream, path: str, extra: bytes = b"") -> tuple[int, bytes]:
        """One keep-alive request on ``stream``: (status, head); (0, b"") when the server closed it."""
        reader, writer = stream
        writer.write(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n".encode() + extra + b"\r\n")
        await writer.drain()
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        except (asyncio.IncompleteReadError, ConnectionError):
            return 0, b""
        length = next(
            (
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            ),
            0,
        )
        await reader.readexactly(length)
        return int(head.split(b" ")[1]), head


async def all_closed(streams: list[Stream]) -> list[bool]:
    return list(await asyncio.gather(*(closed(s) for s in streams)))


async def closed(stream: Stream) -> bool:
    """Whether the server closed ``stream`` (its end reads as EOF within a moment)."""
    try:
        return await asyncio.wait_for(stream[0].read(1), 2) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    """``/{svc}/...``: a public service's request (``/{svc}/hold`` answers once ``release`` is set); ``/auth``: a
    request that authenticates. At most 3 connections per service and 5 in all; 50 not yet authenticated."""
    public = PublicConnections(per_service=3, total=5)
    release = asyncio.Event()

    async def service(request: web.Request) -> web.Response:
        conn = anonymous_connection(request)
        if conn is not None and not public.admit(conn, request.match_info["svc"]):
            response = web.Response(status=503)
            response.force_close()
            return response
        if request.match_info["rest"] == "hold":
            await release.wait()
        return web.Response(text="ok")

    async def authenticated(request: web.Request) -> web.Response:
        mark_authenticated(request)
        return web.Response(text="you")

    app = web.Application()
    app.router.add_get("/auth", authenticated)
    app.router.add_get("/{svc}/{rest}", service)
    runner = GatedRunner(app, ConnectionGate(max_unauthenticated=50), access_log=None, keepalive_timeout=30)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield Server(runner, public, release)
    finally:
        release.set()
        await runner.cleanup()


async def test_a_flood_of_keep_alive_connections_to_one_service_holds_the_cap(server: Server) -> None:
    streams = [await server.connect() for _ in range(10)]
    for stream in streams:
        assert (await server.ask(stream, "/a/x"))[0] == 200  # every request answered: the newest is let in
    assert (len(server.public), server.public.held("a"), server.public.closed_idle) == (3, 3, 7)
    assert await all_closed(streams) == [True] * 7 + [False] * 3
    assert len(server.gate.unauthenticated) == 0  # counted here now, not there
    for stream in streams[7:]:
        assert (await server.ask(stream, "/a/y"))[0] == 200  # the three kept answer again


async def test_busy_connections_are_never_closed_and_the_newcomer_is_refused(server: Server) -> None:
    busy = [await server.connect() for _ in range(3)]
    asks = [asyncio.create_task(server.ask(s, "/a/hold")) for s in busy]
    await asyncio.sleep(0.3)
    late = await server.connect()
    status, head = await server.ask(late, "/a/x")
    assert status == 503 and b"connection: close" in head.lower()
    assert await closed(late)
    assert server.public.refused == 1
    # Another service is not crowded out by this one's.
    assert (await server.ask(await server.connect(), "/b/x"))[0] == 200
    server.release.set()
    assert [(await a)[0] for a in asks] == [200, 200, 200]


async def test_the_cap_for_all_services_closes_the_longest_idle_of_any(server: Server) -> None:
    a = [await server.connect() for _ in range(3)]
    b = [await server.connect() for _ in range(3)]
    for stream in a:
        assert (await server.ask(stream, "/a/x"))[0] == 200
    for stream in b:
        assert (await server.ask(stream, "/b/x"))[0] == 200
    assert (len(server.public), server.public.held("a"), server.public.held("b")) == (5, 2, 3)
    assert await all_closed(a + b) == [True, False, False, False, False, False]
    # Used again, a connection is the most recently used: the next to go is the oldest other one.
    assert (await server.ask(a[1], "/a/x"))[0] == 200
    assert (await server.ask(await server.connect(), "/c/x"))[0] == 200
    assert await all_closed([a[2], a[1]]) == [True, False]


async def test_a_connection_moves_between_services_and_leaves_when_it_authenticates_or_closes(
    server: Server,
) -> None:
    stream = await server.connect()
    assert (await server.ask(stream, "/a/x"))[0] == 200
    assert (await server.ask(stream, "/b/x"))[0] == 200
    assert (len(server.public), server.public.held("a"), server.public.held("b")) == (1, 0, 1)
    assert (await server.ask(stream, "/auth"))[0] == 200
    assert len(server.public) == 0
    assert (await server.ask(stream, "/b/x"))[0] == 200  # proven: no longer counted anywhere
    assert len(server.public) == 0
    other = await server.connect()
    assert (await server.ask(other, "/a/x"))[0] == 200
    assert len(server.public) == 1
    other[1].close()
    for _ in range(50):
        if len(server.public) == 0:
            break
        await asyncio.sleep(0.05)
    assert len(server.public) == 0
