"""sandbox-cli's network options: ``create --network/--allow/--deny`` and ``network REF`` (show, PATCH),
against a small fake node on a unix socket."""

from __future__ import annotations

import asyncio
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
from wire_samples import sandbox_body

from sbx.cli.main import main

SANDBOX: dict[str, Any] = sandbox_body(
    id="sbx_0123456789abcdef", name="web", network={"mode": "open", "deny": ["bad.example"]}
)


def answered(body: dict[str, Any]) -> dict[str, Any]:
    """A request's fields as the answer shows them (a policy as the server resolves it)."""
    shown = dict(body)
    if "network" in shown:
        policy = shown["network"]
        shown["network"] = {"mode": "allowlist" if "allow" in policy else "none", "deny": [], **policy}
    return shown


class Node:
    def __init__(self) -> None:
        self.bodies: list[tuple[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/sandboxes", self.create)
        app.router.add_get("/v1/sandboxes/{ref}", self.get)
        app.router.add_patch("/v1/sandboxes/{ref}", self.patch)
        return app

    async def create(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(("POST", body))
        return web.json_response({**SANDBOX, **answered(body)}, status=201)

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response(SANDBOX)

    async def patch(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(("PATCH", body))
        if body["network"]["mode"] == "open" and SANDBOX["network"]["mode"] == "none":
            message = (
                "the network policy of sandbox sbx_0123456789abcdef cannot change: created with mode none"
            )
            return web.json_response({"error": {"code": "conflict", "message": message}}, status=409)
        return web.json_response({**SANDBOX, **answered(body)})


@pytest.fixture
def node() -> Iterator[tuple[Node, str]]:
    directory = Path(tempfile.mkdtemp(prefix="sbxnet", dir="/tmp"))
    socket_path = str(directory / "sandboxd.sock")
    fake = Node()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake.app(), access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.UnixSite(runner, socket_path).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"unix://{socket_path}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        shutil.rmtree(directory, ignore_errors=True)


def invoke(url: str, *args: str) -> Any:
    return CliRunner().invoke(main, ["--url", url, *args], env={"SANDBOX_URL": "", "SANDBOX_TOKEN": ""})


@pytest.mark.parametrize(
    ("args", "network"),
    [
        ([], None),
        (["--network", "none"], {"mode": "none"}),
        (["--network", "allowlist", "--allow", "pypi.org", "--allow", "*.pythonhosted.org"],
         {"mode": "allowlist", "allow": ["pypi.org", "*.pythonhosted.org"]}),
        (["--network", "open", "--deny", "bad.example"], {"mode": "open", "deny": ["bad.example"]}),
        (["--allow", "pypi.org"], {"allow": ["pypi.org"]}),  # the server's default mode
    ],
)  # fmt: skip
def test_create_network_options(node: tuple[Node, str], args: list[str], network: Any) -> None:
    fake, url = node
    result = invoke(url, "create", *args)
    assert result.exit_code == 0, result.output
    sent = fake.bodies[-1][1]
    assert sent.get("network") == network


def test_create_refuses_an_unknown_mode(node: tuple[Node, str]) -> None:
    _, url = node
    result = invoke(url, "create", "--network", "wide")
    assert result.exit_code == 2 and "'wide' is not one of 'none', 'allowlist', 'open'" in result.stderr


def test_network_shows_the_policy(node: tuple[Node, str]) -> None:
    fake, url = node
    result = invoke(url, "network", "web")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == ["mode:  open", "allow: -", "deny:  bad.example"]
    assert fake.bodies == []  # nothing changed
    result = invoke(url, "--json", "network", "web")
    assert json.loads(result.stdout) == {"mode": "open", "deny": ["bad.example"]}


def test_network_patches_the_policy(node: tuple[Node, str]) -> None:
    fake, url = node
    result = invoke(url, "network", "web", "--mode", "allowlist", "--allow", "pypi.org")
    assert result.exit_code == 0, result.output
    assert fake.bodies == [("PATCH", {"network": {"mode": "allowlist", "allow": ["pypi.org"]}})]
    assert result.stdout.splitlines() == ["mode:  allowlist", "allow: pypi.org", "deny:  -"]


def test_network_names_without_mode_is_bad_usage(node: tuple[Node, str]) -> None:
    fake, url = node
    result = invoke(url, "network", "web", "--deny", "x.example")
    assert result.exit_code == 2 and "give --mode as well" in result.stderr
    assert fake.bodies == []


def test_network_errors_are_one_line_and_exit_1(node: tuple[Node, str]) -> None:
    _, url = node
    SANDBOX["network"] = {"mode": "none", "deny": []}
    try:
        result = invoke(url, "network", "web", "--mode", "open")
    finally:
        SANDBOX["network"] = {"mode": "open", "deny": ["bad.example"]}
    assert result.exit_code == 1
    assert result.stderr == (
        "conflict: the network policy of sandbox sbx_0123456789abcdef cannot change: created with mode none\n"
    )
