"""The SDK's ``sandbox.ports`` (async and blocking) against a gateway that answers the exposed-ports endpoints
(``ports_gateway``): the requests it builds, the answers it decodes, what it refuses before sending."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from ports_gateway import KEY, SANDBOX_ID, PortsGateway, serve

from sbx.api.errors import InvalidRequest, Unauthorized, Unsupported
from sbx.api.ports import Port, PortToken
from sbx.client import AsyncClient, Sandbox
from sbx.client.sync import Client


@pytest.fixture
def gateway() -> Iterator[tuple[PortsGateway, str]]:
    fake = PortsGateway()
    with serve(fake) as url:
        yield fake, url


async def test_list_get_url_public_and_token(gateway: tuple[PortsGateway, str]) -> None:
    fake, url = gateway
    async with AsyncClient(url, KEY) as client:
        sandbox = await client.sandboxes.get("web")
        assert await sandbox.ports.list() == [
            Port(port=8000, url=fake.url(8000), public=False, listening=True)
        ]
        assert await sandbox.ports.get(9000) == Port(
            port=9000, url=fake.url(9000), public=False, listening=False
        )
        assert await sandbox.ports.url(8000) == fake.url(8000)
        made_public = await sandbox.ports.public(9000, True)
        assert made_public.public and fake.public == {9000}
        assert [p.port for p in await sandbox.ports.list()] == [8000, 9000]
        assert not (await sandbox.ports.public(9000, False)).public and fake.public == set()
        token = await sandbox.ports.token(8000, ttl_secs=600)
        assert (
            isinstance(token, PortToken) and token.url.startswith(fake.url(8000)) and token.token in token.url
        )
        await sandbox.ports.token(8000)
    ports = f"/v1/sandboxes/{SANDBOX_ID}/ports"
    assert fake.requests[1:] == [
        ("GET", ports, None),
        ("GET", ports + "/9000", None),
        ("GET", ports + "/8000", None),
        ("PUT", ports + "/9000", {"public": True}),
        ("GET", ports, None),
        ("PUT", ports + "/9000", {"public": False}),
        ("POST", ports + "/8000/tokens", {"ttl_secs": 600}),
        ("POST", ports + "/8000/tokens", {}),  # no ttl: the server's default (3600)
    ]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: p.get(0), "port 0: give a TCP port number, 1 to 65535"),
        (lambda p: p.url(65536), "port 65536: give a TCP port number, 1 to 65535"),
        (lambda p: p.public("80", True), "port '80': give a TCP port number, 1 to 65535"),
        (lambda p: p.public(80, "yes"), "public 'yes': give True (anyone may open it) or False (private)"),
        (lambda p: p.token(80, 0), "ttl_secs 0: give 1 to 86400 seconds (default 3600)"),
        (lambda p: p.token(80, 86401), "ttl_secs 86401: give 1 to 86400 seconds (default 3600)"),
        (lambda p: p.token(True), "port True: give a TCP port number, 1 to 65535"),
    ],
)
async def test_bad_arguments_are_refused_before_sending(
    gateway: tuple[PortsGateway, str], call: Any, message: str
) -> None:
    fake, url = gateway
    async with AsyncClient(url, KEY) as client:
        sandbox = await client.sandboxes.get(SANDBOX_ID)
        sent = len(fake.requests)
        with pytest.raises(InvalidRequest) as caught:
            await call(sandbox.ports)
    assert caught.value.message == message
    assert len(fake.requests) == sent


async def test_a_gateway_without_ports_domain_is_unsupported(gateway: tuple[PortsGateway, str]) -> None:
    fake, url = gateway
    fake.serving = False
    async with AsyncClient(url, KEY) as client:
        sandbox = await client.sandboxes.get("web")
        for call in (sandbox.ports.list(), sandbox.ports.url(8000), sandbox.ports.token(8000)):
            with pytest.raises(Unsupported, match="--ports-domain"):
                await call


async def test_a_wrong_key_is_unauthorized(gateway: tuple[PortsGateway, str]) -> None:
    fake, url = gateway
    async with AsyncClient(url, KEY) as client:
        info = (await client.sandboxes.get("web")).info
    async with AsyncClient(url, "sbxk_someone_else") as other:
        with pytest.raises(Unauthorized):
            await Sandbox(other, info).ports.token(8000)
    assert fake.requests[-1][:2] == ("POST", f"/v1/sandboxes/{SANDBOX_ID}/ports/8000/tokens")
    assert fake.tokens == 0


def test_the_blocking_client_has_the_same_calls(gateway: tuple[PortsGateway, str]) -> None:
    fake, url = gateway
    with Client(url, KEY) as client:
        sandbox = client.sandboxes.get("web")
        assert [p.port for p in sandbox.ports.list()] == [8000]
        assert sandbox.ports.url(8000) == fake.url(8000)
        assert sandbox.ports.public(8000, True).public
        assert sandbox.ports.token(8000, 60).url.startswith(fake.url(8000))
    assert fake.public == {8000}


def test_every_namespace_of_the_blocking_client_blocks(gateway: tuple[PortsGateway, str]) -> None:
    """Each namespace comes back wrapped: its calls return answers, never coroutines (``client.admin`` did)."""
    _, url = gateway
    with Client(url, KEY) as client:
        for name in (
            "sandboxes",
            "images",
            "snapshots",
            "volumes",
            "admin",
            "services",
            "jobs",
            "secrets",
            "ssh",
        ):
            assert type(getattr(client, name)).__name__ == "SyncProxy", name
        assert client.capabilities().capabilities["exposed_ports"] is True
