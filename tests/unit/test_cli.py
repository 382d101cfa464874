"""sandbox-cli against a small fake sandboxd on a unix socket: output, --json, errors and exit codes.

The fake answers a handful of routes the way the spec says a node does; it is a stand-in for
the network peer of a client test, not for the backend.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from click.testing import CliRunner
from wire_samples import capabilities_body, node_status_body, sandbox_body

from sbx.cli.main import main

SANDBOX: dict[str, Any] = sandbox_body(
    id="sbx_0123456789abcdef", name="web", image="python:3.12", labels={"team": "a"}, idle_timeout_secs=300,
    persistent=False,
)  # fmt: skip
OTHER: dict[str, Any] = {
    **SANDBOX,
    "id": "sbx_fedcba9876543210",
    "name": "",
    "labels": {"team": "b"},
    "state": "terminated",
}
#: A persistent sandbox, stopped by a request (tests/unit/test_cli_persistent.py).
KEEP: dict[str, Any] = {
    **SANDBOX,
    "id": "sbx_00000000000000aa",
    "name": "keep",
    "labels": {"team": "c"},
    "persistent": True,
    "state": "stopped",
    "stopped_reason": "request",
}


def _error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status)


class FakeNode:
    """Routes of a node, with what it was sent kept for the assertions."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any, dict[str, str]]] = []
        #: Whether the capabilities offer persistent sandboxes.
        self.persistent = True

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._remember])
        app.router.add_get("/v1/capabilities", self.capabilities)
        app.router.add_post("/v1/sandboxes", self.create)
        app.router.add_get("/v1/sandboxes", self.list)
        app.router.add_get("/v1/sandboxes/{ref}", self.get)
        app.router.add_delete("/v1/sandboxes/{ref}", self.delete)
        app.router.add_post("/v1/sandboxes/{ref}/run", self.run)
        app.router.add_post("/v1/sandboxes/{ref}/stop", self.stop)
        app.router.add_post("/v1/sandboxes/{ref}/resume", self.resume)
        app.router.add_get("/v1/node", self.node)
        app.router.add_post("/v1/node/cordon", self.cordon)
        return app

    @web.middleware
    async def _remember(self, request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.requests.append((request.method, request.path_qs, body, dict(request.headers)))
        result: web.StreamResponse = await handler(request)
        return result

    async def capabilities(self, request: web.Request) -> web.Response:
        body = capabilities_body(audit=True, suspend=False, network_policy_update=False)
        body["capabilities"] = {
            "audit": True, "suspend": False, "network_policy_update": False, "persistent": self.persistent
        }  # fmt: skip
        return web.json_response(body)

    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("name") == "taken":
            return _error(409, "conflict", "name 'taken' is in use by sbx_1")
        if body.get("cpus", 1) > 4:
            return _error(400, "invalid_request", "cpus 9 is above the limit 4")
        if "PATH" in body.get("env", {}):
            return _error(403, "refused", "env name PATH is reserved")
        return web.json_response({**SANDBOX, **{k: v for k, v in body.items() if k != "env"}}, status=201)

    async def list(self, request: web.Request) -> web.Response:
        wanted = [label.split("=", 1) for label in request.query.getall("label", [])]
        found = [s for s in (SANDBOX, OTHER, KEEP) if all(s["labels"].get(k) == v for k, v in wanted)]
        return web.json_response({"sandboxes": found})

    async def get(self, request: web.Request) -> web.Response:
        for box in (SANDBOX, KEEP):
            if request.match_info["ref"] in (box["id"], box["name"]):
                return web.json_response(box)
        return _error(404, "not_found", f"no sandbox {request.match_info['ref']!r}")

    async def stop(self, request: web.Request) -> web.Response:
        if request.match_info["ref"] == KEEP["id"]:
            return web.json_response(KEEP)
        return _error(
            409, "conflict", f"sandbox {request.match_info['ref']} is not persistent; delete it instead"
        )

    async def resume(self, request: web.Request) -> web.Response:
        running = {k: v for k, v in KEEP.items() if k != "stopped_reason"}
        return web.json_response({**running, "state": "running"})

    async def delete(self, request: web.Request) -> web.Response:
        if request.match_info["ref"] == "broken":
            return web.Response(status=502, text="<html>bad gateway</html>", content_type="text/html")
        return web.Response(status=204)

    async def run(self, request: web.Request) -> web.Response:
        argv = (await request.json())["argv"]

        def result(code: int, out: bytes, err: bytes, timed_out: bool = False) -> web.Response:
            return web.json_response(
                {
                    "exit_code": code,
                    "stdout": base64.b64encode(out).decode(),
                    "stderr": base64.b64encode(err).decode(),
                    "truncated": False,
                    "timed_out": timed_out,
                }
            )

        if argv[0] == "echo":
            return result(0, " ".join(argv[1:]).encode() + b"\n", b"")
        if argv[0] == "fail":
            return result(3, b"partial\xff", b"boom\n")
        if argv[0] == "sleep":
            return result(-1, b"", b"", timed_out=True)
        return _error(400, "invalid_request", f"command {argv[0]!r} does not exist")

    async def node(self, request: web.Request) -> web.Response:
        return web.json_response(node_status_body(
            capacity={"cpus": 8, "memory_mb": 16384, "disk_mb": 100000},
            free={"cpus": 7, "memory_mb": 15872, "disk_mb": 97952}, running=1, images=["python:3.12"],
        ))  # fmt: skip

    async def cordon(self, request: web.Request) -> web.Response:
        cordoned = (await request.json())["cordoned"]
        return web.json_response(node_status_body(running=1, cordoned=cordoned))


@pytest.fixture
def fake() -> Iterator[tuple[FakeNode, str]]:
    """A FakeNode serving on a temporary unix socket from its own thread and loop."""
    # A short directory: unix socket paths are limited to about 108 bytes.
    directory = Path(tempfile.mkdtemp(prefix="sbxcli", dir="/tmp"))
    socket_path = str(directory / "sandboxd.sock")
    node = FakeNode()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(node.app(), access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.UnixSite(runner, socket_path).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield node, f"unix://{socket_path}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()
        shutil.rmtree(directory)


def _invoke(url: str, *args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(
        main, ["--url", url, *args], env=env or {"SANDBOX_URL": "", "SANDBOX_TOKEN": ""}
    )


@pytest.mark.parametrize(
    ("args", "exit_code", "stdout", "stderr"),
    [
        (["get", "nope"], 1, "", "not_found: no sandbox 'nope'\n"),
        (["create", "--name", "taken"], 1, "", "conflict: name 'taken' is in use by sbx_1\n"),
        (["create", "--cpus", "9"], 1, "", "invalid_request: cpus 9 is above the limit 4\n"),
        (["create", "--env", "PATH=/x"], 1, "", "refused: env name PATH is reserved\n"),
        (["run", "web", "--", "nosuch"], 1, "", "invalid_request: command 'nosuch' does not exist\n"),
        # A non-JSON error page still ends as one line and exit 1.
        (["rm", "broken"], 1, "", "internal: HTTP 502\n"),
        (["get", "web"], 0, "id:", ""),
        (["create", "--name", "ok"], 0, "sbx_0123456789abcdef\n", ""),
        (["rm", "web"], 0, "web\n", ""),
    ],
)
def test_errors_map_to_code_message_and_exit_1(
    fake: tuple[FakeNode, str], args: list[str], exit_code: int, stdout: str, stderr: str
) -> None:
    _, url = fake
    result = _invoke(url, *args)
    assert result.exit_code == exit_code, result.output
    assert result.stderr == stderr
    assert result.stdout.startswith(stdout)


@pytest.mark.parametrize(
    "args",
    [
        ["create", "--label", "novalue"],
        ["create", "--env", "=x"],
        ["create", "--cpus", "0"],
        ["ls", "--label", "team"],
        ["run", "web"],
        ["frobnicate"],
    ],
)
def test_bad_usage_exits_2_without_a_request(fake: tuple[FakeNode, str], args: list[str]) -> None:
    node, url = fake
    result = _invoke(url, *args)
    assert result.exit_code == 2, result.output
    assert node.requests == []


def test_bad_url_is_usage_error() -> None:
    result = CliRunner().invoke(main, ["--url", "ftp://example.com", "ls"])
    assert result.exit_code == 2
    assert "unix:///path/to/sandboxd.sock" in result.stderr


def test_unreachable_server_says_how_to_start_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--url", f"unix://{tmp_path}/absent.sock", "ls"])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"unavailable: cannot reach sandboxd at unix://{tmp_path}/absent.sock")
    assert "start it with" in result.stderr


def test_create_sends_only_given_fields(fake: tuple[FakeNode, str]) -> None:
    node, url = fake
    args = ["create", "--image", "python:3.12", "--memory-mb", "1024", "--label", "a=1", "--label", "b=x=y"]
    result = _invoke(url, *args, "--env", "TOKEN=s")
    assert result.exit_code == 0, result.output
    method, path, body, _ = node.requests[-1]
    assert (method, path) == ("POST", "/v1/sandboxes")
    assert body == {
        "image": "python:3.12",
        "memory_mb": 1024,
        "labels": {"a": "1", "b": "x=y"},
        "env": {"TOKEN": "s"},
    }


def test_ls_table_and_label_filter(fake: tuple[FakeNode, str]) -> None:
    node, url = fake
    result = _invoke(url, "ls")
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0].split() == [
        "ID", "NAME", "STATE", "PERSISTENT", "IMAGE", "CPUS", "MEMORY_MB", "DISK_MB", "CREATED_AT"
    ]  # fmt: skip
    assert lines[1].split()[:4] == ["sbx_0123456789abcdef", "web", "running", "false"]
    # Columns line up: every row has its STATE where the header has it.
    assert lines[2].index("terminated") == lines[0].index("STATE")
    result = _invoke(url, "ls", "--label", "team=b")
    assert [line.split()[0] for line in result.stdout.splitlines()[1:]] == ["sbx_fedcba9876543210"]
    assert node.requests[-1][1] == "/v1/sandboxes?label=team%3Db"


@pytest.mark.parametrize(
    ("args", "check"),
    [
        (["ls"], lambda out: [s["id"] for s in out["sandboxes"]] == [SANDBOX["id"], OTHER["id"], KEEP["id"]]),
        (["get", "web"], lambda out: out == SANDBOX),
        (["create"], lambda out: out["id"] == SANDBOX["id"]),
        (["node"], lambda out: out["capacity"]["cpus"] == 8),
        (["node", "--cordon"], lambda out: out["cordoned"] is True),
        (["capabilities"], lambda out: out["api_version"] == "v1" and out["capabilities"]["audit"] is True),
        (
            ["run", "web", "--", "echo", "hi"],
            lambda out: out["exit_code"] == 0 and base64.b64decode(out["stdout"]) == b"hi\n",
        ),
    ],
)
def test_json_output(fake: tuple[FakeNode, str], args: list[str], check: Any) -> None:
    _, url = fake
    result = CliRunner().invoke(main, ["--json", "--url", url, *args])
    assert result.exit_code == 0, result.output
    assert check(json.loads(result.stdout))


def test_run_prints_raw_output_and_exits_with_its_code(fake: tuple[FakeNode, str]) -> None:
    node, url = fake
    result = _invoke(url, "run", "--cwd", "/tmp", "--env", "A=1", "web", "--", "fail", "-x", "--flag")
    assert result.exit_code == 3
    assert result.stdout_bytes == b"partial\xff"
    assert result.stderr == "boom\n"
    assert node.requests[-1][2] == {"argv": ["fail", "-x", "--flag"], "env": {"A": "1"}, "cwd": "/tmp"}
    timed_out = _invoke(url, "run", "web", "--", "sleep", "100")
    assert timed_out.exit_code == 124
    assert "timed out" in timed_out.stderr


def test_node_and_capabilities_for_people(fake: tuple[FakeNode, str]) -> None:
    _, url = fake
    result = _invoke(url, "node")
    assert result.exit_code == 0
    assert "capacity: cpus=8, memory_mb=16384, disk_mb=100000" in result.stdout
    assert "cordoned: false" in result.stdout
    caps = _invoke(url, "capabilities")
    assert "capabilities: audit, persistent\n" in caps.stdout


def test_url_and_token_from_the_environment(fake: tuple[FakeNode, str]) -> None:
    node, url = fake
    result = CliRunner().invoke(main, ["node"], env={"SANDBOX_URL": url, "SANDBOX_TOKEN": "s3cret"})
    assert result.exit_code == 0, result.output
    assert node.requests[-1][3]["Authorization"] == "Bearer s3cret"
    # The flag wins over the environment.
    CliRunner().invoke(main, ["--token", "flag", "node"], env={"SANDBOX_URL": url, "SANDBOX_TOKEN": "s3cret"})
    assert node.requests[-1][3]["Authorization"] == "Bearer flag"
