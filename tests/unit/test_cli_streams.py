"""Attach and tunnel, client side: the hand-made HTTP/1.1 upgrade and the frames over it, against a
tiny fake server on a unix socket (the real server's end-to-end tests come with its attach work)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from wire_samples import sandbox

from sbx.api import frames
from sbx.api.errors import Internal, NotFound, Unavailable
from sbx.api.frames import Frame, FrameDecoder, encode_frame
from sbx.cli.forward import pipe
from sbx.client import AsyncClient, Sandbox
from sbx.client._endpoint import Endpoint
from sbx.client._upgrade import build_request
from sbx.web.upgrade import parse_head


class FakeServer:
    """Answers upgrades the way the spec says; remembers each request head."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        self.heads.append(head)
        target = head.split(b" ")[1].decode()
        try:
            if target.endswith("/processes/5/attach"):
                await self.attach(reader, writer)
            elif target.endswith("/tunnel?port=8080"):
                await self.tunnel(reader, writer)
            elif target.endswith("/processes/6/attach"):
                # Switches, then dies in the middle of a frame.
                writer.write(_switch("sbx-stream/1") + encode_frame(b"o", b"abc")[:6])
            elif target.endswith("/processes/7/attach"):
                writer.write(_switch("sbx-stream/1") + encode_frame(b"i", b"client type from server"))
            elif target.endswith("/processes/8/attach"):
                writer.write(_switch("something-else/2"))
            elif target.endswith("/processes/9/attach"):
                writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
            else:
                body = json.dumps({"error": {"code": "not_found", "message": f"no route {target}"}}).encode()
                writer.write(
                    b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
            await writer.drain()
        finally:
            writer.close()

    async def attach(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # The 101 and the first output leave in one write: the client must not lose bytes read
        # together with the head.
        writer.write(_switch("sbx-stream/1") + encode_frame(b"o", b"replayed\n"))
        decoder = FrameDecoder(frames.CLIENT_TYPES)
        while data := await reader.read(7):  # small reads: frames arrive split
            for frame in decoder.feed(data):
                if frame.type == frames.STDIN:
                    writer.write(encode_frame(b"o", frame.payload.upper()))
                elif frame.type == frames.RESIZE:
                    rows, cols = frames.decode_resize(frame.payload)
                    writer.write(encode_frame(b"E", f"{rows}x{cols}".encode()))
                elif frame.type == frames.SIGNAL:
                    writer.write(encode_frame(b"E", frame.payload))
                elif frame.type == frames.END_OF_INPUT:
                    writer.write(frames.exit_frame(-15))
                    return
            await writer.drain()

    async def tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(_switch("sbx-tunnel/1"))
        received = b""
        while data := await reader.read(65536):
            received += data
        # After the client's half-close the other direction still works.
        writer.write(f"got {len(received)} bytes".encode())


def _switch(protocol: str) -> bytes:
    return f"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n\r\n".encode()


@pytest.fixture
async def fake(tmp_path: Path) -> AsyncIterator[tuple[FakeServer, AsyncClient]]:
    server = FakeServer()
    path = tmp_path / "s.sock"
    listener = await asyncio.start_unix_server(server.handle, path=str(path))
    async with listener, AsyncClient(f"unix://{path}", token="t0k") as client:
        yield server, client


async def test_attach_round_trip(fake: tuple[FakeServer, AsyncClient]) -> None:
    server, client = fake
    box = Sandbox(client, sandbox())
    async with await box.attach(5) as att:
        assert await att.recv() == Frame(b"o", b"replayed\n")
        await att.write_stdin(b"hello")
        assert await att.recv() == Frame(b"o", b"HELLO")
        await att.resize(50, 132)
        assert await att.recv() == Frame(b"E", b"50x132")
        await att.signal("sigint")
        assert await att.recv() == Frame(b"E", b"INT")
        big = b"z" * (frames.MAX_PAYLOAD_BYTES + 10)
        await att.write_stdin(big)
        echoed = [await att.recv(), await att.recv()]
        assert b"".join(f.payload for f in echoed if f) == big.upper()
        await att.close_stdin()
        assert await att.recv() == Frame(b"x", frames.encode_exit(-15))
        assert att.exit_code == -15
        assert await att.recv() is None
    head = server.heads[0].decode()
    assert head.startswith("GET /v1/sandboxes/sbx_1/processes/5/attach HTTP/1.1\r\n")
    for line in (
        "Host: localhost",
        "Connection: Upgrade",
        "Upgrade: sbx-stream/1",
        "Authorization: Bearer t0k",
    ):
        assert f"\r\n{line}\r\n" in head


async def test_attach_iterates_until_close(fake: tuple[FakeServer, AsyncClient]) -> None:
    _, client = fake
    att = await Sandbox(client, sandbox()).attach(5)
    await att.write_stdin(b"a")
    await att.close_stdin()
    got = [f async for f in att]
    assert [f.type for f in got] == [b"o", b"o", b"x"]
    await att.close()


@pytest.mark.parametrize(
    ("pid", "error", "message"),
    [
        (4, NotFound, "no route /v1/sandboxes/sbx_1/processes/4/attach"),
        (8, Internal, "switched to 'something-else/2'"),
        (9, Internal, "did not answer the upgrade with HTTP"),
    ],
)
async def test_refused_upgrades(
    fake: tuple[FakeServer, AsyncClient], pid: int, error: type[Exception], message: str
) -> None:
    _, client = fake
    with pytest.raises(error, match=message):
        await Sandbox(client, sandbox()).attach(pid)


@pytest.mark.parametrize(("pid", "message"), [(6, "middle of a frame"), (7, "malformed frame")])
async def test_broken_streams(fake: tuple[FakeServer, AsyncClient], pid: int, message: str) -> None:
    _, client = fake
    att = await Sandbox(client, sandbox()).attach(pid)
    with pytest.raises(Unavailable, match=message):
        await att.recv()
    await att.close()


async def test_tunnel_half_close(fake: tuple[FakeServer, AsyncClient]) -> None:
    server, client = fake
    async with await Sandbox(client, sandbox()).tunnel(8080) as tunnel:
        tunnel.writer.write(b"x" * 100_000)
        tunnel.writer.write_eof()
        assert await tunnel.reader.read() == b"got 100000 bytes"
    assert b"Upgrade: sbx-tunnel/1\r\n" in server.heads[0]


async def test_forward_pipe_passes_half_close(fake: tuple[FakeServer, AsyncClient]) -> None:
    """The forward command's copy loop between a local connection and a tunnel."""
    _, client = fake
    tunnel = await Sandbox(client, sandbox()).tunnel(8080)
    local = asyncio.StreamReader()
    local.feed_data(b"abc" * 1000)
    local.feed_eof()
    await pipe(local, tunnel.writer)  # ends with a half-close toward the guest
    assert await tunnel.reader.read() == b"got 3000 bytes"
    await tunnel.close()


@pytest.mark.parametrize(
    ("endpoint", "params", "expected"),
    [
        (Endpoint("http://localhost", "/s.sock"), None, "GET /v1/x HTTP/1.1\r\nHost: localhost\r\n"),
        (
            Endpoint("https://node:8443/pre", None, "k"),
            {"port": "80"},
            "GET /pre/v1/x?port=80 HTTP/1.1\r\nHost: node:8443\r\n",
        ),
    ],
)
def test_build_request(endpoint: Endpoint, params: dict[str, str] | None, expected: str) -> None:
    wire = build_request(endpoint, "/v1/x", "sbx-tunnel/1", params).decode()
    assert wire.startswith(expected)
    assert wire.endswith("\r\n\r\n")
    assert ("Authorization: Bearer k" in wire) == (endpoint.token == "k")


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: X\r\n\r\n", (101, {"upgrade": "X"})),
        (b"HTTP/1.0 404 Not Found\r\n\r\n", (404, {})),
    ],
)
def test_parse_head(head: bytes, expected: tuple[int, dict[str, str]]) -> None:
    assert parse_head(head) == expected


@pytest.mark.parametrize(
    "head", [b"garbage\r\n\r\n", b"HTTP/1.1 abc\r\n\r\n", b"HTTP/1.1 200 OK\r\nnocolon\r\n\r\n"]
)
def test_parse_head_refuses(head: bytes) -> None:
    with pytest.raises(Internal):
        parse_head(head)
