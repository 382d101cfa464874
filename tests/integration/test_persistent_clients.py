"""Persistent sandboxes through the clients, against a real sandboxd (gVisor): the SDK (async and blocking),
`sandbox-cli` as a subprocess and `sandbox-cli mcp` driven by the official MCP client.

Each client creates a persistent sandbox by name, stops it (state ``stopped``, reason ``request``), starts it
again with resume or by a call that needs it, and finds its files kept; the state is shown as each client
shows it, ``suspended`` too once one sat idle. The end of an MCP session terminates its other sandboxes and leaves the persistent one. Bad input
(persistent without a name, stopping a sandbox that is not persistent) comes back with the server's code and
message. The node's side (suspend at the idle timeout, wake, restore) is tested in its own modules.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sandboxd_harness import Sandboxd
from test_mcp import (  # noqa: F401  (patient_host: an autouse fixture)
    call,
    failure,
    patient_host,
    session,
    state_of,
    wait_for,
)

from sbx.api.errors import Conflict, InvalidRequest
from sbx.client import AsyncClient
from sbx.client.sync import Client

#: The server's refusal of a persistent create without a name (sbx.api.requests.check_create).
NO_NAME = (
    "persistent: a persistent sandbox needs a name (it is found again by it after every sleep); add name"
)
#: Seconds to wait for anything a test waits on (generous: a loaded 2-core machine).
DEADLINE_SECS = 90.0
#: The file each test writes before a stop and reads after it.
MARK = "/sandbox/home/mark.txt"


def unique(prefix: str) -> str:
    """A sandbox name no other test of the module's shared server uses."""
    return f"{prefix}-{secrets.token_hex(3)}"


def listed(server: Sandboxd, sandbox_id: str) -> dict[str, Any]:
    """The sandbox as the listing shows it (a listing never wakes a sandbox), ``{}`` once it is forgotten."""
    found = [s for s in server.request("GET", "/v1/sandboxes").json()["sandboxes"] if s["id"] == sandbox_id]
    return found[0] if found else {}


def cli(server: Sandboxd, *args: str) -> subprocess.CompletedProcess[str]:
    """`sandbox-cli --url unix://... ARGS` as a user runs it, from this checkout's code."""
    return subprocess.run(
        [sys.executable, "-m", "sbx.cli.main", "--url", f"unix://{server.socket_path}", *args],
        capture_output=True, text=True, timeout=DEADLINE_SECS, check=False,
        env={**os.environ, "SANDBOX_URL": "", "SANDBOX_TOKEN": ""},
    )  # fmt: skip


@pytest.fixture
async def client(sandboxd: Sandboxd) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(f"unix://{sandboxd.socket_path}") as c:
        yield c


@pytest.fixture(autouse=True)
def offers_persistent(sandboxd: Sandboxd) -> None:
    """The node under test offers the capability: without it every test here would fail for that alone."""
    assert sandboxd.request("GET", "/v1/capabilities").json()["capabilities"].get("persistent") is True


# --- the SDK ------------------------------------------------------------------------------------------------


async def test_sdk_create_stop_resume_and_wake(client: AsyncClient, sandboxd: Sandboxd) -> None:
    name = unique("sdk-keep")
    box = await client.sandboxes.create(name=name, persistent=True)
    try:
        assert (box.state, box.persistent, box.stopped_reason) == ("running", True, None)
        await box.files.write(MARK, "kept\n")

        assert await box.stop() is box
        assert (box.state, box.stopped_reason) == ("stopped", "request")
        # Reading it back does not wake it, by name or in the listing.
        again = await client.sandboxes.get(name)
        assert (again.id, again.state, again.persistent, again.stopped_reason) == (
            box.id, "stopped", True, "request",
        )  # fmt: skip
        assert listed(sandboxd, box.id)["state"] == "stopped"
        assert (await box.stop()).state == "stopped"  # stopping a stopped one is fine

        await box.resume()
        assert (box.state, box.stopped_reason) == ("running", None)
        assert await box.files.read_text(MARK) == "kept\n"

        # Stopped again, a call that needs the guest wakes it and is answered as usual.
        await box.stop()
        result = await box.run(["cat", MARK])
        assert (result.exit_code, result.stdout) == (0, b"kept\n")
        assert (await box.refresh()).state == "running"
    finally:
        await box.delete()
    assert (await box.refresh()).state == "terminated"


async def test_sdk_bad_input_gets_the_servers_code_and_message(client: AsyncClient) -> None:
    with pytest.raises(InvalidRequest) as caught:
        await client.sandboxes.create(persistent=True)
    assert (caught.value.code, caught.value.message) == ("invalid_request", NO_NAME)
    plain = await client.sandboxes.create(name=unique("sdk-plain"))
    try:
        assert plain.persistent is False
        with pytest.raises(Conflict) as refused:
            await plain.stop()
        assert refused.value.code == "conflict" and refused.value.message
        assert (await plain.refresh()).state == "running"
    finally:
        await plain.delete()


def test_sync_client_stops_and_resumes(sandboxd: Sandboxd) -> None:
    name = unique("sync-keep")
    with Client(f"unix://{sandboxd.socket_path}") as client:
        box = client.sandboxes.create(name=name, persistent=True)
        try:
            assert box.stop().state == "stopped" and box.stopped_reason == "request"
            assert box.resume().state == "running" and box.persistent
        finally:
            box.delete()


# --- sandbox-cli ----------------------------------------------------------------------------------------------


def test_cli_create_stop_resume_and_listings(sandboxd: Sandboxd) -> None:
    name = unique("cli-keep")
    made = cli(sandboxd, "create", "--persistent", "--name", name)
    assert made.returncode == 0, made.stderr
    sid = made.stdout.strip()
    try:
        assert sid.startswith("sbx_")
        assert cli(sandboxd, "run", name, "--", "sh", "-c", f"echo kept > {MARK}").returncode == 0
        fields = dict(line.split(":", 1) for line in cli(sandboxd, "get", name).stdout.splitlines())
        assert (fields["state"].strip(), fields["persistent"].strip()) == ("running", "true")
        assert "stopped_reason" not in fields

        stopped = cli(sandboxd, "stop", name)
        assert (stopped.returncode, stopped.stdout, stopped.stderr) == (0, f"{sid}: stopped (request)\n", "")
        fields = dict(line.split(":", 1) for line in cli(sandboxd, "get", name).stdout.splitlines())
        assert {k: fields[k].strip() for k in ("state", "persistent", "stopped_reason")} == {
            "state": "stopped", "persistent": "true", "stopped_reason": "request",
        }  # fmt: skip
        lines = cli(sandboxd, "ls").stdout.splitlines()
        header, row = lines[0], next(line for line in lines if line.startswith(sid))
        assert row[header.index("STATE") :].startswith("stopped (request)")
        assert row[header.index("PERSISTENT") :].startswith("true")
        shown = json.loads(cli(sandboxd, "--json", "get", name).stdout)
        assert (shown["state"], shown["persistent"], shown["stopped_reason"]) == ("stopped", True, "request")

        resumed = cli(sandboxd, "resume", name)
        assert (resumed.returncode, resumed.stdout) == (0, f"{sid}: running\n"), resumed.stderr
        ran = cli(sandboxd, "run", name, "--", "cat", MARK)
        assert (ran.returncode, ran.stdout) == (0, "kept\n")
    finally:
        assert cli(sandboxd, "rm", sid).returncode == 0


def test_cli_shows_an_idle_persistent_sandbox_suspended_and_a_command_wakes_it(sandboxd: Sandboxd) -> None:
    name = unique("cli-idle")
    made = cli(sandboxd, "create", "--persistent", "--name", name, "--idle-timeout", "2")
    assert made.returncode == 0, made.stderr
    sid = made.stdout.strip()
    try:
        # Watched through the listing: a request naming the sandbox would count as activity.
        wait_for(
            lambda: listed(sandboxd, sid).get("state") == "suspended", "the idle sandbox to be suspended"
        )
        lines = cli(sandboxd, "ls").stdout.splitlines()
        header, row = lines[0], next(line for line in lines if line.startswith(sid))
        assert row[header.index("STATE") :].startswith("suspended ")
        assert row[header.index("PERSISTENT") :].startswith("true")
        ran = cli(sandboxd, "run", name, "--", "echo", "awake")
        assert (ran.returncode, ran.stdout) == (0, "awake\n"), ran.stderr
    finally:
        assert cli(sandboxd, "rm", sid).returncode == 0


def test_cli_bad_input_says_what_to_change(sandboxd: Sandboxd) -> None:
    # Without --name: bad usage, exit 2, and nothing was made.
    before = {s["id"] for s in sandboxd.request("GET", "/v1/sandboxes").json()["sandboxes"]}
    nameless = cli(sandboxd, "create", "--persistent")
    assert nameless.returncode == 2 and nameless.stdout == ""
    assert nameless.stderr.endswith(
        "Error: --persistent needs --name: a persistent sandbox is found again by its name after it sleeps\n"
    )
    assert {s["id"] for s in sandboxd.request("GET", "/v1/sandboxes").json()["sandboxes"]} == before

    plain = sandboxd.create(name=unique("cli-plain"))
    try:
        # The server's refusals: its code and message on one line, exit 1.
        taken = cli(sandboxd, "create", "--persistent", "--name", plain["name"])
        assert taken.returncode == 1 and taken.stdout == ""
        assert taken.stderr.startswith("conflict: ") and plain["name"] in taken.stderr
        assert len(taken.stderr.splitlines()) == 1
        refused = cli(sandboxd, "stop", plain["id"])
        assert refused.returncode == 1 and refused.stdout == ""
        assert refused.stderr.startswith("conflict: ") and len(refused.stderr.splitlines()) == 1
        assert state_of(sandboxd, plain["id"]) == "running"
    finally:
        sandboxd.request("DELETE", f"/v1/sandboxes/{plain['id']}")


# --- the MCP server -------------------------------------------------------------------------------------------


async def test_mcp_session_end_leaves_the_persistent_sandbox(sandboxd: Sandboxd, tmp_path: Path) -> None:
    name = unique("mcp-keep")
    async with session(sandboxd, tmp_path / "a.log") as mcp:
        code, message = await failure(mcp, "create_sandbox", {"persistent": True})
        assert (code, message) == ("invalid_request", NO_NAME)

        kept = await call(mcp, "create_sandbox", name=name, persistent=True)
        plain = await call(mcp, "create_sandbox")
        assert (kept["persistent"], plain["persistent"]) == (True, False)
        assert kept["this_session"] and "stopped_reason" not in kept
        written = await call(mcp, "write_file", sandbox=name, path=MARK, content="kept\n")
        assert written["bytes"] == 5
    # The session ended: its other sandbox went with it, the persistent one did not.
    wait_for(
        lambda: state_of(sandboxd, plain["id"]) in ("terminated", "gone"), "the session's plain sandbox to go"
    )
    try:
        assert listed(sandboxd, kept["id"])["state"] in ("running", "suspended")
        assert "session ended" in (tmp_path / "a.log").read_text()

        # A later session finds it by name, with its files; it is not that session's own.
        sandboxd.request("POST", f"/v1/sandboxes/{kept['id']}/stop")
        async with session(sandboxd, tmp_path / "b.log") as later:
            everything = {s["id"]: s for s in (await call(later, "list_sandboxes", scope="all"))["sandboxes"]}
            seen = everything[kept["id"]]
            assert (seen["state"], seen["persistent"], seen["stopped_reason"]) == ("stopped", True, "request")
            assert not seen["this_session"]
            ran = await call(later, "run_command", sandbox=name, command=f"cat {MARK}")
            assert (ran["exit_code"], ran["stdout"]) == (0, "kept\n")
        assert listed(sandboxd, kept["id"])["state"] in ("running", "suspended")
        # terminate_sandbox is what removes it.
        async with session(sandboxd, tmp_path / "c.log") as last:
            assert (await call(last, "terminate_sandbox", sandbox=name))["terminated"] is True
        assert state_of(sandboxd, kept["id"]) in ("terminated", "gone")
    finally:
        sandboxd.request("DELETE", f"/v1/sandboxes/{kept['id']}")
