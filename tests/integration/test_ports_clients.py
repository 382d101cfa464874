"""Exposed ports through the clients, against a real sandbox-gateway run with ``--ports-domain`` over a real
sandboxd (gVisor): the Python SDK (async and blocking), ``sandbox-cli ports`` as a subprocess and the MCP tool
``expose_port`` of ``sandbox-cli mcp`` driven by the official MCP client.

Each client gets a URL of a guest server's port and the test opens it as a browser would, on loopback
(``ports_world.open_url``: the URL's host in the Host header): a token URL trades its token for a cookie and
redirects, then the page and a WebSocket answer with that cookie; a private port's plain URL is 401 without a key;
a public one opens for anyone. The gateway's own side (labels, cookies, caps, revocation) is tested with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from ports_world import (
    DEADLINE_SECS,
    ECHO_TEXT,
    GUEST_PORT,
    PAGE_TEXT,
    PortsWorld,
    open_like_a_browser,
    open_url,
    ports_world,
)
from sandboxd_harness import Sandboxd
from test_mcp import CLI, CODE_ENV, call, failure, patient_host  # noqa: F401  (patient_host: autouse)

from sbx.api.errors import InvalidRequest, NotFound, Unauthorized
from sbx.client import AsyncClient
from sbx.client.sync import Client as SyncClient

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def world(sandboxd: Sandboxd) -> Iterator[PortsWorld]:
    with ports_world(sandboxd) as made:
        yield made


@pytest.fixture(scope="module")
def box(world: PortsWorld) -> Iterator[str]:
    """One sandbox of ``owner`` whose guest server listens on GUEST_PORT."""
    sandbox_id = world.sandbox_with_server()
    yield sandbox_id
    world.gw.request("DELETE", f"/v1/sandboxes/{sandbox_id}", key=world.keys["owner"])


def assert_opens(url: str) -> None:
    """``url`` (a token URL) opens the guest's page, then its WebSocket, with the cookie it was traded for."""
    page, cookie = open_like_a_browser(url)
    assert page.status == 200 and PAGE_TEXT.encode() in page.body, (page.status, page.body[:300])
    plain = url.split("?", 1)[0]
    ws = open_url(plain + "ws", cookie=cookie, upgrade=True)
    assert (ws.status, ws.body) == (101, ECHO_TEXT.encode())


def assert_private(url: str) -> None:
    resp = open_url(url)
    assert resp.status == 401, (resp.status, resp.body)
    assert PAGE_TEXT.encode() not in resp.body


def assert_public(url: str) -> None:
    resp = open_url(url)
    assert resp.status == 200 and PAGE_TEXT.encode() in resp.body, (resp.status, resp.body[:300])


# --- the SDK ------------------------------------------------------------------------------------------------


async def test_sdk_lists_gives_urls_tokens_and_toggles(world: PortsWorld, box: str) -> None:
    url = world.port_url(box, GUEST_PORT)
    async with AsyncClient(world.url, world.keys["owner"]) as client:
        assert (await client.capabilities()).capabilities.get("exposed_ports") is True
        sandbox = await client.sandboxes.get(box)
        listed = {p.port: p for p in await sandbox.ports.list()}
        assert GUEST_PORT in listed, listed
        assert (listed[GUEST_PORT].url, listed[GUEST_PORT].public, listed[GUEST_PORT].listening) == (
            url,
            False,
            True,
        )
        assert await sandbox.ports.url(GUEST_PORT) == url
        quiet = await sandbox.ports.get(9)
        assert (quiet.public, quiet.listening) == (False, False)
        assert_private(url)
        # The owner's key opens it as it is.
        assert PAGE_TEXT.encode() in open_url(url, key=world.keys["owner"]).body

        token = await sandbox.ports.token(GUEST_PORT, ttl_secs=300)
        assert token.url.startswith(url) and token.token in token.url and token.expires_at
        assert_opens(token.url)

        assert (await sandbox.ports.public(GUEST_PORT, True)).public is True
        assert_public(url)
        assert (await sandbox.ports.public(GUEST_PORT, False)).public is False
        assert_private(url)

        with pytest.raises(InvalidRequest):
            await sandbox.ports.token(GUEST_PORT, ttl_secs=0)
    async with AsyncClient(world.url, world.keys["other"]) as stranger:
        # Another user's key sees no such sandbox.
        with pytest.raises(NotFound):
            await stranger.sandboxes.get(box)
    async with AsyncClient(world.url, "sgk_not_a_key") as nobody:
        with pytest.raises(Unauthorized):
            await nobody.sandboxes.get(box)


def test_blocking_sdk(world: PortsWorld, box: str) -> None:
    with SyncClient(world.url, world.keys["owner"]) as client:
        sandbox = client.sandboxes.get(box)
        assert GUEST_PORT in [p.port for p in sandbox.ports.list()]
        assert_opens(sandbox.ports.token(GUEST_PORT).url)


# --- sandbox-cli ----------------------------------------------------------------------------------------------


def cli(world: PortsWorld, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, "--url", world.url, *args], capture_output=True, text=True, timeout=DEADLINE_SECS, check=False,
        env={**os.environ, "SANDBOX_URL": "", "SANDBOX_TOKEN": world.keys["owner"]},
    )  # fmt: skip


def test_cli_ls_open_public_private(world: PortsWorld, box: str) -> None:
    url = world.port_url(box, GUEST_PORT)
    listed = cli(world, "ports", "ls", box)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert rows[0] == ["PORT", "URL", "PUBLIC", "LISTENING"]
    assert [str(GUEST_PORT), url, "false", "true"] in rows[1:]

    opened = cli(world, "ports", "open", box, str(GUEST_PORT), "--ttl", "120")
    assert opened.returncode == 0, opened.stderr
    assert opened.stderr.startswith("expires ")
    assert_opens(opened.stdout.strip())

    made = cli(world, "ports", "public", box, str(GUEST_PORT))
    assert made.returncode == 0 and made.stdout.splitlines()[1].split()[2] == "true", made
    assert_public(url)
    back = cli(world, "--json", "ports", "private", box, str(GUEST_PORT))
    assert back.returncode == 0 and json.loads(back.stdout)["public"] is False, back
    assert_private(url)

    bad = cli(world, "ports", "open", box, "70000")
    assert bad.returncode == 2
    missing = cli(world, "ports", "ls", "sbx_00000000000000ff")
    assert (missing.returncode, missing.stderr.split(":", 1)[0]) == (1, "not_found")


# --- the MCP tool ------------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def mcp_session(world: PortsWorld, tmp_path: Path) -> AsyncIterator[Client]:
    """``sandbox-cli mcp`` over stdio against the gateway (inside the test: an MCP client's task group cannot
    cross from a fixture's task to the test's)."""
    env = {**CODE_ENV, "SANDBOX_URL": world.url, "SANDBOX_TOKEN": world.keys["owner"]}
    params = StdioServerParameters(command=CLI[0], args=[*CLI[1:], "mcp"], env=env)
    with open(tmp_path / "mcp.log", "a", encoding="utf-8") as errlog:  # noqa: ASYNC230
        async with Client(
            stdio_client(params, errlog=errlog), read_timeout_seconds=DEADLINE_SECS * 2
        ) as client:
            yield client


async def test_mcp_expose_port(world: PortsWorld, box: str, tmp_path: Path) -> None:
    async with mcp_session(world, tmp_path) as mcp_client:
        await check_expose_port(world, box, mcp_client)


async def check_expose_port(world: PortsWorld, box: str, mcp_client: Client) -> None:
    url = world.port_url(box, GUEST_PORT)
    tools = {tool.name: tool for tool in (await mcp_client.list_tools()).tools}
    assert "token URL" in (tools["expose_port"].description or "")

    private: dict[str, Any] = await call(
        mcp_client, "expose_port", sandbox=box, port=GUEST_PORT, ttl_secs=600
    )
    assert (private["public"], private["listening"], private["sandbox"]) == (False, True, box)
    assert private["url"].startswith(url) and private["url"] != url and private["expires_at"]
    assert_opens(private["url"])
    assert_private(url)

    public: dict[str, Any] = await call(mcp_client, "expose_port", sandbox=box, port=GUEST_PORT, public=True)
    assert (public["url"], public["public"], public["expires_at"]) == (url, True, None)
    assert_public(url)
    # Asked for as private again, it is private again.
    again: dict[str, Any] = await call(mcp_client, "expose_port", sandbox=box, port=GUEST_PORT)
    assert again["public"] is False
    assert_private(url)

    code, message = await failure(mcp_client, "expose_port", {"sandbox": box, "port": 0})
    assert code == "invalid_request" and "port" in message
