"""Wire format of the host <-> sbx-agent channel: frames, messages and the agent's error tree.

Pure functions and frozen dataclasses only (no I/O), so every rule here is testable as a table.
The byte-exact description is docs/agent-protocol.md; agent.c implements the other side.

A frame is ``type u8 | id u32 | length u32 | payload`` (big-endian), ``length`` at most
:data:`MAX_PAYLOAD`. Payload fields are fixed-width big-endian integers, strings as ``u32 length``
then UTF-8 bytes, string lists as ``u32 count`` then strings, and raw data as "the rest of the
payload". Each message class below lists its fields in wire order in ``FIELDS``.

Error tree (every error the agent client raises)::

    sbx.api.errors.Internal         (an agent error that reaches a user unmapped is a 500)
    └── AgentError                  base of everything below
        ├── AgentUnavailable        could not connect or handshake within the timeout
        ├── AgentConnectionLost     the channel closed while a request was in flight
        ├── AgentProtocolError      a malformed frame, or a protocol version the peer lacks
        └── AgentRequestError       the agent refused a request (errno and message)
            ├── SpawnFailed         a process could not be started
            │   └── CommandNotFound the program is missing or not executable
            └── AgentFileError      a file operation failed (errno says why: ENOENT, EACCES, ...)

Backends translate these into the user-facing classes of :mod:`sbx.api.errors` at their edge.
"""

from __future__ import annotations

import errno as errno_mod
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal

from sbx.api.errors import Internal

MAGIC = b"SBXA"
VERSION = 4
"""The protocol version this host speaks: 2 is version 1 plus TCP tunnels, 3 adds QUIESCE, 4 raw tunnel
connections on the agent's tunnel socket (:mod:`sbx.agent.raw_tunnel`)."""
MIN_VERSION = 1
"""The oldest agent protocol the client still talks to (an agent started before an upgrade)."""
HEADER = struct.Struct(">BII")
HEADER_LEN = HEADER.size  # 9
MAX_PAYLOAD = 1 << 20
"""Largest payload either side accepts (bytes); a larger frame ends the connection."""
CHUNK = 64 * 1024
#: Largest TCP_SEND chunk the host sends (the agent sends TCP_DATA of up to as much): fewer, larger frames
#: for tunnels, whose window is larger (docs/agent-protocol.md).
TCP_CHUNK = 256 * 1024
"""Largest data chunk the host puts in one STDIN, WRITE_DATA or TCP_SEND frame (bytes)."""

STDOUT = 0
STDERR = 1
STREAM_NAMES = ("stdout", "stderr")

STAGE_SETUP, STAGE_EXEC, STAGE_CWD, STAGE_CREDS, STAGE_RLIMIT, STAGE_TTY = range(6)
FILE_TYPES = ("file", "dir", "other")


# ---- errors --------------------------------------------------------------------------------


class AgentError(Internal):
    """Base of every error of the agent channel."""


class AgentUnavailable(AgentError):
    """The agent did not accept a connection or a handshake within the timeout."""


class AgentConnectionLost(AgentError):
    """The channel to the agent closed (agent or sandbox gone, or replaced by a newer client)."""


class AgentProtocolError(AgentError):
    """The peer sent something this side cannot parse, or speaks another protocol version."""


class AgentRequestError(AgentError):
    """The agent refused a request; ``errno`` is the guest's errno value."""

    def __init__(self, errno: int, message: str) -> None:
        super().__init__(message)
        self.errno = errno


class SpawnFailed(AgentRequestError):
    """A process could not be started; ``stage`` says which step failed (STAGE_* constants)."""

    def __init__(self, errno: int, message: str, stage: int = STAGE_SETUP) -> None:
        super().__init__(errno, message)
        self.stage = stage


class CommandNotFound(SpawnFailed):
    """The program does not exist or is not executable."""


class AgentFileError(AgentRequestError):
    """A file operation failed inside the sandbox."""


def spawn_error(errno: int, stage: int, message: str) -> SpawnFailed:
    """The exception for a SPAWN_FAILED reply: exec's ENOENT/ENOTDIR/EACCES is 'command not found'."""
    if stage == STAGE_EXEC and errno in (errno_mod.ENOENT, errno_mod.ENOTDIR, errno_mod.EACCES):
        return CommandNotFound(errno, message, stage)
    return SpawnFailed(errno, message, stage)


# ---- field codecs --------------------------------------------------------------------------


class _Reader:
    """Cursor over one payload; every read checks the remaining length."""

    def __init__(self, data: bytes) -> None:
        self.raw = data
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise AgentProtocolError(f"payload truncated: needed {n} bytes at offset {self.pos}")
        out = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return out

    def rest(self) -> bytes:
        if self.pos == 0:  # the whole payload (tunnel data, output): no copy of up to a MiB
            self.pos = len(self.data)
            return self.raw
        return self.take(len(self.data) - self.pos)

    def done(self) -> None:
        if self.pos != len(self.data):
            raise AgentProtocolError(f"{len(self.data) - self.pos} unexpected bytes after the payload")


class _Codec:
    def put(self, value: Any, out: bytearray) -> None:
        raise NotImplementedError

    def get(self, r: _Reader) -> Any:
        raise NotImplementedError


class _Int(_Codec):
    def __init__(self, fmt: str) -> None:
        self.s = struct.Struct(">" + fmt)

    def put(self, value: Any, out: bytearray) -> None:
        try:
            out += self.s.pack(value)
        except struct.error as e:
            raise AgentProtocolError(f"integer {value!r} does not fit its field: {e}") from None

    def get(self, r: _Reader) -> Any:
        return self.s.unpack(r.take(self.s.size))[0]


class _Str(_Codec):
    # surrogateescape: guest file names and arguments need not be UTF-8.
    def put(self, value: Any, out: bytearray) -> None:
        b = value.encode("utf-8", "surrogateescape")
        if b"\0" in b:
            raise AgentProtocolError("strings on the agent channel cannot contain NUL")
        out += struct.pack(">I", len(b)) + b

    def get(self, r: _Reader) -> Any:
        (n,) = struct.unpack(">I", r.take(4))
        return r.take(n).decode("utf-8", "surrogateescape")


class _Strs(_Codec):
    def put(self, value: Any, out: bytearray) -> None:
        out += struct.pack(">I", len(value))
        for s in value:
            STR.put(s, out)

    def get(self, r: _Reader) -> Any:
        (n,) = struct.unpack(">I", r.take(4))
        return tuple(STR.get(r) for _ in range(n))


class _Rest(_Codec):
    """Raw data filling the rest of the payload (must be the last field)."""

    def put(self, value: Any, out: bytearray) -> None:
        out += value

    def get(self, r: _Reader) -> Any:
        return r.rest()


class _Fixed(_Codec):
    def __init__(self, n: int) -> None:
        self.n = n

    def put(self, value: Any, out: bytearray) -> None:
        if len(value) != self.n:
            raise AgentProtocolError(f"field must be exactly {self.n} bytes")
        out += value

    def get(self, r: _Reader) -> Any:
        return r.take(self.n)


class _Optional(_Codec):
    """A trailing field present only in newer protocol versions: None when absent."""

    def __init__(self, inner: _Codec) -> None:
        self.inner = inner

    def put(self, value: Any, out: bytearray) -> None:
        if value is not None:
            self.inner.put(value, out)

    def get(self, r: _Reader) -> Any:
        return self.inner.get(r) if r.pos < len(r.data) else None


class _List(_Codec):
    def __init__(self, item: type[Record]) -> None:
        self.item = item

    def put(self, value: Any, out: bytearray) -> None:
        out += struct.pack(">I", len(value))
        for v in value:
            v.put(out)

    def get(self, r: _Reader) -> Any:
        (n,) = struct.unpack(">I", r.take(4))
        if n > len(r.data):  # each item takes at least a byte: refuse absurd counts early
            raise AgentProtocolError(f"list count {n} exceeds the payload")
        return tuple(self.item.get(r) for _ in range(n))


U8, U16, U32, I32, U64, I64 = _Int("B"), _Int("H"), _Int("I"), _Int("i"), _Int("Q"), _Int("q")
STR, STRS, REST = _Str(), _Strs(), _Rest()


class Record:
    """A struct of fields in wire order, given by ``FIELDS`` (name, codec)."""

    FIELDS: ClassVar[tuple[tuple[str, _Codec], ...]] = ()

    def put(self, out: bytearray) -> None:
        for name, codec in self.FIELDS:
            codec.put(getattr(self, name), out)

    @classmethod
    def get(cls, r: _Reader) -> Any:
        return cls(**{name: codec.get(r) for name, codec in cls.FIELDS})


class Message(Record):
    """A frame's payload; ``TYPE`` is its type byte."""

    TYPE: ClassVar[int] = 0


# ---- messages, host -> agent -----------------------------------------------------------------


@dataclass(frozen=True)
class Hello(Message):
    """First frame of every connection: magic and the protocol version the host speaks."""

    TYPE = 0x01
    FIELDS = (("magic", _Fixed(4)), ("version", U32))
    version: int = VERSION
    magic: bytes = MAGIC


@dataclass(frozen=True)
class ListProcesses(Message):
    """Ask for every process the agent knows (reply: Processes)."""

    TYPE = 0x02


@dataclass(frozen=True)
class Spawn(Message):
    """Start a process. rows=cols=0: three pipes; otherwise one terminal of rows x cols.
    rlimit_nproc / rlimit_nofile: 0 leaves the limit as it is. cwd "" keeps the agent's."""

    TYPE = 0x03
    FIELDS = (
        ("handle", U32), ("uid", U32), ("gid", U32), ("rows", U16), ("cols", U16),
        ("rlimit_nproc", U32), ("rlimit_nofile", U32), ("cwd", STR), ("argv", STRS), ("env", STRS),
    )  # fmt: skip
    handle: int
    uid: int
    gid: int
    rows: int
    cols: int
    rlimit_nproc: int
    rlimit_nofile: int
    cwd: str
    argv: tuple[str, ...]
    env: tuple[str, ...]


@dataclass(frozen=True)
class Resume(Message):
    """Subscribe to a process's output from these offsets (the host has everything before)."""

    TYPE = 0x04
    FIELDS = (("handle", U32), ("stdout_offset", U64), ("stderr_offset", U64))
    handle: int
    stdout_offset: int
    stderr_offset: int


@dataclass(frozen=True)
class Ack(Message):
    """The host durably has output bytes [0, offset) of one stream; no reply."""

    TYPE = 0x05
    FIELDS = (("handle", U32), ("stream", U8), ("offset", U64))
    handle: int
    stream: int
    offset: int


@dataclass(frozen=True)
class Stdin(Message):
    """Stdin bytes starting at stream offset ``offset``; acked by StdinAck, no reply."""

    TYPE = 0x06
    FIELDS = (("handle", U32), ("offset", U64), ("data", REST))
    handle: int
    offset: int
    data: bytes


@dataclass(frozen=True)
class StdinClose(Message):
    """Close stdin once queued bytes are written (a terminal gets ^D)."""

    TYPE = 0x07
    FIELDS = (("handle", U32),)
    handle: int


@dataclass(frozen=True)
class Signal(Message):
    """Send a signal to the process's group."""

    TYPE = 0x08
    FIELDS = (("handle", U32), ("signum", U32))
    handle: int
    signum: int


@dataclass(frozen=True)
class Resize(Message):
    """Set a terminal's size (characters)."""

    TYPE = 0x09
    FIELDS = (("handle", U32), ("rows", U16), ("cols", U16))
    handle: int
    rows: int
    cols: int


@dataclass(frozen=True)
class Forget(Message):
    """Drop an exited process and its retained output."""

    TYPE = 0x0A
    FIELDS = (("handle", U32),)
    handle: int


@dataclass(frozen=True)
class ReadFile(Message):
    """Stream a regular file (reply: ReadOpen, Data..., End, or Error)."""

    TYPE = 0x10
    FIELDS = (("uid", U32), ("gid", U32), ("path", STR))
    uid: int
    gid: int
    path: str


@dataclass(frozen=True)
class ReadAck(Message):
    """The host consumed bytes [0, offset) of the READ with this frame's id; no reply."""

    TYPE = 0x11
    FIELDS = (("offset", U64),)
    offset: int


@dataclass(frozen=True)
class WriteFile(Message):
    """Begin writing a file; WriteData frames with the same id follow, then WriteEnd."""

    TYPE = 0x12
    FIELDS = (("mode", U32), ("uid", U32), ("gid", U32), ("path", STR))
    mode: int
    uid: int
    gid: int
    path: str


@dataclass(frozen=True)
class WriteData(Message):
    """A chunk of the file being written."""

    TYPE = 0x13
    FIELDS = (("data", REST),)
    data: bytes


@dataclass(frozen=True)
class WriteEnd(Message):
    """All data sent: rename into place (reply: Ok or Error)."""

    TYPE = 0x14


@dataclass(frozen=True)
class Remove(Message):
    """Remove a file or an empty directory."""

    TYPE = 0x15
    FIELDS = (("uid", U32), ("gid", U32), ("path", STR))
    uid: int
    gid: int
    path: str


@dataclass(frozen=True)
class ListDir(Message):
    """List a directory (reply: DirEntries..., End, or Error)."""

    TYPE = 0x16
    FIELDS = (("uid", U32), ("gid", U32), ("path", STR))
    uid: int
    gid: int
    path: str


@dataclass(frozen=True)
class Stat(Message):
    """Stat a path, following links (reply: StatOk or Error)."""

    TYPE = 0x17
    FIELDS = (("uid", U32), ("gid", U32), ("path", STR))
    uid: int
    gid: int
    path: str


@dataclass(frozen=True)
class Cancel(Message):
    """Abandon the READ, WRITE or LIST_DIR with this frame's id; no reply."""

    TYPE = 0x18


@dataclass(frozen=True)
class TcpOpen(Message):
    """Connect to 127.0.0.1:port in the guest (reply: Ok or Error); this frame's id names the tunnel."""

    TYPE = 0x20
    FIELDS = (("port", U16),)
    port: int


@dataclass(frozen=True)
class TcpSend(Message):
    """Bytes for the guest socket, in order; acknowledged by TcpSendAck once written, no reply."""

    TYPE = 0x21
    FIELDS = (("data", REST),)
    data: bytes


@dataclass(frozen=True)
class TcpAck(Message):
    """The host consumed the guest's bytes [0, offset) of this tunnel; no reply."""

    TYPE = 0x22
    FIELDS = (("offset", U64),)
    offset: int


@dataclass(frozen=True)
class TcpShutWr(Message):
    """The host's end of data: shutdown(SHUT_WR) in the guest after the queued bytes; no reply."""

    TYPE = 0x23


@dataclass(frozen=True)
class TcpClose(Message):
    """Close the tunnel's guest socket and forget it; no reply."""

    TYPE = 0x24


@dataclass(frozen=True)
class Quiesce(Message):
    """Give up every host socket so the sandbox can be checkpointed (reply: Ok, then the agent closes the
    connection); the agent listens again once the file ``wake_path`` (a guest path) exists."""

    TYPE = 0x30
    FIELDS = (("wake_path", STR),)
    wake_path: str


# ---- messages, agent -> host -----------------------------------------------------------------


@dataclass(frozen=True)
class HelloOk(Message):
    """Handshake accepted; the agent's limits (bytes)."""

    TYPE = 0x81
    FIELDS = (
        ("version", U32), ("pid", U32), ("max_payload", U32),
        ("output_window", U32), ("stdin_window", U32), ("read_window", U32),
        ("tcp_window", _Optional(U32)),
    )  # fmt: skip
    version: int
    pid: int
    max_payload: int
    output_window: int
    stdin_window: int
    read_window: int
    tcp_window: int | None = None
    """Version 2 on: unacknowledged bytes per tunnel and direction. Absent (None) in version 1."""


@dataclass(frozen=True)
class Ok(Message):
    """The request with this id succeeded."""

    TYPE = 0x82


@dataclass(frozen=True)
class Error(Message):
    """The request with this id failed; errno is the guest's."""

    TYPE = 0x83
    FIELDS = (("errno", U32), ("message", STR))
    errno: int
    message: str


@dataclass(frozen=True)
class ProcessInfo(Record):
    """One entry of Processes. exit_code is meaningful only when not running."""

    FIELDS = (
        ("handle", U32), ("pid", U32), ("running", U8), ("tty", U8), ("exit_code", I32),
        ("stdout_bytes", U64), ("stderr_bytes", U64), ("stdin_received", U64), ("stdin_written", U64),
    )  # fmt: skip
    handle: int
    pid: int
    running: int
    tty: int
    exit_code: int
    stdout_bytes: int
    stderr_bytes: int
    stdin_received: int
    stdin_written: int


@dataclass(frozen=True)
class Processes(Message):
    """Reply to ListProcesses."""

    TYPE = 0x84
    FIELDS = (("processes", _List(ProcessInfo)),)
    processes: tuple[ProcessInfo, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class Spawned(Message):
    """The process started; pid is the guest kernel's."""

    TYPE = 0x85
    FIELDS = (("pid", U32),)
    pid: int


@dataclass(frozen=True)
class SpawnFailedMsg(Message):
    """The process could not start; stage is one of STAGE_*."""

    TYPE = 0x86
    FIELDS = (("errno", U32), ("stage", U8), ("message", STR))
    errno: int
    stage: int
    message: str


@dataclass(frozen=True)
class Output(Message):
    """Output bytes of one stream starting at stream offset ``offset``."""

    TYPE = 0x87
    FIELDS = (("handle", U32), ("stream", U8), ("offset", U64), ("data", REST))
    handle: int
    stream: int
    offset: int
    data: bytes


@dataclass(frozen=True)
class Exited(Message):
    """The process exited (code, or 128+signal); every output byte was sent before this."""

    TYPE = 0x88
    FIELDS = (("handle", U32), ("exit_code", I32))
    handle: int
    exit_code: int


@dataclass(frozen=True)
class StdinAck(Message):
    """Stdin bytes [0, offset) were written to the process (or discarded because it is gone)."""

    TYPE = 0x89
    FIELDS = (("handle", U32), ("offset", U64))
    handle: int
    offset: int


@dataclass(frozen=True)
class ReadOpen(Message):
    """The file is open; its size when opened (bytes)."""

    TYPE = 0x8A
    FIELDS = (("size", U64),)
    size: int


@dataclass(frozen=True)
class Data(Message):
    """The next chunk of a READ."""

    TYPE = 0x8B
    FIELDS = (("data", REST),)
    data: bytes


@dataclass(frozen=True)
class End(Message):
    """A READ or LIST_DIR finished."""

    TYPE = 0x8C


@dataclass(frozen=True)
class DirEntry(Record):
    """One directory entry: type is 'file' or 'dir' (links followed); size in bytes, 0 for dirs."""

    FIELDS = (("name", STR), ("kind", U8), ("size", U64))
    name: str
    kind: int
    size: int

    @property
    def type(self) -> Literal["file", "dir"]:
        return "dir" if self.kind == 1 else "file"


@dataclass(frozen=True)
class DirEntries(Message):
    """A batch of entries of a LIST_DIR."""

    TYPE = 0x8D
    FIELDS = (("entries", _List(DirEntry)),)
    entries: tuple[DirEntry, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class StatOk(Message):
    """Reply to Stat: kind 0 file, 1 dir, 2 other; mtime in seconds since the epoch."""

    TYPE = 0x8E
    FIELDS = (("kind", U8), ("size", U64), ("mode", U32), ("uid", U32), ("gid", U32), ("mtime", I64))
    kind: int
    size: int
    mode: int
    uid: int
    gid: int
    mtime: int

    @property
    def type(self) -> str:
        return FILE_TYPES[self.kind] if self.kind < len(FILE_TYPES) else "other"


@dataclass(frozen=True)
class TcpData(Message):
    """The next bytes the guest socket delivered (offsets implied, in order)."""

    TYPE = 0x8F
    FIELDS = (("data", REST),)
    data: bytes


@dataclass(frozen=True)
class TcpSendAck(Message):
    """Bytes [0, offset) of the host's TcpSend data were written to the guest socket."""

    TYPE = 0x90
    FIELDS = (("offset", U64),)
    offset: int


@dataclass(frozen=True)
class TcpEof(Message):
    """The guest shut its side for writing: end of its data (after every TcpData)."""

    TYPE = 0x91


@dataclass(frozen=True)
class TcpClosed(Message):
    """The agent closed the tunnel: errno 0 once both directions ended, else why it failed."""

    TYPE = 0x92
    FIELDS = (("errno", U32), ("message", STR))
    errno: int
    message: str


MESSAGES: dict[int, type[Message]] = {
    m.TYPE: m
    for m in (
        Hello, ListProcesses, Spawn, Resume, Ack, Stdin, StdinClose, Signal, Resize, Forget,
        ReadFile, ReadAck, WriteFile, WriteData, WriteEnd, Remove, ListDir, Stat, Cancel,
        TcpOpen, TcpSend, TcpAck, TcpShutWr, TcpClose, Quiesce,
        HelloOk, Ok, Error, Processes, Spawned, SpawnFailedMsg, Output, Exited, StdinAck,
        ReadOpen, Data, End, DirEntries, StatOk, TcpData, TcpSendAck, TcpEof, TcpClosed,
    )
}  # fmt: skip


def _check_schema() -> None:
    # A FIELDS list out of step with the dataclass would encode garbage silently.
    records: tuple[type[Record], ...] = (*MESSAGES.values(), ProcessInfo, DirEntry)
    for m in records:
        names = [f.name for f in fields(m)]  # type: ignore[arg-type]
        if sorted(names) != sorted(n for n, _ in m.FIELDS):
            raise AssertionError(f"{m.__name__}: FIELDS {m.FIELDS} do not match {names}")


_check_schema()


# ---- frames ------------------------------------------------------------------------------------


def encode(msg: Message, frame_id: int = 0) -> bytes:
    """One frame carrying ``msg``; raises AgentProtocolError if it exceeds MAX_PAYLOAD."""
    out = bytearray(HEADER_LEN)
    msg.put(out)
    n = len(out) - HEADER_LEN
    if n > MAX_PAYLOAD:
        raise AgentProtocolError(f"{type(msg).__name__} payload of {n} bytes exceeds {MAX_PAYLOAD}")
    HEADER.pack_into(out, 0, msg.TYPE, frame_id, n)
    return bytes(out)


def decode(frame_type: int, payload: bytes) -> Message:
    """The message of one frame; raises AgentProtocolError for an unknown type or a bad payload."""
    cls = MESSAGES.get(frame_type)
    if cls is None:
        raise AgentProtocolError(f"unknown frame type 0x{frame_type:02x}")
    r = _Reader(payload)
    msg: Message = cls.get(r)
    r.done()
    return msg


@dataclass(frozen=True)
class Frame:
    """A raw frame as read from the stream."""

    type: int
    id: int
    payload: bytes


class FrameReader:
    """Splits a byte stream into frames; keeps at most one partial frame buffered."""

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self._buf = bytearray()
        self._max = max_payload

    def feed(self, data: bytes) -> Iterator[Frame]:
        """Frames completed by ``data``; raises AgentProtocolError on an oversized frame.

        Each payload is copied once, out of ``data`` itself while nothing is held back (the common case
        for large frames read whole), else out of the held-back bytes with ``data`` appended.
        """
        if self._buf:
            self._buf += data
            source: bytes | bytearray = self._buf
        else:
            source = data
        pos = 0
        try:
            while len(source) - pos >= HEADER_LEN:
                t, fid, n = HEADER.unpack_from(source, pos)
                if n > self._max:
                    raise AgentProtocolError(f"frame of {n} bytes exceeds the maximum of {self._max}")
                if len(source) - pos < HEADER_LEN + n:
                    break
                start = pos + HEADER_LEN
                with memoryview(source) as view:
                    payload = bytes(view[start : start + n])
                yield Frame(t, fid, payload)
                pos = start + n
        finally:
            if source is self._buf:
                del self._buf[:pos]
            else:
                self._buf += memoryview(data)[pos:]

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)
