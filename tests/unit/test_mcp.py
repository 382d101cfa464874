"""The pure parts of the MCP server (sbx.mcp): caps on output, the process output window, argument mapping,
schemas, answers as text (``call_tool`` on canned answers), the listen address. The server itself is driven
over stdio and HTTP in tests/integration/test_mcp.py."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from mcp_types import TextContent
from msgspec import UNSET

from sbx.api.codec import convert_request
from sbx.api.errors import InvalidRequest, Refused, SandboxError
from sbx.mcp import tools as t
from sbx.mcp.output import StreamWindow, head_and_tail, page, utf8_boundary, utf8_start
from sbx.mcp.server import call_tool, error_result, parse_http_address, success_result, tool_list
from sbx.mcp.session import Session

# --- caps --------------------------------------------------------------------------------------------------

E = "é".encode()  # two bytes: 0xC3 0xA9
EURO = "€".encode()  # three bytes


@pytest.mark.parametrize(
    ("data", "cut", "expected"),
    [
        (b"abcdef", 3, 3),
        (b"abcdef", 0, 0),
        (b"abcdef", 9, 6),
        (b"a" + E + b"b", 2, 1),  # inside the two-byte sequence: back to its start
        (b"a" + E + b"b", 3, 3),  # after it
        (b"a" + EURO, 2, 1),
        (b"a" + EURO, 3, 1),
        (b"\x80\x80\x80\x80\x80", 4, 4),  # not UTF-8: the cut stays
    ],
)
def test_utf8_boundary(data: bytes, cut: int, expected: int) -> None:
    assert utf8_boundary(data, cut) == expected


@pytest.mark.parametrize(
    ("data", "start", "expected"),
    [(b"abc", 1, 1), (b"a" + E + b"b", 2, 3), (b"a" + EURO + b"b", 2, 4), (b"abc", 5, 3)],
)
def test_utf8_start(data: bytes, start: int, expected: int) -> None:
    assert utf8_start(data, start) == expected


@pytest.mark.parametrize(
    ("data", "limit", "truncated", "omitted", "head", "tail"),
    [
        (b"", 10, False, 0, "", ""),
        (b"0123456789", 10, False, 0, "0123456789", "0123456789"),
        (b"0123456789ab", 10, True, 2, "01234", "789ab"),
        (b"x" * 100_000, 1000, True, 99_000, "x" * 500, "x" * 500),
        # A cut inside a character moves out of it: no U+FFFD where the cap fell.
        (E * 10, 5, True, 16, "é\n", "\né"),
    ],
)
def test_head_and_tail(data: bytes, limit: int, truncated: bool, omitted: int, head: str, tail: str) -> None:
    capped = head_and_tail(data, limit)
    assert (capped.truncated, capped.omitted_bytes) == (truncated, omitted)
    assert capped.text.startswith(head) and capped.text.endswith(tail)
    assert "\ufffd" not in capped.text
    if truncated:
        assert f"[... {omitted} bytes omitted: the output cap is {limit} bytes per stream ...]" in capped.text
        assert len(capped.text.encode()) <= limit + 100
    else:
        assert capped.text == data.decode()


@pytest.mark.parametrize(
    ("data", "offset", "limit", "text", "expected"),
    [
        (b"abcdef", 0, 4, True, (b"abcd", 4, True)),
        (b"abcdef", 4, 4, True, (b"ef", 6, False)),
        (b"abcdef", 9, 4, True, (b"", 6, False)),
        (b"a" + E, 0, 2, True, (b"a", 1, True)),  # not through the middle of é
        (b"a" + E, 0, 2, False, (b"a\xc3", 2, True)),  # bytes: cut anywhere
        (E, 0, 1, True, (b"\xc3", 1, True)),  # a cap below one character still moves on
    ],
)
def test_page(data: bytes, offset: int, limit: int, text: bool, expected: tuple[bytes, int, bool]) -> None:
    got = page(data, offset, limit, text=text)
    assert (got.data, got.next_offset, got.more) == expected


def test_the_window_keeps_the_newest_bytes_and_counts_what_was_dropped() -> None:
    window = StreamWindow(capacity=10)
    window.append(b"0123456789")
    window.append(b"abcde")
    assert (window.base, window.total, bytes(window.buffer)) == (5, 15, b"56789abcde")
    # (offset, limit) -> (data, next_offset, dropped, more)
    cases: list[tuple[int, int, tuple[bytes, int, int, bool]]] = [
        (0, 4, (b"5678", 9, 5, True)),
        (5, 100, (b"56789abcde", 15, 0, False)),
        (12, 2, (b"cd", 14, 0, True)),
        (15, 4, (b"", 15, 0, False)),
        (20, 4, (b"", 15, 0, False)),
    ]
    for offset, limit, expected in cases:
        assert window.read(offset, limit) == expected, (offset, limit)


# --- arguments ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "argv", "expected"),
    [
        ("ls -l | head", UNSET, ["/bin/sh", "-c", "ls -l | head"]),
        (UNSET, ["ls", "-l"], ["ls", "-l"]),
        ("ls", ["ls"], "give command (a shell line) or argv (a list), not both"),
        (UNSET, UNSET, "a command is required: give command"),
    ],
)
def test_command_argv(command: Any, argv: Any, expected: list[str] | str) -> None:
    if isinstance(expected, list):
        assert t.command_argv(command, argv) == expected
    else:
        with pytest.raises(InvalidRequest) as caught:
            t.command_argv(command, argv)
        assert caught.value.message.startswith(expected)


@pytest.mark.parametrize(
    ("args", "idle", "expected"),
    [
        ({}, 900, {"labels": {"mcp.session": "s1"}, "idle_timeout_secs": 900}),
        ({}, None, {"labels": {"mcp.session": "s1"}}),
        ({"idle_timeout_secs": 30}, 900, {"labels": {"mcp.session": "s1"}, "idle_timeout_secs": 30}),
        # Persistent: passed on with its name (the node refuses it without one); idle means suspended then.
        ({"name": "keep", "persistent": True}, 900,
         {"name": "keep", "persistent": True, "labels": {"mcp.session": "s1"}, "idle_timeout_secs": 900}),
        ({"persistent": False}, None, {"persistent": False, "labels": {"mcp.session": "s1"}}),
        (
            {"image": "python:3.12", "cpus": 1, "labels": {"team": "a"}, "network": {"mode": "allowlist",
             "allow": ["pypi.org"]}, "env": {"A": "1"}},
            None,
            {"image": "python:3.12", "cpus": 1, "labels": {"team": "a", "mcp.session": "s1"},
             "network": {"mode": "allowlist", "allow": ["pypi.org"]}, "env": {"A": "1"}},
        ),
    ],
)  # fmt: skip
def test_create_fields(args: dict[str, Any], idle: int | None, expected: dict[str, Any]) -> None:
    assert t.create_fields(convert_request(args, t.CreateSandboxArgs), "s1", idle) == expected


def test_a_fork_keeps_its_snapshot_and_gets_the_label() -> None:
    fields = t.create_fields(convert_request({"snapshot_id": "snap_1"}, t.ForkSandboxArgs), "s1", 60)
    assert fields == {"snapshot_id": "snap_1", "labels": {"mcp.session": "s1"}, "idle_timeout_secs": 60}


def test_the_session_label_is_the_servers_to_set() -> None:
    args = convert_request({"labels": {"mcp.session": "other"}}, t.CreateSandboxArgs)
    with pytest.raises(InvalidRequest, match="'mcp.session' is set by the MCP server to its session"):
        t.create_fields(args, "s1", None)


@pytest.mark.parametrize(
    ("wanted", "server_max", "expected"), [(900, 86400, 900), (900, 300, 300), (900, 0, 900), (0, 300, None)]
)
def test_session_idle_timeout(wanted: int, server_max: int, expected: int | None) -> None:
    assert t.session_idle_timeout(wanted, server_max) == expected


@pytest.mark.parametrize(("asked", "cap", "expected"), [(UNSET, 100, 100), (10, 100, 10), (1000, 100, 100)])
def test_output_limit(asked: Any, cap: int, expected: int) -> None:
    assert t.output_limit(asked, cap) == expected


#: (tool, arguments, message): what a host's wrong arguments are answered, before anything is sent.
BAD_ARGUMENTS = [
    ("run_command", {"sandbox": "x", "command": 5}, "command: expected a string, got an integer"),
    ("run_command", {"command": "ls"}, "sandbox is required"),
    ("run_command", {"sandbox": "x", "command": "ls", "shell": True},
     "unknown field 'shell'; the fields are sandbox, command, argv, cwd, env, stdin, timeout_secs, max_output_bytes"),
    ("run_command", {"sandbox": "x", "command": "ls", "timeout_secs": 0}, "timeout_secs: expected `int` >= 1"),
    ("run_command", {"sandbox": "x", "command": "ls", "timeout_secs": 3601},
     "timeout_secs: expected `int` <= 3600"),
    ("run_command", {"sandbox": "x", "argv": []}, "argv: expected `array` of length >= 1"),
    ("run_command", {"sandbox": "x", "argv": "ls -l"}, "argv: expected an array of strings, got a string"),
    ("run_command", {"sandbox": "", "command": "ls"}, "sandbox: expected `str` of length >= 1"),
    ("create_sandbox", {"cpus": "2"}, "cpus: expected an integer, got a string"),
    ("create_sandbox", {"network": {"mode": "wide"}}, "network.mode: expected one of none, allowlist, open, got 'wide'"),
    ("create_sandbox", {"network": {"mode": "none", "extra": 1}}, "unknown field 'network.extra'"),
    ("read_process_output", {"sandbox": "x", "pid": 1, "wait_secs": 61}, "wait_secs: expected `float` <= 60"),
    ("signal_process", {"sandbox": "x", "pid": 1, "signal": "STOP"},
     "signal: expected one of INT, TERM, KILL, HUP, got 'STOP'"),
    ("write_file", {"sandbox": "x", "path": "/a"}, "content is required"),
    ("write_file", {"sandbox": "x", "path": "/a", "content": "", "encoding": "latin-1"},
     "encoding: expected one of utf-8, base64, got 'latin-1'"),
    ("list_sandboxes", {"scope": "mine"}, "scope: expected one of session, all, got 'mine'"),
    ("create_sandbox", {"name": "keep", "persistent": "yes"}, "persistent: expected a boolean, got a string"),
    ("fork_sandbox", {"snapshot_id": "snap_1", "persistent": True}, "unknown field 'persistent'"),
]  # fmt: skip


@pytest.mark.parametrize(("tool", "arguments", "message"), BAD_ARGUMENTS)
def test_bad_arguments_are_invalid_requests_naming_the_argument(
    tool: str, arguments: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        convert_request(arguments, t.TOOLS_BY_NAME[tool].args)
    assert caught.value.message.startswith(message), caught.value.message


# --- the catalogue and its schemas -------------------------------------------------------------------------


def _walk(node: Any) -> list[Any]:
    found = [node]
    if isinstance(node, dict):
        for value in node.values():
            found += _walk(value)
    elif isinstance(node, list):
        for value in node:
            found += _walk(value)
    return found


@pytest.mark.parametrize("spec", t.TOOLS, ids=lambda spec: spec.name)
def test_every_tool_has_a_self_contained_schema_an_agent_can_read(spec: t.ToolSpec) -> None:
    schema = t.json_schema(spec.args)
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert not any(isinstance(n, dict) and ("$ref" in n or "$defs" in n) for n in _walk(schema))
    for name, prop in schema["properties"].items():
        assert prop.get("description"), f"{spec.name}.{name} has no description"
        assert "``" not in prop["description"] and "\n" not in prop["description"]
    assert set(schema.get("required", [])) <= set(schema["properties"])
    output = t.json_schema(spec.result)
    assert output["type"] == "object" and not any(isinstance(n, dict) and "$ref" in n for n in _walk(output))
    assert len(spec.description) > 40
    assert callable(getattr(Session, spec.name, None)), f"no Session method for {spec.name}"


def test_the_tool_list_names_every_tool_once_with_hints() -> None:
    listed = tool_list()
    assert [tool.name for tool in listed] == [spec.name for spec in t.TOOLS]
    assert len({tool.name for tool in listed}) == len(listed)
    by_name = {tool.name: tool for tool in listed}
    assert by_name["read_file"].annotations is not None and by_name["read_file"].annotations.read_only_hint
    assert by_name["terminate_sandbox"].annotations is not None
    assert by_name["terminate_sandbox"].annotations.destructive_hint


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidRequest("cpus: too many"), "invalid_request"),
        (Refused("no"), "refused"),
        (SandboxError("x"), "internal"),
    ],
)
def test_an_error_is_a_tool_error_with_the_specs_code_and_message(error: SandboxError, code: str) -> None:
    result = error_result(error)
    assert result.is_error is True
    assert result.structured_content == {"error": {"code": code, "message": error.message}}
    assert result.content[0].text == f"{code}: {error.message}"  # type: ignore[union-attr]


def test_a_success_carries_its_answer_as_structure_and_as_json_text() -> None:
    answer = t.Deleted(path="/a", deleted=True)
    result = success_result(answer)
    assert result.is_error is False
    assert result.structured_content == {"path": "/a", "deleted": True}
    assert json.loads(result.content[0].text) == msgspec.to_builtins(answer)  # type: ignore[union-attr]


# --- answers as text -----------------------------------------------------------------------------------------


class Canned:
    """A session whose every tool answers ``answer``: all ``call_tool`` needs of one is ``handler``."""

    def __init__(self, answer: msgspec.Struct) -> None:
        self.answer = answer

    def handler(self, name: str) -> Any:
        async def run(args: msgspec.Struct) -> msgspec.Struct:
            assert isinstance(args, t.TOOLS_BY_NAME[name].args)
            return self.answer

        return run


#: Arguments each tool of these tests is called with (read strictly, as a host's would be).
ARGS: dict[str, dict[str, Any]] = {
    "read_file": {"sandbox": "sbx_1", "path": "/sandbox/home/a.py"},
    "run_command": {"sandbox": "sbx_1", "command": "make"},
    "read_process_output": {"sandbox": "sbx_1", "pid": 3},
    "delete_file": {"sandbox": "sbx_1", "path": "/sandbox/home/a.py"},
}


async def answered(tool: str, answer: msgspec.Struct) -> tuple[list[tuple[str, Any]], Any]:
    """``tool``'s answer ``answer`` as a host gets it: its text blocks as ``(text, _meta)``, checked to be
    text content, and its structured content, checked to be the answer exactly (today's shape)."""
    result = await call_tool(Canned(answer), tool, ARGS[tool])
    assert result.is_error is False
    assert result.structured_content == msgspec.to_builtins(answer)
    texts = [block for block in result.content if isinstance(block, TextContent)]
    assert texts == result.content
    return [(block.text, block.meta) for block in texts], result.structured_content


def file_answer(content: str, *, offset: int = 0, truncated: bool = False, size: int | None = None) -> Any:
    size = len(content.encode()) if size is None else size
    return t.FileContent(
        path="/sandbox/home/a.py", content=content, encoding="utf-8", offset=offset, bytes=size,
        next_offset=offset + size, truncated=truncated,
    )  # fmt: skip


def test_only_the_tools_that_carry_text_render_it() -> None:
    rendered = {spec.name for spec in t.TOOLS if spec.text is not None}
    assert rendered == {"read_file", "run_command", "read_process_output"}


@pytest.mark.parametrize(
    "content",
    [
        'def greet(name):\n    print(f"hello {name}!")\n    return "a\\"b" + \'\\\\n\'\n',
        "tab\there\r\nwindows line\n",
        "héllo → wörld ✓ 日本語 🐍\n",
        "no newline at the end",
        "",
        "\n\n\n",
    ],
    ids=["quotes-and-backslashes", "tabs-and-crlf", "unicode", "no-final-newline", "empty", "only-newlines"],
)
async def test_a_text_files_text_content_is_its_text_exactly(content: str) -> None:
    blocks, structured = await answered("read_file", file_answer(content))
    assert blocks == [(content, None)]
    assert structured["content"] == content and structured["encoding"] == "utf-8"


#: (offset, bytes shown, truncated, the note after the text, or None).
FILE_PAGES: list[tuple[int, int, bool, str | None]] = [
    (0, 4096, True, "[bytes 0-4095 shown; the file goes on: call read_file with offset=4096 for more]"),
    (4096, 4096, True, "[bytes 4096-8191 shown; the file goes on: call read_file with offset=8192 for more]"),
    (8192, 1000, False, None),  # the last page
    (0, 1000, False, None),  # the whole file
    (50, 0, False, None),  # past the end: nothing, and nothing to read on
]


@pytest.mark.parametrize(
    ("offset", "shown", "truncated", "note"), FILE_PAGES, ids=["first", "second", "last", "whole", "past-end"]
)
async def test_a_truncated_file_says_where_to_read_on(
    offset: int, shown: int, truncated: bool, note: str | None
) -> None:
    text = "x" * shown
    blocks, structured = await answered("read_file", file_answer(text, offset=offset, truncated=truncated))
    assert blocks == [(text, None)] + ([(note, None)] if note else [])
    assert (structured["next_offset"], structured["truncated"]) == (offset + shown, truncated)


async def test_a_base64_file_keeps_its_json_text() -> None:
    answer = t.FileContent(
        path="/sandbox/home/b.bin", content="AAEC/w==", encoding="base64", offset=0, bytes=4, next_offset=4,
        truncated=True,
    )  # fmt: skip
    blocks, structured = await answered("read_file", answer)
    assert len(blocks) == 1 and blocks[0][1] is None
    assert json.loads(blocks[0][0]) == structured


def run_answer(stdout: str = "", stderr: str = "", **fields: Any) -> t.RunCommandResult:
    defaults: dict[str, Any] = {
        "exit_code": 0, "timed_out": False, "stdout_truncated": False, "stderr_truncated": False,
        "stdout_bytes": len(stdout.encode()), "stderr_bytes": len(stderr.encode()),
    }  # fmt: skip
    return t.RunCommandResult(stdout=stdout, stderr=stderr, **{**defaults, **fields})


OUT = {"stream": "stdout"}
ERR = {"stream": "stderr"}

#: (answer, the text blocks a host gets as (text, _meta)).
RUNS: list[tuple[t.RunCommandResult, list[tuple[str, Any]]]] = [
    (run_answer('say "hi"\n'),
     [('say "hi"\n', OUT), ("[exit code 0; stdout: 9 bytes, block 1; stderr: 0 bytes, no block]", None)]),
    (run_answer(stderr="make: *** No rule\\n\n", exit_code=2),
     [("make: *** No rule\\n\n", ERR), ("[exit code 2; stdout: 0 bytes, no block; stderr: 20 bytes, block 1]", None)]),
    (run_answer("é\n", "warn\n", exit_code=7),
     [("é\n", OUT), ("warn\n", ERR), ("[exit code 7; stdout: 3 bytes, block 1; stderr: 5 bytes, block 2]", None)]),
    (run_answer(), [("[exit code 0; stdout: 0 bytes, no block; stderr: 0 bytes, no block]", None)]),
    (run_answer("aa\n[... 99996 bytes omitted ...]\naa", stdout_bytes=100_000, stdout_truncated=True),
     [("aa\n[... 99996 bytes omitted ...]\naa", OUT),
      ("[exit code 0; stdout: 100000 bytes, truncated to its head and tail, block 1; stderr: 0 bytes, no block]",
       None)]),
    (run_answer("started\n", exit_code=-1, timed_out=True),
     [("started\n", OUT),
      ("[timed out and killed, exit code -1; stdout: 8 bytes, block 1; stderr: 0 bytes, no block]", None)]),
]  # fmt: skip


@pytest.mark.parametrize(("answer", "expected"), RUNS, ids=["stdout", "stderr", "both", "neither", "truncated",
                                                            "timed-out"])  # fmt: skip
async def test_a_commands_text_is_its_output_then_a_status_line(
    answer: t.RunCommandResult, expected: list[tuple[str, Any]]
) -> None:
    blocks, _ = await answered("run_command", answer)
    assert blocks == expected


def process_answer(stdout: str = "", stderr: str = "", **fields: Any) -> t.ProcessOutput:
    defaults: dict[str, Any] = {
        "pid": 3, "state": "running", "exit_code": None, "next_stdout_offset": len(stdout.encode()),
        "next_stderr_offset": len(stderr.encode()), "more": False, "dropped_bytes": 0,
    }  # fmt: skip
    return t.ProcessOutput(stdout=stdout, stderr=stderr, **{**defaults, **fields})


#: (answer, the text blocks a host gets as (text, _meta)).
PROCESS_READS: list[tuple[t.ProcessOutput, list[tuple[str, Any]]]] = [
    (process_answer(),
     [("[process 3 running; stdout: no block, next_stdout_offset 0; stderr: no block, next_stderr_offset 0]",
       None)]),
    (process_answer("got ping\n", "warn\n", state="exited", exit_code=3),
     [("got ping\n", OUT), ("warn\n", ERR),
      (("[process 3 exited, exit code 3; stdout: block 1, next_stdout_offset 9; stderr: block 2, "
        "next_stderr_offset 5]"), None)]),
    (process_answer(stderr="Traceback\n", next_stdout_offset=40, next_stderr_offset=70),
     [("Traceback\n", ERR),
      ("[process 3 running; stdout: no block, next_stdout_offset 40; stderr: block 1, next_stderr_offset 70]",
       None)]),
    (process_answer("b" * 10, state="exited", exit_code=0, next_stdout_offset=1_000_010, more=True,
                    dropped_bytes=1_000_000),
     [("b" * 10, OUT),
      (("[process 3 exited, exit code 0; stdout: block 1, next_stdout_offset 1000010; stderr: no block, "
        "next_stderr_offset 0; more output is waiting: call read_process_output again; 1000000 bytes left "
        "the window before they were read (dropped)]"), None)]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("answer", "expected"), PROCESS_READS, ids=["nothing", "both", "stderr", "more-dropped"]
)
async def test_a_processs_output_is_its_text_then_a_status_line(
    answer: t.ProcessOutput, expected: list[tuple[str, Any]]
) -> None:
    blocks, _ = await answered("read_process_output", answer)
    assert blocks == expected


async def test_a_streams_block_is_marked_on_the_wire() -> None:
    result = await call_tool(Canned(run_answer("out\n", "err\n")), "run_command", ARGS["run_command"])
    wire = result.model_dump(by_alias=True, mode="json", exclude_none=True)["content"]
    assert [block.get("_meta") for block in wire] == [OUT, ERR, None]


async def test_other_tools_keep_their_json_text() -> None:
    blocks, structured = await answered("delete_file", t.Deleted(path="/sandbox/home/a.py", deleted=True))
    assert len(blocks) == 1 and blocks[0][1] is None
    assert json.loads(blocks[0][0]) == structured == {"path": "/sandbox/home/a.py", "deleted": True}


# --- the HTTP listen address -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("8765", ("127.0.0.1", 8765)),
        ("127.0.0.1:8765", ("127.0.0.1", 8765)),
        ("127.0.0.2:1", ("127.0.0.2", 1)),
        ("localhost:80", ("localhost", 80)),
        ("[::1]:9000", ("::1", 9000)),
        ("0", ("127.0.0.1", 0)),
        ("0.0.0.0:8765", Refused),
        ("192.168.1.10:8765", Refused),
        ("[::]:8765", Refused),
        ("example.com:8765", Refused),
        ("::1:8765", InvalidRequest),
        ("127.0.0.1:http", InvalidRequest),
        ("127.0.0.1:70000", InvalidRequest),
        (":8765", InvalidRequest),
    ],
)
def test_parse_http_address(value: str, expected: tuple[str, int] | type[SandboxError]) -> None:
    if isinstance(expected, tuple):
        assert parse_http_address(value) == expected
    else:
        with pytest.raises(expected) as caught:
            parse_http_address(value)
        if expected is Refused:
            assert "listens on loopback only (127.0.0.1, ::1 or localhost)" in caught.value.message
