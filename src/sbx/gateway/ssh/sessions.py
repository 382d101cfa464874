"""Shell and command sessions: an SSH session channel run as a process in the sandbox.

Each session starts one process through the node's API (``POST .../processes``, on a terminal when the client
asked for a PTY) and attaches to it (``sbx-stream/1``): the channel's bytes become ``i`` frames, its EOF an
``e`` frame, window changes ``r`` frames and the client's INT, TERM, KILL or HUP signal requests ``s`` frames;
the process's ``o`` and ``E`` frames become the channel's stdout and stderr, and its ``x`` frame the exit status
(as the node reports it: a process killed by signal N exits 128+N; a negative code, which the frame format
allows for a death by signal, is reported as that signal).

- A shell is a login shell, bash when the image has it, else sh (what ``sandbox-cli shell`` runs).
- ``ssh host COMMAND`` runs ``bash -c COMMAND`` (sh when there is no bash), as sshd runs the user's shell.
- Of the client's environment only names a locale or a terminal needs are passed on
  (:data:`SAFE_ENV_NAMES`); the rest is dropped (a client may not steer the sandbox's start-up, loader or shell).
- A session whose client goes away (or whose connection revocation closes) hangs its process up: ``HUP``
  through the node's API, as a terminal that closes does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING

import asyncssh

from sbx.api import frames
from sbx.api.errors import InvalidRequest, SandboxError
from sbx.api.processes import LOGIN_SHELL, ProcessRequest
from sbx.api.validation import TTY_MAX, TTY_MIN

if TYPE_CHECKING:
    from sbx.gateway.nodes import Node
    from sbx.gateway.ssh.server import SshConnection

log = logging.getLogger(__name__)

#: Environment names a client may set (``SendEnv``): the locale, the time zone, the terminal's colours.
SAFE_ENV_NAMES = re.compile(r"^(?:LANG|LANGUAGE|LC_[A-Z]+|TZ|COLORTERM)$")
#: What ``ssh host COMMAND`` runs: COMMAND through bash when the image has it, else sh (as sshd runs it
#: through the user's shell).
COMMAND_SHELL = (
    "/bin/sh", "-c", 'if command -v bash >/dev/null 2>&1; then exec bash -c "$1"; else exec sh -c "$1"; fi', "sh",
)  # fmt: skip
_TERM = re.compile(r"^[A-Za-z0-9._+-]{1,64}$")
_MAX_ENV_VALUE = 256
#: Exit status reported when the session could not run its process (as ssh reports its own failures).
FAILED_STATUS = 255
#: Attach streams one session opens at most (the first, then again when one ends without the exit frame).
ATTACH_ATTEMPTS = 3
#: Seconds a hang-up may take (the node is asked to send HUP).
HANGUP_TIMEOUT_SECS = 5.0
_READ_BYTES = 64 * 1024


def safe_env(env: Mapping[str, str]) -> dict[str, str]:
    """The client's environment requests that are passed on: locale and terminal names with short, printable
    values; everything else is dropped."""
    return {
        name: value for name, value in env.items()
        if SAFE_ENV_NAMES.match(name) and len(value) <= _MAX_ENV_VALUE and value.isprintable()
    }  # fmt: skip


def process_request(
    command: str | None, term_type: str | None, term_size: tuple[int, int], env: Mapping[str, str]
) -> ProcessRequest:
    """The process a session runs: a login shell or COMMAND, on a terminal of ``term_size`` (cols, rows) when
    the client asked for one."""
    argv = list(LOGIN_SHELL) if command is None else [*COMMAND_SHELL, command]
    wanted = safe_env(env)
    if term_type is None:
        return ProcessRequest(argv=argv, env=wanted)
    wanted["TERM"] = term_type if _TERM.match(term_type) else "xterm-256color"
    cols, rows = (_size(term_size[0], 80), _size(term_size[1], 24))
    return ProcessRequest(argv=argv, env=wanted, tty=True, rows=rows, cols=cols)


def _size(value: int, default: int) -> int:
    """A terminal dimension the node accepts (a client may send 0 for "unknown")."""
    return min(max(value, TTY_MIN), TTY_MAX) if value else default


class Session:
    """One session channel (shell or command) and the process it runs in the sandbox."""

    def __init__(self, conn: SshConnection, process: asyncssh.SSHServerProcess[bytes]) -> None:
        self.conn = conn
        self.process = process
        #: The node and the process's handle there, once started.
        self.node: Node | None = None
        self.pid: int | None = None
        self.exited = False
        #: Output bytes passed on to the client so far, by frame type (``o``, ``E``).
        self._sent = {frames.STDOUT: 0, frames.STDERR: 0}

    @property
    def kind(self) -> str:
        """``shell`` or ``exec`` (the audit log's session field)."""
        return "shell" if self.process.command is None else "exec"

    async def run(self) -> None:
        """Serve the channel until the process exits or the client goes away."""
        process = self.process
        if process.subsystem is not None:
            process.stderr.write(
                f"the subsystem {process.subsystem[:64]!r} is not offered here; only sftp\r\n".encode()
            )
            process.exit(1)
            return
        login = self.conn.login
        assert login is not None
        request = process_request(process.command, process.term_type, process.term_size[:2], process.env)
        try:
            self.node = self.conn.server.nodes.node_for(login.sandbox.node, f"sandbox {login.sandbox.id}")
            started = await self.node.client.start_process(login.sandbox.id, request)
        except SandboxError as exc:
            self._fail(f"cannot start a process in {login.sandbox.id}: {exc.message}")
            return
        self.pid = started.pid
        log.debug("SSH session started its process", extra={"sandbox": login.sandbox.id, "pid": started.pid})
        self.conn.audit_session(self.kind)
        try:
            await self._relay(login.sandbox.id, started.pid)
        finally:
            if not self.exited:
                await self.hangup()

    async def _relay(self, sandbox_id: str, pid: int) -> None:
        """Attach and pump until the exit frame, or the client goes away. A stream that ends without the exit
        frame (the node closed it and our next write to it, an EOF from the client, failed with EPIPE: asyncio
        then drops what was still unread) is attached again, skipping the output already passed on: the node
        replays a process's output from its start."""
        assert self.node is not None
        for attempt in range(ATTACH_ATTEMPTS):
            try:
                reader, writer = await self.node.client.attach(sandbox_id, pid)
            except SandboxError as exc:
                self._fail(f"cannot attach to the process in {sandbox_id}: {exc.message}")
                return
            try:
                exit_code, client_gone = await self._pump(reader, writer)
            finally:
                writer.close()
            if client_gone:
                return
            if exit_code is not None:
                self._finish(exit_code)
                return
            log.info("an SSH session's attach stream ended early; attaching again",
                     extra={"sandbox": sandbox_id, "pid": pid, "attempt": attempt + 1})  # fmt: skip
        self._finish(None)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[int | None, bool]:
        """One attach stream: (the exit code or None, whether the client went away)."""
        output = asyncio.create_task(self._output(reader))
        keys = asyncio.create_task(self._input(writer))
        closed = asyncio.create_task(self.process.channel.wait_closed())
        try:
            await asyncio.wait({output, closed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (output, keys, closed):
                task.cancel()
            await asyncio.gather(output, keys, closed, return_exceptions=True)
        if output.cancelled():
            return None, True
        failure = output.exception()
        if failure is not None:
            if not isinstance(failure, OSError):  # a bug: say so, and end the session rather than hang it
                log.error("an SSH session's output failed", exc_info=failure)
            return None, self.process.channel.is_closing()
        return output.result(), False

    async def _output(self, reader: asyncio.StreamReader) -> int | None:
        """The process's frames to the channel (skipping what an earlier stream passed on); its exit code, or
        None when the node's stream ended without."""
        decoder = frames.FrameDecoder(frames.SERVER_TYPES)
        skip = dict(self._sent)
        writers = {frames.STDOUT: self.process.stdout, frames.STDERR: self.process.stderr}
        while data := await reader.read(_READ_BYTES):
            try:
                received = decoder.feed(data)
            except InvalidRequest:
                return None
            for frame in received:
                if frame.type == frames.EXIT:
                    self.exited = True
                    return frames.decode_exit(frame.payload)
                payload = frame.payload
                if skip[frame.type]:
                    cut = min(skip[frame.type], len(payload))
                    skip[frame.type] -= cut
                    payload = payload[cut:]
                if payload:
                    writers[frame.type].write(payload)
                    self._sent[frame.type] += len(payload)
            await self.process.stdout.drain()
        return None

    async def _input(self, writer: asyncio.StreamWriter) -> None:
        """The channel's bytes, EOF, window changes and signals to the process."""
        stdin = self.process.stdin
        while True:
            try:
                data = await stdin.read(_READ_BYTES)
            except asyncssh.TerminalSizeChanged as change:
                writer.write(frames.resize_frame(_size(change.height, 24), _size(change.width, 80)))
                continue
            except asyncssh.SignalReceived as received:
                if received.signal in frames.SIGNALS:
                    writer.write(frames.signal_frame(received.signal))
                continue
            except asyncssh.BreakReceived:
                continue
            if not data:
                writer.write(frames.encode_frame(frames.END_OF_INPUT))
                await writer.drain()
                return
            writer.write(frames.encode_chunks(frames.STDIN, data))
            await writer.drain()

    async def refuse(self, message: str) -> None:
        """End the channel at once with ``message`` (no process is started)."""
        self._fail(message)

    def _finish(self, exit_code: int | None) -> None:
        log.debug("SSH session's process ended", extra={"pid": self.pid, "exit_code": exit_code})
        process = self.process
        if exit_code is None:
            self._fail("the connection to the sandbox's node was lost; the process may still run")
        elif exit_code >= 0:
            process.exit(exit_code)
        else:
            try:
                name = signal.Signals(-exit_code).name.removeprefix("SIG")
            except ValueError:
                process.exit(128 - exit_code)
                return
            process.exit_with_signal(name)

    def _fail(self, message: str) -> None:
        with contextlib.suppress(OSError, asyncssh.Error):
            self.process.stderr.write(f"sbx: {message}\r\n".encode())
            self.process.exit(FAILED_STATUS)

    async def hangup(self) -> None:
        """HUP the process (it runs on as long as it likes after its client went away otherwise)."""
        if self.node is None or self.pid is None or self.exited:
            return
        login = self.conn.login
        assert login is not None
        try:
            await self.node.client.signal(login.sandbox.id, self.pid, "HUP", HANGUP_TIMEOUT_SECS)
        except SandboxError as exc:  # exited meanwhile (409/404), or the node is gone
            log.info("could not hang up an SSH session's process", extra={"error": exc.message})
        self.exited = True
