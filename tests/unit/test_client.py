"""The async SDK over a transport that calls a handler: endpoints, error mapping, decoding."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp.client_reqrep import ConnectionKey
from wire_samples import (
    node_status_body,
    process,
    process_body,
    sandbox,
    sandbox_body,
    snapshot_body,
    volume_body,
)

import sbx.client
from sbx.api.codec import to_builtins
from sbx.api.errors import (
    Conflict,
    Internal,
    InvalidRequest,
    NotFound,
    SandboxError,
    Unavailable,
    Unsupported,
    error_from_answer,
)
from sbx.client import AsyncClient, Endpoint, RunResult, Sandbox, resolve_endpoint
from sbx.client._endpoint import translate_error
from sbx.client._transport import Params, Response, Upgraded

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
        status, body = self.handler(method, path, to_builtins(json) if json is not None else None, params)
        if isinstance(body, bytes):
            return Response(status, "text/html", body)
        return Response(status, "application/json", b"" if body is None else _dumps(body))

    async def stream(
        self, method: str, path: str, *, json: Any = None, params: Params | None = None
    ) -> AsyncIterator[bytes]:
        status, body = self.handler(method, path, json, params)
        if not 200 <= status < 300:
            raise error_from_answer(status, _dumps(body))
        # One byte at a time: the client must reassemble lines however the body is split.
        for i in range(len(body)):
            yield body[i : i + 1]

    async def upgrade(self, path: str, protocol: str, *, params: Params | None = None) -> Upgraded:
        raise Unsupported("no upgrades in this fake")

    async def aclose(self) -> None:
        self.closed = True


def _dumps(body: Any) -> bytes:
    return json.dumps(body).encode()


def test_exported_names() -> None:
    assert set(sbx.client.__all__) == {
        "AsyncClient",
        "Sandboxes",
        "Sandbox",
        "Files",
        "Ports",
        "Process",
        "Images",
        "Snapshots",
        "Volumes",
        "Attachment",
        "Tunnel",
        "Services",
        "Jobs",
        "Secrets",
        "Frame",
        "RunResult",
        "OutputEvent",
        "DirEntry",
        "EventList",
        "Endpoint",
        "resolve_endpoint",
        "DEFAULT_SOCKET",
        "SandboxError",
        "InvalidRequest",
        "Unauthorized",
        "Refused",
        "ForbiddenOrigin",
        "NotFound",
        "NotServed",
        "Conflict",
        "PayloadTooLarge",
        "Unsupported",
        "Unavailable",
        "BadGateway",
        "GatewayTimeout",
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


_NOT_AN_ADDRESS = (
    "is not a sandboxd address: use unix:///path/to/sandboxd.sock, http://host:port or https://host:port"
)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://h", f"'ftp://h' {_NOT_AN_ADDRESS}"),
        ("node:8443", f"'node:8443' {_NOT_AN_ADDRESS}"),
        ("http://", f"'http://' {_NOT_AN_ADDRESS}"),
        ("unix://", "'unix://' names no socket: write unix:///path/to/sandboxd.sock"),
        ("http://h/?x=1", "'http://h/?x=1': a server address takes no query or fragment"),
        ("http://h/#f", "'http://h/#f': a server address takes no query or fragment"),
    ],
)
def test_resolve_endpoint_refuses(url: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        resolve_endpoint(url, None, {})
    assert info.value.message == message


_SOCKET = Endpoint("http://localhost", "/run/x.sock")
_TCP = Endpoint("http://node:8443")
_KEY = ConnectionKey("node", 8443, False, True, None, None, None, None)


@pytest.mark.parametrize(
    ("exc", "endpoint", "error", "message"),
    [
        (
            aiohttp.ClientConnectorError(_KEY, ConnectionRefusedError(111, "Connection refused")),
            _TCP,
            Unavailable,
            "cannot reach sandboxd at http://node:8443 (Connection refused): check that sandboxd listens there",
        ),
        (
            aiohttp.ClientConnectorError(_KEY, FileNotFoundError(2, "No such file or directory")),
            _SOCKET,
            Unavailable,
            "cannot reach sandboxd at unix:///run/x.sock (No such file or directory): start it with `sandboxd`",
        ),
        (
            aiohttp.ClientConnectorError(_KEY, PermissionError(13, "Permission denied")),
            _SOCKET,
            Unavailable,
            "cannot reach sandboxd at unix:///run/x.sock: permission denied; run as the user that owns",
        ),
        # Raw connections (upgrades) see the OS error itself.
        (
            FileNotFoundError(2, "No such file or directory"),
            _SOCKET,
            Unavailable,
            "cannot reach sandboxd at unix:///run/x.sock (No such file or directory): start it with `sandboxd`",
        ),
        (
            ConnectionRefusedError(111, "Connection refused"),
            _TCP,
            Unavailable,
            "cannot reach sandboxd at http://node:8443 (Connection refused): check that",
        ),
        (
            PermissionError(13, "Permission denied"),
            _SOCKET,
            Unavailable,
            "cannot reach sandboxd at unix:///run/x.sock: permission denied; run as the user",
        ),
        (TimeoutError(), _TCP, Unavailable, "sandboxd at http://node:8443 did not answer in time"),
        (
            aiohttp.ServerDisconnectedError(),
            _TCP,
            Unavailable,
            "sandboxd at http://node:8443 closed the connection before answering",
        ),
        (
            ConnectionResetError(104, "reset"),
            _TCP,
            Unavailable,
            "talking to sandboxd at http://node:8443 failed",
        ),
        (ValueError("odd"), _TCP, Internal, "unexpected error talking to sandboxd at http://node:8443"),
    ],
)
def test_failures_to_reach_the_server_become_sandbox_errors(
    exc: BaseException, endpoint: Endpoint, error: type[SandboxError], message: str
) -> None:
    translated = translate_error(exc, endpoint)
    assert type(translated) is error
    assert translated.message.startswith(message), translated.message


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
        await client.sandboxes.get("x")
    assert caught.value.message == message


async def test_calls_build_the_spec_requests() -> None:
    seen: list[tuple[str, str, Any, Any]] = []

    def handler(method: str, path: str, body: Any, params: Params | None) -> tuple[int, Any]:
        seen.append((method, path, body, params))
        if path == "/v1/sandboxes" and method == "GET":
            return 200, {"sandboxes": [sandbox_body()]}
        if method == "DELETE":
            return 204, None
        if path.endswith("/run"):
            out = base64.b64encode(b"\x00hi").decode()
            return 200, {"exit_code": 0, "stdout": out, "stderr": "", "truncated": False, "timed_out": False}
        if path == "/v1/node/cordon":
            return 200, node_status_body()
        return 200, {"ok": True}

    transport = HandlerTransport(handler)
    async with AsyncClient(transport=transport) as client:
        listed = await client.sandboxes.list({"team": "a", "env": "prod"})
        assert [s.info for s in listed] == [sandbox()]
        with pytest.raises(Internal, match="missing required field `id`"):
            await client.sandboxes.get("my name/..")
        await client.sandboxes.delete("sbx_1")
        result = await listed[0].run(["cat"], stdin=b"in", timeout_secs=5, cwd="/sandbox/home")
        with pytest.raises(Internal):
            await client.sandboxes.create(name="n", cpus=2)
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


async def test_state_calls_build_the_spec_requests() -> None:
    seen: list[tuple[str, str, Any, Any]] = []

    def handler(method: str, path: str, body: Any, params: Params | None) -> tuple[int, Any]:
        seen.append((method, path, body, params))
        if method == "DELETE":
            return 204, None
        if path == "/v1/snapshots" and method == "GET":
            return 200, {"snapshots": [snapshot_body()]}
        if path == "/v1/volumes" and method == "GET":
            return 200, {"volumes": [volume_body()]}
        if path.endswith("/snapshots"):
            return 201, snapshot_body(kind="disk")
        if path == "/v1/volumes":
            return 201, volume_body()
        return 200, sandbox_body(state="suspended")

    async with AsyncClient(transport=HandlerTransport(handler)) as client:
        box = Sandbox(client, sandbox())
        assert (await box.suspend()).info.state == "suspended"
        await box.resume()
        assert (await box.snapshot("disk")).kind == "disk"
        await box.set_snapshot_schedule(60, keep=2)
        assert [s.id for s in await client.snapshots.list()] == ["snap_1"]
        await client.snapshots.delete("snap_1")
        await client.volumes.create("data", size_mb=64)
        await client.volumes.create("other")
        assert [v.name for v in await client.volumes.list()] == ["data"]
        await client.volumes.delete("data")
    assert seen == [
        ("POST", "/v1/sandboxes/sbx_1/suspend", None, None),
        ("POST", "/v1/sandboxes/sbx_1/resume", None, None),
        ("POST", "/v1/sandboxes/sbx_1/snapshots", {"kind": "disk"}, None),
        ("PUT", "/v1/sandboxes/sbx_1/snapshot-schedule", {"every_secs": 60, "keep": 2}, None),
        ("GET", "/v1/snapshots", None, None),
        ("DELETE", "/v1/snapshots/snap_1", None, None),
        ("POST", "/v1/volumes", {"name": "data", "size_mb": 64}, None),
        ("POST", "/v1/volumes", {"name": "other"}, None),
        ("GET", "/v1/volumes", None, None),
        ("DELETE", "/v1/volumes/data", None, None),
    ]


async def test_persistent_create_stop_and_resume_build_the_requests() -> None:
    """A node's answers for one persistent sandbox, from create through stop to resume; each call keeps the
    answer in ``info``, so the properties follow the sandbox's life."""
    seen: list[tuple[str, str, Any]] = []
    answers = {
        ("POST", "/v1/sandboxes"): (201, sandbox_body(name="keep", persistent=True)),
        ("POST", "/v1/sandboxes/sbx_1/stop"): (
            200,
            sandbox_body(name="keep", persistent=True, state="stopped", stopped_reason="request"),
        ),
        ("POST", "/v1/sandboxes/sbx_1/resume"): (200, sandbox_body(name="keep", persistent=True)),
    }

    def handler(method: str, path: str, body: Any, params: Params | None) -> tuple[int, Any]:
        seen.append((method, path, body))
        return answers[(method, path)]

    async with AsyncClient(transport=HandlerTransport(handler)) as client:
        box = await client.sandboxes.create(name="keep", persistent=True)
        assert (box.state, box.persistent, box.stopped_reason) == ("running", True, None)
        assert await box.stop() is box
        assert (box.state, box.persistent, box.stopped_reason) == ("stopped", True, "request")
        await box.resume()
        assert (box.state, box.stopped_reason) == ("running", None)
    assert seen == [
        ("POST", "/v1/sandboxes", {"name": "keep", "persistent": True}),
        ("POST", "/v1/sandboxes/sbx_1/stop", None),
        ("POST", "/v1/sandboxes/sbx_1/resume", None),
    ]


@pytest.mark.parametrize(
    ("overrides", "state", "persistent", "reason"),
    [
        ({}, "running", False, None),  # a server before persistent sandboxes: the field's default
        ({"persistent": False}, "running", False, None),
        ({"persistent": True, "state": "suspended"}, "suspended", True, None),
        ({"persistent": True, "state": "stopped", "stopped_reason": "request"}, "stopped", True, "request"),
        ({"persistent": True, "state": "stopped", "stopped_reason": "crash"}, "stopped", True, "crash"),
        ({"persistent": True, "state": "stopped", "stopped_reason": "restore_failed"}, "stopped", True,
         "restore_failed"),
    ],
)  # fmt: skip
def test_persistent_and_stopped_reason_read_the_answer(
    overrides: dict[str, Any], state: str, persistent: bool, reason: str | None
) -> None:
    box = Sandbox(AsyncClient(transport=HandlerTransport(lambda *_: (500, None))), sandbox(**overrides))
    assert (box.state, box.persistent, box.stopped_reason) == (state, persistent, reason)


@pytest.mark.parametrize(
    ("call", "status", "code", "message", "error"),
    [
        (lambda c, b: c.sandboxes.create(persistent=True), 400, "invalid_request",
         "persistent: a persistent sandbox needs a name (it is found again by it after every sleep); add name",
         InvalidRequest),
        (lambda c, b: b.stop(), 409, "conflict", "sandbox sbx_1 is not persistent: only a persistent one stops",
         Conflict),
        (lambda c, b: b.resume(), 503, "unavailable", "no room for 1 cpus and 512 MiB now", Unavailable),
    ],
)  # fmt: skip
async def test_a_refused_persistent_call_raises_the_servers_error_and_keeps_info(
    call: Any, status: int, code: str, message: str, error: type[SandboxError]
) -> None:
    body = {"error": {"code": code, "message": message}}
    async with AsyncClient(transport=HandlerTransport(lambda *_: (status, body))) as client:
        box = Sandbox(
            client, sandbox(name="keep", persistent=True, state="stopped", stopped_reason="request")
        )
        with pytest.raises(error) as caught:
            await call(client, box)
    assert (caught.value.code, caught.value.message) == (code, message)
    # The held answer is the last one the server gave, not a guess at what the failed call would have made.
    assert (box.state, box.stopped_reason) == ("stopped", "request")


@pytest.mark.parametrize(
    "body",
    [{"stdout": ""}, {"exit_code": 0, "stdout": "not base64!"}, ["not", "an", "object"]],
)
async def test_malformed_run_result_is_internal(body: Any) -> None:
    client = AsyncClient(transport=HandlerTransport(lambda *_: (200, body)))
    with pytest.raises(Internal):
        await Sandbox(client, sandbox()).run(["true"])


_BOX = sandbox()


@pytest.mark.parametrize(
    ("call", "body", "message"),
    [
        (
            lambda c: Sandbox(c, _BOX).refresh(),
            ["x"],
            "malformed Sandbox (HTTP 200 of GET /v1/sandboxes/sbx_1)",
        ),
        (lambda c: Sandbox(c, _BOX).update(name="n"), "x", "malformed Sandbox"),
        (lambda c: Sandbox(c, _BOX).suspend(), [], "malformed Sandbox"),
        (lambda c: Sandbox(c, _BOX).stop(), {"id": "sbx_1"}, "malformed Sandbox"),
        (lambda c: Sandbox(c, _BOX).set_snapshot_schedule(60), 1, "malformed Sandbox"),
        (lambda c: Sandbox(c, _BOX).snapshot(), [], "malformed Snapshot"),
        (lambda c: Sandbox(c, _BOX).events(), [], "malformed EventList"),
        (lambda c: Sandbox(c, _BOX).events(), {"events": 1}, "Expected `array`, got `int` - at `$.events`"),
        (lambda c: Sandbox(c, _BOX).files.list("/"), {}, "missing required field `entries`"),
        (lambda c: Sandbox(c, _BOX).processes(), {"processes": {}}, "malformed ProcessList"),
        (lambda c: c.sandboxes.list(), {"items": []}, "missing required field `sandboxes`"),
        (lambda c: c.images.list(), [], "malformed ImageList"),
        (lambda c: c.images.pull("x:1"), [], "malformed Image"),
        (lambda c: c.snapshots.list(), {}, "malformed SnapshotList"),
        (lambda c: c.volumes.list(), {"volumes": "x"}, "malformed VolumeList"),
        (lambda c: c.volumes.create("v"), [], "malformed Volume"),
        (lambda c: c.capabilities(), [], "malformed Capabilities"),
    ],
)
async def test_answers_of_the_wrong_shape_are_internal(call: Any, body: Any, message: str) -> None:
    async with AsyncClient(transport=HandlerTransport(lambda *_: (200, body))) as client:
        with pytest.raises(Internal) as info:
            await call(client)
    assert message in info.value.message


async def test_answers_may_carry_fields_this_client_does_not_know() -> None:
    """A newer server may add fields (spec: Versioning 3): they are ignored, never an error."""
    body = sandbox_body(added_later={"x": 1})
    async with AsyncClient(transport=HandlerTransport(lambda *_: (200, body))) as client:
        assert (await client.sandboxes.get("sbx_1")).info == sandbox()


async def test_process_output_reassembles_split_lines_and_sets_exit_code() -> None:
    lines = [
        {"stream": "stdout", "data": base64.b64encode(b"a\n").decode()},
        {"stream": "stderr", "data": base64.b64encode(b"\x00err").decode()},
        {"exit_code": 3},
    ]
    body = b"".join(_dumps(line) + b"\n" for line in lines)

    def handler(method: str, path: str, json_body: Any, params: Params | None) -> tuple[int, Any]:
        if path.endswith("/processes"):
            return 201, process_body(pid=7, argv=["x"])
        assert path == "/v1/sandboxes/sbx_1/processes/7/output"
        return 200, body

    client = AsyncClient(transport=HandlerTransport(handler))
    proc = await Sandbox(client, sandbox()).start_process(["x"])
    assert proc.exit_code is None
    events = [(e.stream, e.data) async for e in proc.output()]
    assert events == [("stdout", b"a\n"), ("stderr", b"\x00err")]
    assert proc.exit_code == 3
    assert await proc.wait() == 3


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b'{"stream":"stdout","data":"YQ=="}\n', Unavailable),  # ends without the exit line
        (b"not json\n", Internal),
        (b'{"stream":"video","data":""}\n', Internal),
    ],
)
async def test_process_output_contract_breaks(body: bytes, error: type[SandboxError]) -> None:
    client = AsyncClient(transport=HandlerTransport(lambda *_: (200, body)))
    proc = sbx.client.Process(client, "sbx_1", process())
    with pytest.raises(error):
        async for _ in proc.output():
            pass


async def test_output_of_a_missing_process_is_not_found() -> None:
    error = {"error": {"code": "not_found", "message": "no process 9"}}
    client = AsyncClient(transport=HandlerTransport(lambda *_: (404, error)))
    with pytest.raises(NotFound, match="no process 9"):
        async for _ in sbx.client.Process(client, "sbx_1", process(pid=9)).output():
            pass


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"rows": 10}, "tty=True"), ({"cols": 10}, "tty=True")],
)
async def test_start_process_refuses_size_without_tty(kwargs: dict[str, int], message: str) -> None:
    client = AsyncClient(transport=HandlerTransport(lambda *_: (500, None)))
    with pytest.raises(InvalidRequest, match=message):
        await Sandbox(client, sandbox()).start_process(["sh"], **kwargs)


async def test_argv_as_one_string_is_refused() -> None:
    client = AsyncClient(transport=HandlerTransport(lambda *_: (500, None)))
    with pytest.raises(InvalidRequest, match="list of strings"):
        await Sandbox(client, sandbox()).run("ls -l")  # type: ignore[arg-type]
