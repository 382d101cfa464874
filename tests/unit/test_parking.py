"""Parking's decisions and races (sbx.node.parking) on a stub backend and agent: when a park goes ahead or is
refused (and when it is tried again), that a request during a park waits for it and wakes the sandbox, that a
sandbox taken back parked connects its agent at its first wake. The real freeze: tests/integration/test_parking.py
and the backend contract suite."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from sbx.agent.client import AgentUnavailable
from sbx.agent.protocol import DirEntry
from sbx.api.errors import Internal
from sbx.api.network_policy import NetworkPolicy
from sbx.backends.base import BackendError, GuestUser
from sbx.node.audit import AuditLog
from sbx.node.parking import Parking
from sbx.node.records import SandboxRecord, SandboxState
from sbx.node.sandbox import Sandbox

GUEST = GuestUser(uid=1000, gid=1000, name="sandbox", home="/sandbox/home")
PARK_AFTER = 30


class StubAgent:
    """An agent whose /proc lists ``pids``; ``gate`` holds the listing until set."""

    def __init__(self, pids: list[str]) -> None:
        self.pids = pids
        self.closed = asyncio.Event()
        self.gate: asyncio.Event | None = None
        self.listings = 0
        self.fail: Exception | None = None

    async def list_dir(self, path: str, uid: int, gid: int) -> list[DirEntry]:
        assert (path, uid, gid) == ("/proc", GUEST.uid, GUEST.gid)
        self.listings += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        names = [*self.pids, "self", "thread-self", "meminfo", "sys"]
        return [DirEntry(name=n, kind=1, size=0) for n in names]


class StubBackend:
    """Records parks and wakes; ``fail_park`` makes the next park fail; ``parked`` is what the host says."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail_park = False
        self.parked: set[str] = set()
        self.park_gate: asyncio.Event | None = None

    async def park(self, sandbox_id: str) -> None:
        self.calls.append("park")
        if self.park_gate is not None:
            await self.park_gate.wait()
        if self.fail_park:
            raise BackendError("the sandbox's processes were not all stopped within 5 s")
        self.parked.add(sandbox_id)

    async def unpark(self, sandbox_id: str) -> None:
        self.calls.append("unpark")
        self.parked.discard(sandbox_id)

    async def is_parked(self, sandbox_id: str) -> bool:
        return sandbox_id in self.parked


class Clock:
    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def make(
    tmp_path: Path, pids: list[str] | None = None
) -> tuple[Parking, Sandbox, StubBackend, StubAgent, Clock]:
    record = SandboxRecord(
        id="sbx_0123456789abcdef", state=SandboxState.RUNNING, image="default", cpus=1, memory_mb=512,
        disk_mb=1024, network=NetworkPolicy("none"), idle_timeout_secs=600, created_at="2026-01-01T00:00:00.000Z",
    )  # fmt: skip
    sandbox = Sandbox(record, tmp_path / record.id, AuditLog(tmp_path / "audit"), GUEST)
    agent = StubAgent(["1"] if pids is None else pids)
    sandbox.processes.agent = agent  # type: ignore[assignment]
    backend = StubBackend()
    clock = Clock()
    changes: list[bool] = []
    reattached: list[Sandbox] = []

    async def reattach(s: Sandbox) -> None:
        reattached.append(s)
        s.processes.agent = agent  # type: ignore[assignment]

    parking = Parking(backend, PARK_AFTER, lambda s: changes.append(s.parked), reattach, clock=clock)  # type: ignore[arg-type]
    sandbox.waker = parking.wake
    sandbox.last_activity = clock.now - PARK_AFTER  # idle for exactly park_after_secs
    return parking, sandbox, backend, agent, clock


async def test_an_idle_sandbox_whose_guest_runs_only_the_agent_is_parked(tmp_path: Path) -> None:
    parking, sandbox, backend, agent, _ = make(tmp_path)
    parked: list[str] = []

    async def hook(s: Sandbox) -> None:
        parked.append(s.record.id)

    parking.on_parked.append(hook)
    assert await parking.try_park(sandbox) is None
    assert sandbox.parked and parking.parked == {sandbox.record.id} and parking.parks == 1
    assert backend.calls == ["park"] and agent.listings == 1 and parked == [sandbox.record.id]


@pytest.mark.parametrize(
    ("setup", "why", "retry"),
    [
        (lambda s, a: a.pids.extend(["7", "12"]), "2 process(es) besides the agent run in the guest (pid 7, 12)", True),
        (lambda s, a: setattr(a, "fail", AgentUnavailable("gone")), "the guest's processes could not be listed", True),
        (lambda s, a: setattr(s.processes, "paused_reason", "being snapshotted"), "its agent is not connected", True),
        (lambda s, a: s.hold(), "a request or stream is open", False),
        (lambda s, a: setattr(s, "last_activity", s.last_activity + 1), "it was used meanwhile", False),
        (lambda s, a: setattr(s.record, "state", SandboxState.SUSPENDED), "it is suspended", False),
    ],
)  # fmt: skip
async def test_a_sandbox_not_idle_is_not_parked(tmp_path: Path, setup: Any, why: str, retry: bool) -> None:
    parking, sandbox, backend, agent, clock = make(tmp_path)
    setup(sandbox, agent)
    got = await parking.try_park(sandbox)
    assert got is not None and got.startswith(why)
    assert not sandbox.parked and "park" not in backend.calls and parking.parked == set()
    # A refusal the idle timer cannot see (the guest, the agent) delays the next try; the others it sees itself.
    assert (sandbox.park_retry_at == clock.now + PARK_AFTER) is retry
    if retry:
        await parking.try_park(sandbox)
        assert sandbox.park_refusals == 2  # the delay doubles (sbx.node.idle.park_retry_delay)


async def test_a_failed_park_leaves_the_sandbox_awake_and_tries_later(tmp_path: Path) -> None:
    parking, sandbox, backend, _, clock = make(tmp_path)
    backend.fail_park = True
    why = await parking.try_park(sandbox)
    assert why is not None and "were not all stopped" in why
    assert not sandbox.parked and parking.parked == set() and parking.parks == 0
    assert sandbox.park_retry_at == clock.now + PARK_AFTER


async def test_activity_during_the_guest_listing_cancels_the_park(tmp_path: Path) -> None:
    parking, sandbox, backend, agent, _ = make(tmp_path)
    agent.gate = asyncio.Event()
    attempt = asyncio.create_task(parking.try_park(sandbox))
    await asyncio.sleep(0.01)
    sandbox.last_activity += 5  # a request came meanwhile
    agent.gate.set()
    assert await attempt == "it was used meanwhile"
    assert not sandbox.parked and backend.calls == []


async def test_a_request_during_a_park_waits_for_it_then_wakes_the_sandbox(tmp_path: Path) -> None:
    parking, sandbox, backend, _, _ = make(tmp_path)
    backend.park_gate = asyncio.Event()
    unparked: list[str] = []
    parking.on_unparked.append(lambda s: unparked.append(s.record.id))
    attempt = asyncio.create_task(parking.try_park(sandbox))
    await asyncio.sleep(0.01)
    assert sandbox.parked  # marked before the freeze: whatever comes now wakes it
    woken = asyncio.create_task(sandbox.wake())
    await asyncio.sleep(0.01)
    assert not woken.done()  # waits for the park to end
    backend.park_gate.set()
    assert await attempt is None
    await woken
    assert backend.calls == ["park", "unpark"] and not sandbox.parked and parking.parked == set()
    assert unparked == [sandbox.record.id] and parking.unparks == 1
    await sandbox.wake()  # awake: nothing more
    assert backend.calls == ["park", "unpark"]


async def test_a_sandbox_taken_back_parked_connects_its_agent_at_its_first_wake(tmp_path: Path) -> None:
    parking, sandbox, backend, agent, _ = make(tmp_path)
    backend.parked.add(sandbox.record.id)
    sandbox.processes.agent = None  # a restarted sandboxd has not connected it
    assert await parking.take_back(sandbox)
    assert sandbox.parked and parking.parked == {sandbox.record.id} and backend.calls == []
    await sandbox.wake()
    assert backend.calls == ["unpark"] and sandbox.processes.agent is agent


async def test_a_half_done_park_found_at_start_is_undone(tmp_path: Path) -> None:
    parking, sandbox, backend, _, _ = make(tmp_path)
    assert not await parking.take_back(sandbox)  # not frozen (e.g. FREEZING when sandboxd was killed)
    assert backend.calls == ["unpark"] and not sandbox.parked


async def test_a_wake_the_backend_refuses_is_internal_and_leaves_it_parked(tmp_path: Path) -> None:
    parking, sandbox, backend, _, _ = make(tmp_path)
    assert await parking.try_park(sandbox) is None

    async def refuse(sandbox_id: str) -> None:
        raise BackendError("cannot thaw cgroup")

    backend.unpark = refuse  # type: ignore[method-assign]
    with pytest.raises(Internal, match="could not be woken from parking: cannot thaw cgroup"):
        await sandbox.wake()
    assert sandbox.parked and parking.parked == {sandbox.record.id}


async def test_a_terminated_parked_sandbox_is_no_longer_counted(tmp_path: Path) -> None:
    parking, sandbox, _, _, _ = make(tmp_path)
    assert await parking.try_park(sandbox) is None
    parking.forget(sandbox)
    assert not sandbox.parked and parking.parked == set()
