"""Asyncio client of the in-sandbox agent (sbx-agent), as used by sandboxd.

One :class:`AgentClient` owns one channel to one agent and multiplexes every request over it by
frame id. Process output is delivered to a per-process *sink*; the client acknowledges output to
the agent only after the sink's coroutine returned, so the agent retains (and after a reconnect
resends) exactly what the host has not recorded. The protocol is docs/agent-protocol.md.

Typical use::

    client = await AgentClient.connect(state_dir / "ctl" / "agent.sock", timeout_secs=10)
    pid = await client.spawn(7, ["echo", "hi"], {"PATH": "/usr/bin:/bin"}, "/", 1000, 1000, sink=rec)
    ...
    await client.close()

After sandboxd restarts: ``connect`` again, ``list_processes()``, then ``set_process_sink`` for each
handle with the byte counts the host had recorded; the agent resends from there.

TCP connections to guest loopback (protocol version 2) are :class:`AgentTcpStream` objects from
:meth:`AgentClient.open_tcp`; unlike processes they end with the channel.

The agent runs inside the sandbox, so the client trusts nothing it sends: data past a window the agent
announced (process output, file reads, TCP tunnels) or more process handles than an agent retains is a
protocol error that closes the channel, so a hostile guest can make the host hold at most a window per
stream. At most :data:`MAX_FILE_TRANSFERS` file transfers run at once on a channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as errno_mod
import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Self

from sbx.agent import protocol as p
from sbx.agent import raw_tunnel
from sbx.agent.protocol import (
    AgentConnectionLost,
    AgentError,
    AgentFileError,
    AgentProtocolError,
    AgentRequestError,
    AgentUnavailable,
    CommandNotFound,
    SpawnFailed,
)

__all__ = [
    "AgentClient",
    "AgentConnectionLost",
    "AgentError",
    "AgentFileError",
    "AgentProcess",
    "AgentProtocolError",
    "AgentRequestError",
    "AgentTcpStream",
    "AgentUnavailable",
    "CommandNotFound",
    "DirEntry",
    "FileReader",
    "FileStat",
    "ProcessSink",
    "Rlimits",
    "SpawnFailed",
]

log = logging.getLogger(__name__)

DirEntry = p.DirEntry
_READ_BUFFER = 256 * 1024
#: File transfers (READ, WRITE, LIST_DIR) one channel carries at once; more are refused with EMFILE. Each
#: READ may hold a read window (1 MiB) of data on the host until its caller takes it.
MAX_FILE_TRANSFERS = 64
#: Process handles one channel tracks; an agent naming more (the agent retains at most 4096) is broken or
#: hostile, and its channel is closed.
MAX_HANDLES = 8192
#: FORGETs :meth:`AgentClient.forget_later` holds back at most, to go out with the next frames written; past
#: that they are written on their own. The agent thus retains at most this many exited processes it need not.
MAX_DEFERRED_FORGETS = 64


class ProcessSink(Protocol):
    """Receives one process's output in order; each call is acknowledged once it returns."""

    async def on_output(self, stream: str, data: bytes) -> None:
        """``stream`` is "stdout" or "stderr" (a terminal's output is "stdout")."""

    async def on_exit(self, exit_code: int) -> None:
        """The exit status, or 128+signal; called after the last on_output."""


@dataclass(frozen=True)
class AgentProcess:
    """A process as the agent reports it; byte counts are output produced so far."""

    handle: int
    guest_pid: int
    exit_code: int | None
    stdout_bytes: int
    stderr_bytes: int
    tty: bool


@dataclass(frozen=True)
class Rlimits:
    """Per-process resource limits; 0 leaves the agent's (the sandbox's) limit unchanged."""

    nproc: int = 0
    nofile: int = 0


@dataclass(frozen=True)
class FileStat:
    """Result of :meth:`AgentClient.stat`; type is "file", "dir" or "other"; mtime in epoch secs."""

    type: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime: int


class _Proc:
    """Client-side state of one process handle on this connection."""

    def __init__(self, subscribed: bool) -> None:
        self.subscribed = subscribed  # the agent sends this process's output on this connection
        self.sink: ProcessSink | None = None
        self.events: asyncio.Queue[tuple[int, int, bytes] | None] = asyncio.Queue()
        self.worker: asyncio.Task[None] | None = None
        self.expected = [0, 0]  # next output offset per stream
        self.acked = [0, 0]  # output offset acknowledged to the agent per stream
        self.stdin_sent = 0
        self.stdin_acked = 0
        self.stdin_changed = asyncio.Event()
        self.stdin_lock = asyncio.Lock()


_EXIT = -1  # stream marker of an exit event in _Proc.events


class _Request:
    """One request awaiting its reply; streamed replies (READ, LIST_DIR) go to ``queue``."""

    def __init__(self, streamed: bool) -> None:
        self.future: asyncio.Future[p.Message] = asyncio.get_running_loop().create_future()
        self.queue: asyncio.Queue[p.Message | BaseException] | None = asyncio.Queue() if streamed else None
        #: For a READ: DATA bytes received and acknowledged, and the window between them (0: none).
        self.received = 0
        self.acked = 0
        self.window = 0


class AgentClient:
    """A connection to one sbx-agent. Create with :meth:`connect` or :meth:`from_streams`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._frames = p.FrameReader()
        self._requests: dict[int, _Request] = {}
        self._procs: dict[int, _Proc] = {}
        self._tunnels: dict[int, AgentTcpStream] = {}  # by the id of their TCP_OPEN
        self._transfers: set[int] = set()  # frame ids of the file transfers under way
        self._deferred: list[bytes] = []  # encoded frames that go out with the next ones (forget_later)
        self._next_id = 1
        # Every handle the agent holds is in _procs once list_processes() ran on this connection;
        # only then may spawn pipeline stdin frames (see spawn).
        self._handles_known = False
        self._closed_error: AgentError | None = None
        #: QUIESCE was written: nothing more may be (see :meth:`quiesce`).
        self._quiesced = False
        self.closed = asyncio.Event()
        """Set when the channel is gone (agent exited, sandbox stopped, or a newer client took over)."""
        self.agent_pid = 0
        self.version = 0
        """The protocol version agreed with the agent (1 for an agent without TCP tunnels)."""
        self.max_payload = p.MAX_PAYLOAD
        self.output_window = 0
        self.stdin_window = 64 * 1024
        self.read_window = 64 * 1024
        self.tcp_window = 0
        self.tunnel_socket: Path | None = None
        """Where the agent takes raw tunnel connections (protocol version 4), if it does."""
        self._task: asyncio.Task[None] | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    @classmethod
    async def connect(
        cls, socket_path: Path, timeout_secs: float = 10.0, tunnel_socket: Path | None = None
    ) -> AgentClient:
        """Connect and handshake, retrying every 2 ms while the socket is not there yet.

        ``tunnel_socket`` is where an agent of protocol version 4 takes raw tunnel connections
        (:meth:`open_raw_tcp`); None when it has none. Raises AgentUnavailable after ``timeout_secs``
        (seconds), AgentProtocolError if the agent speaks no protocol version this client knows.
        """
        deadline = time.monotonic() + timeout_secs
        last: Exception | None = None
        while True:
            try:
                reader, writer = await _connect_unix_nofollow(socket_path)
                break
            except (FileNotFoundError, ConnectionRefusedError) as e:
                last = e
            if time.monotonic() >= deadline:
                raise AgentUnavailable(
                    f"the sandbox agent did not accept a connection on {socket_path} within "
                    f"{timeout_secs:g}s ({last}); is the sandbox running?"
                )
            # The socket appears a few ms after runsc returns; a short poll keeps that off create latency.
            await asyncio.sleep(0.002)
        try:
            client = await asyncio.wait_for(
                cls.from_streams(reader, writer), max(0.1, deadline - time.monotonic())
            )
            client.tunnel_socket = tunnel_socket
            return client
        except TimeoutError:
            writer.close()
            raise AgentUnavailable(
                f"the sandbox agent at {socket_path} did not answer the handshake within {timeout_secs:g}s"
            ) from None

    @classmethod
    async def from_streams(cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> AgentClient:
        """Handshake over an already-connected stream (a socketpair, later a virtio port)."""
        client = cls(reader, writer)
        client._task = asyncio.create_task(client._read_loop(), name="agent-client-reader")
        try:
            reply = await client._hello()
        except BaseException:
            await client.close()
            raise
        client.version = reply.version
        client.tcp_window = reply.tcp_window or 0
        client.agent_pid = reply.pid
        client.max_payload = reply.max_payload
        client.output_window = reply.output_window
        client.stdin_window = reply.stdin_window
        client.read_window = reply.read_window
        return client

    async def _hello(self) -> p.HelloOk:
        """Agree on the newest version both sides speak: an agent started before an upgrade of the
        host is older than its client, and refuses the newer version with EPROTONOSUPPORT."""
        version = p.VERSION
        while True:
            try:
                reply = await self._call(p.Hello(version=version))
            except AgentRequestError as e:
                if e.errno != errno_mod.EPROTONOSUPPORT:
                    raise
                if version > p.MIN_VERSION:
                    version -= 1
                    continue
                raise AgentProtocolError(
                    f"the sandbox agent speaks no protocol this host knows: {e.message}"
                ) from None
            if not isinstance(reply, p.HelloOk) or reply.version != version:
                raise AgentProtocolError(f"the sandbox agent answered HELLO version {version} with {reply}")
            if version >= 2 and not reply.tcp_window:
                raise AgentProtocolError("the sandbox agent announced no TCP window in protocol version 2")
            return reply

    async def close(self) -> None:
        """Close the channel; processes in the sandbox keep running, TCP tunnels are closed."""
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._lost(AgentConnectionLost("the agent connection was closed by this host"))

    # ---- processes -----------------------------------------------------------------------

    async def list_processes(self) -> list[AgentProcess]:
        """Every process the agent retains, running or exited and not yet forgotten."""
        reply = await self._call(p.ListProcesses())
        assert isinstance(reply, p.Processes)
        self._handles_known = True
        out = []
        for info in reply.processes:
            st = self._procs.get(info.handle)
            if st is None:  # remember stdin offsets so write_stdin continues where the last host was
                st = self._procs[info.handle] = _Proc(subscribed=False)
                st.stdin_sent, st.stdin_acked = info.stdin_received, info.stdin_written
            out.append(
                AgentProcess(
                    handle=info.handle,
                    guest_pid=info.pid,
                    exit_code=None if info.running else info.exit_code,
                    stdout_bytes=info.stdout_bytes,
                    stderr_bytes=info.stderr_bytes,
                    tty=bool(info.tty),
                )
            )
        return out

    async def spawn(
        self,
        handle: int,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        uid: int,
        gid: int,
        tty: tuple[int, int] | None = None,
        rlimits: Rlimits = Rlimits(),
        sink: ProcessSink | None = None,
        *,
        stdin: bytes = b"",
        close_stdin: bool = False,
    ) -> int:
        """Start ``argv`` (PATH-searched in ``env``) and return the guest pid.

        ``tty`` is (rows, cols) for a terminal; output then arrives as "stdout" only. With ``sink``
        output is delivered from the first byte; otherwise it is held (at most the agent's window)
        until :meth:`set_process_sink`. ``stdin`` is written to the process's input and
        ``close_stdin`` then ends it (a terminal gets ^D), as write_stdin and close_stdin after the
        spawn would, but without waiting for the spawn first: the frames follow SPAWN on the
        channel, so the whole start is one round trip. That needs every handle the agent holds to
        be known (after :meth:`list_processes` on this connection, as sandboxd does on attach),
        since stdin pipelined behind a SPAWN refused for a duplicate handle would reach the other
        process; before that they are sent after SPAWNED. Raises CommandNotFound or SpawnFailed.
        """
        if not argv:
            raise ValueError("argv must name a program")
        if handle in self._procs:
            raise ValueError(f"process handle {handle} is already in use on this connection")
        rows, cols = tty if tty else (0, 0)
        if tty and not (0 < rows < 65536 and 0 < cols < 65536):
            raise ValueError("terminal rows and cols must be between 1 and 65535")
        msg = p.Spawn(
            handle=handle, uid=uid, gid=gid, rows=rows, cols=cols,
            rlimit_nproc=rlimits.nproc, rlimit_nofile=rlimits.nofile,
            cwd=cwd, argv=tuple(argv), env=tuple(f"{k}={v}" for k, v in env.items()),
        )  # fmt: skip
        st = self._procs[handle] = _Proc(subscribed=True)
        if sink is not None:
            self._start_sink(handle, st, sink)
        # A new process's window is empty, so up to a window of stdin needs no acknowledgement.
        ahead = stdin[: self.stdin_window] if self._handles_known else b""
        close_ahead = close_stdin and self._handles_known and len(ahead) == len(stdin)
        fid = close_fid = 0
        try:
            fid, req = self._register(streamed=False)
            frames = [p.encode(msg, fid)]
            for off in range(0, len(ahead), p.CHUNK):
                frames.append(p.encode(p.Stdin(handle, off, ahead[off : off + p.CHUNK])))
            if close_ahead:
                close_fid, close_req = self._register(streamed=False)
                frames.append(p.encode(p.StdinClose(handle), close_fid))
            st.stdin_sent = len(ahead)
            await self._send_bytes(b"".join(frames))
            reply = self._check_reply(msg, await self._await(fid, req))
            if close_ahead:
                self._check_reply(p.StdinClose(handle), await self._await(close_fid, close_req))
        except BaseException:
            # After a refused SPAWN the agent answers the pipelined STDIN_CLOSE with ENOENT and
            # acknowledges the stdin: with the request and the handle gone, both are ignored.
            self._requests.pop(fid, None)
            self._requests.pop(close_fid, None)
            self._drop_proc(handle)
            raise
        assert isinstance(reply, p.Spawned)
        if len(ahead) < len(stdin):
            await self.write_stdin(handle, stdin[len(ahead) :])
        if close_stdin and not close_ahead:
            await self.close_stdin(handle)
        return reply.pid

    async def set_process_sink(
        self, handle: int, sink: ProcessSink, stdout_offset: int = 0, stderr_offset: int = 0
    ) -> None:
        """Deliver the process's output to ``sink`` from these byte offsets on.

        For a process spawned on this connection the offsets must be 0 (nothing is lost: output is
        held until now). For one found by :meth:`list_processes` after a reconnect, pass the bytes
        the host has recorded per stream; the agent resends from there. Raises AgentRequestError
        (ERANGE) if the agent no longer has those bytes.
        """
        st = self._procs.get(handle)
        if st is not None and st.sink is not None:
            raise ValueError(f"process handle {handle} already has a sink")
        if st is None:
            st = self._procs[handle] = _Proc(subscribed=False)
        if st.subscribed:
            if stdout_offset or stderr_offset:
                raise ValueError("a process spawned on this connection is delivered from offset 0")
        else:
            # Set before asking: output follows the agent's OK at once, maybe in the same read.
            st.expected = [stdout_offset, stderr_offset]
            st.acked = [stdout_offset, stderr_offset]
            st.subscribed = True
            try:
                await self._call(p.Resume(handle, stdout_offset, stderr_offset))
            except BaseException:
                st.subscribed = False
                raise
        self._start_sink(handle, st, sink)

    async def write_stdin(self, handle: int, data: bytes) -> None:
        """Queue ``data`` for the process's stdin, waiting while the agent's window is full."""
        st = self._procs.setdefault(handle, _Proc(subscribed=False))
        async with st.stdin_lock:
            view = memoryview(data)
            while view:
                chunk = bytes(view[: p.CHUNK])
                view = view[p.CHUNK :]
                while st.stdin_sent - st.stdin_acked + len(chunk) > self.stdin_window:
                    self._check_open()
                    st.stdin_changed.clear()
                    closed = asyncio.ensure_future(self.closed.wait())
                    try:
                        await asyncio.wait(
                            [asyncio.ensure_future(st.stdin_changed.wait()), closed],
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                    finally:
                        closed.cancel()
                await self._send(p.Stdin(handle, st.stdin_sent, chunk))
                st.stdin_sent += len(chunk)

    async def close_stdin(self, handle: int) -> None:
        """End the process's input after what was written (a terminal gets ^D)."""
        await self._call(p.StdinClose(handle))

    async def signal(self, handle: int, signum: int) -> None:
        """Send ``signum`` to the process's process group."""
        await self._call(p.Signal(handle, signum))

    async def resize(self, handle: int, rows: int, cols: int) -> None:
        """Resize a terminal process's terminal (characters)."""
        await self._call(p.Resize(handle, rows, cols))

    async def quiesce(self, wake_path: str, timeout_secs: float = 10.0) -> None:
        """Have the agent close its listening socket and this connection, so that the sandbox holds no host
        socket and can be checkpointed; it listens again once the guest file ``wake_path`` exists.

        Returns when the connection is closed, after every frame the agent sent before it was read (so
        output records are complete up to the close). Needs protocol version 3.

        Nothing more is written on this connection once QUIESCE is (no ACK, no request: those raise
        AgentConnectionLost). The agent closes the connection right after its answer, and a write that meets
        the closed socket makes asyncio abort the transport at once, dropping what the agent sent and this
        host had not read yet: the answer itself and the output before it.
        """
        if self.version < 3:
            raise AgentProtocolError(
                f"the agent in this sandbox speaks protocol version {self.version}, which cannot quiesce "
                "for a checkpoint; sandboxes started before the upgrade cannot be suspended or snapshotted"
            )
        try:
            await self._call(p.Quiesce(wake_path), last=True)
        except AgentRequestError:
            # Refused: the agent keeps the connection, so writing resumes, with the ACKs held back meanwhile.
            self._quiesced = False
            for handle, st in self._procs.items():
                for stream in (0, 1):
                    if st.sink is not None and st.acked[stream]:
                        self._send_nowait(p.Ack(handle, stream, st.acked[stream]), 0)
            raise
        try:
            await asyncio.wait_for(self.closed.wait(), timeout_secs)
        except TimeoutError:
            raise AgentUnavailable("the sandbox agent did not close its connection after QUIESCE") from None

    async def forget(self, handle: int) -> None:
        """Drop an exited process the host has fully recorded (EBUSY while it runs)."""
        await self._call(p.Forget(handle))
        self._drop_proc(handle)

    def forget_later(self, handle: int) -> None:
        """Drop an exited process the host has fully recorded, without a round trip of its own: its FORGET (id 0,
        so its answer is ignored) goes out in the same write as the next frames, or on its own once
        MAX_DEFERRED_FORGETS wait. Each write wakes the agent and each answer sandboxd, so a run that forgot
        its process on its own cost one more of each. A FORGET a closed connection loses is harmless: the host
        forgets again what the agent still lists at the next connection (sbx.node.processes)."""
        self._drop_proc(handle)
        if self._closed_error is not None or self._quiesced:
            return
        self._deferred.append(p.encode(p.Forget(handle), 0))
        if len(self._deferred) >= MAX_DEFERRED_FORGETS and not self._writer.is_closing():
            self._writer.write(self._take_deferred())

    def _take_deferred(self, frames: bytes = b"") -> bytes:
        """``frames`` with the deferred ones in front (they were asked for first)."""
        if not self._deferred:
            return frames
        frames = b"".join(self._deferred) + frames
        self._deferred.clear()
        return frames

    # ---- files ---------------------------------------------------------------------------

    async def open_read(self, path: str, uid: int, gid: int) -> FileReader:
        """Open a regular file as uid/gid; raises AgentFileError (ENOENT, EACCES, EISDIR, ...; EMFILE when
        MAX_FILE_TRANSFERS are under way). The transfer counts until the reader is done or closed."""
        fid, req = self._register_transfer(path)
        req.window = self.read_window
        try:
            await self._send(p.ReadFile(uid, gid, path), fid)
            first = await self._next(fid, req)
            if isinstance(first, p.Error):
                raise AgentFileError(first.errno, f"{path}: {first.message}")
            if not isinstance(first, p.ReadOpen):
                raise AgentProtocolError(f"unexpected reply {type(first).__name__} to READ")
        except BaseException:
            self._end_transfer(fid)
            raise
        return FileReader(self, fid, req, path, first.size)

    async def read_file(self, path: str, uid: int, gid: int) -> AsyncIterator[bytes]:
        """The file's bytes in chunks; AgentFileError comes before the first chunk if it cannot open."""
        reader = await self.open_read(path, uid, gid)
        try:
            async for chunk in reader:
                yield chunk
        finally:
            await reader.aclose()

    async def write_file(
        self, path: str, chunks: AsyncIterable[bytes], uid: int, gid: int, mode: int = 0o644
    ) -> None:
        """Replace ``path`` atomically with the chunks, creating parents, as uid/gid (mode: permission bits).
        AgentFileError EMFILE when MAX_FILE_TRANSFERS are under way."""
        fid, req = self._register_transfer(path, streamed=False)
        try:
            await self._write_file(fid, req, path, chunks, uid, gid, mode)
        finally:
            self._end_transfer(fid)

    async def _write_file(
        self, fid: int, req: _Request, path: str, chunks: AsyncIterable[bytes], uid: int, gid: int, mode: int
    ) -> None:
        await self._send(p.WriteFile(mode, uid, gid, path), fid)
        try:
            async for chunk in chunks:
                view = memoryview(chunk)
                while view:
                    if req.future.done():  # the agent failed early: stop sending
                        break
                    await self._send(p.WriteData(bytes(view[: p.CHUNK])), fid)
                    view = view[p.CHUNK :]
            if not req.future.done():
                await self._send(p.WriteEnd(), fid)
        except BaseException:
            if not req.future.done() and not self.closed.is_set():
                with contextlib.suppress(AgentError):
                    await self._send(p.Cancel(), fid)
            self._requests.pop(fid, None)
            raise
        self._expect_ok(await self._await(fid, req), path)

    async def remove(self, path: str, uid: int, gid: int) -> None:
        """Remove a file or an empty directory (AgentFileError: ENOENT, ENOTEMPTY, EACCES, ...)."""
        self._expect_ok(await self._call(p.Remove(uid, gid, path), file_path=path), path)

    async def list_dir(self, path: str, uid: int, gid: int) -> list[p.DirEntry]:
        """A directory's entries (not . and ..), links followed for the type. AgentFileError EMFILE when
        MAX_FILE_TRANSFERS are under way."""
        fid, req = self._register_transfer(path)
        try:
            return await self._list_dir(fid, req, path, uid, gid)
        finally:
            self._end_transfer(fid)

    async def _list_dir(self, fid: int, req: _Request, path: str, uid: int, gid: int) -> list[p.DirEntry]:
        await self._send(p.ListDir(uid, gid, path), fid)
        entries: list[p.DirEntry] = []
        while True:
            msg = await self._next(fid, req)
            if isinstance(msg, p.DirEntries):
                entries.extend(msg.entries)
            elif isinstance(msg, p.End):
                self._requests.pop(fid, None)
                return entries
            elif isinstance(msg, p.Error):
                self._requests.pop(fid, None)
                raise AgentFileError(msg.errno, f"{path}: {msg.message}")
            else:
                raise AgentProtocolError(f"unexpected reply {type(msg).__name__} to LIST_DIR")

    async def stat(self, path: str, uid: int, gid: int) -> FileStat:
        """Stat ``path`` following links (AgentFileError ENOENT when it does not exist)."""
        reply = await self._call(p.Stat(uid, gid, path), file_path=path)
        assert isinstance(reply, p.StatOk)
        return FileStat(reply.type, reply.size, reply.mode, reply.uid, reply.gid, reply.mtime)

    # ---- TCP tunnels ---------------------------------------------------------------------

    async def open_tcp(self, port: int, timeout_secs: float = 10.0) -> AgentTcpStream:
        """Connect to 127.0.0.1:``port`` inside the sandbox (guest loopback only).

        Raises AgentRequestError with the guest's errno if the connection fails (ECONNREFUSED when
        nothing listens, ETIMEDOUT after ``timeout_secs`` seconds, ENOSYS from an agent of protocol
        version 1). Any number of tunnels may be open alongside processes and file operations;
        all of them end when the channel does.
        """
        if not 0 < port < 65536:
            raise ValueError(f"port {port} must be from 1 to 65535")
        if self.version < 2:
            self._check_open()
            raise AgentRequestError(
                errno_mod.ENOSYS,
                f"the agent in this sandbox speaks protocol version {self.version}, which has no TCP "
                "tunnels; recreate the sandbox to give it the current agent",
            )
        fid, req = self._register(streamed=False)
        stream = self._tunnels[fid] = AgentTcpStream(self, fid, port, self.tcp_window)
        try:
            await self._send(p.TcpOpen(port), fid)
            try:
                reply = await asyncio.wait_for(req.future, timeout_secs)
            except TimeoutError:
                raise AgentRequestError(
                    errno_mod.ETIMEDOUT, f"no connection within {timeout_secs:g}s (is the server accepting?)"
                ) from None
        except BaseException:
            # The agent may still be connecting: tell it to give up; a late answer is ignored.
            self._tunnels.pop(fid, None)
            self._send_nowait(p.TcpClose(), fid)
            raise
        finally:
            self._requests.pop(fid, None)
        if isinstance(reply, p.Error):
            self._tunnels.pop(fid, None)
            why = reply.message
            if reply.errno == errno_mod.ECONNREFUSED:
                why = "nothing is listening on that port (connection refused)"
            raise AgentRequestError(reply.errno, why)
        if not isinstance(reply, p.Ok):
            raise AgentProtocolError(f"unexpected reply {type(reply).__name__} to TCP_OPEN")
        return stream

    async def open_raw_tcp(self, port: int, timeout_secs: float = 10.0) -> socket.socket | None:
        """Like :meth:`open_tcp`, but a connection of its own on the agent's tunnel socket that carries the
        TCP connection's bytes unframed (:mod:`sbx.agent.raw_tunnel`), for the caller to relay and close.

        None when this agent takes no raw tunnels (protocol version below 4, no tunnel socket, or one that
        was removed inside the sandbox): :meth:`open_tcp` then carries the tunnel. Raises as open_tcp does.
        """
        self._check_open()
        if self.version < raw_tunnel.VERSION or self.tunnel_socket is None:
            return None
        try:
            return await raw_tunnel.open_raw_tcp(self.tunnel_socket, port, timeout_secs)
        except raw_tunnel.NoTunnelSocket as exc:
            log.info("the agent takes no raw tunnels; using a framed one", extra={"reason": str(exc)})
            return None

    # ---- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed_error is not None:
            raise type(self._closed_error)(self._closed_error.message)
        if self._quiesced:
            raise AgentConnectionLost(
                "the sandbox agent is closing this connection for a checkpoint (QUIESCE); reconnect after it"
            )

    def _register(self, streamed: bool) -> tuple[int, _Request]:
        self._check_open()
        while True:
            fid = self._next_id
            self._next_id = self._next_id % 0xFFFFFFFF + 1  # ids 1..2^32-1; 0 is "no reply"
            if fid not in self._requests and fid not in self._tunnels:
                break
        req = self._requests[fid] = _Request(streamed)
        return fid, req

    def _register_transfer(self, path: str, streamed: bool = True) -> tuple[int, _Request]:
        """Register a streamed file request, counted until :meth:`_end_transfer`; EMFILE past the cap."""
        self._check_open()
        if len(self._transfers) >= MAX_FILE_TRANSFERS:
            raise AgentFileError(
                errno_mod.EMFILE,
                f"{path}: {MAX_FILE_TRANSFERS} file transfers are under way in this sandbox; retry when one "
                "has finished",
            )
        fid, req = self._register(streamed)
        self._transfers.add(fid)
        return fid, req

    def _end_transfer(self, fid: int) -> None:
        """The transfer ``fid`` is over (idempotent)."""
        self._transfers.discard(fid)
        self._requests.pop(fid, None)

    async def _send(self, msg: p.Message, frame_id: int = 0, *, last: bool = False) -> None:
        await self._send_bytes(p.encode(msg, frame_id), last=last)

    async def _send_bytes(self, frames: bytes, *, last: bool = False) -> None:
        """Write ``frames`` and wait for the transport; ``last``: nothing may be written after them."""
        self._check_open()
        self._writer.write(self._take_deferred(frames))
        # Set before the first await: no other task may slip a frame in behind these.
        self._quiesced = self._quiesced or last
        try:
            await self._writer.drain()
        except (ConnectionError, OSError) as e:
            self._lost(AgentConnectionLost(f"writing to the sandbox agent failed: {e}"))
            self._check_open()

    def _send_nowait(self, msg: p.Message, frame_id: int) -> None:
        """Queue a small frame without waiting for the transport (acks, closes); no-op once closed."""
        if self._closed_error is None and not self._quiesced and not self._writer.is_closing():
            self._writer.write(self._take_deferred(p.encode(msg, frame_id)))

    async def _await(self, fid: int, req: _Request) -> p.Message:
        try:
            return await req.future
        finally:
            self._requests.pop(fid, None)

    async def _next(self, fid: int, req: _Request) -> p.Message:
        assert req.queue is not None
        item = await req.queue.get()
        if isinstance(item, BaseException):
            self._requests.pop(fid, None)
            raise item
        return item

    async def _call(self, msg: p.Message, file_path: str | None = None, *, last: bool = False) -> p.Message:
        fid, req = self._register(streamed=False)
        try:
            await self._send(msg, fid, last=last)
        except BaseException:
            self._requests.pop(fid, None)
            raise
        return self._check_reply(msg, await self._await(fid, req), file_path)

    @staticmethod
    def _check_reply(msg: p.Message, reply: p.Message, file_path: str | None = None) -> p.Message:
        """``reply`` to ``msg`` unless it is a refusal, which is raised as the matching error."""
        if isinstance(reply, p.Error):
            if file_path is not None:
                raise AgentFileError(reply.errno, f"{file_path}: {reply.message}")
            raise AgentRequestError(reply.errno, f"{type(msg).__name__}: {reply.message}")
        if isinstance(reply, p.SpawnFailedMsg):
            raise p.spawn_error(reply.errno, reply.stage, reply.message)
        return reply

    @staticmethod
    def _expect_ok(reply: p.Message, path: str) -> None:
        if isinstance(reply, p.Error):
            raise AgentFileError(reply.errno, f"{path}: {reply.message}")
        if not isinstance(reply, p.Ok):
            raise AgentProtocolError(f"unexpected reply {type(reply).__name__}")

    def _start_sink(self, handle: int, st: _Proc, sink: ProcessSink) -> None:
        st.sink = sink
        if not st.events.empty():
            self._start_worker(handle, st, sink)

    def _start_worker(self, handle: int, st: _Proc, sink: ProcessSink) -> None:
        # At the first event, not with the sink: a task started only to wait costs a turn of the loop, and a
        # process that prints nothing has a single event, its exit.
        st.worker = asyncio.create_task(self._deliver(handle, st, sink), name=f"agent-sink-{handle}")

    def _queue_event(self, handle: int, st: _Proc, event: tuple[int, int, bytes]) -> None:
        """Queue an output chunk or the exit for the process's sink (started at the first)."""
        st.events.put_nowait(event)
        if st.worker is None and st.sink is not None:
            self._start_worker(handle, st, st.sink)

    def _drop_proc(self, handle: int) -> None:
        st = self._procs.pop(handle, None)
        if st is not None and st.worker is not None:
            st.events.put_nowait(None)

    async def _deliver(self, handle: int, st: _Proc, sink: ProcessSink) -> None:
        """Hands events to the sink in order, acking each output chunk after the sink returned."""
        while True:
            ev = await st.events.get()
            if ev is None:
                return
            stream, value, data = ev
            if stream == _EXIT:
                await sink.on_exit(value)
                return
            await sink.on_output(p.STREAM_NAMES[stream], data)
            st.acked[stream] = value + len(data)
            if not self.closed.is_set() and not self._quiesced:
                with contextlib.suppress(AgentError):
                    await self._send(p.Ack(handle, stream, value + len(data)))

    async def _read_loop(self) -> None:
        error: AgentError = AgentConnectionLost("the sandbox agent closed the connection")
        try:
            while True:
                data = await self._reader.read(_READ_BUFFER)
                if not data:
                    break
                for frame in self._frames.feed(data):
                    self._dispatch(frame)
        except AgentProtocolError as e:
            log.error("agent channel protocol error: %s", e.message)
            error = e
            self._writer.close()
        except (ConnectionError, OSError) as e:
            error = AgentConnectionLost(f"reading from the sandbox agent failed: {e}")
        finally:
            self._lost(error)

    def _dispatch(self, frame: p.Frame) -> None:
        msg = p.decode(frame.type, frame.payload)
        if isinstance(msg, p.Output):
            self._on_output(msg)
        elif isinstance(msg, p.Exited):
            self._queue_event(msg.handle, self._proc_for(msg.handle), (_EXIT, msg.exit_code, b""))
        elif isinstance(msg, (p.TcpData, p.TcpSendAck, p.TcpEof, p.TcpClosed)):
            tunnel = self._tunnels.get(frame.id)
            if tunnel is not None:  # else closed here already: frames in flight are dropped
                tunnel._on_frame(msg)
        elif isinstance(msg, p.StdinAck):
            st = self._procs.get(msg.handle)
            if st is not None and msg.offset > st.stdin_acked:
                st.stdin_acked = msg.offset
                st.stdin_changed.set()
        else:
            req = self._requests.get(frame.id)
            if req is None:
                return  # a late chunk of a cancelled READ or LIST_DIR
            if req.queue is not None:
                if isinstance(msg, p.Data) and req.window:
                    req.received += len(msg.data)
                    if req.received - req.acked > req.window + self.max_payload:
                        raise AgentProtocolError(
                            f"the agent sent more file data than the read window {req.window}"
                        )
                req.queue.put_nowait(msg)
            elif not req.future.done():
                req.future.set_result(msg)

    def _on_output(self, msg: p.Output) -> None:
        if msg.stream > 1:
            raise AgentProtocolError(f"output on unknown stream {msg.stream}")
        st = self._proc_for(msg.handle)
        expected = st.expected[msg.stream]
        data, offset = msg.data, msg.offset
        if offset > expected:
            raise AgentProtocolError(f"output of handle {msg.handle} skips from byte {expected} to {offset}")
        if offset < expected:  # a resend overlapping what we have: keep only the new tail
            data = data[expected - offset :]
            offset = expected
        if data:
            st.expected[msg.stream] = offset + len(data)
            if st.expected[msg.stream] - st.acked[msg.stream] > self.output_window + self.max_payload:
                raise AgentProtocolError(
                    f"the agent sent more output of handle {msg.handle} than the window {self.output_window}"
                )
            self._queue_event(msg.handle, st, (msg.stream, offset, data))

    def _proc_for(self, handle: int) -> _Proc:
        """The state of ``handle``, made when the agent names it first (output after a reconnect)."""
        st = self._procs.get(handle)
        if st is None:
            if len(self._procs) >= MAX_HANDLES:
                raise AgentProtocolError(f"the agent named more than {MAX_HANDLES} process handles")
            st = self._procs[handle] = _Proc(subscribed=True)
        return st

    def _lost(self, error: AgentError) -> None:
        if self._closed_error is not None:
            return
        self._closed_error = error
        self.closed.set()
        for req in self._requests.values():
            if req.queue is not None:
                req.queue.put_nowait(error)
            elif not req.future.done():
                req.future.set_exception(error)
                req.future.exception()  # mark retrieved: nobody may be awaiting it any more
        self._requests.clear()
        for st in self._procs.values():
            st.stdin_changed.set()
            if st.worker is not None:
                st.events.put_nowait(None)  # deliver what arrived, then stop
        tunnels, self._tunnels = self._tunnels, {}
        for tunnel in tunnels.values():  # the agent closes them too: tunnels are not resumable
            tunnel._end(error)


async def _connect_unix_nofollow(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Connect to the unix socket file at ``path`` itself, never to one a symlink there points to: the
    socket lives in a directory the guest can write (docs/backends.md), where root in the guest could plant
    a link to a host socket. The file is opened with O_PATH | O_NOFOLLOW, checked to be a socket, and
    connected to through /proc/self/fd. ConnectionRefusedError when what is there is no socket."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise ConnectionRefusedError(f"{path} is not a socket (it was replaced inside the sandbox)")
        return await asyncio.open_unix_connection(f"/proc/self/fd/{fd}", limit=_READ_BUFFER)
    finally:
        os.close(fd)


class FileReader:
    """An open READ: ``size`` (bytes, when opened) and async iteration over chunks."""

    def __init__(self, client: AgentClient, fid: int, req: _Request, path: str, size: int) -> None:
        self._client = client
        self._fid = fid
        self._req = req
        self._path = path
        self.size = size
        self._consumed = 0
        self._acked = 0
        self._done = False

    def __aiter__(self) -> FileReader:
        return self

    async def __anext__(self) -> bytes:
        if self._done:
            raise StopAsyncIteration
        c = self._client
        # Ack what the caller took since the last call, a quarter window at a time.
        if self._consumed - self._acked >= max(1, c.read_window // 4):
            await c._send(p.ReadAck(self._consumed), self._fid)
            self._acked = self._req.acked = self._consumed
        try:
            msg = await c._next(self._fid, self._req)
        except BaseException:
            self._done = True
            c._end_transfer(self._fid)
            raise
        if isinstance(msg, p.Data):
            self._consumed += len(msg.data)
            return msg.data
        self._done = True
        c._end_transfer(self._fid)
        if isinstance(msg, p.End):
            raise StopAsyncIteration
        if isinstance(msg, p.Error):
            raise AgentFileError(msg.errno, f"{self._path}: {msg.message}")
        raise AgentProtocolError(f"unexpected reply {type(msg).__name__} to READ")

    async def aclose(self) -> None:
        """Stop reading early; the agent closes the file."""
        if self._done:
            return
        self._done = True
        c = self._client
        c._end_transfer(self._fid)
        if not c.closed.is_set():
            with contextlib.suppress(AgentError):
                await c._send(p.Cancel(), self._fid)


def _fresh(e: AgentError) -> AgentError:
    """A new exception like ``e``, to raise again without growing its traceback."""
    if isinstance(e, AgentRequestError):
        return type(e)(e.errno, e.message)
    return type(e)(e.message)


class AgentTcpStream:
    """A TCP connection to 127.0.0.1:``port`` inside the sandbox, from :meth:`AgentClient.open_tcp`.

    Both directions are flow-controlled by the agent's window (``AgentClient.tcp_window`` bytes):
    :meth:`write` waits while that much is unacknowledged, and the agent stops reading the guest
    socket while the host holds that much unread, so neither side buffers more than a window.
    """

    def __init__(self, client: AgentClient, fid: int, port: int, window: int) -> None:
        self._client = client
        self._fid = fid
        self.port = port
        self._window = window
        self._inbox: asyncio.Queue[bytes | AgentError | None] = asyncio.Queue()  # None: end of data
        self._read_end: AgentError | None = None
        self._read_eof = False
        self._received = 0  # guest bytes received from the agent
        self._consumed = 0  # ... handed to the caller
        self._acked = 0  # ... and acknowledged to the agent
        self._sent = 0  # host bytes sent to the agent
        self._send_acked = 0  # ... and written into the guest socket
        self._changed = asyncio.Event()  # acknowledgement or end: wakes a waiting writer
        self._write_lock = asyncio.Lock()
        self._eof_sent = False
        self._ended: AgentError | None = None  # why the tunnel cannot carry more bytes

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def read(self) -> bytes:
        """The next bytes from the guest (at most 64 KiB), b"" at its end of data.

        Raises AgentRequestError (the guest's errno, e.g. ECONNRESET) if the connection failed, or
        AgentConnectionLost if the agent channel went away; bytes that arrived before come first.
        """
        if self._read_eof:
            return b""
        if self._read_end is not None:
            raise _fresh(self._read_end)
        item = await self._inbox.get()
        if isinstance(item, bytes):
            self._consumed += len(item)
            # Acknowledge a quarter window at a time; the agent reads on while less than a window
            # is unacknowledged, so this never stalls it.
            if self._consumed - self._acked >= max(1, self._window // 4) and self._ended is None:
                self._client._send_nowait(p.TcpAck(self._consumed), self._fid)
                self._acked = self._consumed
            return item
        if item is None:
            self._read_eof = True
            return b""
        self._read_end = item
        raise _fresh(item)

    async def write(self, data: bytes) -> None:
        """Send ``data`` to the guest, waiting while a window of bytes is unacknowledged.

        Raises AgentRequestError (EPIPE after :meth:`write_eof` or :meth:`close`, or the guest's
        errno) once the tunnel cannot carry it, AgentConnectionLost if the channel went away.
        """
        c = self._client
        async with self._write_lock:
            if self._eof_sent:
                raise AgentRequestError(errno_mod.EPIPE, "write after write_eof on the tunnel")
            view = memoryview(data)
            step = min(p.TCP_CHUNK, self._window)  # a chunk must fit the window, or it would wait forever
            while view:
                chunk = bytes(view[:step])
                view = view[step:]
                while self._ended is None and self._sent - self._send_acked + len(chunk) > self._window:
                    self._changed.clear()
                    await self._changed.wait()
                if self._ended is not None:
                    raise _fresh(self._ended)
                await c._send(p.TcpSend(chunk), self._fid)
                self._sent += len(chunk)

    async def write_eof(self) -> None:
        """End the host's data: the guest reads end of file after the bytes written before."""
        async with self._write_lock:
            if self._eof_sent:
                return
            if self._ended is not None:
                raise _fresh(self._ended)
            self._eof_sent = True
            await self._client._send(p.TcpShutWr(), self._fid)

    async def close(self) -> None:
        """Close the guest connection (both directions) and free it; idempotent."""
        c = self._client
        if c._tunnels.get(self._fid) is self:
            del c._tunnels[self._fid]
            c._send_nowait(p.TcpClose(), self._fid)
        self._end(AgentRequestError(errno_mod.EPIPE, "the tunnel was closed by this host"), eof=True)

    def _end(self, error: AgentError, eof: bool = False) -> None:
        """No more bytes either way: wake the writer, and the reader after what arrived."""
        if self._ended is None:
            self._ended = error
            self._inbox.put_nowait(None if eof else error)
        self._changed.set()

    def _on_frame(self, msg: p.Message) -> None:
        if isinstance(msg, p.TcpData):
            self._received += len(msg.data)
            if self._received - self._acked > self._window + self._client.max_payload:
                raise AgentProtocolError(f"the agent sent more tunnel data than the window {self._window}")
            self._inbox.put_nowait(msg.data)
        elif isinstance(msg, p.TcpSendAck):
            if msg.offset > self._send_acked:
                self._send_acked = msg.offset
                self._changed.set()
        elif isinstance(msg, p.TcpEof):
            self._inbox.put_nowait(None)
        elif isinstance(msg, p.TcpClosed):
            self._client._tunnels.pop(self._fid, None)
            if msg.errno:
                self._end(AgentRequestError(msg.errno, f"connection to 127.0.0.1:{self.port}: {msg.message}"))
            else:  # both directions had ended; the agent freed the socket
                self._end(AgentRequestError(errno_mod.EPIPE, "the guest connection is closed"), eof=True)
