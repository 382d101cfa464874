"""The HTTP edge: guard order and error bodies, with a handler in place of sandboxd's routes."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sbx.api.errors import Conflict
from sbx.web.guard import make_guard
from sbx.web.http import JSON_BODY_CAP, error_middleware, json_response, read_json_body


async def _client(token: str | None = None) -> TestClient:  # type: ignore[type-arg]
    async def echo(request: web.Request) -> web.Response:
        body = await read_json_body(request)
        return json_response({"bytes": len(body)})

    async def conflict(request: web.Request) -> web.Response:
        raise Conflict("busy")

    app = web.Application(
        middlewares=[
            error_middleware,
            make_guard(frozenset({"node.example"}), frozenset({"https://ui.example"}), token),
        ]
    )
    app.add_routes([web.post("/echo", echo), web.get("/conflict", conflict)])
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


@pytest.mark.parametrize(
    ("headers", "status", "code"),
    [
        ({"Host": "localhost"}, 200, None),
        ({"Host": "node.example:443"}, 200, None),
        ({"Host": "other.example"}, 403, "forbidden_origin"),
        ({"Host": "localhost", "Origin": "https://ui.example"}, 200, None),
        ({"Host": "localhost", "Origin": "https://evil.example"}, 403, "forbidden_origin"),
        ({"Host": "evil.example", "Authorization": "Bearer t"}, 403, "forbidden_origin"),
    ],
    ids=[
        "loopback",
        "configured-host",
        "foreign-host",
        "allowed-origin",
        "foreign-origin",
        "host-before-token",
    ],
)
async def test_guard(headers: dict[str, str], status: int, code: str | None) -> None:
    client = await _client()
    try:
        resp = await client.post("/echo", data=b"{}", headers=headers)
        assert resp.status == status
        if code:
            assert (await resp.json())["error"]["code"] == code
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("auth", "status"),
    [(None, 401), ("Bearer wrong", 401), ("bearer t0k", 401), ("Bearer t0k", 200)],
    ids=["missing", "wrong", "case", "right"],
)
async def test_token(auth: str | None, status: int) -> None:
    client = await _client(token="t0k")
    try:
        headers = {"Host": "localhost", **({"Authorization": auth} if auth else {})}
        resp = await client.post("/echo", data=b"{}", headers=headers)
        assert resp.status == status
        if status == 401:
            assert (await resp.json())["error"]["code"] == "unauthorized"
    finally:
        await client.close()


async def test_errors_have_the_error_body() -> None:
    client = await _client()
    try:
        resp = await client.get("/conflict", headers={"Host": "localhost"})
        assert resp.status == 409 and await resp.json() == {"error": {"code": "conflict", "message": "busy"}}
        resp = await client.get("/nowhere", headers={"Host": "localhost"})
        assert resp.status == 404
        assert await resp.json() == {"error": {"code": "not_found", "message": "no endpoint GET /nowhere"}}
        resp = await client.get("/echo", headers={"Host": "localhost"})
        assert resp.status == 405 and (await resp.json())["error"]["code"] == "invalid_request"
        resp = await client.post("/echo", data=b"x" * (JSON_BODY_CAP + 1), headers={"Host": "localhost"})
        assert resp.status == 413 and (await resp.json())["error"]["code"] == "invalid_request"
        resp = await client.post("/echo", data=b"x" * JSON_BODY_CAP, headers={"Host": "localhost"})
        assert resp.status == 200 and (await resp.json()) == {"bytes": JSON_BODY_CAP}
    finally:
        await client.close()
