"""The metrics sampler's arithmetic and bookkeeping, fed by a fake counter source (no sandboxes here)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fake_backend import FakeBackend

from sbx.api.codec import to_builtins
from sbx.api.network_policy import NetworkPolicy
from sbx.backends.base import BackendUsage
from sbx.images.store import ImageStore
from sbx.node.audit import AuditLog
from sbx.node.config import Capacity, NodeConfig
from sbx.node.manager import KEEP_TERMINATED, SandboxManager
from sbx.node.records import SandboxRecord, SandboxState
from sbx.node.reservations import Reservations
from sbx.node.sampler import (
    CounterTotal,
    MetricsSampler,
    Round,
    Sample,
    SampleRing,
    SampleTarget,
    SandboxSeries,
    cpu_share,
)
from sbx.statefile import write_json_atomic

GIB = 1024**3


@pytest.mark.parametrize(
    ("cpu_ns", "elapsed_secs", "cpus", "percent"),
    [
        (5_000_000_000, 5.0, 1, 100.0),  # one vCPU busy the whole interval
        (2_500_000_000, 5.0, 1, 50.0),
        (5_000_000_000, 5.0, 2, 50.0),  # one of two vCPUs busy
        (10_000_000_000, 5.0, 2, 100.0),
        (0, 5.0, 4, 0.0),
        (6_000_000_000, 5.0, 1, 100.0),  # quota bursts and sampling jitter never show above 100
        (-1, 5.0, 1, 0.0),  # nor below 0
        (1_000_000, 0.0, 1, 0.0),  # no time passed: nothing to divide by
        (1_000_000, 5.0, 0, 0.0),
    ],
)
def test_cpu_share(cpu_ns: int, elapsed_secs: float, cpus: int, percent: float) -> None:
    assert cpu_share(cpu_ns, elapsed_secs, cpus) == pytest.approx(percent)


@pytest.mark.parametrize(
    ("readings", "totals"),
    [
        ([0, 10, 25], [0, 10, 25]),
        ([100, 150], [100, 150]),  # the first reading is the starting total
        ([100, 150, 30], [100, 150, 180]),  # restart: 30 counted since, nothing taken back
        ([100, 150, 0, 20], [100, 150, 150, 170]),
        ([50, 50, 50], [50, 50, 50]),
    ],
)
def test_counter_total_never_goes_back(readings: list[int], totals: list[int]) -> None:
    counter = CounterTotal()
    assert [counter.update(r) for r in readings] == totals


def _sample(i: int) -> Sample:
    return Sample(
        time=1_700_000_000.0 + 5 * i,
        cpu_percent=i / 10,
        memory_bytes=i * 1000,
        memory_limit_bytes=GIB,
        net_rx_bytes=i,
        net_tx_bytes=2 * i,
        disk_read_bytes=3 * i,
        disk_write_bytes=2**52 + i,  # large totals survive the ring's doubles exactly
        processes=i % 7,
    )


@pytest.mark.parametrize(("capacity", "appended"), [(1, 3), (3, 2), (3, 3), (3, 7), (720, 1000)])
def test_ring_keeps_the_newest_oldest_first(capacity: int, appended: int) -> None:
    ring = SampleRing(capacity)
    for i in range(appended):
        ring.append(_sample(i))
    kept = [_sample(i) for i in range(max(0, appended - capacity), appended)]
    assert len(ring) == len(kept)
    assert ring.samples() == kept
    assert all(isinstance(s.memory_bytes, int) for s in ring.samples())


def test_ring_of_an_hour_is_compact() -> None:
    ring = SampleRing()
    assert ring.capacity == 720
    assert ring._values.itemsize * len(ring._values) == 720 * 72


def test_series_cpu_from_two_readings_and_first_is_zero() -> None:
    target = SampleTarget("sbx_a", cpus=2, memory_bytes=GIB)
    series = SandboxSeries()
    first = series.observe(target, BackendUsage(cpu_ns=7_000_000_000), monotonic=100.0, wall=1.0)
    assert first.cpu_percent == 0
    second = series.observe(target, BackendUsage(cpu_ns=12_000_000_000), monotonic=105.0, wall=6.0)
    assert second.cpu_percent == pytest.approx(50.0)  # 5 s of CPU over 5 s of 2 vCPUs
    # A CPU counter that restarts (cgroup recreated) counts what it shows since, never a negative share.
    third = series.observe(target, BackendUsage(cpu_ns=1_000_000_000), monotonic=110.0, wall=11.0)
    assert third.cpu_percent == pytest.approx(10.0)


def test_series_totals_and_limit_fallback() -> None:
    target = SampleTarget("sbx_a", cpus=1, memory_bytes=256 * 1024 * 1024)
    series = SandboxSeries()
    series.observe(target, BackendUsage(disk_write_bytes=1000, net_rx_bytes=5), 0.0, 0.0)
    # The gofer exits and takes its I/O counts with it: the total stays, later writes add on.
    s = series.observe(
        target, BackendUsage(disk_write_bytes=300, net_rx_bytes=9, memory_limit_bytes=GIB), 5.0, 5.0
    )
    assert (s.disk_write_bytes, s.net_rx_bytes) == (1300, 9)
    assert s.memory_limit_bytes == GIB  # the enforced limit when the backend knows it
    s = series.observe(target, BackendUsage(), 10.0, 10.0)
    assert s.memory_limit_bytes == 256 * 1024 * 1024  # else what the sandbox was given


class FakeCounters:
    """A counter source: per sandbox a list of readings handed out in turn; None when not running."""

    def __init__(self, readings: dict[str, list[BackendUsage | None]]) -> None:
        self.readings = readings
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None

    async def __call__(self, sandbox_id: str) -> BackendUsage | None:
        self.calls.append(sandbox_id)
        if self.gate is not None:
            await self.gate.wait()
        queue = self.readings.get(sandbox_id) or [None]
        return queue.pop(0) if len(queue) > 1 else queue[0]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_sampler_rounds_over_running_targets() -> None:
    targets = [SampleTarget("sbx_a", 1, GIB), SampleTarget("sbx_b", 1, GIB)]
    counters = FakeCounters(
        {
            "sbx_a": [
                BackendUsage(cpu_ns=0),
                BackendUsage(cpu_ns=2_500_000_000),
                BackendUsage(cpu_ns=2_500_000_000),
            ],
            "sbx_b": [BackendUsage(cpu_ns=0), None],  # stopped between rounds
        }
    )
    clock = Clock()
    sampler = MetricsSampler(lambda: list(targets), counters, clock=clock, wall=clock)
    await sampler.sample_once()
    clock.now += 5
    await sampler.sample_once()
    assert [s.cpu_percent for s in sampler.samples("sbx_a")] == [0.0, pytest.approx(50.0)]
    assert len(sampler.samples("sbx_b")) == 1
    # Terminated: no longer a target, no longer read, its samples kept until forgotten.
    targets.pop()
    targets.pop()
    counters.calls.clear()
    clock.now += 5
    await sampler.sample_once()
    assert counters.calls == []
    assert len(sampler.samples("sbx_a")) == 2
    sampler.forget("sbx_a")
    assert sampler.samples("sbx_a") == []
    assert sampler.samples("sbx_unknown") == []


async def test_a_sandbox_that_ends_mid_round_is_not_sampled_after_its_end() -> None:
    state = {"sbx_b": True}
    counters = FakeCounters({"sbx_a": [BackendUsage()], "sbx_b": [BackendUsage()]})

    async def read(sandbox_id: str) -> BackendUsage | None:
        state["sbx_b"] = False  # terminated while sbx_a's counters are read
        return await counters(sandbox_id)

    targets = [
        SampleTarget("sbx_a", 1, GIB),
        SampleTarget("sbx_b", 1, GIB, running=lambda: state["sbx_b"]),
    ]
    sampler = MetricsSampler(lambda: targets, read)
    await sampler.sample_once()
    assert counters.calls == ["sbx_a"]
    assert sampler.samples("sbx_b") == []
    assert "sbx_b" not in sampler._series


async def test_a_sandbox_forgotten_mid_read_does_not_come_back() -> None:
    counters = FakeCounters({"sbx_a": [BackendUsage(cpu_ns=1)]})
    counters.gate = asyncio.Event()
    sampler = MetricsSampler(lambda: [SampleTarget("sbx_a", 1, GIB)], counters)
    round_ = asyncio.ensure_future(sampler.sample_once())
    await asyncio.sleep(0)
    sampler.forget("sbx_a")
    counters.gate.set()
    await round_
    assert sampler.samples("sbx_a") == []
    assert "sbx_a" not in sampler._series


async def test_sampler_task_samples_on_its_interval() -> None:
    counters = FakeCounters({"sbx_a": [BackendUsage()]})
    sampler = MetricsSampler(lambda: [SampleTarget("sbx_a", 1, GIB)], counters, interval_secs=1)
    await sampler.start()
    await asyncio.sleep(1.5)  # a round at once, one a second later
    await sampler.close()
    assert len(sampler.samples("sbx_a")) == 2


def test_sample_wire_form() -> None:
    wire = to_builtins(_sample(3).wire())
    assert list(wire) == [
        "time", "cpu_percent", "memory_bytes", "memory_limit_bytes", "net_rx_bytes", "net_tx_bytes",
        "disk_read_bytes", "disk_write_bytes", "processes",
    ]  # fmt: skip
    assert wire["time"] == "2023-11-14T22:13:35.000Z"
    assert wire["cpu_percent"] == 0.3


async def test_the_manager_tells_the_sampler_what_it_forgets(tmp_path: Path) -> None:
    """Samples live as long as the node remembers the sandbox: the 100 newest terminated ones."""
    state = tmp_path / "state"
    network = NetworkPolicy(mode="none")
    for i in range(KEEP_TERMINATED + 1):
        record = SandboxRecord(
            id=f"sbx_{i:016x}", state=SandboxState.TERMINATED, image="default", cpus=1, memory_mb=256,
            disk_mb=512, network=network, idle_timeout_secs=600, created_at=f"2026-01-01T00:00:{i % 60:02d}.000Z",
            terminated_at=f"2026-01-01T01:{i // 60:02d}:{i % 60:02d}.000Z", terminated_reason="request",
        )  # fmt: skip
        (state / "sandboxes" / record.id).mkdir(parents=True)
        write_json_atomic(state / "sandboxes" / record.id / "sandbox.json", record.to_disk(), durable=False)
    manager = SandboxManager(
        NodeConfig(), state, backend=FakeBackend(state, tmp_path / "agent"), images=ImageStore(tmp_path / "images"),
        audit=AuditLog(tmp_path / "audit"), reservations=Reservations(Capacity(cpus=4, memory_mb=4096, disk_mb=10000)),
    )  # fmt: skip
    sampler = MetricsSampler(list, FakeCounters({}))
    for i in range(KEEP_TERMINATED + 1):
        sampler._series[f"sbx_{i:016x}"] = SandboxSeries(capacity=1)
    manager.on_forget.append(sampler.forget)
    await manager.start()  # forgets the oldest terminated sandbox beyond the 100 newest
    await manager.close()
    assert f"sbx_{0:016x}" not in sampler._series
    assert len(sampler._series) == KEEP_TERMINATED


# -- parked sandboxes: never read, their samples known ----------------------------------------------------------


def _usage(cpu_secs: float, memory: int, rx: int) -> BackendUsage:
    return BackendUsage(cpu_ns=int(cpu_secs * 1e9), memory_bytes=memory, net_rx_bytes=rx)


async def test_a_parked_sandbox_is_not_read_and_its_samples_are_exact() -> None:
    target = SampleTarget("sbx_a", 1, GIB)
    awake = [True]
    counters = FakeCounters(
        {"sbx_a": [_usage(0, 100, 5), _usage(1, 200, 7), _usage(2, 300, 9), _usage(2.5, 310, 9)]}
    )
    clock = Clock()
    sampler = MetricsSampler(lambda: [target] if awake[0] else [], counters, clock=clock, wall=clock)
    await sampler.sample_once()  # 1000
    clock.now += 5
    await sampler.sample_once()  # 1005: 1 s of CPU over 5 s
    clock.now += 2
    awake[0] = False  # parked at 1007, after one more second of CPU: read once, then never
    await sampler.park(target)
    counters.calls.clear()
    for now in (1010.0, 1015.0, 1020.0):
        clock.now = now
        await sampler.sample_once()
    assert counters.calls == []
    expected = [
        (1000.0, 0.0, 100, 5),
        (1005.0, 20.0, 200, 7),
        (1010.0, 20.0, 300, 9),  # its last second before the park, over the interval
        (1015.0, 0.0, 300, 9),
        (1020.0, 0.0, 300, 9),
    ]
    got = [(x.time, x.cpu_percent, x.memory_bytes, x.net_rx_bytes) for x in sampler.samples("sbx_a")]
    assert got == [(t, pytest.approx(c), m, r) for t, c, m, r in expected]
    clock.now = 1022  # woken: what was shown stays, and reading goes on from the last parked sample
    sampler.unpark("sbx_a")
    awake[0] = True
    assert [(x.time, x.cpu_percent) for x in sampler.samples("sbx_a")] == [
        (t, pytest.approx(c)) for t, c, _, _ in expected
    ]
    clock.now = 1025
    await sampler.sample_once()
    last = sampler.samples("sbx_a")[-1]
    assert (last.time, last.cpu_percent, last.memory_bytes) == (1025.0, pytest.approx(10.0), 310)


async def test_a_park_within_one_interval_leaves_no_gap_and_counts_the_cpu_before_it() -> None:
    target = SampleTarget("sbx_a", 1, GIB)
    counters = FakeCounters({"sbx_a": [_usage(0, 100, 0), _usage(1, 100, 0), _usage(1.5, 100, 0)]})
    clock = Clock()
    sampler = MetricsSampler(lambda: [target], counters, clock=clock, wall=clock)
    await sampler.sample_once()  # 1000
    clock.now = 1002
    await sampler.park(target)  # 1 s used before it
    clock.now = 1003
    sampler.unpark("sbx_a")  # woken before any round passed
    clock.now = 1005
    await sampler.sample_once()
    assert [(x.time, x.cpu_percent) for x in sampler.samples("sbx_a")] == [
        (1000.0, 0.0),
        (1005.0, pytest.approx(30.0)),
    ]


async def test_a_sandbox_parked_before_its_first_sample_starts_at_zero() -> None:
    target = SampleTarget("sbx_a", 2, GIB)  # e.g. taken back parked after a restart
    sampler = MetricsSampler(list, FakeCounters({"sbx_a": [_usage(40, 500, 3)]}), clock=Clock(), wall=Clock())
    await sampler.park(target)
    await sampler.sample_once()
    samples = sampler.samples("sbx_a")
    assert [(x.cpu_percent, x.memory_bytes, x.net_rx_bytes, x.memory_limit_bytes) for x in samples] == [
        (0.0, 500, 3, GIB)
    ]


def test_a_round_sampled_while_parked_is_not_sampled_again_when_woken_in_it() -> None:
    target = SampleTarget("sbx_a", 1, GIB)
    series = SandboxSeries()
    series.observe(target, _usage(0, 1, 0), 100.0, 100.0, round_index=0)
    series.park(target, _usage(1, 2, 0))
    series.unpark(
        [Round(0, 100.0, 100.0), Round(1, 105.0, 105.0)]
    )  # woken during round 1, not yet read in it
    assert (
        series.observe(target, _usage(1, 3, 0), 105.1, 105.1, round_index=1) is None
    )  # round 1 has its sample
    fresh = series.observe(target, _usage(2, 3, 0), 110.0, 110.0, round_index=2)
    assert fresh is not None and fresh.cpu_percent == pytest.approx(20.0)
    assert [x.time for x in series.ring.samples()] == [100.0, 105.0, 110.0]


def test_parked_samples_are_kept_to_the_hour() -> None:
    target = SampleTarget("sbx_a", 1, GIB)
    series = SandboxSeries(capacity=4)
    series.observe(target, _usage(0, 1, 0), 0.0, 0.0, round_index=0)
    series.park(target, _usage(0, 1, 0))
    rounds = [Round(i, 5.0 * i, 5.0 * i) for i in range(1, 10)]
    series.unpark(rounds)
    assert [x.time for x in series.ring.samples()] == [30.0, 35.0, 40.0, 45.0]
