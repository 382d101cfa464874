"""A request costs sandboxd the same whatever the sandbox has done before (issue 31).

The whole node (sbx.node.server.build_app: middlewares, routes, manager, idle timers, process table, output logs,
audit) serves HTTP in this process, over a backend whose agent is played in-process on a socketpair (it answers
a spawn with the process's output and exit at once, so a run costs the node's work only). The work of a request
is counted as the Python lines executed from the moment it is sent until its answer is read (``sys.settrace``,
every module but this one: the node, aiohttp, asyncio, the client), which is exact and deterministic where CPU
time on a loaded machine is not. The median over a window of runs after 3,000 runs in one sandbox must be that
after 30, within a small margin: a scan of the processes, output logs, events or requests a sandbox has had
(the process table's running count once cost a line per remembered process, five times per run) makes it grow
by thousands of lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import statistics
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from fake_backend import FakeBackend

from sbx.agent import protocol as p
from sbx.agent.client import AgentClient
from sbx.backends.base import BackendError, BackendUsage, BootSpec
from sbx.images.store import ImageStore
from sbx.node import backend_kinds
from sbx.node.config import NodeConfig, config_from_mapping
from sbx.node.server import ServerOptions, build_app

#: Runs made in the sandbox before each measurement, and runs measured each time.
SHORT_HISTORY, LONG_HISTORY, WINDOW = 30, 3000, 25
#: How much more a request may cost after the long history: far below what one line per remembered process
#: (1,000 of them) adds, and above the few lines that vary with how the loop happens to batch reads.
MARGIN = 1.10


async def _play_agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An agent whose processes end at once: ``echo`` prints its arguments, anything else prints nothing."""
    frames = p.FrameReader()
    guest_pid = 100
    while data := await reader.read(1 << 16):
        for frame in frames.feed(data):
            msg = p.decode(frame.type, frame.payload)
            if isinstance(msg, p.Hello):
                reply: p.Message = p.HelloOk(p.VERSION, 1, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20, 1 << 20)
                writer.write(p.encode(reply, frame.id))
            elif isinstance(msg, p.ListProcesses):
                writer.write(p.encode(p.Processes(()), frame.id))
            elif isinstance(msg, p.Spawn):
                guest_pid += 1
                writer.write(p.encode(p.Spawned(guest_pid), frame.id))
                if msg.argv[0] == "echo":
                    printed = (" ".join(msg.argv[1:]) + "\n").encode()
                    writer.write(p.encode(p.Output(msg.handle, 0, 0, printed)))
                writer.write(p.encode(p.Exited(msg.handle, 0)))
            elif isinstance(msg, (p.StdinClose, p.Forget)):
                writer.write(p.encode(p.Ok(), frame.id))
            elif not isinstance(msg, (p.Ack, p.Stdin)):
                writer.write(p.encode(p.Error(38, "not played here"), frame.id))  # ENOSYS
    writer.close()


class PlayedBackend(FakeBackend):
    """The fake backend with each sandbox's agent played in this process (no host process at all)."""

    def __init__(self, state_dir: Path) -> None:
        super().__init__(state_dir, Path("/nonexistent"))
        self._agents: dict[str, asyncio.Task[None]] = {}

    def check(self) -> None:
        Path(self.guest.home).mkdir(exist_ok=True)

    async def boot(self, spec: BootSpec) -> None:
        self._agents[spec.sandbox_id] = asyncio.get_running_loop().create_task(asyncio.sleep(3600))

    async def connect_agent(self, sandbox_id: str, timeout_secs: float) -> AgentClient:
        ours, theirs = socket.socketpair()
        agent_side = await asyncio.open_connection(sock=theirs)
        self._agents[sandbox_id].cancel()
        self._agents[sandbox_id] = asyncio.get_running_loop().create_task(_play_agent(*agent_side))
        return await AgentClient.from_streams(*await asyncio.open_connection(sock=ours))

    async def is_running(self, sandbox_id: str) -> bool:
        return sandbox_id in self._agents

    async def destroy(self, sandbox_id: str) -> None:
        task = self._agents.pop(sandbox_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def usage(self, sandbox_id: str) -> BackendUsage | None:
        return None

    async def park(self, sandbox_id: str) -> None:
        raise BackendError("not parked in this test")

    async def is_parked(self, sandbox_id: str) -> bool:
        return False


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    """A node on the played backend, its default image an empty directory; yields an HTTP client of it."""
    backend_kinds.register("played", lambda config, state: PlayedBackend(state))
    images = tmp_path / "images"
    ImageStore(images).install_rootfs("default", lambda root: None)
    config: NodeConfig = config_from_mapping({
        "backend": {"kind": "played"},
        "paths": {"images_dir": str(images), "agent_path": str(tmp_path / "agent")},
    })  # fmt: skip
    options = ServerOptions(
        state_dir=tmp_path / "state", socket_path=None, listen=None, token=None, tls_cert=None, tls_key=None,
        node_id=None, metrics_listen=None,
    )  # fmt: skip
    (tmp_path / "state").mkdir()
    try:
        async with TestClient(TestServer(build_app(config, options))) as client:
            yield client
    finally:
        del backend_kinds.KINDS["played"]


class LineCounter:
    """Counts the Python lines executed while it is on (all modules but this one)."""

    def __init__(self) -> None:
        self.lines = 0
        self._previous: Callable[..., Any] | None = None

    def _local(self, frame: FrameType, event: str, arg: object) -> Callable[..., Any]:
        if event == "line":
            self.lines += 1
        return self._local

    def _global(self, frame: FrameType, event: str, arg: object) -> Callable[..., Any] | None:
        return None if frame.f_code.co_filename == __file__ else self._local

    @contextlib.contextmanager
    def on(self) -> Any:
        self._previous = sys.gettrace()
        sys.settrace(self._global)
        try:
            yield
        finally:
            sys.settrace(self._previous)


async def _run(client: TestClient[Any, Any], sandbox_id: str, argv: list[str]) -> None:
    resp = await client.post(f"/v1/sandboxes/{sandbox_id}/run", json={"argv": argv})
    assert resp.status == 200, await resp.text()
    await resp.read()


async def _lines_per_run(client: TestClient[Any, Any], sandbox_id: str) -> float:
    """The median lines of WINDOW runs of `true`, each counted from its request to its answer."""
    counts = []
    for _ in range(WINDOW):
        counter = LineCounter()
        with counter.on():
            await _run(client, sandbox_id, ["true"])
        counts.append(counter.lines)
    return statistics.median(counts)


async def test_the_work_of_a_run_does_not_grow_with_the_sandbox_history(node: TestClient[Any, Any]) -> None:
    created = await node.post("/v1/sandboxes", json={})
    assert created.status == 201, await created.text()
    sandbox_id = (await created.json())["id"]
    for i in range(SHORT_HISTORY):
        await _run(node, sandbox_id, ["echo", str(i)] if i % 2 else ["true"])
    short = await _lines_per_run(node, sandbox_id)
    # Past the 1,000 exited processes a sandbox remembers, with output logs, audit events and requests behind.
    for i in range(LONG_HISTORY):
        await _run(node, sandbox_id, ["echo", str(i)] if i % 2 else ["true"])
    long = await _lines_per_run(node, sandbox_id)
    listing = await (await node.get(f"/v1/sandboxes/{sandbox_id}/processes")).json()
    assert len(listing["processes"]) >= 1000  # the history is there
    assert long <= short * MARGIN, (
        f"a run cost {short:.0f} lines after {SHORT_HISTORY} runs, {long:.0f} after more"
    )
