"""Agent channel frames: byte-exact encodings, round trips, and rejection of bad frames."""

from __future__ import annotations

import errno
import struct

import pytest

from sbx.agent import protocol as p

# (message, frame id, exact bytes): the layout docs/agent-protocol.md promises and agent.c parses.
ENCODINGS: list[tuple[p.Message, int, bytes]] = [
    (p.Hello(), 1, b"\x01\x00\x00\x00\x01\x00\x00\x00\x08SBXA\x00\x00\x00\x04"),
    (p.Hello(version=1), 1, b"\x01\x00\x00\x00\x01\x00\x00\x00\x08SBXA\x00\x00\x00\x01"),
    # HELLO_OK of version 1 ends at read_window; version 2 adds tcp_window.
    (
        p.HelloOk(1, 1, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20),
        1,
        b"\x81\x00\x00\x00\x01\x00\x00\x00\x18"
        + struct.pack(">6I", 1, 1, 1 << 20, 1 << 20, 1 << 20, 1 << 20),
    ),
    (
        p.HelloOk(2, 1, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20, 1 << 18),
        1,
        b"\x81\x00\x00\x00\x01\x00\x00\x00\x1c"
        + struct.pack(">7I", 2, 1, 1 << 20, 1 << 20, 1 << 20, 1 << 20, 1 << 18),
    ),
    (p.TcpOpen(8080), 5, b"\x20\x00\x00\x00\x05\x00\x00\x00\x02\x1f\x90"),
    (p.TcpSend(b"GET"), 5, b"\x21\x00\x00\x00\x05\x00\x00\x00\x03GET"),
    (p.TcpAck(65536), 5, b"\x22\x00\x00\x00\x05\x00\x00\x00\x08" + struct.pack(">Q", 65536)),
    (p.TcpShutWr(), 5, b"\x23\x00\x00\x00\x05\x00\x00\x00\x00"),
    (p.Quiesce("/w"), 6, b"\x30\x00\x00\x00\x06\x00\x00\x00\x06\x00\x00\x00\x02/w"),
    (p.TcpClose(), 5, b"\x24\x00\x00\x00\x05\x00\x00\x00\x00"),
    (p.TcpData(b"200"), 5, b"\x8f\x00\x00\x00\x05\x00\x00\x00\x03200"),
    (p.TcpSendAck(3), 5, b"\x90\x00\x00\x00\x05\x00\x00\x00\x08" + struct.pack(">Q", 3)),
    (p.TcpEof(), 5, b"\x91\x00\x00\x00\x05\x00\x00\x00\x00"),
    (
        p.TcpClosed(104, "reset"),
        5,
        b"\x92\x00\x00\x00\x05\x00\x00\x00\x0d\x00\x00\x00\x68\x00\x00\x00\x05reset",
    ),
    (p.ListProcesses(), 7, b"\x02\x00\x00\x00\x07\x00\x00\x00\x00"),
    (
        p.Spawn(5, 1000, 1001, 24, 80, 0, 256, "/tmp", ("ls", "-l"), ("A=b",)),
        2,
        b"\x03\x00\x00\x00\x02\x00\x00\x00\x3b"
        + b"\x00\x00\x00\x05\x00\x00\x03\xe8\x00\x00\x03\xe9\x00\x18\x00\x50\x00\x00\x00\x00\x00\x00\x01\x00"
        + b"\x00\x00\x00\x04/tmp"
        + b"\x00\x00\x00\x02\x00\x00\x00\x02ls\x00\x00\x00\x02-l"
        + b"\x00\x00\x00\x01\x00\x00\x00\x03A=b",
    ),
    (p.Resume(9, 1, 2), 3, b"\x04\x00\x00\x00\x03\x00\x00\x00\x14" + struct.pack(">IQQ", 9, 1, 2)),
    (p.Ack(9, 1, 65536), 0, b"\x05\x00\x00\x00\x00\x00\x00\x00\x0d" + struct.pack(">IBQ", 9, 1, 65536)),
    (p.Stdin(9, 10, b"xy"), 0, b"\x06\x00\x00\x00\x00\x00\x00\x00\x0e" + struct.pack(">IQ", 9, 10) + b"xy"),
    (p.Signal(9, 15), 4, b"\x08\x00\x00\x00\x04\x00\x00\x00\x08\x00\x00\x00\x09\x00\x00\x00\x0f"),
    (p.Resize(9, 50, 132), 4, b"\x09\x00\x00\x00\x04\x00\x00\x00\x08\x00\x00\x00\x09\x00\x32\x00\x84"),
    (
        p.WriteFile(0o644, 0, 0, "/a"),
        6,
        b"\x12\x00\x00\x00\x06\x00\x00\x00\x12" + struct.pack(">III", 0o644, 0, 0) + b"\x00\x00\x00\x02/a",
    ),
    (p.Cancel(), 6, b"\x18\x00\x00\x00\x06\x00\x00\x00\x00"),
    (p.Error(2, "no"), 6, b"\x83\x00\x00\x00\x06\x00\x00\x00\x0a\x00\x00\x00\x02\x00\x00\x00\x02no"),
    (p.Exited(3, 137), 0, b"\x88\x00\x00\x00\x00\x00\x00\x00\x08\x00\x00\x00\x03\x00\x00\x00\x89"),
    (
        p.Output(3, 0, 5, b"hi"),
        0,
        b"\x87\x00\x00\x00\x00\x00\x00\x00\x0f" + struct.pack(">IBQ", 3, 0, 5) + b"hi",
    ),
    (
        p.DirEntries((p.DirEntry("a", 1, 0),)),
        8,
        b"\x8d\x00\x00\x00\x08\x00\x00\x00\x12\x00\x00\x00\x01\x00\x00\x00\x01a\x01" + b"\x00" * 8,
    ),
]


@pytest.mark.parametrize(("msg", "fid", "wire"), ENCODINGS, ids=lambda v: type(v).__name__)
def test_exact_encoding(msg: p.Message, fid: int, wire: bytes) -> None:
    assert p.encode(msg, fid) == wire
    (frame,) = p.FrameReader().feed(wire)
    assert (frame.type, frame.id) == (msg.TYPE, fid)
    assert p.decode(frame.type, frame.payload) == msg


ROUND_TRIPS: list[p.Message] = [
    p.StdinClose(1),
    p.Forget(2),
    p.ReadFile(1, 2, "/x/é"),
    p.ReadAck(1 << 40),
    p.WriteData(b"\0\1\2"),
    p.WriteEnd(),
    p.Remove(0, 0, "/r"),
    p.ListDir(0, 0, "/"),
    p.Stat(65534, 65534, "/s"),
    p.HelloOk(1, 1, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20),
    p.HelloOk(2, 1, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20, 1 << 18),
    p.TcpOpen(65535),
    p.TcpSend(b""),
    p.TcpData(b"\0" * 10),
    p.TcpClosed(0, ""),
    p.Ok(),
    p.Processes((p.ProcessInfo(1, 2, 0, 1, 143, 10, 20, 30, 25),)),
    p.Processes(()),
    p.Spawned(42),
    p.SpawnFailedMsg(2, p.STAGE_EXEC, "missing"),
    p.StdinAck(1, 99),
    p.ReadOpen(0),
    p.Data(b"chunk"),
    p.End(),
    p.StatOk(1, 4096, 0o40755, 0, 0, 1_700_000_000),
    p.Spawn(1, 0, 0, 0, 0, 0, 0, "", ("a\udcff",), ()),  # non-UTF-8 argv survives
]


@pytest.mark.parametrize("msg", ROUND_TRIPS, ids=lambda m: type(m).__name__)
def test_round_trip(msg: p.Message) -> None:
    wire = p.encode(msg, 77)
    (frame,) = p.FrameReader().feed(wire)
    assert frame.id == 77
    assert p.decode(frame.type, frame.payload) == msg


def test_every_message_type_is_distinct_and_directional() -> None:
    types = [m.TYPE for m in p.MESSAGES.values()]
    assert len(types) == len(set(types))
    host_to_agent = [t for t in types if t < 0x80]
    agent_to_host = [t for t in types if t >= 0x80]
    assert len(host_to_agent) == 25 and len(agent_to_host) == 18


def test_frames_split_anywhere_reassemble() -> None:
    wire = b"".join(p.encode(m, i) for i, m in enumerate(ROUND_TRIPS))
    for step in (1, 2, 7, 9, 1000):
        reader = p.FrameReader()
        got: list[p.Frame] = []
        for i in range(0, len(wire), step):
            got.extend(reader.feed(wire[i : i + step]))
        assert [p.decode(f.type, f.payload) for f in got] == ROUND_TRIPS
        assert reader.pending == 0


BAD_PAYLOADS: list[tuple[str, int, bytes, str]] = [
    ("unknown type", 0x7F, b"", "unknown frame type"),
    ("truncated int", p.Spawned.TYPE, b"\x00\x00", "truncated"),
    ("trailing bytes", p.Spawned.TYPE, b"\x00\x00\x00\x01\x00", "unexpected bytes"),
    ("string longer than payload", p.Error.TYPE, b"\x00\x00\x00\x01\xff\xff\xff\xff", "truncated"),
    ("list count absurd", p.Processes.TYPE, b"\xff\xff\xff\xff", "exceeds the payload"),
    (
        "list items missing",
        p.DirEntries.TYPE,
        b"\x00\x00\x00\x02\x00\x00\x00\x00\x00" + b"\0" * 8,
        "truncated",
    ),
    ("empty where fields are due", p.Exited.TYPE, b"", "truncated"),
    ("half a tcp_window", p.HelloOk.TYPE, b"\0" * 24 + b"\0\0", "truncated"),
    ("more than HELLO_OK has", p.HelloOk.TYPE, b"\0" * 32, "unexpected bytes"),
    ("port wider than u16", p.TcpOpen.TYPE, b"\0\0\x1f\x90", "unexpected bytes"),
]


@pytest.mark.parametrize(("name", "ftype", "payload", "why"), BAD_PAYLOADS, ids=lambda v: str(v))
def test_bad_payload_is_a_protocol_error(name: str, ftype: int, payload: bytes, why: str) -> None:
    with pytest.raises(p.AgentProtocolError, match=why):
        p.decode(ftype, payload)


def test_oversized_frame_is_rejected_before_buffering_it() -> None:
    header = p.HEADER.pack(p.Data.TYPE, 1, p.MAX_PAYLOAD + 1)
    with pytest.raises(p.AgentProtocolError, match="exceeds the maximum"):
        list(p.FrameReader().feed(header))


def test_encoding_refuses_what_the_agent_would_reject() -> None:
    with pytest.raises(p.AgentProtocolError, match="NUL"):
        p.encode(p.Stat(0, 0, "/a\0b"))
    with pytest.raises(p.AgentProtocolError, match="exceeds"):
        p.encode(p.Data(b"x" * (p.MAX_PAYLOAD + 1)))
    with pytest.raises(p.AgentProtocolError, match="does not fit"):
        p.encode(p.Signal(-1, 9))
    with pytest.raises(p.AgentProtocolError, match="does not fit"):
        p.encode(p.TcpOpen(65536))


@pytest.mark.parametrize(
    ("err", "stage", "cls"),
    [
        (errno.ENOENT, p.STAGE_EXEC, p.CommandNotFound),
        (errno.ENOTDIR, p.STAGE_EXEC, p.CommandNotFound),
        (errno.EACCES, p.STAGE_EXEC, p.CommandNotFound),
        (errno.ENOEXEC, p.STAGE_EXEC, p.SpawnFailed),
        (errno.ENOENT, p.STAGE_CWD, p.SpawnFailed),
        (errno.EPERM, p.STAGE_CREDS, p.SpawnFailed),
    ],
)
def test_spawn_error_classes(err: int, stage: int, cls: type[p.SpawnFailed]) -> None:
    e = p.spawn_error(err, stage, "m")
    assert type(e) is cls and e.errno == err and e.stage == stage
    assert isinstance(e, p.AgentError)
