"""The MCP tool ``expose_port`` through ``call_tool`` against a gateway answering the exposed-ports endpoints
(``ports_gateway``): a token URL for a private port, the plain URL for a public one, what is refused. The real
gateway: tests/integration/test_ports_clients.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from ports_gateway import KEY, SANDBOX_ID, PortsGateway, serve

from sbx.client import AsyncClient, resolve_endpoint
from sbx.mcp import tools as t
from sbx.mcp.server import call_tool
from sbx.mcp.session import Session, SessionConfig


@pytest.fixture
def gateway() -> Iterator[tuple[PortsGateway, str]]:
    fake = PortsGateway()
    with serve(fake) as url:
        yield fake, url


@pytest.fixture
async def session(gateway: tuple[PortsGateway, str]) -> AsyncIterator[Session]:
    _, url = gateway
    endpoint = resolve_endpoint(url, KEY)
    made = Session(SessionConfig(endpoint), AsyncClient(url, KEY))
    yield made
    await made.client.aclose()


async def _call(session: Session, arguments: dict[str, Any]) -> tuple[bool, Any]:
    result = await call_tool(session, "expose_port", arguments)
    return bool(result.is_error), result.structured_content


async def test_a_private_port_gets_a_token_url(gateway: tuple[PortsGateway, str], session: Session) -> None:
    fake, _ = gateway
    failed, answer = await _call(session, {"sandbox": "web", "port": 8000, "ttl_secs": 300})
    assert not failed, answer
    assert answer["url"] == f"{fake.url(8000)}?sbx_port_token=sbxp_1_300"
    assert (answer["sandbox"], answer["port"], answer["public"], answer["listening"]) == (
        SANDBOX_ID,
        8000,
        False,
        True,
    )
    assert answer["expires_at"] == "2030-01-01T00:00:00Z"
    assert answer["note"].startswith("private: this token URL opens the port for whoever holds it until 2030")
    ports = f"/v1/sandboxes/{SANDBOX_ID}/ports/8000"
    assert fake.requests[-2:] == [
        ("PUT", ports, {"public": False}),
        ("POST", ports + "/tokens", {"ttl_secs": 300}),
    ]


async def test_a_public_port_gets_its_plain_url(gateway: tuple[PortsGateway, str], session: Session) -> None:
    fake, _ = gateway
    failed, answer = await _call(session, {"sandbox": SANDBOX_ID, "port": 3000, "public": True})
    assert not failed, answer
    assert (answer["url"], answer["public"], answer["expires_at"]) == (fake.url(3000), True, None)
    assert answer["note"] == (
        "public: anyone with this URL may open it until the port is made private again or the sandbox ends; "
        "nothing listens on the port yet: start the server, the URL will then answer."
    )
    assert fake.public == {3000} and fake.tokens == 0
    # Asked again as private, it is private again and gets a token URL.
    failed, answer = await _call(session, {"sandbox": SANDBOX_ID, "port": 3000})
    assert not failed and not answer["public"] and "sbx_port_token" in answer["url"]
    assert fake.public == set()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"sandbox": "web", "port": 0}, "port: expected `int` >= 1"),
        ({"sandbox": "web", "port": 70000}, "port: expected `int` <= 65535"),
        ({"sandbox": "web", "port": 80, "ttl_secs": 86401}, "ttl_secs: expected `int` <= 86400"),
        ({"sandbox": "web", "port": 80, "public": "yes"}, "public: expected a boolean, got a string"),
        (
            {"sandbox": "web", "port": 80, "public": True, "ttl_secs": 60},
            "ttl_secs: a public port's URL does not expire; give ttl_secs only with public false",
        ),
    ],
)
async def test_bad_arguments_are_refused_before_anything_is_sent(
    gateway: tuple[PortsGateway, str], session: Session, arguments: dict[str, Any], message: str
) -> None:
    fake, _ = gateway
    failed, answer = await _call(session, arguments)
    assert failed
    assert answer["error"]["code"] == "invalid_request"
    assert message in answer["error"]["message"]
    assert fake.requests == []


async def test_a_gateway_without_ports_domain_answers_unsupported(
    gateway: tuple[PortsGateway, str], session: Session
) -> None:
    fake, _ = gateway
    fake.serving = False
    result = await call_tool(session, "expose_port", {"sandbox": "web", "port": 8000})
    assert result.is_error
    text = result.content[0].text  # type: ignore[union-attr]
    assert text == "unsupported: exposed ports are off: start the gateway with --ports-domain DOMAIN"


def test_the_description_says_which_url_comes_back() -> None:
    spec = t.TOOLS_BY_NAME["expose_port"]
    assert "token URL" in spec.description and "plain URL" in spec.description
    schema = t.json_schema(spec.args)
    assert schema["required"] == ["sandbox", "port"]
    assert schema["properties"]["public"]["default"] is False
    assert json.dumps(t.json_schema(spec.result))
