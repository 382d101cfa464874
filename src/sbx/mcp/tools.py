"""The tools: each one's arguments and answer as wire types, its description, and the pure mapping to SDK calls.

A tool's input and output JSON Schemas are generated from these Structs (``msgspec.json.schema``), and the
arguments a host sends are read with the project's one strict reader (``sbx.api.codec.convert_request``), so
a wrong argument is ``invalid_request`` with a message naming it, exactly as the HTTP API would say it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from sbx.api.errors import InvalidRequest
from sbx.api.ports import MAX_TOKEN_TTL_SECS

#: The label every sandbox made by an MCP session carries; its value is the session's id.
SESSION_LABEL = "mcp.session"
#: Default of ``run_command``'s ``timeout_secs``, in seconds.
DEFAULT_RUN_TIMEOUT_SECS = 60
#: Longest ``run_command`` timeout, in seconds (anything longer: ``start_process`` and read its output).
MAX_RUN_TIMEOUT_SECS = 3600
#: Longest ``read_process_output`` wait, in seconds.
MAX_WAIT_SECS = 60
#: Most sandboxes one ``list_sandboxes`` answer names (newest first).
MAX_LISTED_SANDBOXES = 100
#: Most entries one ``list_files`` answer names.
MAX_LISTED_ENTRIES = 1000
#: Longest lifetime of an ``expose_port`` token URL, in seconds (the gateway's bound).
MAX_PORT_TOKEN_TTL_SECS = MAX_TOKEN_TTL_SECS

Ref = Annotated[str, Meta(min_length=1, description="The sandbox: its id (sbx_...) or its name.")]
Pid = Annotated[
    int, Meta(ge=1, description="The process handle start_process answered (not the guest's pid).")
]
GuestPath = Annotated[
    str, Meta(min_length=1, description="An absolute path in the sandbox, e.g. /sandbox/home/app.py.")
]
Command = Annotated[
    str,
    Meta(
        min_length=1,
        description="A shell command line, run with /bin/sh -c (pipes, redirections, && work). Give this or "
        "argv, not both.",
    ),
]
Argv = Annotated[
    list[str],
    Meta(min_length=1, description="The program and its arguments, run directly without a shell. Give this "
         "or command, not both."),
]  # fmt: skip
Env = Annotated[dict[str, str], Meta(description="Environment variables, merged over the sandbox's own.")]
Cwd = Annotated[str, Meta(description="Absolute working directory. Default: /sandbox/home.")]
MaxOutput = Annotated[
    int,
    Meta(ge=1, description="Cap of each text field of the answer in bytes; at most the server's cap, which is "
         "also the default."),
]  # fmt: skip


class NetworkArg(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Egress of the sandbox: ``none`` (no network), ``allowlist`` (only the names in allow) or ``open``
    (everything but deny). A mode above the server's ceiling is refused, never narrowed."""

    mode: Annotated[Literal["none", "allowlist", "open"], Meta(description="none, allowlist or open.")]
    allow: (
        Annotated[list[str], Meta(description="Host names or *.domain patterns (allowlist only). Default: the "
              "server's default list.")]
        | UnsetType
    ) = UNSET  # fmt: skip
    deny: (
        Annotated[list[str], Meta(description="Host names or *.domain patterns always refused.")] | UnsetType
    ) = UNSET


# --- arguments ---------------------------------------------------------------------------------------------


class CreateSandboxArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of create_sandbox; every one optional (the server's defaults)."""

    image: Annotated[str, Meta(description="Image reference, e.g. python:3.12. Default: the server's "
                     "default image (Debian with bash, git, python3, node, gcc).")] | UnsetType = UNSET  # fmt: skip
    cpus: Annotated[int, Meta(ge=1, description="vCPUs.")] | UnsetType = UNSET
    memory_mb: Annotated[int, Meta(ge=1, description="Memory in MiB.")] | UnsetType = UNSET
    disk_mb: Annotated[int, Meta(ge=1, description="Disk in MiB.")] | UnsetType = UNSET
    network: NetworkArg | UnsetType = UNSET
    env: Env | UnsetType = UNSET
    name: Annotated[str, Meta(min_length=1, description="A name unique among live sandboxes; usable "
                    "wherever a sandbox is asked for.")] | UnsetType = UNSET  # fmt: skip
    labels: (
        Annotated[dict[str, str], Meta(description="Labels (metadata) besides the session's own.")]
        | UnsetType
    ) = UNSET
    idle_timeout_secs: (
        Annotated[int, Meta(ge=1, description="Seconds without any request or running process before the "
              "sandbox is terminated (suspended if persistent). Default: the MCP server's idle timeout.")]
        | UnsetType
    ) = UNSET  # fmt: skip
    persistent: (
        Annotated[bool, Meta(description="Keep the sandbox beyond this session: when idle it is suspended "
              "instead of terminated, and the next call that needs it wakes it with its files, so it lasts "
              "until terminate_sandbox. Needs name (find it again by it, e.g. in a later session).")]
        | UnsetType
    ) = UNSET  # fmt: skip


class ForkSandboxArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of fork_sandbox."""

    snapshot_id: Annotated[str, Meta(min_length=1, description="The snapshot to start from "
                           "(snapshot_sandbox's answer).")]  # fmt: skip
    name: Annotated[str, Meta(min_length=1, description="A name for the new sandbox.")] | UnsetType = UNSET
    cpus: Annotated[int, Meta(ge=1, description="vCPUs (disk snapshots only; a memory snapshot keeps "
                    "its own).")] | UnsetType = UNSET  # fmt: skip
    memory_mb: Annotated[int, Meta(ge=1, description="Memory in MiB (disk snapshots only).")] | UnsetType = (
        UNSET
    )
    disk_mb: Annotated[int, Meta(ge=1, description="Disk in MiB (disk snapshots only).")] | UnsetType = UNSET
    network: NetworkArg | UnsetType = UNSET
    env: Env | UnsetType = UNSET
    labels: Annotated[dict[str, str], Meta(description="Labels besides the session's own.")] | UnsetType = (
        UNSET
    )
    idle_timeout_secs: Annotated[int, Meta(ge=1, description="As create_sandbox's.")] | UnsetType = UNSET


class ListSandboxesArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of list_sandboxes."""

    scope: Annotated[Literal["session", "all"], Meta(description="session: the sandboxes this MCP session "
                     "made; all: every sandbox the server's key may see.")] = "session"  # fmt: skip
    labels: (
        Annotated[dict[str, str], Meta(description="Only sandboxes carrying all of these labels.")]
        | UnsetType
    ) = UNSET
    include_terminated: Annotated[bool, Meta(description="Also list terminated sandboxes the server still "
                                  "remembers.")] = False  # fmt: skip


class SandboxArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments naming one sandbox."""

    sandbox: Ref


class RunCommandArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of run_command."""

    sandbox: Ref
    command: Command | UnsetType = UNSET
    argv: Argv | UnsetType = UNSET
    cwd: Cwd | UnsetType = UNSET
    env: Env | UnsetType = UNSET
    stdin: Annotated[str, Meta(description="Text fed to the command's stdin, then closed.")] | UnsetType = (
        UNSET
    )
    timeout_secs: Annotated[
        int, Meta(ge=1, le=MAX_RUN_TIMEOUT_SECS, description="Kill the command after this many seconds "
                  "(the answer then has timed_out true and exit_code -1).")
    ] = DEFAULT_RUN_TIMEOUT_SECS  # fmt: skip
    max_output_bytes: MaxOutput | UnsetType = UNSET


class StartProcessArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of start_process."""

    sandbox: Ref
    command: Command | UnsetType = UNSET
    argv: Argv | UnsetType = UNSET
    cwd: Cwd | UnsetType = UNSET
    env: Env | UnsetType = UNSET
    stdin: Annotated[str, Meta(description="Text written to stdin first (stdin stays open: "
                     "write_process_stdin).")] | UnsetType = UNSET  # fmt: skip


class ReadProcessOutputArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of read_process_output."""

    sandbox: Ref
    pid: Pid
    wait_secs: Annotated[
        float, Meta(ge=0, le=MAX_WAIT_SECS, description="Wait up to this many seconds for the process to "
                    "exit before answering (it answers as soon as it exits). 0: answer at once.")
    ] = 0  # fmt: skip
    stdout_offset: (
        Annotated[int, Meta(ge=0, description="Read stdout from this byte offset. Default: where this "
              "session's previous read stopped (0 the first time).")]
        | UnsetType
    ) = UNSET  # fmt: skip
    stderr_offset: Annotated[int, Meta(ge=0, description="As stdout_offset, for stderr.")] | UnsetType = UNSET
    max_output_bytes: MaxOutput | UnsetType = UNSET


class WriteProcessStdinArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of write_process_stdin."""

    sandbox: Ref
    pid: Pid
    data: Annotated[str, Meta(description="Text to write (add \\n for a line).")] = ""
    close: Annotated[bool, Meta(description="Close stdin afterwards (the process reads end of file).")] = (
        False
    )


class SignalProcessArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of signal_process."""

    sandbox: Ref
    pid: Pid
    signal: Annotated[Literal["INT", "TERM", "KILL", "HUP"], Meta(description="The signal.")] = "TERM"


class ReadFileArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of read_file."""

    sandbox: Ref
    path: GuestPath
    offset: Annotated[int, Meta(ge=0, description="Start at this byte (to page through a large file).")] = 0
    max_bytes: MaxOutput | UnsetType = UNSET


class WriteFileArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of write_file."""

    sandbox: Ref
    path: GuestPath
    content: Annotated[str, Meta(description="The whole new content of the file.")]
    encoding: Annotated[Literal["utf-8", "base64"], Meta(description="How content is written: utf-8 text, "
                        "or base64 of binary bytes.")] = "utf-8"  # fmt: skip


class PathArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments naming one path in one sandbox."""

    sandbox: Ref
    path: GuestPath


class SnapshotSandboxArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of snapshot_sandbox."""

    sandbox: Ref
    kind: Annotated[Literal["memory", "disk"], Meta(description="memory: files, memory and running processes "
                    "(a fork resumes them); disk: files only (a fork boots afresh).")] = "memory"  # fmt: skip


class ExposePortArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments of expose_port."""

    sandbox: Ref
    port: Annotated[int, Meta(ge=1, le=65535, description="The TCP port a server in the sandbox listens on.")]
    public: Annotated[bool, Meta(description="true: the port becomes public and the answer is its plain URL, "
                      "which anyone may open, for as long as the sandbox lives; false (default): the port is "
                      "(or becomes again) private and the answer is a token URL that opens it in a browser until "
                      "it expires.")] = False  # fmt: skip
    ttl_secs: (
        Annotated[int, Meta(ge=1, le=MAX_PORT_TOKEN_TTL_SECS, description="How long a private port's token URL "
              "works, in seconds. Default: 3600. Not for a public port (its URL does not expire).")]
        | UnsetType
    ) = UNSET  # fmt: skip


class SnapshotArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Arguments naming one snapshot."""

    snapshot_id: Annotated[str, Meta(min_length=1, description="The snapshot's id.")]


# --- answers -----------------------------------------------------------------------------------------------


class SandboxSummary(msgspec.Struct, kw_only=True):
    """A sandbox as the tools show it; ``persistent``: suspended, not terminated, when idle and left alone at
    the session's end; ``stopped_reason`` only while it is ``stopped``."""

    id: str
    name: str | None
    state: str
    image: str
    cpus: int
    memory_mb: int
    disk_mb: int
    network: dict[str, Any]
    labels: dict[str, str]
    idle_timeout_secs: int
    created_at: str
    this_session: bool
    persistent: bool
    stopped_reason: str | UnsetType = UNSET


class SandboxList(msgspec.Struct, kw_only=True):
    """list_sandboxes' answer: newest first, at most MAX_LISTED_SANDBOXES."""

    sandboxes: list[SandboxSummary]
    total: int
    truncated: bool


class Terminated(msgspec.Struct, kw_only=True):
    """terminate_sandbox's answer."""

    sandbox: str
    terminated: bool


class RunCommandResult(msgspec.Struct, kw_only=True):
    """run_command's answer. stdout and stderr are UTF-8 text (invalid bytes as U+FFFD), each cut to the cap
    keeping its head and tail; the *_truncated flags say a stream is incomplete (cut here, or by the server's
    8 MiB limit) and *_bytes count what the command wrote, as far as the server kept it."""

    exit_code: int
    timed_out: bool
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_bytes: int
    stderr_bytes: int


class ProcessStarted(msgspec.Struct, kw_only=True):
    """start_process' answer."""

    sandbox: str
    pid: int
    argv: list[str]
    state: str


class ProcessOutput(msgspec.Struct, kw_only=True):
    """read_process_output's answer: output since the offsets read from, at most the cap per stream."""

    pid: int
    state: Literal["running", "exited"]
    exit_code: int | None
    stdout: str
    stderr: str
    next_stdout_offset: int
    next_stderr_offset: int
    more: bool
    dropped_bytes: int


class StdinWritten(msgspec.Struct, kw_only=True):
    """write_process_stdin's answer."""

    pid: int
    written_bytes: int
    closed: bool


class Signalled(msgspec.Struct, kw_only=True):
    """signal_process' answer."""

    pid: int
    signal: str


class FileContent(msgspec.Struct, kw_only=True):
    """read_file's answer: content from offset, at most the cap; base64 when the bytes are not UTF-8."""

    path: str
    content: str
    encoding: Literal["utf-8", "base64"]
    offset: int
    bytes: int
    next_offset: int
    truncated: bool


class FileWritten(msgspec.Struct, kw_only=True):
    """write_file's answer."""

    path: str
    bytes: int


class Entry(msgspec.Struct, kw_only=True):
    """One directory entry; size in bytes."""

    name: str
    type: str
    size: int


class Listing(msgspec.Struct, kw_only=True):
    """list_files' answer: entries by name, at most MAX_LISTED_ENTRIES."""

    path: str
    entries: list[Entry]
    total: int
    truncated: bool


class Deleted(msgspec.Struct, kw_only=True):
    """delete_file's answer."""

    path: str
    deleted: bool


class SnapshotSummary(msgspec.Struct, kw_only=True):
    """A snapshot; bytes is the storage it takes."""

    id: str
    sandbox: str
    image: str
    kind: str
    bytes: int
    created_at: str


class SnapshotDeleted(msgspec.Struct, kw_only=True):
    """delete_snapshot's answer."""

    snapshot_id: str
    deleted: bool


class ExposedPort(msgspec.Struct, kw_only=True):
    """expose_port's answer: ``url`` is what to hand to the user; ``expires_at`` only for a token URL."""

    sandbox: str
    port: int
    url: str
    public: bool
    listening: bool
    expires_at: str | None
    note: str


class ErrorDetail(msgspec.Struct, kw_only=True):
    """The error of a failed tool call: the service's code and message (spec: Errors)."""

    code: str
    message: str


class ToolError(msgspec.Struct, kw_only=True):
    """The structured content of a failed tool call: ``{"error": {"code", "message"}}``."""

    error: ErrorDetail


# --- answers as text --------------------------------------------------------------------------------------
#
# A successful call's text content is what most hosts put before their model. For most tools that is the
# answer's JSON; for the tools that carry text (a file, a command's output) it is that text itself, since in
# JSON a source file or a log reaches the model as one line of \n and \" escapes. The metadata stays in the
# structured content, and a short closing note says what the text blocks are.


@dataclass(frozen=True)
class TextBlock:
    """One text block of a successful call's content: the text, and the output stream it carries (``None``:
    not a stream, e.g. a note about the answer)."""

    text: str
    stream: Literal["stdout", "stderr"] | None = None


#: How a tool's answer is shown as text: its blocks, or ``None`` for the answer's JSON (nothing better to show).
TextRenderer = Callable[[Any], list[TextBlock] | None]


def file_text(answer: FileContent) -> list[TextBlock] | None:
    """read_file's text: the file's text exactly, then, only when the file goes on, a note of where to read
    on. A base64 answer has no text to show: its JSON."""
    if answer.encoding != "utf-8":
        return None
    blocks = [TextBlock(answer.content)]
    if answer.truncated:
        # A truncated page holds at least one byte (page() always moves on), so the range is never empty.
        blocks.append(
            TextBlock(
                f"[bytes {answer.offset}-{answer.next_offset - 1} shown; the file goes on: call read_file "
                f"with offset={answer.next_offset} for more]"
            )
        )
    return blocks


def _stream_blocks(stdout: str, stderr: str) -> tuple[list[TextBlock], dict[str, int]]:
    """A block per non-empty stream, stdout first, and the number (from 1) of each stream's block."""
    streams: tuple[tuple[Literal["stdout", "stderr"], str], ...] = (("stdout", stdout), ("stderr", stderr))
    blocks = [TextBlock(text, stream) for stream, text in streams if text]
    return blocks, {str(block.stream): number for number, block in enumerate(blocks, 1)}


def _where(numbers: dict[str, int], stream: str) -> str:
    """Where the status note says ``stream`` is: ``block N``, or ``no block`` when it was empty."""
    return f"block {numbers[stream]}" if stream in numbers else "no block"


def run_text(answer: RunCommandResult) -> list[TextBlock]:
    """run_command's text: stdout exactly, stderr exactly (each only when not empty), then one status line
    with the exit code, a timeout, each stream's size and cut, and which block holds which stream."""
    blocks, numbers = _stream_blocks(answer.stdout, answer.stderr)
    exited = f"exit code {answer.exit_code}"
    status = [f"timed out and killed, {exited}" if answer.timed_out else exited]
    for stream, written, truncated in (
        ("stdout", answer.stdout_bytes, answer.stdout_truncated),
        ("stderr", answer.stderr_bytes, answer.stderr_truncated),
    ):
        cut = ", truncated to its head and tail" if truncated else ""
        status.append(f"{stream}: {written} bytes{cut}, {_where(numbers, stream)}")
    return [*blocks, TextBlock("[" + "; ".join(status) + "]")]


def process_text(answer: ProcessOutput) -> list[TextBlock]:
    """read_process_output's text: the new stdout and stderr exactly (each only when not empty), then one
    status line with the state, the exit code, which block holds which stream, the offsets to read on from,
    and, when so, that more is waiting or that unread bytes were dropped."""
    blocks, numbers = _stream_blocks(answer.stdout, answer.stderr)
    state = f"process {answer.pid} {answer.state}"
    if answer.exit_code is not None:
        state += f", exit code {answer.exit_code}"
    status = [
        state,
        f"stdout: {_where(numbers, 'stdout')}, next_stdout_offset {answer.next_stdout_offset}",
        f"stderr: {_where(numbers, 'stderr')}, next_stderr_offset {answer.next_stderr_offset}",
    ]
    if answer.more:
        status.append("more output is waiting: call read_process_output again")
    if answer.dropped_bytes:
        status.append(f"{answer.dropped_bytes} bytes left the window before they were read (dropped)")
    return [*blocks, TextBlock("[" + "; ".join(status) + "]")]


# --- the catalogue -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolSpec:
    """One tool: name, title, what an agent reads to use it, its argument and answer types, hints, and how
    its answer is shown as text (``None``: as its JSON)."""

    name: str
    title: str
    description: str
    args: type[msgspec.Struct]
    result: type[msgspec.Struct]
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False
    text: TextRenderer | None = None


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "create_sandbox", "Create a sandbox",
        "Create an isolated Linux sandbox (gVisor) and return it. Commands run as an unprivileged user with home "
        "/sandbox/home. The sandbox is labelled with this MCP session, terminated after idle_timeout_secs without "
        "use, and terminated when the session ends unless the server runs with --keep. With persistent true (it "
        "needs a name) it outlives the session instead: suspended when idle, woken with its files by the next "
        "call that needs it, never removed when the session ends; terminate_sandbox removes it. Network is the "
        "server's default unless network is given.",
        CreateSandboxArgs, SandboxSummary,
    ),
    ToolSpec(
        "list_sandboxes", "List sandboxes",
        "List sandboxes, newest first: by default those this MCP session made (scope 'session'), or every "
        "sandbox the server's key may see (scope 'all').",
        ListSandboxesArgs, SandboxList, read_only=True,
    ),
    ToolSpec(
        "terminate_sandbox", "Terminate a sandbox",
        "Terminate a sandbox: its processes stop and its disk is discarded. Terminating one twice is fine.",
        SandboxArgs, Terminated, destructive=True, idempotent=True,
    ),
    ToolSpec(
        "run_command", "Run a command",
        "Run a command in a sandbox to completion and return its exit code, stdout and stderr. Give command (a "
        "shell line) or argv. The text answer is stdout, then stderr, each as it is and only when not empty, "
        "then a status line naming the blocks. Output is cut to the server's cap per stream keeping head and "
        "tail (the status line and the *_truncated flags say so); for long output redirect it to a file and "
        "page it with read_file. A command running past timeout_secs (default 60) is killed: timed_out true, "
        "exit_code -1. For servers and anything longer use start_process.",
        RunCommandArgs, RunCommandResult, text=run_text,
    ),
    ToolSpec(
        "start_process", "Start a background process",
        "Start a command in the background (a server, a watcher, a long build) and return its pid at once. Its "
        "output is collected while it runs: read it with read_process_output, feed it with write_process_stdin, "
        "stop it with signal_process.",
        StartProcessArgs, ProcessStarted,
    ),
    ToolSpec(
        "read_process_output", "Read a background process's output",
        "Return what a background process wrote since this session's last read (or from the given offsets), "
        "its state and exit code: as text, the new stdout, then stderr, then a status line. wait_secs waits "
        "for the process to exit first. Up to the cap per stream: when more is true (the status line says so), "
        "call again. The last 1 MiB per stream is kept; older unread bytes are counted in dropped_bytes.",
        ReadProcessOutputArgs, ProcessOutput, read_only=True, text=process_text,
    ),
    ToolSpec(
        "write_process_stdin", "Write to a background process's stdin",
        "Write text to a background process's stdin; close true closes it afterwards (end of file).",
        WriteProcessStdinArgs, StdinWritten,
    ),
    ToolSpec(
        "signal_process", "Signal a background process",
        "Send INT, TERM (default), KILL or HUP to a background process.",
        SignalProcessArgs, Signalled, destructive=True,
    ),
    ToolSpec(
        "read_file", "Read a file",
        "Read a file from a sandbox: the text answer is the file's UTF-8 text as it is (JSON with base64 content "
        "when the bytes are not UTF-8). At most the cap from offset; when the file goes on (truncated true), a "
        "closing note gives the offset to read on from (next_offset).",
        ReadFileArgs, FileContent, read_only=True, text=file_text,
    ),
    ToolSpec(
        "write_file", "Write a file",
        "Write a whole file in a sandbox (parent directories are created; an existing file is replaced). At "
        "most 64 MiB.",
        WriteFileArgs, FileWritten, destructive=True, idempotent=True,
    ),
    ToolSpec(
        "list_files", "List a directory",
        "List a directory of a sandbox: names, type (file or dir) and size in bytes.",
        PathArgs, Listing, read_only=True,
    ),
    ToolSpec(
        "delete_file", "Delete a file",
        "Delete a file or an empty directory of a sandbox (for a tree, run_command rm -r).",
        PathArgs, Deleted, destructive=True,
    ),
    ToolSpec(
        "expose_port", "Give a URL of a sandbox's port",
        "Return a URL of a TCP port of a sandbox that the user can open in a browser (a dev server, a notebook, a "
        "preview; WebSockets work too), through the gateway's ports domain. With public false (default) the port "
        "stays private and the url is a token URL: it opens that one port, without a key, for whoever holds it, "
        "until expires_at (ttl_secs, default 3600); hand it to the user only. With public true the port becomes "
        "public and the url is its plain URL, open to anyone, not expiring. listening says whether something "
        "listens on the port now: start the server (start_process) before or after, the URL stays the same. "
        "Needs a gateway run with --ports-domain (else unsupported).",
        ExposePortArgs, ExposedPort, idempotent=True,
    ),
    ToolSpec(
        "snapshot_sandbox", "Snapshot a sandbox",
        "Snapshot a running sandbox without stopping it: kind memory (files, memory and processes) or disk "
        "(files only). Start copies of it with fork_sandbox. Snapshots this session takes are deleted when it "
        "ends unless the server runs with --keep.",
        SnapshotSandboxArgs, SnapshotSummary,
    ),
    ToolSpec(
        "fork_sandbox", "Fork a snapshot",
        "Create a new sandbox from a snapshot: from a memory snapshot it resumes where the snapshot was, "
        "processes running; from a disk snapshot it boots afresh with the snapshot's files. Labelled with this "
        "session like create_sandbox's.",
        ForkSandboxArgs, SandboxSummary,
    ),
    ToolSpec(
        "delete_snapshot", "Delete a snapshot",
        "Delete a snapshot and the storage it takes.",
        SnapshotArgs, SnapshotDeleted, destructive=True,
    ),
)  # fmt: skip

TOOLS_BY_NAME: Mapping[str, ToolSpec] = {tool.name: tool for tool in TOOLS}


# --- schemas -----------------------------------------------------------------------------------------------


def json_schema(struct: type[msgspec.Struct]) -> dict[str, Any]:
    """The JSON Schema of ``struct`` as one self-contained object (``$ref`` inlined, titles dropped): what a
    host shows its model, so nothing in it points elsewhere."""
    generated = msgspec.json.schema(struct)
    defs: dict[str, Any] = generated.get("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                target = inline(defs[node["$ref"].rsplit("/", 1)[-1]])
                extra = {k: inline(v) for k, v in node.items() if k not in ("$ref", "$defs")}
                return {**target, **extra}
            return {k: _clean(k, inline(v)) for k, v in node.items() if k not in ("title", "$defs")}
        if isinstance(node, list):
            return [inline(item) for item in node]
        return node

    schema: dict[str, Any] = inline(generated)
    # The tool's description says what the arguments are for; the Struct's docstring is for this code.
    schema.pop("description", None)
    if _forbids_unknown(struct):
        schema["additionalProperties"] = False
    return schema


def _clean(key: str, value: Any) -> Any:
    """A docstring as one line of plain text (no reST quotes) when it is a description."""
    if key == "description" and isinstance(value, str):
        return " ".join(value.replace("``", "").split())
    return value


def _forbids_unknown(struct: type[msgspec.Struct]) -> bool:
    return bool(struct.__struct_config__.forbid_unknown_fields)


# --- pure mapping of arguments -----------------------------------------------------------------------------


def command_argv(command: str | UnsetType, argv: list[str] | UnsetType) -> list[str]:
    """The argv a tool runs: ``command`` through ``/bin/sh -c``, or ``argv`` as it is; exactly one of them."""
    if command is not UNSET and argv is not UNSET:
        raise InvalidRequest("give command (a shell line) or argv (a list), not both")
    if isinstance(command, str):
        return ["/bin/sh", "-c", command]
    if isinstance(argv, list):
        return list(argv)
    raise InvalidRequest(
        'a command is required: give command (e.g. "ls -l | head") or argv (e.g. ["ls", "-l"])'
    )


def create_fields(
    args: CreateSandboxArgs | ForkSandboxArgs, session_id: str, default_idle_secs: int | None
) -> dict[str, Any]:
    """The create request's fields for ``args``: what was given, the session label over the agent's labels,
    and the session's idle timeout unless the agent set one (``None``: the server's default)."""
    fields: dict[str, Any] = {
        name: value
        for name in args.__struct_fields__
        if (value := getattr(args, name)) is not UNSET and name not in ("labels", "network")
    }
    labels = dict(args.labels) if args.labels is not UNSET else {}
    if SESSION_LABEL in labels:
        raise InvalidRequest(
            f"labels: {SESSION_LABEL!r} is set by the MCP server to its session; leave it out"
        )
    labels[SESSION_LABEL] = session_id
    fields["labels"] = labels
    if args.network is not UNSET:
        fields["network"] = msgspec.to_builtins(args.network)
    if args.idle_timeout_secs is UNSET and default_idle_secs is not None:
        fields["idle_timeout_secs"] = default_idle_secs
    return fields


def session_idle_timeout(wanted_secs: int, server_max_secs: int) -> int | None:
    """The idle timeout given to the sandboxes of a session: ``wanted_secs`` within the server's limit
    (``server_max_secs`` 0: no limit), ``None`` to leave it to the server (``wanted_secs`` 0)."""
    if wanted_secs <= 0:
        return None
    if server_max_secs > 0:
        return min(wanted_secs, server_max_secs)
    return wanted_secs


def output_limit(asked: int | UnsetType, cap: int) -> int:
    """The byte cap of one answer: what the agent asked, never above the server's ``cap``."""
    return cap if asked is UNSET else min(int(asked), cap)


def port_note(public: bool, listening: bool, expires_at: str | None) -> str:
    """expose_port's note to the agent: who may open the URL, and whether anything answers on it yet."""
    who = (
        "public: anyone with this URL may open it until the port is made private again or the sandbox ends"
        if public
        else f"private: this token URL opens the port for whoever holds it until {expires_at}; give it to the "
        "user only"
    )
    if listening:
        return who + "."
    return who + "; nothing listens on the port yet: start the server, the URL will then answer."
