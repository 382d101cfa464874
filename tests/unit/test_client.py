"""The async SDK over a transport that calls a handler: endpoints, error mapping, decoding."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest

import sbx.client
from sbx.api.errors import Conflict, Internal, InvalidRequest, NotFound, SandboxError, Unavailable
from sbx.client import AsyncClient, Endpoint, RunResult, resolve_endpoint
from sbx.client._transport import Params, Response

Handler = Callable[[str, str, Any, Params | None], tuple[int, Any]]


class HandlerTransport:
    """Answers each request by calling ``handler(method, path, json, params) -> (status, body)``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.closed = False

    async def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        data: bytes | None = None,
        params: Params | None = None,
    ) -> Response:
        status, body = self.handler(method, path, json, params)
        if isinstance(body, bytes):
            return Response(status, "text/html", body)
        return Response(status, "application/json", b"" if body is None else _dumps(body))

    async def aclose(self) -> None:
        self.closed = True


def _dumps(body: Any) -> bytes:
    return json.dumps(body).encode()


def test_exported_names() -> None:
    assert set(sbx.client.__all__) == {
        "AsyncClient",
        "RunResult",
        "Endpoint",
        "resolve_endpoint",
        "DEFAULT_SOCKET",
        "SandboxError",
        "InvalidRequest",
        "Unauthorized",
        "Refused",
        "ForbiddenOrigin",
        "NotFound",
        "Conflict",
        "PayloadTooLarge",
        "Unsupported",
        "Unavailable",
        "BadGateway",
        "Internal",
    }
    for name in sbx.client.__all__:
        assert hasattr(sbx.client, name)


@pytest.mark.parametrize(
    ("url", "token", "env", "expected"),
    [
        (None, None, {}, Endpoint("http://localhost", "/run/sandboxd.sock")),
        ("unix:///tmp/s.sock", "t", {}, Endpoint("http://localhost", "/tmp/s.sock", "t")),
        ("/tmp/s.sock", None, {}, Endpoint("http://localhost", "/tmp/s.sock")),
        ("https://node:8443/", None, {}, Endpoint("https://node:8443")),
        ("http://127.0.0.1:7070/prefix", None, {}, Endpoint("http://127.0.0.1:7070/prefix")),
        (None, None, {"SANDBOX_URL": "http://h:1", "SANDBOX_TOKEN": "e"}, Endpoint("http://h:1", None, "e")),
        (
            "http://flag:2",
            "f",
            {"SANDBOX_URL": "http://h:1", "SANDBOX_TOKEN": "e"},
            Endpoint("http://flag:2", None, "f"),
        ),
        (
            "",
            "",
            {"SANDBOX_URL": "", "SANDBOX_TOKEN": ""},
            Endpoint("http://localhost", "/run/sandboxd.sock"),
        ),
    ],
)
def test_resolve_endpoint(
    url: str | None, token: str | None, env: dict[str, str], expected: Endpoint
) -> None:
    assert resolve_endpoint(url, token, env) == expected


@pytest.mark.parametrize("url", ["ftp://h", "node:8443", "unix://", "http://", "http://h/?x=1"])
def test_resolve_endpoint_refuses(url: str) -> None:
    with pytest.raises(InvalidRequest, match="sandboxd|socket|query"):
        resolve_endpoint(url, None, {})


@pytest.mark.parametrize(
    ("status", "body", "error", "message"),
    [
        (404, {"error": {"code": "not_found", "message": "no sandbox 'x'"}}, NotFound, "no sandbox 'x'"),
        (409, {"error": {"code": "conflict", "message": "name in use"}}, Conflict, "name in use"),
        (503, {"error": {"code": "unavailable", "message": "cordoned"}}, Unavailable, "cordoned"),
        (500, b"<html>oops</html>", Internal, "HTTP 500"),
    ],
)
async def test_non_2xx_raises_the_matching_error(
    status: int, body: Any, error: type[SandboxError], message: str
) -> None:
    client = AsyncClient(transport=HandlerTransport(lambda *_: (status, body)))
    with pytest.raises(error) as caught:
        await client.get("x")
    assert caught.value.message == message


async def test_calls_build_the_spec_requests() -> None:
    seen: list[tuple[str, str, Any, Any]] = []

    def handler(method: str, path: str, body: Any, params: Params | None) -> tuple[int, Any]:
        seen.append((method, path, body, params))
        if path == "/v1/sandboxes" and method == "GET":
            return 200, {"sandboxes": [{"id": "sbx_1"}]}
        if method == "DELETE":
            return 204, None
        if path.endswith("/run"):
            out = base64.b64encode(b"\x00hi").decode()
            return 200, {"exit_code": 0, "stdout": out, "stderr": "", "truncated": False, "timed_out": False}
        return 200, {"ok": True}

    transport = HandlerTransport(handler)
    async with AsyncClient(transport=transport) as client:
        assert await client.list({"team": "a", "env": "prod"}) == [{"id": "sbx_1"}]
        await client.get("my name/..")
        await client.delete("sbx_1")
        result = await client.run("sbx_1", ["cat"], stdin=b"in", timeout_secs=5, cwd="/sandbox/home")
        await client.create(name="n", cpus=2)
        await client.cordon(False)
    assert transport.closed
    assert result == RunResult(exit_code=0, stdout=b"\x00hi", stderr=b"", truncated=False, timed_out=False)
    assert seen == [
        ("GET", "/v1/sandboxes", None, [("label", "team=a"), ("label", "env=prod")]),
        ("GET", "/v1/sandboxes/my%20name%2F..", None, None),
        ("DELETE", "/v1/sandboxes/sbx_1", None, None),
        (
            "POST",
            "/v1/sandboxes/sbx_1/run",
            {"argv": ["cat"], "cwd": "/sandbox/home", "stdin": "aW4=", "timeout_secs": 5},
            None,
        ),
        ("POST", "/v1/sandboxes", {"name": "n", "cpus": 2}, None),
        ("POST", "/v1/node/cordon", {"cordoned": False}, None),
    ]


@pytest.mark.parametrize(
    "body",
    [{"stdout": ""}, {"exit_code": 0, "stdout": "not base64!"}, ["not", "an", "object"]],
)
async def test_malformed_run_result_is_internal(body: Any) -> None:
    client = AsyncClient(transport=HandlerTransport(lambda *_: (200, body)))
    with pytest.raises(Internal):
        await client.run("sbx_1", ["true"])
