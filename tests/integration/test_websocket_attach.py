"""The WebSocket form of attach (capability ``websocket_attach``) against a real sandboxd: frames both ways in
binary messages, resize, the exit frame and the close, messages that break the rules, the credential offered as a
subprotocol (a wrong one refused before the switch, never echoed), the Origin check, and the attach cap shared
with the plain attach."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from sandboxd_harness import Sandboxd, UnixHTTPConnection, free_port
from test_attach import Attached, start
from ws_attach import WsAttach, exchange, handshake, offered

from sbx.api import frames

BASE = "http://localhost"


def ws_path(ref: str, pid: int) -> str:
    return f"/v1/sandboxes/{ref}/processes/{pid}/attach/websocket"


async def attach(server: Sandboxd, ref: str, pid: int, **kwargs: Any) -> WsAttach:
    return await WsAttach.connect(BASE, ws_path(ref, pid), socket_path=server.socket_path, **kwargs)


def test_the_capability_is_reported(sandboxd: Sandboxd) -> None:
    caps = sandboxd.request("GET", "/v1/capabilities").json()
    assert caps["capabilities"]["websocket_attach"] is True


async def test_frames_both_ways_then_exit_and_close(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    ref = sandbox["id"]
    pid = start(sandboxd, ref, ["sh", "-c", "echo early; cat; echo done >&2; exit 3"])
    async with await attach(sandboxd, ref, pid) as client:
        assert client.ws.protocol == frames.WEBSOCKET_PROTOCOL
        assert (await client.read(until=b"early\n")).out == b"early\n"  # replayed from the start
        # Several frames in one message, then the end of input in another.
        await client.send((frames.STDIN, b"hello "), (frames.STDIN, b"world\n"))
        await client.send((frames.END_OF_INPUT, b""))
        seen = await client.read()
    assert seen.out == b"hello world\ndone\n" and seen.exit_code == 3
    assert seen.close_code == aiohttp.WSCloseCode.OK
    for message in seen.messages:  # whole frames only, in every message
        frames.decode_message(message, frames.SERVER_TYPES)


async def test_tty_resize_and_end_of_input(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    ref = sandbox["id"]
    pid = start(sandboxd, ref, ["bash", "--norc", "--noprofile", "-i"], tty=True, rows=30, cols=100)
    async with await attach(sandboxd, ref, pid) as client:
        # Typed at the prompt, as a person would: input typed while bash starts may be dropped by its
        # terminal set-up (this runsc's line discipline).
        await client.read(until=b"$ ")
        await client.send((frames.STDIN, b"stty size\n"))
        await client.read(until=b"30 100")
        await client.resize(40, 120)
        await client.send((frames.STDIN, b"echo $((6*7)); stty size\n"))
        await client.read(until=b"$ ", after=b"40 120")  # the size, then the prompt again
        await client.send((frames.END_OF_INPUT, b""))  # ^D at the prompt ends the shell
        seen = await client.read()
    assert seen.exit_code == 0


@pytest.mark.parametrize(
    ("send", "code", "reason"),
    [
        (lambda ws: ws.send_str("hello"), aiohttp.WSCloseCode.UNSUPPORTED_DATA,
         "send binary messages of sbx-stream/1 frames"),
        (lambda ws: ws.send_bytes(b"i\x00\x00\x00\x05ab"), aiohttp.WSCloseCode.INVALID_TEXT,
         "a WebSocket message holds whole frames: it ended 7 bytes into a frame"),
        (lambda ws: ws.send_bytes(frames.encode_frame(b"o", b"x")), aiohttp.WSCloseCode.INVALID_TEXT,
         "unexpected frame type b'o'"),
    ],
    ids=["text", "partial-frame", "server-frame-type"],
)  # fmt: skip
async def test_a_message_breaking_the_rules_closes_with_the_reason(
    sandboxd: Sandboxd, sandbox: dict[str, Any], send: Callable[[Any], Any], code: int, reason: str
) -> None:
    ref = sandbox["id"]
    pid = start(sandboxd, ref, ["sh", "-c", "read x; echo got $x"])
    async with await attach(sandboxd, ref, pid) as client:
        await send(client.ws)
        seen = await client.read()
    assert seen.close_code == code and seen.close_reason.startswith(reason)
    assert seen.exit_code is None
    # The process was not disturbed: a second attach still drives it to its end.
    async with await attach(sandboxd, ref, pid) as again:
        await again.send((frames.STDIN, b"ok\n"))
        assert (await again.read()).out == b"got ok\n"


#: The largest client message (docs/node-api.md: 1 MiB + 5 bytes, a frame at the payload limit), and one byte
#: more made of whole frames (so only its size is wrong): its size, what ``wc -c`` then counts, the close code.
MIB = 1 << 20
LARGEST_MESSAGES = [
    pytest.param(frames.encode_frame(frames.STDIN, b"a" * MIB), MIB + 5, b"1048576\n", aiohttp.WSCloseCode.OK,
                 id="largest"),
    pytest.param(frames.encode_frame(frames.STDIN, b"a" * (MIB - 4)) + frames.encode_frame(frames.END_OF_INPUT, b""),
                 MIB + 6, b"0\n", aiohttp.WSCloseCode.MESSAGE_TOO_BIG, id="one-byte-more"),
]  # fmt: skip


@pytest.mark.parametrize(("message", "size", "counted", "code"), LARGEST_MESSAGES)
def test_the_largest_client_message_is_taken_and_one_byte_more_is_1009(
    sandboxd: Sandboxd, sandbox: dict[str, Any], message: bytes, size: int, counted: bytes, code: int
) -> None:
    assert len(message) == size
    ref = sandbox["id"]
    pid = start(sandboxd, ref, ["wc", "-c"])
    end = frames.encode_frame(frames.END_OF_INPUT, b"")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(60)
        sock.connect(str(sandboxd.socket_path))
        seen = exchange(sock, "localhost", ws_path(ref, pid), [message, end])
    assert seen.close_code == code
    if code != aiohttp.WSCloseCode.OK:  # nothing of it reached the process, which goes on
        assert seen.exit_code is None
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(60)
            sock.connect(str(sandboxd.socket_path))
            seen = exchange(sock, "localhost", ws_path(ref, pid), [end])
    assert (seen.out, seen.exit_code) == (counted, 0)


@pytest.mark.parametrize(
    ("headers", "protocols", "message"),
    [
        ({}, None, "this endpoint is a WebSocket: send a WebSocket handshake"),
        (None, ["chat"], "offer the WebSocket subprotocol sbx-stream.v1 (Sec-WebSocket-Protocol)"),
    ],
    ids=["plain-get", "no-sbx-subprotocol"],
)
def test_what_is_not_a_websocket_attach_is_400(
    sandboxd: Sandboxd, sandbox: dict[str, Any], headers: dict[str, str] | None, protocols: list[str] | None,
    message: str,
) -> None:  # fmt: skip
    pid = start(sandboxd, sandbox["id"], ["true"])
    path = ws_path(sandbox["id"], pid)
    if protocols is None:
        resp = sandboxd.request("GET", path, headers=headers)
    else:
        resp = handshake(UnixHTTPConnection(sandboxd.socket_path, 10), path, protocols)
    assert resp.status == 400 and resp.error[0] == "invalid_request" and resp.error[1].startswith(message)


def test_unknown_process_is_404_before_the_switch(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    resp = handshake(UnixHTTPConnection(sandboxd.socket_path, 10), ws_path(sandbox["id"], 99999), offered())
    assert resp.status == 404 and resp.error[0] == "not_found"


@pytest.fixture(scope="module")
def tcp_node(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A node on TCP with a token and one allowed Origin, as a browser would reach it."""
    workdir = tmp_path_factory.mktemp("ws-node")
    (workdir / "token").write_text("node-token\n")
    port = free_port()
    server = Sandboxd(
        workdir, '[server]\nallowed_origins = ["http://console.example"]\n',
        ["--socket", str(workdir / "s.sock"), "--listen", f"127.0.0.1:{port}", "--token-file", str(workdir / "token")],
    )  # fmt: skip
    server.socket_path = workdir / "s.sock"
    server.token = "node-token"
    server.start()
    try:
        yield server, port, server.create()["id"]
    finally:
        server.teardown()


async def test_the_token_as_a_subprotocol_is_accepted_and_never_echoed(tcp_node: Any) -> None:
    server, port, ref = tcp_node
    pid = start(server, ref, ["echo", "hi"])
    client = await WsAttach.connect(
        f"http://127.0.0.1:{port}", ws_path(ref, pid), token="node-token", origin="http://console.example"
    )
    async with client:
        assert client.ws.protocol == frames.WEBSOCKET_PROTOCOL
        seen = await client.read()
    assert seen.out == b"hi\n" and seen.exit_code == 0


@pytest.mark.parametrize(
    ("token", "origin", "status", "code", "message"),
    [
        (None, None, 401, "unauthorized", "missing or wrong token: send Authorization: Bearer <token>"),
        ("wrong", None, 401, "unauthorized", "missing or wrong token: send Authorization: Bearer <token>"),
        ("node-token", "http://evil.example", 403, "forbidden_origin",
         "Origin 'http://evil.example' is not allowed: add it to [server] allowed_origins"),
    ],
    ids=["no-token", "wrong-token", "foreign-origin"],
)  # fmt: skip
def test_refused_before_the_switch_with_the_error_body(
    tcp_node: Any, token: str | None, origin: str | None, status: int, code: str, message: str
) -> None:
    server, port, ref = tcp_node
    pid = start(server, ref, ["sleep", "30"])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    resp = handshake(conn, ws_path(ref, pid), offered(token), {"Origin": origin} if origin else None)
    assert (resp.status, *resp.error) == (status, code, message)
    assert "sec-websocket-protocol" not in resp.headers
    # Nothing changed: the process runs on, unattached.
    assert server.request("GET", f"/v1/sandboxes/{ref}/processes/{pid}").json()["state"] == "running"


def test_the_token_subprotocol_is_read_only_on_websocket_routes(tcp_node: Any) -> None:
    _, port, _ = tcp_node
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    resp = handshake(conn, "/v1/sandboxes", offered("node-token"))
    assert resp.status == 401


async def test_the_attach_cap_is_shared_with_the_plain_attach(
    sandboxd: Sandboxd, sandbox: dict[str, Any]
) -> None:
    from sbx.node.streams import MAX_ATTACHES

    ref = sandbox["id"]
    pid = start(sandboxd, ref, ["sh", "-c", "echo ready; read x; echo got-$x"])
    held = [Attached(sandboxd, ref, pid) for _ in range(MAX_ATTACHES - 1)]
    try:
        async with await attach(sandboxd, ref, pid) as last:  # the 64th, as a WebSocket
            resp = handshake(UnixHTTPConnection(sandboxd.socket_path, 10), ws_path(ref, pid), offered())
            assert (resp.status, *resp.error) == (
                503, "unavailable", f"{MAX_ATTACHES} attaches are open in this sandbox; close one and retry"
            )  # fmt: skip
            plain = sandboxd.request(
                "GET", f"/v1/sandboxes/{ref}/processes/{pid}/attach",
                headers={"Connection": "Upgrade", "Upgrade": "sbx-stream/1"},
            )  # fmt: skip
            assert plain.status == 503
            await last.send((frames.STDIN, b"ping\n"))
            seen = await last.read()
        assert (seen.out, seen.exit_code) == (b"ready\ngot-ping\n", 0)
    finally:
        for a in held:
            a.close()
