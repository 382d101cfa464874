"""`sandbox-cli mcp` driven by the official `mcp` SDK's own client, against a real sandboxd (gVisor).

The server runs as the subprocess an MCP host would start (`sandbox-cli --url unix://... mcp`, over stdio;
one test over streamable HTTP). Every tool is called; a file's text and a command's output come back as text
blocks, not JSON; bad arguments and the service's errors come back as tool errors with the spec's code and
message while the server keeps answering; a command past its timeout is killed; a huge output is capped; a
session's sandboxes carry its label and are removed when it ends.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import mcp.client.stdio
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.shared.exceptions import MCPError
from mcp_types import TextContent
from sandboxd_harness import Sandboxd, free_port

BIN = Path(sys.executable).parent
CLI = [str(BIN / "sandbox-cli")] if (BIN / "sandbox-cli").exists() else [sys.executable, "-m", "sbx.cli.main"]

TOOLS = {
    "create_sandbox", "list_sandboxes", "terminate_sandbox", "run_command", "start_process",
    "read_process_output", "write_process_stdin", "signal_process", "read_file", "write_file", "list_files",
    "delete_file", "expose_port", "snapshot_sandbox", "fork_sandbox", "delete_snapshot",
}  # fmt: skip

#: Seconds to wait for anything a test waits on (generous: a loaded 2-core machine).
DEADLINE_SECS = 90.0
#: The SDK's stdio client gives a server only a few safe variables; PYTHONPATH (when set, e.g. to a worktree's
#: src) goes too, so the server runs the code under test, as sandboxd (which inherits everything) does.
CODE_ENV = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}


@pytest.fixture(autouse=True)
def patient_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's client gives a server 2 s after closing its stdin before SIGTERM (then 2 s to SIGKILL); a
    loaded machine may need longer to terminate a session's sandboxes, so these tests wait as a patient host
    would. (An impatient host's kill leaves them to their idle timeout: docs/mcp.md.)"""
    monkeypatch.setattr(mcp.client.stdio, "PROCESS_TERMINATION_TIMEOUT", DEADLINE_SECS)


def server_command(server: Sandboxd, *extra: str) -> list[str]:
    return [*CLI, "--url", f"unix://{server.socket_path}", "mcp", *extra]


@contextlib.asynccontextmanager
async def session(
    server: Sandboxd, log: Path, *extra: str, env: dict[str, str] | None = None, mode: str = "auto"
) -> AsyncIterator[Client]:
    """An MCP session with `sandbox-cli mcp` started over stdio as a host starts it; its stderr goes to ``log``."""
    command = server_command(server, *extra)
    params = StdioServerParameters(command=command[0], args=command[1:], env={**CODE_ENV, **(env or {})})
    # A local log file, opened once per session: not worth a thread.
    with open(log, "a", encoding="utf-8") as errlog:  # noqa: ASYNC230
        async with Client(
            stdio_client(params, errlog=errlog), read_timeout_seconds=DEADLINE_SECS * 2, mode=mode
        ) as client:
            yield client


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    """A successful call's structured answer (the client checked it against the tool's output schema)."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, (tool, result.content)
    assert isinstance(result.structured_content, dict)
    return result.structured_content


async def failure(client: Client, tool: str, arguments: dict[str, Any]) -> tuple[str, str]:
    """A failed call's (code, message), checked to be a tool error whose text says the same."""
    result = await client.call_tool(tool, arguments)
    assert result.is_error, (tool, arguments, result.structured_content)
    error = result.structured_content["error"]  # type: ignore[index]
    assert result.content[0].text == f"{error['code']}: {error['message']}"  # type: ignore[union-attr]
    return error["code"], error["message"]


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_SECS
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def state_of(server: Sandboxd, sandbox_id: str) -> str:
    resp = server.request("GET", f"/v1/sandboxes/{sandbox_id}")
    return "gone" if resp.status == 404 else str(resp.json()["state"])


def live_ids(server: Sandboxd) -> set[str]:
    listing = server.request("GET", "/v1/sandboxes").json()["sandboxes"]
    return {s["id"] for s in listing if s["state"] != "terminated"}


# --- every tool ----------------------------------------------------------------------------------------------


async def test_every_tool(sandboxd: Sandboxd, tmp_path: Path) -> None:
    outsider = sandboxd.create()  # made without MCP: listed with scope all, never this session's
    name = f"mcp-{secrets.token_hex(3)}"
    async with session(sandboxd, tmp_path / "mcp.log", "--idle-timeout", "700") as client:
        listed = await client.list_tools()
        assert {tool.name for tool in listed.tools} == TOOLS
        assert all(tool.description and tool.input_schema["type"] == "object" for tool in listed.tools)

        made = await call(
            client, "create_sandbox", name=name, cpus=1, memory_mb=512, labels={"team": "qa"},
            network={"mode": "none"}, env={"GREETING": "hello"},
        )  # fmt: skip
        sid = made["id"]
        assert made["state"] == "running" and made["name"] == name and made["cpus"] == 1
        assert made["network"]["mode"] == "none" and made["idle_timeout_secs"] == 700
        assert made["labels"]["team"] == "qa" and made["labels"]["mcp.session"] and made["this_session"]

        mine = await call(client, "list_sandboxes")
        assert [s["id"] for s in mine["sandboxes"]] == [sid] and mine == {
            **mine,
            "total": 1,
            "truncated": False,
        }
        everything = {s["id"]: s for s in (await call(client, "list_sandboxes", scope="all"))["sandboxes"]}
        assert everything[sid]["this_session"] and not everything[outsider["id"]]["this_session"]

        ran = await call(
            client, "run_command", sandbox=name, command='echo "$GREETING $X"; pwd; cat; echo oops >&2; exit 7',
            env={"X": "world"}, stdin="piped",
        )  # fmt: skip
        assert ran == {
            "exit_code": 7, "timed_out": False, "stdout": "hello world\n/sandbox/home\npiped", "stderr": "oops\n",
            "stdout_truncated": False, "stderr_truncated": False, "stdout_bytes": 31, "stderr_bytes": 5,
        }  # fmt: skip
        ran = await call(client, "run_command", sandbox=sid, argv=["pwd"], cwd="/tmp")
        assert (ran["exit_code"], ran["stdout"]) == (0, "/tmp\n")
        # Bytes that are not UTF-8 are shown as U+FFFD, never break the answer.
        ran = await call(client, "run_command", sandbox=sid, command="printf '\\377\\376 ok'")
        assert (ran["stdout"], ran["stdout_bytes"]) == ("\ufffd\ufffd ok", 5)

        # A background process: fed through stdin, its output read after it exits, then read again.
        started = await call(
            client, "start_process", sandbox=sid, command="read line; echo got $line; echo warn >&2; exit 3"
        )
        pid = started["pid"]
        assert started["state"] == "running" and started["sandbox"] == sid
        assert await call(client, "write_process_stdin", sandbox=sid, pid=pid, data="ping\n") == {
            "pid": pid, "written_bytes": 5, "closed": False,
        }  # fmt: skip
        out = await call(client, "read_process_output", sandbox=sid, pid=pid, wait_secs=60)
        assert out == {
            "pid": pid, "state": "exited", "exit_code": 3, "stdout": "got ping\n", "stderr": "warn\n",
            "next_stdout_offset": 9, "next_stderr_offset": 5, "more": False, "dropped_bytes": 0,
        }  # fmt: skip
        again = await call(client, "read_process_output", sandbox=sid, pid=pid)
        assert (again["stdout"], again["stderr"], again["next_stdout_offset"]) == ("", "", 9)
        from_start = await call(client, "read_process_output", sandbox=sid, pid=pid, stdout_offset=4)
        assert from_start["stdout"] == "ping\n"

        # A process this session did not start (here: through the API) is followed from its first read.
        other = sandboxd.request(
            "POST", f"/v1/sandboxes/{sid}/processes", {"argv": ["sh", "-c", "echo from-elsewhere; exit 4"]}
        ).json()["pid"]
        elsewhere = await call(client, "read_process_output", sandbox=sid, pid=other, wait_secs=60)
        assert (elsewhere["stdout"], elsewhere["exit_code"]) == ("from-elsewhere\n", 4)

        # A process that runs until signalled; closing its stdin, then killing it.
        sleeper = (await call(client, "start_process", sandbox=sid, argv=["sleep", "300"]))["pid"]
        running = await call(client, "read_process_output", sandbox=sid, pid=sleeper)
        assert (running["state"], running["exit_code"]) == ("running", None)
        closed = await call(client, "write_process_stdin", sandbox=sid, pid=sleeper, close=True)
        assert closed["closed"] is True
        assert await call(client, "signal_process", sandbox=sid, pid=sleeper, signal="KILL") == {
            "pid": sleeper, "signal": "KILL",
        }  # fmt: skip
        killed = await call(client, "read_process_output", sandbox=sid, pid=sleeper, wait_secs=60)
        # Killed by SIGKILL: as the node reports it (negative signal number, or a shell's 128 + 9).
        assert killed["state"] == "exited" and killed["exit_code"] in (-9, 137)

        # Files: text, binary (base64 both ways), a listing, a delete.
        home = "/sandbox/home"
        assert await call(client, "write_file", sandbox=sid, path=f"{home}/notes/a.txt", content="héllo\n") == {
            "path": f"{home}/notes/a.txt", "bytes": 7,
        }  # fmt: skip
        binary = bytes(range(256))
        await call(client, "write_file", sandbox=sid, path=f"{home}/notes/b.bin",
                   content=base64.b64encode(binary).decode(), encoding="base64")  # fmt: skip
        text = await call(client, "read_file", sandbox=sid, path=f"{home}/notes/a.txt")
        assert text == {
            "path": f"{home}/notes/a.txt", "content": "héllo\n", "encoding": "utf-8", "offset": 0, "bytes": 7,
            "next_offset": 7, "truncated": False,
        }  # fmt: skip
        raw = await call(client, "read_file", sandbox=sid, path=f"{home}/notes/b.bin")
        assert raw["encoding"] == "base64" and base64.b64decode(raw["content"]) == binary
        listing = await call(client, "list_files", sandbox=sid, path=f"{home}/notes")
        assert listing == {
            "path": f"{home}/notes", "total": 2, "truncated": False,
            "entries": [{"name": "a.txt", "type": "file", "size": 7}, {"name": "b.bin", "type": "file", "size": 256}],
        }  # fmt: skip
        assert await call(client, "delete_file", sandbox=sid, path=f"{home}/notes/b.bin") == {
            "path": f"{home}/notes/b.bin", "deleted": True,
        }  # fmt: skip
        code, message = await failure(client, "read_file", {"sandbox": sid, "path": f"{home}/notes/b.bin"})
        assert code == "not_found" and "b.bin" in message

        # Snapshot and fork: the fork has the file, carries the session's label; the snapshot is deleted.
        snap = await call(client, "snapshot_sandbox", sandbox=sid, kind="disk")
        assert snap["sandbox"] == sid and snap["kind"] == "disk" and snap["id"]
        fork = await call(client, "fork_sandbox", snapshot_id=snap["id"])
        assert fork["this_session"] and fork["id"] != sid and fork["idle_timeout_secs"] == 700
        seen = await call(client, "run_command", sandbox=fork["id"], argv=["cat", f"{home}/notes/a.txt"])
        assert seen["stdout"] == "héllo\n"
        assert {s["id"] for s in (await call(client, "list_sandboxes"))["sandboxes"]} == {sid, fork["id"]}
        assert await call(client, "delete_snapshot", snapshot_id=snap["id"]) == {
            "snapshot_id": snap["id"], "deleted": True,
        }  # fmt: skip
        assert snap["id"] not in {
            s["id"] for s in sandboxd.request("GET", "/v1/snapshots").json()["snapshots"]
        }

        assert await call(client, "terminate_sandbox", sandbox=fork["id"]) == {
            "sandbox": fork["id"], "terminated": True,
        }  # fmt: skip
        assert state_of(sandboxd, fork["id"]) == "terminated"
        await call(client, "terminate_sandbox", sandbox=fork["id"])  # twice is fine
        assert [s["id"] for s in (await call(client, "list_sandboxes"))["sandboxes"]] == [sid]
    # The session ended: its sandbox went with it, the outsider did not.
    wait_for(
        lambda: state_of(sandboxd, sid) in ("terminated", "gone"), "the session's sandbox to be terminated"
    )
    assert state_of(sandboxd, outsider["id"]) == "running"
    sandboxd.request("DELETE", f"/v1/sandboxes/{outsider['id']}")


# --- answers as text -----------------------------------------------------------------------------------------

#: A source file with what JSON would escape: quotes, backslashes, newlines, non-ASCII.
SOURCE = (
    'import sys\n\n\ndef greet(name: str) -> str:\n    """Say \'hi\'."""\n'
    '    return f"héllo, {name}!\\n\\t\\\\ done"\n\n\n'
    'print(greet("wörld"), end="")\nprint("warn: \\"careful\\"", file=sys.stderr)\nsys.exit(3)\n'
)


async def texts(client: Client, tool: str, **arguments: Any) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """A successful call's text blocks as ``(text, _meta)`` (each checked to be text content) and its
    structured answer."""
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, (tool, result.content)
    assert isinstance(result.structured_content, dict)
    blocks = [block for block in result.content if isinstance(block, TextContent)]
    assert blocks == result.content
    return [(block.text, block.meta) for block in blocks], result.structured_content


async def test_the_text_tools_answer_with_the_text_itself(sandboxd: Sandboxd, tmp_path: Path) -> None:
    """A file's lines and a command's output reach the host as text, not as a JSON string of escapes; the
    structured content keeps its shape."""
    out, err = {"stream": "stdout"}, {"stream": "stderr"}
    async with session(sandboxd, tmp_path / "mcp.log") as client:
        sid = (await call(client, "create_sandbox"))["id"]
        path = "/sandbox/home/greet.py"
        await call(client, "write_file", sandbox=sid, path=path, content=SOURCE)
        blocks, answer = await texts(client, "read_file", sandbox=sid, path=path)
        assert blocks == [(SOURCE, None)]
        assert (answer["content"], answer["encoding"], answer["truncated"]) == (SOURCE, "utf-8", False)

        # A page of it: the text of the page, then where to read on.
        blocks, answer = await texts(client, "read_file", sandbox=sid, path=path, max_bytes=10)
        note = "[bytes 0-9 shown; the file goes on: call read_file with offset=10 for more]"
        assert blocks == [(SOURCE[:10], None), (note, None)]
        assert (answer["content"], answer["next_offset"], answer["truncated"]) == (SOURCE[:10], 10, True)

        # The program's own output, a block per stream marked with its stream, then the status line.
        blocks, answer = await texts(client, "run_command", sandbox=sid, argv=["python3", path])
        printed, warned = "héllo, wörld!\n\t\\ done", 'warn: "careful"\n'
        status = "[exit code 3; stdout: 23 bytes, block 1; stderr: 16 bytes, block 2]"
        assert blocks == [(printed, out), (warned, err), (status, None)]
        assert (answer["stdout"], answer["stderr"], answer["exit_code"]) == (printed, warned, 3)
        blocks, _ = await texts(client, "run_command", sandbox=sid, command="true")
        assert blocks == [("[exit code 0; stdout: 0 bytes, no block; stderr: 0 bytes, no block]", None)]

        pid = (await call(client, "start_process", sandbox=sid, command="echo 'a \"b\"'; echo c >&2"))["pid"]
        blocks, answer = await texts(client, "read_process_output", sandbox=sid, pid=pid, wait_secs=60)
        status = (
            f"[process {pid} exited, exit code 0; stdout: block 1, next_stdout_offset 6; stderr: block 2, "
            "next_stderr_offset 2]"
        )
        assert blocks == [('a "b"\n', out), ("c\n", err), (status, None)]
        assert (answer["stdout"], answer["stderr"], answer["state"]) == ('a "b"\n', "c\n", "exited")

        # Every other tool still answers its JSON as text.
        listed = await client.call_tool("list_files", {"sandbox": sid, "path": "/sandbox/home"})
        assert json.loads(listed.content[0].text) == listed.structured_content  # type: ignore[union-attr]


# --- errors ----------------------------------------------------------------------------------------------------

#: (tool, arguments, code, what the message holds): the host's mistakes and the service's refusals. SID is
#: replaced by the session's sandbox.
BAD_CALLS: list[tuple[str, dict[str, Any], str, str]] = [
    # The tool's schema, checked by the MCP server before anything is sent.
    ("run_command", {"sandbox": "SID", "command": 5}, "invalid_request", "command: expected a string, got an integer"),
    ("run_command", {"sandbox": "SID"}, "invalid_request", "a command is required: give command"),
    ("run_command", {"sandbox": "SID", "command": "ls", "argv": ["ls"]}, "invalid_request", "not both"),
    ("run_command", {"sandbox": "SID", "command": "ls", "timeout_secs": 0}, "invalid_request",
     "timeout_secs: expected `int` >= 1"),
    ("create_sandbox", {"colour": "red"}, "invalid_request", "unknown field 'colour'; the fields are image, cpus"),
    ("create_sandbox", {"network": {"mode": "wide"}}, "invalid_request",
     "network.mode: expected one of none, allowlist, open, got 'wide'"),
    ("create_sandbox", {"labels": {"mcp.session": "x"}}, "invalid_request",
     "'mcp.session' is set by the MCP server to its session"),
    ("read_process_output", {"sandbox": "SID"}, "invalid_request", "pid is required"),
    ("write_file", {"sandbox": "SID", "path": "/sandbox/home/x", "content": "%%%", "encoding": "base64"},
     "invalid_request", "content: expected standard base64"),
    # The service's own answers (spec: Errors), relayed as they are.
    ("run_command", {"sandbox": "sbx_0000000000000000", "command": "true"}, "not_found", "sbx_0000000000000000"),
    ("run_command", {"sandbox": "SID", "argv": ["no-such-program"]}, "invalid_request", "no-such-program"),
    ("create_sandbox", {"cpus": 99}, "invalid_request", "limits.max_cpus"),
    ("create_sandbox", {"network": {"mode": "open"}}, "refused", "network policy rule 3"),
    ("create_sandbox", {"env": {"LD_PRELOAD": "/x.so"}}, "refused", "LD_PRELOAD"),
    ("read_file", {"sandbox": "SID", "path": "/sandbox/home/absent"}, "not_found", "/sandbox/home/absent"),
    ("read_file", {"sandbox": "SID", "path": "relative/path"}, "invalid_request", "relative/path"),
    ("list_files", {"sandbox": "SID", "path": "/sandbox/../etc"}, "invalid_request", ".."),
    ("read_process_output", {"sandbox": "SID", "pid": 4242}, "not_found", "4242"),
    ("signal_process", {"sandbox": "SID", "pid": 4242}, "not_found", "4242"),
    ("fork_sandbox", {"snapshot_id": "snap_absent"}, "not_found", "snap_absent"),
    ("delete_snapshot", {"snapshot_id": "snap_absent"}, "not_found", "snap_absent"),
]  # fmt: skip


async def test_bad_arguments_and_refusals_are_tool_errors_and_change_nothing(
    sandboxd: Sandboxd, tmp_path: Path
) -> None:
    async with session(sandboxd, tmp_path / "mcp.log") as client:
        sid = (await call(client, "create_sandbox"))["id"]
        before = live_ids(sandboxd)
        home_before = await call(client, "list_files", sandbox=sid, path="/sandbox/home")
        wrong = []
        for tool, arguments, code, needle in BAD_CALLS:
            args = {k: (sid if v == "SID" else v) for k, v in arguments.items()}
            got_code, message = await failure(client, tool, args)
            if got_code != code or needle not in message:
                wrong.append((tool, arguments, got_code, message))
        assert wrong == []
        # Nothing was made, nothing written, and the server still answers.
        assert live_ids(sandboxd) == before
        assert await call(client, "list_files", sandbox=sid, path="/sandbox/home") == home_before
        assert [s["id"] for s in (await call(client, "list_sandboxes"))["sandboxes"]] == [sid]
        # An unknown tool is a protocol error (the MCP spec), and the session goes on.
        with pytest.raises(MCPError) as caught:
            await client.call_tool("format_disk", {})
        assert "unknown tool 'format_disk'; the tools are create_sandbox" in caught.value.error.message
        assert (await call(client, "run_command", sandbox=sid, argv=["echo", "alive"]))["stdout"] == "alive\n"


async def test_a_host_on_the_handshake_protocol(sandboxd: Sandboxd, tmp_path: Path) -> None:
    """Hosts of the initialize handshake (protocol versions before 2026-07-28) get the same tools and errors."""
    async with session(sandboxd, tmp_path / "mcp.log", mode="legacy") as client:
        assert {tool.name for tool in (await client.list_tools()).tools} == TOOLS
        sid = (await call(client, "create_sandbox"))["id"]
        assert (await call(client, "run_command", sandbox=sid, command="echo legacy"))["stdout"] == "legacy\n"
        assert await failure(client, "run_command", {"sandbox": sid, "argv": "ls"}) == (
            "invalid_request", "argv: expected an array of strings, got a string",
        )  # fmt: skip
    assert state_of(sandboxd, sid) == "terminated"


async def test_a_command_past_its_timeout_is_killed(sandboxd: Sandboxd, tmp_path: Path) -> None:
    async with session(sandboxd, tmp_path / "mcp.log") as client:
        sid = (await call(client, "create_sandbox"))["id"]
        started = time.monotonic()
        ran = await call(
            client, "run_command", sandbox=sid, command="echo started; sleep 120", timeout_secs=2
        )
        assert time.monotonic() - started < 60
        assert (ran["timed_out"], ran["exit_code"]) == (True, -1)
        # The sandbox is fine afterwards, and the command is gone.
        ps = await call(
            client, "run_command", sandbox=sid, command="ps -eo args | grep -c '[s]leep 120' || true"
        )
        assert ps["stdout"].strip() == "0"


async def test_a_huge_output_is_capped_and_says_so(sandboxd: Sandboxd, tmp_path: Path) -> None:
    cap = 4096
    async with session(sandboxd, tmp_path / "mcp.log", "--max-output-bytes", str(cap)) as client:
        sid = (await call(client, "create_sandbox"))["id"]
        # 20 MB on stdout: the node keeps 8 MiB, the MCP server passes on its head and tail.
        result = await client.call_tool(
            "run_command",
            {"sandbox": sid, "command": "head -c 20000000 /dev/zero | tr '\\0' a; echo done >&2",
             "max_output_bytes": 10_000_000},
        )  # fmt: skip
        ran = result.structured_content
        assert isinstance(ran, dict) and not result.is_error
        assert len(result.content[0].text) < 3 * cap  # type: ignore[union-attr]
        assert ran["stdout_truncated"] and ran["stdout_bytes"] == 8 * 1024 * 1024
        assert ran["stdout"].startswith("a" * (cap // 2) + "\n[... ")
        assert ran["stdout"].endswith("bytes per stream ...]\n" + "a" * (cap // 2))
        assert f"[... {8 * 1024 * 1024 - cap} bytes omitted" in ran["stdout"]
        assert (ran["stderr"], ran["stderr_truncated"], ran["exit_code"]) == ("done\n", False, 0)

        # A background process's 3 MB: the newest 1 MiB is kept, read a cap at a time, the rest counted.
        total = 3_000_000
        pid = (
            await call(
                client, "start_process", sandbox=sid, command=f"head -c {total} /dev/zero | tr '\\0' b"
            )
        )["pid"]
        out = await call(client, "read_process_output", sandbox=sid, pid=pid, wait_secs=60)
        dropped = total - 1024 * 1024
        assert out["state"] == "exited" and out["stdout"] == "b" * cap and out["more"]
        assert (out["dropped_bytes"], out["next_stdout_offset"]) == (dropped, dropped + cap)
        following = await call(client, "read_process_output", sandbox=sid, pid=pid, max_output_bytes=10)
        assert (following["stdout"], following["dropped_bytes"]) == ("b" * 10, 0)

        # A file larger than the cap: read a page, then the next from where the first stopped.
        await call(client, "run_command", sandbox=sid, command="seq 1 100000 > /sandbox/home/big.txt")
        first = await call(client, "read_file", sandbox=sid, path="/sandbox/home/big.txt")
        assert first["truncated"] and first["bytes"] == cap and first["next_offset"] == cap
        second = await call(client, "read_file", sandbox=sid, path="/sandbox/home/big.txt", offset=cap)
        assert second["offset"] == cap and second["next_offset"] == 2 * cap
        whole = "".join(f"{i}\n" for i in range(1, 100001))
        assert first["content"] + second["content"] == whole[: 2 * cap]


# --- sessions ------------------------------------------------------------------------------------------------


async def test_sessions_label_their_sandboxes_and_remove_them_at_the_end(
    sandboxd: Sandboxd, tmp_path: Path
) -> None:
    async with session(sandboxd, tmp_path / "b.log", "--keep", "--idle-timeout", "120") as keeper:
        kept = (await call(keeper, "create_sandbox"))["id"]
        async with session(sandboxd, tmp_path / "a.log") as client:
            first = (await call(client, "create_sandbox"))["id"]
            second = (await call(client, "create_sandbox", idle_timeout_secs=30))["id"]
            snap = (await call(client, "snapshot_sandbox", sandbox=first, kind="disk"))["id"]
            mine = {s["id"] for s in (await call(client, "list_sandboxes"))["sandboxes"]}
            theirs = {s["id"] for s in (await call(keeper, "list_sandboxes"))["sandboxes"]}
            assert (mine, theirs) == ({first, second}, {kept})
            everyone = {s["id"] for s in (await call(client, "list_sandboxes", scope="all"))["sandboxes"]}
            assert {first, second, kept} <= everyone
            labels = {
                sid: sandboxd.request("GET", f"/v1/sandboxes/{sid}").json() for sid in (first, second, kept)
            }
            assert labels[first]["labels"]["mcp.session"] == labels[second]["labels"]["mcp.session"]
            assert labels[first]["labels"]["mcp.session"] != labels[kept]["labels"]["mcp.session"]
            assert [labels[s]["idle_timeout_secs"] for s in (first, second, kept)] == [900, 30, 120]
        # The first session ended: its sandboxes and its snapshot are gone; the other session's is not.
        assert state_of(sandboxd, first) in ("terminated", "gone") and state_of(sandboxd, second) in (
            "terminated", "gone",
        )  # fmt: skip
        assert snap not in {s["id"] for s in sandboxd.request("GET", "/v1/snapshots").json()["snapshots"]}
        assert state_of(sandboxd, kept) == "running"
        assert [s["id"] for s in (await call(keeper, "list_sandboxes"))["sandboxes"]] == [kept]
    # --keep: left to its idle timeout.
    assert state_of(sandboxd, kept) == "running"
    sandboxd.request("DELETE", f"/v1/sandboxes/{kept}")


async def test_a_host_that_sends_sigterm_at_once_still_gets_the_clean_up(
    sandboxd: Sandboxd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A host that does not wait after closing stdin: SIGTERM at once (SIGKILL only much later)."""
    monkeypatch.setattr(mcp.client.stdio, "PROCESS_TERMINATION_TIMEOUT", 0.0)
    monkeypatch.setattr(mcp.client.stdio, "FORCE_KILL_TIMEOUT", DEADLINE_SECS)
    log = tmp_path / "mcp.log"
    async with session(sandboxd, log) as client:
        made = [(await call(client, "create_sandbox"))["id"] for _ in range(2)]
    assert [state_of(sandboxd, sid) for sid in made] == ["terminated", "terminated"]
    text = log.read_text(encoding="utf-8")
    # SIGTERM came before or during the clean-up (stdin closed too, at once): either way it ran to its end.
    assert '"signal": "SIGTERM"' in text and '"msg": "session ended"' in text and '"sandboxes": 2' in text


async def test_an_unreachable_server_is_a_tool_error_not_a_crash(tmp_path: Path) -> None:
    absent = tmp_path / "absent.sock"
    params = StdioServerParameters(
        command=CLI[0], args=[*CLI[1:], "--url", f"unix://{absent}", "mcp"], env=CODE_ENV
    )
    with open(tmp_path / "mcp.log", "w", encoding="utf-8") as errlog:  # noqa: ASYNC230 - a local log file
        async with Client(stdio_client(params, errlog=errlog)) as client:
            for tool, arguments in (("list_sandboxes", {}), ("create_sandbox", {})):
                code, message = await failure(client, tool, arguments)
                assert code == "unavailable" and f"cannot reach sandboxd at unix://{absent}" in message
            assert len((await client.list_tools()).tools) == len(TOOLS)


async def test_the_key_comes_from_the_environment_and_is_never_logged(
    sandboxd_factory: Callable[..., Sandboxd], tmp_path: Path
) -> None:
    token = "mcp-key-" + secrets.token_hex(16)
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n", encoding="utf-8")
    server = sandboxd_factory(args=["--token-file", str(token_file)], wait=False)
    server.token = token
    server.wait_ready()
    log = tmp_path / "mcp.log"
    async with session(server, log, env={"SANDBOX_TOKEN": token}) as client:
        sid = (await call(client, "create_sandbox"))["id"]
        assert (await call(client, "run_command", sandbox=sid, command="echo ok"))["stdout"] == "ok\n"
        listed = await client.list_tools()
        assert token not in listed.model_dump_json()
    async with session(server, log, env={"SANDBOX_TOKEN": "wrong-" + token}) as client:
        code, _ = await failure(client, "create_sandbox", {})
        assert code == "unauthorized"
    async with session(server, log) as client:
        code, _ = await failure(client, "list_sandboxes", {})
        assert code == "unauthorized"
    text = log.read_text(encoding="utf-8")
    assert '"tool": "run_command"' in text  # the log is there, and holds no key
    assert token not in text


# --- streamable HTTP -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def http_server(server: Sandboxd, log: Path, *extra: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    with open(log, "ab") as errlog:
        proc = subprocess.Popen(
            server_command(server, "--http", f"127.0.0.1:{port}", *extra),
            stdin=subprocess.DEVNULL, stdout=errlog, stderr=errlog,
        )  # fmt: skip
    try:

        def listening() -> bool:
            assert proc.poll() is None, log.read_text()
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, "the MCP server to listen")
        yield proc, port
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_streamable_http_on_loopback(sandboxd: Sandboxd, tmp_path: Path) -> None:
    with http_server(sandboxd, tmp_path / "mcp.log") as (proc, port):
        async with Client(f"http://127.0.0.1:{port}/mcp") as client:
            assert {tool.name for tool in (await client.list_tools()).tools} == TOOLS
            sid = (await call(client, "create_sandbox"))["id"]
            assert (await call(client, "run_command", sandbox=sid, argv=["echo", "over http"]))["stdout"] == (
                "over http\n"
            )
            code, message = await failure(client, "run_command", {"sandbox": sid, "command": ["ls"]})
            assert (code, message) == ("invalid_request", "command: expected a string, got an array")
        # A page elsewhere cannot drive it through the browser: a foreign Host is refused (DNS rebinding).
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/mcp", body=b"{}", headers={"Host": f"evil.example:{port}",
                                                           "Content-Type": "application/json"})  # fmt: skip
        assert conn.getresponse().status in (403, 421)
        conn.close()
        # SIGTERM ends it cleanly, its session's sandboxes with it.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE_SECS) == 0
    assert state_of(sandboxd, sid) in ("terminated", "gone")


def test_a_killed_server_leaves_its_sandboxes_to_the_idle_timeout(sandboxd: Sandboxd, tmp_path: Path) -> None:
    """SIGKILL gives no clean-up: the idle timeout the session gave its sandboxes reaps them."""

    async def make(port: int) -> str:
        async with Client(f"http://127.0.0.1:{port}/mcp") as client:
            return str((await call(client, "create_sandbox"))["id"])

    with http_server(sandboxd, tmp_path / "mcp.log", "--idle-timeout", "3") as (proc, port):
        sid = asyncio.run(make(port))
        proc.kill()
        proc.wait()

    # Watched through the listing: a request naming the sandbox would count as activity and keep it alive.
    def listed() -> dict[str, Any]:
        found = [s for s in sandboxd.request("GET", "/v1/sandboxes").json()["sandboxes"] if s["id"] == sid]
        return found[0] if found else {"state": "gone"}

    assert listed()["idle_timeout_secs"] == 3
    wait_for(lambda: listed()["state"] in ("terminated", "gone"), "the idle timeout to terminate it")
    assert listed().get("terminated_reason", "idle") == "idle"


@pytest.mark.parametrize("address", ["0.0.0.0:8765", "[::]:8765", "192.0.2.1:8765"])
def test_http_refuses_to_listen_beyond_loopback(sandboxd: Sandboxd, address: str) -> None:
    done = subprocess.run(
        server_command(sandboxd, "--http", address), capture_output=True, text=True, timeout=60, check=False,
        stdin=subprocess.DEVNULL, env={**os.environ, "SANDBOX_TOKEN": "never-shown"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "refusing to listen on" in done.stderr and "listens on loopback only" in done.stderr
    assert "never-shown" not in done.stderr + done.stdout
