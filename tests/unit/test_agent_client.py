"""AgentClient against a scripted agent on a socketpair: what goes on the wire, and when.

The real agent's behaviour is tested in test_agent_host.py; here the test plays the agent, so it can
see whether frames arrive before it answers.
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from sbx.agent import protocol as p
from sbx.agent.client import AgentClient, CommandNotFound

ENV = {"PATH": "/bin"}
QUIET_SECS = 0.1  # how long the fake agent listens for frames that should not come


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
    fake.send(p.HelloOk(p.VERSION, 1, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20), hid)
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
