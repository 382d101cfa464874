"""``sandbox-cli ports ls|public|private|open`` against a gateway answering the exposed-ports endpoints
(``ports_gateway``): the table, the requests, the token URL, usage errors and a gateway without the capability."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from ports_gateway import KEY, SANDBOX_ID, PortsGateway, serve

from sbx.cli.main import main


@pytest.fixture
def gateway() -> Iterator[tuple[PortsGateway, str]]:
    fake = PortsGateway(listening={8000, 5173}, public={9000})
    with serve(fake) as url:
        yield fake, url


def _invoke(url: str, *args: str) -> Any:
    return CliRunner().invoke(
        main, ["--url", url, "--token", KEY, *args], env={"SANDBOX_URL": "", "SANDBOX_TOKEN": ""}
    )


def test_ls_is_a_table_of_ports(gateway: tuple[PortsGateway, str]) -> None:
    fake, url = gateway
    result = _invoke(url, "ports", "ls", "web")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["PORT", "URL", "PUBLIC", "LISTENING"]
    assert [line.split() for line in lines[1:]] == [
        ["5173", fake.url(5173), "false", "true"],
        ["8000", fake.url(8000), "false", "true"],
        ["9000", fake.url(9000), "true", "false"],
    ]


def test_ls_json_is_the_servers_answer(gateway: tuple[PortsGateway, str]) -> None:
    fake, url = gateway
    result = _invoke(url, "--json", "ports", "ls", "web")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"ports": [fake.port_body(p) for p in (5173, 8000, 9000)]}


def test_public_and_private(gateway: tuple[PortsGateway, str]) -> None:
    fake, url = gateway
    made = _invoke(url, "ports", "public", "web", "8000")
    assert made.exit_code == 0, made.output
    assert made.stdout.splitlines()[1].split() == ["8000", fake.url(8000), "true", "true"]
    assert fake.public == {8000, 9000}
    back = _invoke(url, "ports", "private", "web", "9000")
    assert back.exit_code == 0 and back.stdout.splitlines()[1].split()[2] == "false"
    assert fake.public == {8000}
    assert [r for r in fake.requests if r[0] == "PUT"] == [
        ("PUT", f"/v1/sandboxes/{SANDBOX_ID}/ports/8000", {"public": True}),
        ("PUT", f"/v1/sandboxes/{SANDBOX_ID}/ports/9000", {"public": False}),
    ]


def test_open_prints_a_token_url(gateway: tuple[PortsGateway, str]) -> None:
    fake, url = gateway
    result = _invoke(url, "ports", "open", "web", "8000", "--ttl", "120")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{fake.url(8000)}?sbx_port_token=sbxp_1_120\n"
    assert result.stderr == "expires 2030-01-01T00:00:00Z\n"
    assert fake.requests[-1] == ("POST", f"/v1/sandboxes/{SANDBOX_ID}/ports/8000/tokens", {"ttl_secs": 120})
    default = _invoke(url, "--json", "ports", "open", "web", "8000")
    assert json.loads(default.stdout)["token"] == "sbxp_2_3600"
    assert fake.requests[-1][2] == {}


@pytest.mark.parametrize(
    "args",
    [
        ["ports", "open", "web", "0"],
        ["ports", "public", "web", "65536"],
        ["ports", "open", "web", "80", "--ttl", "0"],
        ["ports", "open", "web", "80", "--ttl", "86401"],
        ["ports", "private", "web"],
        ["ports", "ls"],
    ],
)
def test_bad_usage_exits_2_without_a_request(gateway: tuple[PortsGateway, str], args: list[str]) -> None:
    fake, url = gateway
    result = _invoke(url, *args)
    assert result.exit_code == 2, result.output
    assert fake.requests == []


@pytest.mark.parametrize(
    ("args", "stderr"),
    [
        (["ports", "ls", "nope"], "not_found: no sandbox 'nope'\n"),
        (["ports", "open", "web", "8000"], ("unsupported: exposed ports are off: start the gateway with "
         "--ports-domain DOMAIN\n")),
    ],
)  # fmt: skip
def test_failures_are_code_message_and_exit_1(
    gateway: tuple[PortsGateway, str], args: list[str], stderr: str
) -> None:
    fake, url = gateway
    fake.serving = False
    result = _invoke(url, *args)
    assert (result.exit_code, result.stdout, result.stderr) == (1, "", stderr)
