"""sandbox-cli argument handling of the newer commands: cp locations, forward ports, usage errors,
and the clear refusal of image commands and tunnels by a server without those capabilities."""

from __future__ import annotations

from typing import Any

import click
import pytest
from click.testing import CliRunner
from test_cli import FakeNode, fake  # noqa: F401  (the fixture is used by name)

from sbx.cli.files import Remote, parse_location
from sbx.cli.forward import parse_ports
from sbx.cli.main import main

NO_ENV = {"SANDBOX_URL": "", "SANDBOX_TOKEN": ""}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("web:/sandbox/home/a.txt", Remote("web", "/sandbox/home/a.txt")),
        ("sbx_0123:/", Remote("sbx_0123", "/")),
        ("./local.txt", "./local.txt"),
        ("/abs/path", "/abs/path"),
        ("dir/with:colon", "dir/with:colon"),
        ("web:relative", "web:relative"),  # a guest path is absolute: this is a local name
        ("-", "-"),
    ],
)
def test_parse_location(text: str, expected: Remote | str) -> None:
    assert parse_location(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"), [("8000:80", (8000, 80)), ("3000", (3000, 3000)), ("0:5432", (0, 5432))]
)
def test_parse_ports(text: str, expected: tuple[int, int]) -> None:
    assert parse_ports(text) == expected


@pytest.mark.parametrize("text", ["", "a:b", "8000:", "8000:0", "70000:80", "-1:80", "1:2:3"])
def test_parse_ports_refuses(text: str) -> None:
    with pytest.raises(click.BadParameter):
        parse_ports(text)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["cp", "a.txt", "b.txt"], "exactly one side of cp is in a sandbox"),
        (["cp", "web:/a", "web:/b"], "exactly one side of cp is in a sandbox"),
        (["cp", "only-one"], "Missing argument"),
        (["exec", "web"], "Missing argument"),
        (["forward", "web", "x:y"], "LOCAL:REMOTE"),
        (["shell", "web"], "shell needs a terminal"),
        (["rm"], "Missing argument"),
        (["images", "frob"], "No such command"),
    ],
)
def test_bad_usage_exits_2_without_a_request(
    fake: tuple[FakeNode, str],  # noqa: F811
    args: list[str],
    message: str,
) -> None:
    node, url = fake
    result = CliRunner().invoke(main, ["--url", url, *args], env=NO_ENV)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert node.requests == []


def test_cp_of_a_directory_is_usage_error(fake: tuple[FakeNode, str], tmp_path: Any) -> None:  # noqa: F811
    node, url = fake
    result = CliRunner().invoke(main, ["--url", url, "cp", str(tmp_path), "web:/x"], env=NO_ENV)
    assert result.exit_code == 2
    assert "is a directory" in result.stderr
    assert node.requests == []


@pytest.mark.parametrize(
    ("args", "stderr"),
    [
        (["images", "ls"], "unsupported: images are not supported by this server"),
        (["images", "pull", "python:3.12"], "unsupported: images are not supported by this server"),
        (["images", "rm", "python:3.12"], "unsupported: images are not supported by this server"),
        (["forward", "web", "8000:80"], "unsupported: this server does not offer tunnels"),
    ],
)
def test_missing_capabilities_fail_clearly(
    fake: tuple[FakeNode, str],  # noqa: F811
    args: list[str],
    stderr: str,
) -> None:
    node, url = fake
    result = CliRunner().invoke(main, ["--url", url, *args], env=NO_ENV)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(stderr)
    # Only the capabilities were asked: nothing was attempted on a server that cannot do it.
    assert [(m, p) for m, p, *_ in node.requests] == [("GET", "/v1/capabilities")]


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"])
    listed = {line.split()[0] for line in result.stdout.split("Commands:")[1].splitlines() if line.strip()}
    assert listed == {
        "capabilities", "cp", "create", "events", "exec", "forward", "gateway", "get", "images", "ls", "network",
        "node", "ports", "resume", "rm", "run", "shell", "snapshot", "snapshots", "ssh", "stop", "suspend", "volumes",
        "services",
        "jobs", "secrets", "mcp",
    }  # fmt: skip
