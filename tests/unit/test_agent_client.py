"""AgentClient against a scripted agent on a socketpair: what goes on the wire, and when.

The real agent's behaviour is tested in test_agent_host.py; here the test plays the agent, so it can
see whether frames arrive before it answers.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from sbx.agent import protocol as p
from sbx.agent.client import (
    MAX_DEFERRED_FORGETS,
    MAX_FILE_TRANSFERS,
    MAX_HANDLES,
    AgentClient,
    AgentConnectionLost,
    AgentFileError,
    AgentProtocolError,
    AgentRequestError,
    AgentTcpStream,
    AgentUnavailable,
    CommandNotFound,
    FileReader,
)

ENV = {"PATH": "/bin"}
QUIET_SECS = 0.1  # how long the fake agent listens for frames that should not come
TCP_WINDOW = 4 * p.TCP_CHUNK  # what the agent announces: 1 MiB


@dataclass
class FakeAgent:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    frames: p.FrameReader

    async def recv(self, timeout_secs: float = 5.0) -> list[tuple[p.Message, int]]:
        """The frames of the next read (at least one), decoded with their ids."""
        data = await asyncio.wait_for(self.reader.read(1 << 20), timeout_secs)
        assert data, "the client closed the channel"
        return [(p.decode(f.type, f.payload), f.id) for f in self.frames.feed(data)]

    async def recv_all(self) -> list[tuple[p.Message, int]]:
        """Every frame that arrives until the channel is quiet for QUIET_SECS."""
        out: list[tuple[p.Message, int]] = []
        while True:
            try:
                out += await self.recv(QUIET_SECS)
            except TimeoutError:
                return out

    def send(self, msg: p.Message, frame_id: int = 0) -> None:
        self.writer.write(p.encode(msg, frame_id))

    def answer(self, msg: p.Message, frame_id: int) -> None:
        """Reply as an agent that accepts every stdin byte and close."""
        if isinstance(msg, p.Stdin):
            self.send(p.StdinAck(msg.handle, msg.offset + len(msg.data)))
        elif isinstance(msg, p.StdinClose):
            self.send(p.Ok(), frame_id)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[AgentClient, FakeAgent]]:
    a, b = socket.socketpair()
    fake = FakeAgent(*await asyncio.open_connection(sock=b), p.FrameReader())
    reader, writer = await asyncio.open_connection(sock=a)
    connecting = asyncio.create_task(AgentClient.from_streams(reader, writer))
    [(hello, hid)] = await fake.recv()
    assert isinstance(hello, p.Hello)
    fake.send(p.HelloOk(p.VERSION, 1, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20, TCP_WINDOW), hid)
    client = await connecting
    yield client, fake
    await client.close()
    fake.writer.close()


async def _list(client: AgentClient, fake: FakeAgent) -> None:
    listing = asyncio.create_task(client.list_processes())
    [(msg, lid)] = await fake.recv()
    assert isinstance(msg, p.ListProcesses)
    fake.send(p.Processes(()), lid)
    assert await listing == []


def _types(frames: list[tuple[p.Message, int]]) -> list[str]:
    return [type(m).__name__ for m, _ in frames]


@pytest.mark.parametrize(
    ("listed", "stdin", "close", "before", "after"),
    [
        # Every agent handle known: stdin and its close ride behind SPAWN, one round trip.
        (True, b"hi", True, ["Spawn", "Stdin", "StdinClose"], []),
        (True, b"", True, ["Spawn", "StdinClose"], []),
        (True, b"hi", False, ["Spawn", "Stdin"], []),
        (True, b"", False, ["Spawn"], []),
        # More than a window: the first window goes ahead, the rest and the close after SPAWNED.
        (True, b"x" * (p.CHUNK * 16 + 1), True, ["Spawn"] + ["Stdin"] * 16, ["Stdin", "StdinClose"]),
        # Handles not listed on this connection: a SPAWN refused as a duplicate must not carry
        # stdin to the other process, so everything waits for SPAWNED.
        (False, b"hi", True, ["Spawn"], ["Stdin", "StdinClose"]),
    ],
)
async def test_spawn_pipelines_stdin_only_when_every_handle_is_known(
    pair: tuple[AgentClient, FakeAgent], listed: bool, stdin: bytes, close: bool, before: list[str],
    after: list[str],
) -> None:  # fmt: skip
    client, fake = pair
    client.stdin_window = p.CHUNK * 16
    if listed:
        await _list(client, fake)
    spawning = asyncio.create_task(client.spawn(7, ["cat"], ENV, "/", 0, 0, stdin=stdin, close_stdin=close))
    first = await fake.recv_all()
    assert _types(first) == before
    spawn_id = first[0][1]
    fake.send(p.Spawned(42), spawn_id)
    for msg, fid in first[1:]:
        fake.answer(msg, fid)
    later: list[tuple[p.Message, int]] = []
    while not spawning.done():
        receiving = asyncio.ensure_future(fake.recv())
        await asyncio.wait({receiving, spawning}, return_when=asyncio.FIRST_COMPLETED)
        if not receiving.done():
            receiving.cancel()
            break
        for msg, fid in receiving.result():
            later.append((msg, fid))
            fake.answer(msg, fid)
    assert await spawning == 42
    assert _types(later) == after
    sent = b"".join(m.data for m, _ in first + later if isinstance(m, p.Stdin))
    assert sent == stdin


async def test_a_refused_pipelined_spawn_raises_and_leaves_the_client_usable(
    pair: tuple[AgentClient, FakeAgent],
) -> None:
    client, fake = pair
    await _list(client, fake)
    spawning = asyncio.create_task(client.spawn(7, ["nope"], ENV, "/", 0, 0, stdin=b"x", close_stdin=True))
    frames = await fake.recv_all()
    assert _types(frames) == ["Spawn", "Stdin", "StdinClose"]
    # What the agent answers for a handle it does not hold, in order.
    fake.send(p.SpawnFailedMsg(errno.ENOENT, p.STAGE_EXEC, "cannot execute the program"), frames[0][1])
    fake.send(p.StdinAck(7, 1))
    fake.send(p.Error(errno.ENOENT, "no such process handle"), frames[2][1])
    with pytest.raises(CommandNotFound):
        await spawning
    # The handle is free again and the late replies were dropped, not matched to new requests.
    spawning = asyncio.create_task(client.spawn(7, ["cat"], ENV, "/", 0, 0))
    [(msg, fid)] = await fake.recv()
    assert isinstance(msg, p.Spawn)
    fake.send(p.Spawned(43), fid)
    assert await spawning == 43


async def test_forget_later_rides_with_the_next_frames_and_needs_no_answer(
    pair: tuple[AgentClient, FakeAgent],
) -> None:
    client, fake = pair
    await _list(client, fake)
    client.forget_later(3)
    client.forget_later(4)
    with pytest.raises(TimeoutError):
        await fake.recv(QUIET_SECS)  # nothing written on its own
    spawning = asyncio.create_task(client.spawn(5, ["true"], ENV, "/", 0, 0))
    frames = await fake.recv()
    assert [(type(m).__name__, fid) for m, fid in frames[:2]] == [("Forget", 0), ("Forget", 0)]
    assert [m.handle for m, _ in frames[:2]] == [3, 4] and isinstance(frames[2][0], p.Spawn)  # type: ignore[attr-defined]
    fake.send(p.Ok(), 0)  # the agent's answers to id 0 are dropped, never taken for another reply
    fake.send(p.Error(errno.ENOENT, "no such process handle"), 0)
    fake.send(p.Spawned(50), frames[2][1])
    assert await spawning == 50


async def test_forgets_held_back_are_written_on_their_own_past_the_cap(
    pair: tuple[AgentClient, FakeAgent],
) -> None:
    client, fake = pair
    for handle in range(MAX_DEFERRED_FORGETS):
        client.forget_later(handle)
    frames = await fake.recv_all()
    assert [m for m, _ in frames] == [p.Forget(h) for h in range(MAX_DEFERRED_FORGETS)]


# ---- TCP tunnels ----------------------------------------------------------------------------


async def _open(client: AgentClient, fake: FakeAgent, port: int = 8080) -> tuple[AgentTcpStream, int]:
    opening = asyncio.create_task(client.open_tcp(port))
    [(msg, fid)] = await fake.recv()
    assert msg == p.TcpOpen(port) and fid != 0
    fake.send(p.Ok(), fid)
    return await opening, fid


async def read_rest(stream: AgentTcpStream) -> bytes:
    out = bytearray()
    while data := await stream.read():
        out += data
    return bytes(out)


async def test_an_agent_of_version_1_is_still_served_without_tunnels() -> None:
    a, b = socket.socketpair()
    fake = FakeAgent(*await asyncio.open_connection(sock=b), p.FrameReader())
    reader, writer = await asyncio.open_connection(sock=a)
    connecting = asyncio.create_task(AgentClient.from_streams(reader, writer))
    for version in (4, 3):
        [(hello, hid)] = await fake.recv()
        assert hello == p.Hello(version=version)
        fake.send(
            p.Error(
                errno.EPROTONOSUPPORT, f"protocol version {version} is not supported; this agent speaks 1"
            ),
            hid,
        )
    [(hello, hid)] = await fake.recv()
    assert hello == p.Hello(version=2)
    fake.send(p.Error(errno.EPROTONOSUPPORT, "protocol version 2 is not supported; this agent speaks 1"), hid)
    [(hello, hid)] = await fake.recv()  # an agent started before the upgrade: fall back
    assert hello == p.Hello(version=1)
    fake.send(p.HelloOk(1, 1, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20), hid)
    client = await connecting
    assert client.version == 1
    with pytest.raises(AgentRequestError, match="recreate the sandbox") as info:
        await client.open_tcp(80)
    assert info.value.errno == errno.ENOSYS
    assert await client.open_raw_tcp(80) is None  # nor raw tunnels (version 4)
    assert await fake.recv_all() == []  # refused here, without asking the agent
    await client.close()
    fake.writer.close()


async def test_tunnel_writes_wait_for_the_window(pair: tuple[AgentClient, FakeAgent]) -> None:
    client, fake = pair
    stream, fid = await _open(client, fake)
    data = bytes(range(256)) * (p.TCP_CHUNK * 10 // 256)
    writing = asyncio.create_task(stream.write(data))
    first = await fake.recv_all()
    assert [(type(m).__name__, i) for m, i in first] == [("TcpSend", fid)] * 4  # a window, then wait
    assert all(len(m.data) == p.TCP_CHUNK for m, _ in first if isinstance(m, p.TcpSend))
    fake.send(p.TcpSendAck(2 * p.TCP_CHUNK), fid)
    second = await fake.recv_all()
    assert _types(second) == ["TcpSend"] * 2
    assert not writing.done()
    fake.send(p.TcpSendAck(10 * p.TCP_CHUNK), fid)
    third = await fake.recv_all()
    await asyncio.wait_for(writing, 5)
    assert b"".join(m.data for m, _ in first + second + third if isinstance(m, p.TcpSend)) == data
    await stream.write_eof()
    await stream.close()
    assert await fake.recv_all() == [(p.TcpShutWr(), fid), (p.TcpClose(), fid)]


async def test_tunnel_reads_acknowledge_only_what_was_consumed(pair: tuple[AgentClient, FakeAgent]) -> None:
    client, fake = pair
    stream, fid = await _open(client, fake)
    for i in range(4):  # a full window the caller has not read yet
        fake.send(p.TcpData(bytes([i]) * p.TCP_CHUNK), fid)
    fake.send(p.TcpEof(), fid)
    assert await fake.recv_all() == []  # nothing is acknowledged before it is read
    assert await stream.read() == b"\0" * p.TCP_CHUNK
    assert await fake.recv_all() == [(p.TcpAck(p.TCP_CHUNK), fid)]  # a quarter window consumed
    assert len(await read_rest(stream)) == 3 * p.TCP_CHUNK
    assert await stream.read() == b""


async def test_tunnel_closed_by_the_agent_delivers_data_then_the_error(
    pair: tuple[AgentClient, FakeAgent],
) -> None:
    client, fake = pair
    stream, fid = await _open(client, fake)
    fake.send(p.TcpData(b"last words"), fid)
    fake.send(p.TcpClosed(errno.ECONNRESET, "Connection reset by peer"), fid)
    assert await stream.read() == b"last words"
    for op in (stream.read(), stream.write(b"x")):
        with pytest.raises(AgentRequestError) as info:
            await op
        assert info.value.errno == errno.ECONNRESET
    await stream.close()
    assert await fake.recv_all() == []  # the agent freed it already: no TCP_CLOSE needed


async def test_tunnel_open_times_out_and_tells_the_agent(pair: tuple[AgentClient, FakeAgent]) -> None:
    client, fake = pair
    with pytest.raises(AgentRequestError) as info:
        await client.open_tcp(8080, timeout_secs=0.2)
    assert info.value.errno == errno.ETIMEDOUT
    [(opened, fid), (closed, cfid)] = await fake.recv_all()
    assert (opened, closed, cfid) == (p.TcpOpen(8080), p.TcpClose(), fid)
    fake.send(p.Ok(), fid)  # a late answer is ignored, and the client goes on
    stream, fid2 = await _open(client, fake)
    assert fid2 != fid
    await stream.close()


# ---- a hostile agent, and the file transfer cap ----------------------------------------------------------

HUGE = 900 * 1024  # bytes per data frame below: three of them are past any window plus a payload


async def _open_read(client: AgentClient, fake: FakeAgent, path: str = "/f") -> tuple[FileReader, int]:
    opening = asyncio.create_task(client.open_read(path, 1000, 1000))
    [(msg, fid)] = await fake.recv()
    assert isinstance(msg, p.ReadFile)
    fake.send(p.ReadOpen(3 * HUGE), fid)
    return await opening, fid


@pytest.mark.parametrize(
    "frames",
    [
        pytest.param(lambda: [(p.Output(5, 0, n * HUGE, b"x" * HUGE), 0) for n in range(3)], id="output"),
        pytest.param(lambda: [(p.Exited(h, 0), 0) for h in range(MAX_HANDLES + 1)], id="handles"),
    ],
)
async def test_an_agent_ignoring_its_limits_loses_its_channel(
    pair: tuple[AgentClient, FakeAgent], frames: Callable[[], list[tuple[p.Message, int]]]
) -> None:
    client, fake = pair
    for msg, fid in frames():
        fake.send(msg, fid)
    await asyncio.wait_for(client.closed.wait(), 5)
    with pytest.raises(AgentProtocolError):
        await client.list_processes()


async def test_an_agent_sending_file_data_past_the_read_window_loses_its_channel(
    pair: tuple[AgentClient, FakeAgent],
) -> None:
    client, fake = pair
    reader, fid = await _open_read(client, fake)
    for _ in range(3):  # nobody reads: the host acknowledges nothing
        fake.send(p.Data(b"x" * HUGE), fid)
    await asyncio.wait_for(client.closed.wait(), 5)
    with pytest.raises(AgentProtocolError):
        async for _ in reader:
            pass


async def test_an_agent_sending_tunnel_data_past_the_window_loses_its_channel(
    pair: tuple[AgentClient, FakeAgent],
) -> None:
    client, fake = pair
    stream, fid = await _open(client, fake)
    chunk = HUGE // 8
    # Nobody reads: one chunk more than the window the agent announced plus a payload.
    for _ in range((client.tcp_window + client.max_payload) // chunk + 1):
        fake.send(p.TcpData(b"x" * chunk), fid)
    await asyncio.wait_for(client.closed.wait(), 5)
    with pytest.raises(AgentProtocolError):
        await read_rest(stream)


async def test_an_agent_within_its_windows_keeps_its_channel(pair: tuple[AgentClient, FakeAgent]) -> None:
    client, fake = pair
    reader, fid = await _open_read(client, fake)
    for _ in range(3):  # read as it comes: acknowledged, so never past the window
        fake.send(p.Data(b"x" * HUGE), fid)
        assert len(await reader.__anext__()) == HUGE
        await fake.recv_all()
    fake.send(p.End(), fid)
    assert [chunk async for chunk in reader] == []
    assert not client.closed.is_set()


async def test_file_transfers_past_the_cap_are_refused_until_one_ends(
    pair: tuple[AgentClient, FakeAgent],
) -> None:
    client, fake = pair
    readers = [(await _open_read(client, fake, f"/f{n}"))[0] for n in range(MAX_FILE_TRANSFERS)]
    for call in (
        client.open_read("/more", 1000, 1000),
        client.list_dir("/", 1000, 1000),
        client.write_file("/w", _chunks(b"x"), 1000, 1000),
    ):
        with pytest.raises(AgentFileError) as info:
            await call
        assert info.value.errno == errno.EMFILE and "64 file transfers are under way" in info.value.message
    assert await fake.recv_all() == []  # refused here: nothing reached the agent
    await readers[0].aclose()
    await fake.recv_all()  # its CANCEL
    reader, _ = await _open_read(client, fake, "/now")  # a slot came back
    await reader.aclose()


async def _chunks(*chunks: bytes) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


# ---- QUIESCE --------------------------------------------------------------------------------------------


async def test_nothing_is_written_after_quiesce_so_its_answer_is_never_lost() -> None:
    """The race behind a flaky quiesce: the agent answers QUIESCE and closes while the host is busy with output
    that came before the answer. The host then wrote the ACK of that output; the write met the closed socket,
    asyncio aborted the transport, and the OK still unread in the socket was lost (``AgentConnectionLost:
    writing to the sandbox agent failed: Connection lost``). The fake agent here closes from inside the sink,
    while the host's loop is busy, so the race is hit every time."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    b.setblocking(False)
    agent_frames = p.FrameReader()

    async def recv() -> list[tuple[p.Message, int]]:
        data = await loop.sock_recv(b, 1 << 20)
        return [(p.decode(f.type, f.payload), f.id) for f in agent_frames.feed(data)]

    connecting = asyncio.create_task(AgentClient.from_streams(*await asyncio.open_connection(sock=a)))
    [(hello, hid)] = await recv()
    assert isinstance(hello, p.Hello)
    await loop.sock_sendall(b, p.encode(p.HelloOk(p.VERSION, 1, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20,
                                                  TCP_WINDOW), hid))  # fmt: skip
    client = await connecting
    quiesce_id = 0
    delivered: list[bytes] = []

    class AnswersAndClosesMeanwhile:
        async def on_output(self, stream: str, data: bytes) -> None:
            delivered.append(data)
            # As the agent, while the host is busy here: answer QUIESCE, close the connection.
            b.setblocking(True)
            b.sendall(p.encode(p.Ok(), quiesce_id))
            b.close()

        async def on_exit(self, exit_code: int) -> None:
            raise AssertionError("no exit was sent")

    subscribing = asyncio.create_task(client.set_process_sink(1, AnswersAndClosesMeanwhile()))
    [(resume, rid)] = await recv()
    assert isinstance(resume, p.Resume)
    await loop.sock_sendall(b, p.encode(p.Ok(), rid))
    await subscribing
    quiescing = asyncio.create_task(client.quiesce("/wake", timeout_secs=5))
    [(quiesce, quiesce_id)] = await recv()
    assert isinstance(quiesce, p.Quiesce)
    await loop.sock_sendall(b, p.encode(p.Output(1, 0, 0, b"before the answer")))
    await quiescing  # answered, and closed
    assert delivered == [b"before the answer"] and client.closed.is_set()
    with pytest.raises(AgentConnectionLost):
        await client.list_processes()
    await client.close()


async def test_a_refused_quiesce_sends_the_acks_it_held_back(pair: tuple[AgentClient, FakeAgent]) -> None:
    client, fake = pair
    delivered = asyncio.Event()

    class Sink:
        async def on_output(self, stream: str, data: bytes) -> None:
            delivered.set()

        async def on_exit(self, exit_code: int) -> None:
            raise AssertionError("no exit was sent")

    subscribing = asyncio.create_task(client.set_process_sink(1, Sink()))
    [(resume, rid)] = await fake.recv()
    assert isinstance(resume, p.Resume)
    fake.send(p.Ok(), rid)
    await subscribing
    quiescing = asyncio.create_task(client.quiesce("relative"))
    [(quiesce, qid)] = await fake.recv()
    assert isinstance(quiesce, p.Quiesce)
    fake.send(p.Output(1, 0, 0, b"12345"))
    await asyncio.wait_for(delivered.wait(), 5)
    assert await fake.recv_all() == []  # no ACK while the connection may be closing
    fake.send(p.Error(errno.EINVAL, "malformed QUIESCE: the wake path must be absolute"), qid)
    with pytest.raises(AgentRequestError):
        await quiescing
    assert [m for m, _ in await fake.recv_all()] == [p.Ack(1, 0, 5)]
    listing = asyncio.create_task(client.list_processes())  # the connection is usable again
    [(msg, lid)] = await fake.recv()
    assert isinstance(msg, p.ListProcesses)
    fake.send(p.Processes(()), lid)
    assert await listing == []


# ---- the socket in a directory the guest can write --------------------------------------------------------


async def test_connect_never_follows_a_symlink_at_the_socket(tmp_path: Path) -> None:
    host_socket = tmp_path / "host.sock"  # some other host service
    connections: list[bool] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(True)
        writer.close()

    server = await asyncio.start_unix_server(accept, str(host_socket))
    try:
        (tmp_path / "agent.sock").symlink_to(host_socket)
        with pytest.raises(AgentUnavailable, match="not a socket"):
            await AgentClient.connect(tmp_path / "agent.sock", timeout_secs=0.2)
        assert connections == []
        await asyncio.sleep(0.05)
        assert connections == []
    finally:
        server.close()
