"""The WebSocket form of attach through sandbox-gateway in front of a real sandboxd: frames both ways, resize and
the exit; the key (and organisation) offered as subprotocols, a wrong or missing key refused before the switch
with the error body, a foreign Origin refused, a key without sandbox:create refused, the node's attach cap (503)
relayed as sent, and a revoked key's terminal cut with a close frame saying why, audited ``api.revoked``."""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gateway_harness import FAST_ARGS, GatewayProcess
from sandboxd_harness import Sandboxd
from test_attach import Attached
from test_websocket_attach import LARGEST_MESSAGES
from ws_attach import WsAttach, exchange, handshake, offered

from sbx.api import frames


class Fleet:
    def __init__(self, gw: GatewayProcess, node: Sandboxd, keys: dict[str, str]) -> None:
        self.gw, self.node, self.keys = gw, node, keys
        self.base = f"http://127.0.0.1:{gw.port}"


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxws-", dir="/var/tmp"))
    (workdir / "n1").mkdir()
    (workdir / "gw").mkdir()
    node = Sandboxd(workdir / "n1", args=["--node-id", "w"]).start()
    gw = GatewayProcess(workdir / "gw", [("n1", node)], [*FAST_ARGS])
    rw = ("sandbox:read", "sandbox:create", "sandbox:delete")
    keys = {
        "admin": gw.create_key("root", "admin"),
        "alice": gw.create_key("alice", *rw, "org:create"),
        "reader": gw.create_key("alice", "sandbox:read"),
    }
    gw.start()
    try:
        yield Fleet(gw, node, keys)
    finally:
        gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def sandbox(fleet: Fleet) -> Iterator[dict[str, Any]]:
    made = fleet.gw.create(fleet.keys["alice"])
    yield made
    fleet.gw.request("DELETE", f"/v1/sandboxes/{made['id']}", key=fleet.keys["admin"])


def ws_path(ref: str, pid: int) -> str:
    return f"/v1/sandboxes/{ref}/processes/{pid}/attach/websocket"


def start(fleet: Fleet, key: str, ref: str, argv: list[str], **fields: Any) -> int:
    resp = fleet.gw.request("POST", f"/v1/sandboxes/{ref}/processes", {"argv": argv, **fields}, key=key)
    assert resp.status == 201, resp.body
    return int(resp.json()["pid"])


def test_the_gateway_offers_the_capability(fleet: Fleet) -> None:
    caps = fleet.gw.request("GET", "/v1/capabilities", key=fleet.keys["alice"]).json()
    assert caps["capabilities"]["websocket_attach"] is True


async def test_frames_both_ways_resize_and_exit(fleet: Fleet, sandbox: dict[str, Any]) -> None:
    key = fleet.keys["alice"]
    pid = start(fleet, key, sandbox["id"], ["bash", "--norc", "--noprofile", "-i"], tty=True,
                rows=30, cols=100)  # fmt: skip
    origin = fleet.base  # the gateway's own origin, as the console's page has
    async with await WsAttach.connect(fleet.base, ws_path(sandbox["id"], pid), token=key, origin=origin) as c:
        assert c.ws.protocol == frames.WEBSOCKET_PROTOCOL  # the token is never echoed
        await c.read(until=b"$ ")  # at the prompt (input typed while bash starts may be dropped)
        await c.send((frames.STDIN, b"echo hi\n"))
        await c.read(until=b"$ ", after=b"hi\r\n")
        await c.resize(40, 120)
        await c.send((frames.STDIN, b"stty size\n"))
        await c.read(until=b"$ ", after=b"40 120")  # the size, then the prompt again
        await c.send((frames.END_OF_INPUT, b""))
        seen = await c.read()
    assert seen.exit_code == 0 and seen.close_code == aiohttp.WSCloseCode.OK
    for message in seen.messages:
        frames.decode_message(message, frames.SERVER_TYPES)  # whole frames in every message


async def test_a_partial_frame_closes_with_1007_and_the_process_goes_on(
    fleet: Fleet, sandbox: dict[str, Any]
) -> None:
    key = fleet.keys["alice"]
    pid = start(fleet, key, sandbox["id"], ["sh", "-c", "read x; echo got $x"])
    async with await WsAttach.connect(fleet.base, ws_path(sandbox["id"], pid), token=key) as client:
        await client.ws.send_bytes(b"i\x00\x00\x00\x09abc")
        seen = await client.read()
    assert seen.close_code == aiohttp.WSCloseCode.INVALID_TEXT
    assert seen.close_reason == "a WebSocket message holds whole frames: it ended 8 bytes into a frame"
    async with await WsAttach.connect(fleet.base, ws_path(sandbox["id"], pid), token=key) as again:
        await again.send((frames.STDIN, b"on\n"))
        assert (await again.read()).out == b"got on\n"


@pytest.mark.parametrize(("message", "size", "counted", "code"), LARGEST_MESSAGES)
def test_the_largest_client_message_is_taken_and_one_byte_more_is_1009(
    fleet: Fleet, sandbox: dict[str, Any], message: bytes, size: int, counted: bytes, code: int
) -> None:
    assert len(message) == size
    key = fleet.keys["alice"]
    pid = start(fleet, key, sandbox["id"], ["wc", "-c"])
    end = frames.encode_frame(frames.END_OF_INPUT, b"")
    host = f"127.0.0.1:{fleet.gw.port}"
    with socket.create_connection(("127.0.0.1", fleet.gw.port), timeout=60) as sock:
        seen = exchange(sock, host, ws_path(sandbox["id"], pid), [message, end], token=key)
    assert seen.close_code == code
    if code != aiohttp.WSCloseCode.OK:  # nothing of it reached the process, which goes on
        assert seen.exit_code is None
        with socket.create_connection(("127.0.0.1", fleet.gw.port), timeout=60) as sock:
            seen = exchange(sock, host, ws_path(sandbox["id"], pid), [end], token=key)
    assert (seen.out, seen.exit_code) == (counted, 0)


@pytest.mark.parametrize(
    ("who", "headers", "status", "code", "message"),
    [
        (None, {}, 401, "unauthorized", "missing API key: send Authorization: Bearer sgk_..."),
        ("sgk_not-a-key", {}, 401, "unauthorized", "unknown or revoked API key"),
        ("alice", {"Origin": "http://evil.example"}, 403, "forbidden_origin",
         "Origin 'http://evil.example' is not allowed: start the gateway with --cors-origin http://evil.example"),
        ("reader", {}, 403, "refused",
         "this API key lacks the scope sandbox:create: ask an admin for a key with sandbox:create"),
    ],
    ids=["no-key", "wrong-key", "foreign-origin", "read-only-key"],
)  # fmt: skip
def test_refused_before_the_switch(
    fleet: Fleet, sandbox: dict[str, Any], who: str | None, headers: dict[str, str], status: int, code: str,
    message: str,
) -> None:  # fmt: skip
    pid = start(fleet, fleet.keys["alice"], sandbox["id"], ["sleep", "30"])
    token = fleet.keys.get(who, who) if who is not None else None
    resp = handshake(fleet.gw.connection(10), ws_path(sandbox["id"], pid), offered(token), headers)
    assert (resp.status, *resp.error) == (status, code, message)
    assert "sec-websocket-protocol" not in resp.headers
    listed = fleet.node.request("GET", f"/v1/sandboxes/{sandbox['id']}/processes/{pid}").json()
    assert listed["state"] == "running"  # nothing changed


def test_another_users_sandbox_is_404(fleet: Fleet, sandbox: dict[str, Any]) -> None:
    pid = start(fleet, fleet.keys["alice"], sandbox["id"], ["true"])
    other = fleet.gw.request(
        "POST", "/v1/admin/keys", {"user": "mallory", "scopes": ["sandbox:create"]}, key=fleet.keys["admin"]
    ).json()["secret"]
    resp = handshake(fleet.gw.connection(10), ws_path(sandbox["id"], pid), offered(other))
    assert (resp.status, resp.error[0]) == (404, "not_found")


async def test_an_organisation_offered_as_a_subprotocol(fleet: Fleet) -> None:
    gw, key = fleet.gw, fleet.keys["alice"]
    assert gw.request("POST", "/v1/orgs", {"name": "wsorg"}, key=key).status == 201
    made = gw.request("POST", "/v1/sandboxes", {}, key=key, headers={"X-Sandbox-Org": "wsorg"}).json()
    try:
        proc = gw.request("POST", f"/v1/sandboxes/{made['id']}/processes", {"argv": ["echo", "in-org"]}, key=key,
                          headers={"X-Sandbox-Org": "wsorg"}).json()  # fmt: skip
        path = ws_path(made["id"], proc["pid"])
        resp = handshake(gw.connection(10), path, offered(key))  # acting in the key's own tenant
        assert (resp.status, resp.error[0]) == (404, "not_found")
        resp = handshake(gw.connection(10), path, offered(key, org="nosuch"))
        assert (resp.status, *resp.error) == (404, "not_found", "no such organization")
        async with await WsAttach.connect(fleet.base, path, token=key, org="wsorg") as client:
            seen = await client.read()
        assert seen.out == b"in-org\n" and seen.exit_code == 0
    finally:
        gw.request("DELETE", f"/v1/sandboxes/{made['id']}", key=fleet.keys["admin"])


async def test_the_nodes_attach_cap_is_answered_as_the_node_sent_it(
    fleet: Fleet, sandbox: dict[str, Any]
) -> None:
    from sbx.node.streams import MAX_ATTACHES

    key = fleet.keys["alice"]
    pid = start(fleet, key, sandbox["id"], ["sh", "-c", "read x; echo got-$x"])
    held = [Attached(fleet.node, sandbox["id"], pid) for _ in range(MAX_ATTACHES)]
    try:
        resp = handshake(fleet.gw.connection(10), ws_path(sandbox["id"], pid), offered(key))
        assert (resp.status, *resp.error) == (
            503, "unavailable", f"{MAX_ATTACHES} attaches are open in this sandbox; close one and retry"
        )  # fmt: skip
        held.pop().close()
        await asyncio.sleep(0.5)
        async with await WsAttach.connect(fleet.base, ws_path(sandbox["id"], pid), token=key) as client:
            await client.send((frames.STDIN, b"x\n"))
            assert (await client.read()).out == b"got-x\n"
    finally:
        for a in held:
            a.close()


async def test_revoking_the_key_cuts_the_terminal_with_a_reason(
    fleet: Fleet, sandbox: dict[str, Any]
) -> None:
    gw, admin = fleet.gw, fleet.keys["admin"]
    doomed = gw.request(
        "POST", "/v1/admin/keys", {"user": "alice", "scopes": ["sandbox:create"]}, key=admin
    ).json()
    pid = start(fleet, fleet.keys["alice"], sandbox["id"], ["cat"])
    async with await WsAttach.connect(
        fleet.base, ws_path(sandbox["id"], pid), token=doomed["secret"]
    ) as client:
        await client.send((frames.STDIN, b"ping\n"))
        await client.read(until=b"ping\n")
        revoked = await asyncio.to_thread(gw.request, "DELETE", f"/v1/admin/keys/{doomed['id']}", key=admin)
        assert revoked.status == 204
        seen = await client.read(timeout_secs=5)
    assert seen.exit_code is None  # cut, not a clean end
    assert seen.close_code == aiohttp.WSCloseCode.POLICY_VIOLATION
    assert (
        seen.close_reason
        == "this request was ended because its API key was revoked or lost the scope it needs"
    )
    state = fleet.node.request("GET", f"/v1/sandboxes/{sandbox['id']}/processes/{pid}").json()["state"]
    assert state == "running"  # detaching never stops the process
    audit = gw.request("GET", "/v1/admin/audit?limit=1000", key=admin).json()["entries"]
    closed = [e for e in audit if e.get("type") == "api.revoked" and e.get("key_id") == doomed["id"]]
    assert [(e["route"], e["result"], e["target"]) for e in closed] == [
        ("GET /v1/sandboxes/{ref}/processes/{pid}/attach/websocket", "closed", sandbox["id"])
    ]
    # The revoked key's next handshake is refused before any switch.
    resp = handshake(gw.connection(10), ws_path(sandbox["id"], pid), offered(doomed["secret"]))
    assert (resp.status, *resp.error) == (401, "unauthorized", "unknown or revoked API key")


def test_the_key_offered_as_a_subprotocol_never_reaches_a_log(fleet: Fleet, sandbox: dict[str, Any]) -> None:
    """aiohttp logs offered subprotocols it does not know: ours is checked first, so a handshake offering only
    the bearer is a 400 that logs nothing of it."""
    key = fleet.keys["alice"]
    pid = start(fleet, key, sandbox["id"], ["true"])
    resp = handshake(fleet.gw.connection(10), ws_path(sandbox["id"], pid), ["bearer." + key, "chat"])
    assert (resp.status, *resp.error) == (
        400, "invalid_request", "offer the WebSocket subprotocol sbx-stream.v1 (Sec-WebSocket-Protocol)"
    )  # fmt: skip
    audit_dir = fleet.gw.workdir / "audit"
    logs = [fleet.gw.log_text(), fleet.node.log_text(), *(p.read_text() for p in audit_dir.glob("*"))]
    assert all(key not in text and key[4:] not in text for text in logs)
