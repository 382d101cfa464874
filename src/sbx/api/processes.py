"""Wire types of processes (spec: Processes, Process, run result, output stream)."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType

_ARGV_REQUIRED = 'missing command: argv is required, e.g. {"argv": ["ls", "-l"]}'

#: The argv of an interactive login shell in any image: bash when the image has it, else sh (what
#: ``sandbox-cli shell`` and an SSH shell session run).
LOGIN_SHELL: tuple[str, ...] = (
    "/bin/sh", "-c", "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi",
)  # fmt: skip


class RunRequest(msgspec.Struct, kw_only=True):
    """``POST .../run``: ``stdin`` base64; ``timeout_secs`` omitted waits for the exit."""

    required_hints: ClassVar[dict[str, str]] = {"argv": _ARGV_REQUIRED}

    argv: list[str]
    env: dict[str, str] | UnsetType = UNSET
    cwd: str | UnsetType = UNSET
    stdin: bytes | UnsetType = UNSET
    timeout_secs: int | float | UnsetType = UNSET


class ProcessRequest(msgspec.Struct, kw_only=True):
    """``POST .../processes``: as run without ``timeout_secs``; ``tty`` gives a ``rows`` x ``cols`` terminal
    (defaults 24 x 80; rows and cols are accepted only with ``tty: true``)."""

    required_hints: ClassVar[dict[str, str]] = {"argv": _ARGV_REQUIRED}
    removed_fields: ClassVar[dict[str, str]] = {
        "timeout_secs": "timeout_secs applies only to run; a background process runs until it exits or is "
        "signalled"
    }

    argv: list[str]
    env: dict[str, str] | UnsetType = UNSET
    cwd: str | UnsetType = UNSET
    stdin: bytes | UnsetType = UNSET
    tty: bool | UnsetType = UNSET
    rows: int | UnsetType = UNSET
    cols: int | UnsetType = UNSET


class RunResult(msgspec.Struct):
    """The outcome of a run: output (base64 on the wire, bytes here), each stream kept up to 8 MiB
    (``truncated`` when cut); a timed-out run has ``timed_out`` and ``exit_code`` -1."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool


class Process(msgspec.Struct):
    """The spec's Process: ``pid`` is the server's handle; ``exit_code`` null until it exits."""

    pid: int
    argv: list[str]
    state: Literal["running", "exited"]
    exit_code: int | None
    started_at: str


class ProcessList(msgspec.Struct):
    """``GET .../processes``: running and exited ones."""

    processes: list[Process]


class OutputChunk(msgspec.Struct):
    """An output stream line: bytes of one stream (base64 on the wire)."""

    stream: Literal["stdout", "stderr"]
    data: bytes


class OutputExit(msgspec.Struct):
    """The last output stream line; ``truncated`` only when output was dropped before the exit."""

    exit_code: int
    truncated: bool | UnsetType = UNSET


class SignalRequest(msgspec.Struct):
    """``POST .../signal``: ``{signal}``, one of INT, TERM, KILL, HUP."""

    required_hints: ClassVar[dict[str, str]] = {"signal": "signal is required: one of INT, TERM, KILL, HUP"}

    signal: str
