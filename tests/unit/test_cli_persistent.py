"""sandbox-cli and persistent sandboxes, against the fake node of test_cli: ``create --persistent --name``,
``stop``, ``resume``, the state and the flag in ``ls`` and ``get``, and the errors (bad usage, the server's own,
a server without the capability)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner
from test_cli import KEEP, SANDBOX, FakeNode, fake  # noqa: F401  (the fixture is used by name)

from sbx.cli.main import main

NO_ENV = {"SANDBOX_URL": "", "SANDBOX_TOKEN": ""}
CAPS = ("GET", "/v1/capabilities")
NO_CAPABILITY = (
    "unsupported: this server does not offer persistent sandboxes (capability 'persistent' is off): "
)


def _invoke(url: str, *args: str) -> Any:
    return CliRunner().invoke(main, ["--url", url, *args], env=NO_ENV)


#: (arguments, persistent offered, exit status, stdout, stderr (for bad usage: its last line, after click's usage
#: lines), the requests sent as (method, path, body)).
CASES: list[tuple[list[str], bool, int, str, str, list[tuple[str, str, Any]]]] = [
    (["create", "--persistent", "--name", "keep"], True, 0, f"{SANDBOX['id']}\n", "",
     [CAPS + (None,), ("POST", "/v1/sandboxes", {"name": "keep", "persistent": True})]),
    # Without --persistent nothing changes: no capability asked, no persistent field sent.
    (["create", "--name", "keep"], True, 0, f"{SANDBOX['id']}\n", "",
     [("POST", "/v1/sandboxes", {"name": "keep"})]),
    (["create", "--persistent"], True, 2, "",
     "Error: --persistent needs --name: a persistent sandbox is found again by its name after it sleeps\n", []),
    # The server's refusals of a persistent create come through as its code and message, exit 1.
    (["create", "--persistent", "--name", "taken"], True, 1, "", "conflict: name 'taken' is in use by sbx_1\n",
     [CAPS + (None,), ("POST", "/v1/sandboxes", {"name": "taken", "persistent": True})]),
    (["create", "--persistent", "--name", "keep", "--cpus", "9"], True, 1, "",
     "invalid_request: cpus 9 is above the limit 4\n",
     [CAPS + (None,), ("POST", "/v1/sandboxes", {"name": "keep", "cpus": 9, "persistent": True})]),
    (["create", "--persistent", "--name", "keep"], False, 1, "",
     NO_CAPABILITY + "create it without --persistent, or upgrade sandboxd\n", [CAPS + (None,)]),
    (["stop", "keep"], True, 0, f"{KEEP['id']}: stopped (request)\n", "",
     [CAPS + (None,), ("GET", "/v1/sandboxes/keep", None), ("POST", f"/v1/sandboxes/{KEEP['id']}/stop", None)]),
    (["stop", "web"], True, 1, "", f"conflict: sandbox {SANDBOX['id']} is not persistent; delete it instead\n",
     [CAPS + (None,), ("GET", "/v1/sandboxes/web", None), ("POST", f"/v1/sandboxes/{SANDBOX['id']}/stop", None)]),
    (["stop", "nope"], True, 1, "", "not_found: no sandbox 'nope'\n",
     [CAPS + (None,), ("GET", "/v1/sandboxes/nope", None)]),
    (["stop", "keep"], False, 1, "", NO_CAPABILITY + "`suspend` or `rm` the sandbox instead\n", [CAPS + (None,)]),
    (["stop"], True, 2, "", "Error: Missing argument 'REF'.\n", []),
    (["resume", "keep"], True, 0, f"{KEEP['id']}: running\n", "",
     [("GET", "/v1/sandboxes/keep", None), ("POST", f"/v1/sandboxes/{KEEP['id']}/resume", None)]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("args", "offered", "exit_code", "stdout", "stderr", "sent"),
    CASES,
    ids=["create", "create-plain", "create-no-name", "create-conflict", "create-400", "create-no-capability",
         "stop", "stop-not-persistent", "stop-missing", "stop-no-capability", "stop-no-ref", "resume"],
)  # fmt: skip
def test_persistent_commands(
    fake: tuple[FakeNode, str],  # noqa: F811
    args: list[str],
    offered: bool,
    exit_code: int,
    stdout: str,
    stderr: str,
    sent: list[tuple[str, str, Any]],
) -> None:
    node, url = fake
    node.persistent = offered
    result = _invoke(url, *args)
    assert result.exit_code == exit_code, result.output
    assert result.stdout == stdout
    if exit_code == 2:
        assert result.stderr.startswith("Usage: ") and result.stderr.endswith("\n\n" + stderr), result.stderr
    else:
        assert result.stderr == stderr
    assert [(method, path, body) for method, path, body, _ in node.requests] == sent


def test_ls_shows_which_sandboxes_are_persistent_and_why_one_stopped(
    fake: tuple[FakeNode, str],  # noqa: F811
) -> None:
    _, url = fake
    lines = _invoke(url, "ls").stdout.splitlines()
    header = lines[0]
    rows = {line.split()[0]: line for line in lines[1:]}
    keep, web = rows[KEEP["id"]], rows[SANDBOX["id"]]
    assert keep[header.index("STATE") :].startswith("stopped (request)")
    assert keep[header.index("PERSISTENT") :].startswith("true")
    assert web[header.index("STATE") :].startswith("running ")
    assert web[header.index("PERSISTENT") :].startswith("false")


def test_get_shows_persistent_and_the_stopped_reason(fake: tuple[FakeNode, str]) -> None:  # noqa: F811
    _, url = fake
    fields = dict(line.split(":", 1) for line in _invoke(url, "get", "keep").stdout.splitlines())
    assert {k: fields[k].strip() for k in ("state", "persistent", "stopped_reason")} == {
        "state": "stopped", "persistent": "true", "stopped_reason": "request",
    }  # fmt: skip
    running = dict(line.split(":", 1) for line in _invoke(url, "get", "web").stdout.splitlines())
    assert running["persistent"].strip() == "false" and "stopped_reason" not in running


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["stop", "keep"], {"state": "stopped", "persistent": True, "stopped_reason": "request"}),
        (["resume", "keep"], {"state": "running", "persistent": True}),
        (["create", "--persistent", "--name", "keep"], {"name": "keep", "persistent": True}),
    ],
)
def test_json_is_the_servers_sandbox(
    fake: tuple[FakeNode, str],  # noqa: F811
    args: list[str],
    expected: dict[str, Any],
) -> None:
    _, url = fake
    result = CliRunner().invoke(main, ["--json", "--url", url, *args], env=NO_ENV)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert {k: out.get(k) for k in expected} == expected
    if "stopped_reason" not in expected:
        assert "stopped_reason" not in out
