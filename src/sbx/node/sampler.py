"""Per-sandbox metrics (capability ``metrics``): one task samples the host-side counters of every running
sandbox every ``interval_secs`` (5) and keeps the last hour of each in memory.

Kept with the sandbox only: a terminated sandbox's samples stay readable until the node forgets it
(``forget``), and nothing survives a restart (a sandbox taken back starts a new hour). The counters come from
the backend (``Backend.usage``); the sampler turns them into the spec's sample: a CPU share of the given vCPUs
since the previous sample, and byte totals since the sandbox started that never go back.

A parked sandbox (sbx.node.parking) is not read at all: its processes are stopped, so its counters cannot
change. Its counters are read once when it is parked (:meth:`MetricsSampler.park`), and its samples for the
rounds while it stays parked are known without reading anything: the first one's CPU is what it used between
its last sample and the park, every later one's is 0, and memory and byte totals are those read at the park.
They are made when asked for (and kept when it is woken), from a log of the rounds' times that costs the
same whatever the number of sandboxes, so a round reads only the awake ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from array import array
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from functools import partial
from typing import Any

from sbx.api.metrics import MetricsSample
from sbx.backends.base import BackendUsage
from sbx.node.manager import SandboxManager
from sbx.node.records import SandboxState
from sbx.node.sandbox import Sandbox

log = logging.getLogger(__name__)

#: Seconds between two samples of a sandbox (spec: 5).
INTERVAL_SECS = 5
#: Samples kept per sandbox: one hour at the interval.
SAMPLES_KEPT = 3600 // INTERVAL_SECS

#: Reads the counters of one sandbox; None when it is not running.
UsageSource = Callable[[str], Awaitable[BackendUsage | None]]


@dataclass(frozen=True)
class Sample:
    """One sample as the spec's metrics endpoint reports it. ``time`` is Unix time in seconds; byte counts
    are totals since the sandbox started (or since this server took it back)."""

    time: float
    cpu_percent: float
    memory_bytes: int
    memory_limit_bytes: int
    net_rx_bytes: int
    net_tx_bytes: int
    disk_read_bytes: int
    disk_write_bytes: int
    processes: int

    def wire(self) -> MetricsSample:
        """The spec's metrics sample: ``time`` as RFC 3339, ``cpu_percent`` to one decimal."""
        return MetricsSample(
            time=datetime.fromtimestamp(self.time, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            cpu_percent=round(self.cpu_percent, 1), memory_bytes=self.memory_bytes,
            memory_limit_bytes=self.memory_limit_bytes, net_rx_bytes=self.net_rx_bytes,
            net_tx_bytes=self.net_tx_bytes, disk_read_bytes=self.disk_read_bytes,
            disk_write_bytes=self.disk_write_bytes, processes=self.processes,
        )  # fmt: skip


_NAMES = tuple(f.name for f in fields(Sample))
_FIELDS = len(_NAMES)
_INT_FIELDS = tuple(i for i, f in enumerate(fields(Sample)) if f.type == "int")


class SampleRing:
    """The newest ``capacity`` samples in one flat array of doubles, 72 bytes a sample (an hour: 52 KB).

    Doubles hold every integer below 2**53 exactly: byte totals up to 8 PiB.
    """

    def __init__(self, capacity: int = SAMPLES_KEPT) -> None:
        if capacity < 1:
            raise ValueError("a sample ring holds at least one sample")
        self.capacity = capacity
        self._values = array("d", bytes(8 * _FIELDS * capacity))
        self._next = 0  # slot the next sample goes to
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def append(self, sample: Sample) -> None:
        start = self._next * _FIELDS
        self._values[start : start + _FIELDS] = array("d", [getattr(sample, name) for name in _NAMES])
        self._next = (self._next + 1) % self.capacity
        self._count = min(self._count + 1, self.capacity)

    def samples(self) -> list[Sample]:
        """Oldest first."""
        first = (self._next - self._count) % self.capacity
        out = []
        for k in range(self._count):
            start = ((first + k) % self.capacity) * _FIELDS
            row: list[Any] = list(self._values[start : start + _FIELDS])
            for i in _INT_FIELDS:
                row[i] = int(row[i])
            out.append(Sample(*row))
        return out


class CounterTotal:
    """A total that never goes back, fed with readings of a counter that may restart from 0.

    A reading below the previous one means the counter restarted (a process of the sandbox exited and took its
    share with it, an interface was recreated): what it counts since then is added, nothing is subtracted.
    The first reading is the starting total.
    """

    def __init__(self) -> None:
        self.total = 0
        self._last: int | None = None

    def update(self, reading: int) -> int:
        if self._last is None:
            self.total = reading
        else:
            self.total += reading - self._last if reading >= self._last else reading
        self._last = reading
        return self.total


def cpu_share(cpu_ns: int, elapsed_secs: float, cpus: int) -> float:
    """Percent of ``cpus`` vCPUs that ``cpu_ns`` of CPU time used over ``elapsed_secs``, within 0 to 100."""
    if elapsed_secs <= 0 or cpus <= 0:
        return 0.0
    return max(0.0, min(100.0, cpu_ns / (elapsed_secs * 1e9 * cpus) * 100))


def _always() -> bool:
    return True


@dataclass(frozen=True)
class SampleTarget:
    """A running sandbox to sample: its id, its vCPUs and the memory it was given in bytes (the limit
    reported when the backend knows none). ``running`` says whether it still runs when its turn in a round
    comes (a round yields between sandboxes)."""

    sandbox_id: str
    cpus: int
    memory_bytes: int
    running: Callable[[], bool] = _always


@dataclass(frozen=True)
class Round:
    """One sampling round: its number (counting from 0) and when it began (monotonic and Unix seconds)."""

    index: int
    monotonic: float
    wall: float


@dataclass(frozen=True)
class _Parked:
    """What a parked sandbox's samples are made of: its CPU total at the park (ns, as the series counts it),
    the other fields as read then, and its vCPUs."""

    cpu_total: int
    cpus: int
    fields: dict[str, int]


class SandboxSeries:
    """One sandbox's ring and the previous readings its next sample is computed from."""

    def __init__(self, capacity: int = SAMPLES_KEPT) -> None:
        self.ring = SampleRing(capacity)
        self._cpu = CounterTotal()
        self._last_cpu_ns: int | None = None
        self._last_at = 0.0
        self._totals = {
            k: CounterTotal() for k in ("net_rx_bytes", "net_tx_bytes", "disk_read_bytes", "disk_write_bytes")
        }
        #: The round of the newest sample (-1: none yet); a round is sampled once.
        self.last_round = -1
        self._parked: _Parked | None = None

    @property
    def parked(self) -> bool:
        return self._parked is not None

    def observe(
        self, target: SampleTarget, usage: BackendUsage, monotonic: float, wall: float, round_index: int = -1
    ) -> Sample | None:
        """Add the sample made of ``usage`` read at ``monotonic``/``wall`` seconds in round ``round_index``;
        the first one's CPU is 0. None (nothing added) while parked or when that round has its sample."""
        if self._parked is not None or (round_index >= 0 and round_index <= self.last_round):
            return None
        cpu_total = self._cpu.update(usage.cpu_ns)
        percent = 0.0
        if self._last_cpu_ns is not None:
            percent = cpu_share(cpu_total - self._last_cpu_ns, monotonic - self._last_at, target.cpus)
        self._last_cpu_ns, self._last_at = cpu_total, monotonic
        totals = {k: total.update(getattr(usage, k)) for k, total in self._totals.items()}
        sample = Sample(
            time=wall,
            cpu_percent=percent,
            memory_bytes=usage.memory_bytes,
            memory_limit_bytes=usage.memory_limit_bytes or target.memory_bytes,
            processes=usage.processes,
            **totals,
        )
        self.ring.append(sample)
        self.last_round = max(self.last_round, round_index)
        return sample

    def park(self, target: SampleTarget, usage: BackendUsage) -> None:
        """The sandbox is parked and ``usage`` is what its counters say (they no longer change)."""
        if self._parked is not None:
            return
        cpu_total = self._cpu.update(usage.cpu_ns)
        fields = {k: total.update(getattr(usage, k)) for k, total in self._totals.items()}
        fields["memory_bytes"] = usage.memory_bytes
        fields["memory_limit_bytes"] = usage.memory_limit_bytes or target.memory_bytes
        fields["processes"] = usage.processes
        self._parked = _Parked(cpu_total, target.cpus, fields)

    def parked_samples(self, rounds: Iterable[Round]) -> list[Sample]:
        """The samples of the ``rounds`` (oldest first) after the newest one sampled, while parked."""
        parked = self._parked
        if parked is None:
            return []
        out = []
        last_cpu, last_at = self._last_cpu_ns, self._last_at
        for each in rounds:
            if each.index <= self.last_round:
                continue
            percent = 0.0
            if last_cpu is not None:
                percent = cpu_share(parked.cpu_total - last_cpu, each.monotonic - last_at, parked.cpus)
            last_cpu, last_at = parked.cpu_total, each.monotonic
            out.append(Sample(time=each.wall, cpu_percent=percent, **parked.fields))
        return out

    def unpark(self, rounds: Iterable[Round]) -> None:
        """The sandbox is awake again (or terminated): its samples while parked are kept, and the next one is
        computed from the last of them."""
        parked = self._parked
        if parked is None:
            return
        rounds = list(rounds)
        made = self.parked_samples(rounds)
        for sample in made:
            self.ring.append(sample)
        if made:
            newest = [r for r in rounds if r.index > self.last_round][-1]
            self.last_round = newest.index
            self._last_cpu_ns, self._last_at = parked.cpu_total, newest.monotonic
        self._parked = None


class MetricsSampler:
    """Samples ``targets()`` (the running sandboxes) every ``interval_secs`` through ``usage``.

    ``clock`` (monotonic seconds) and ``wall`` (Unix seconds) are replaceable for tests.
    """

    def __init__(
        self,
        targets: Callable[[], Iterable[SampleTarget]],
        usage: UsageSource,
        interval_secs: int = INTERVAL_SECS,
        capacity: int = SAMPLES_KEPT,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.interval_secs = interval_secs
        self.capacity = capacity
        self._targets = targets
        self._usage = usage
        self._clock = clock
        self._wall = wall
        self._series: dict[str, SandboxSeries] = {}
        self._task: asyncio.Task[None] | None = None
        #: How long the last round took, in seconds (every awake running sandbox read once).
        self.last_round_secs = 0.0
        #: The rounds of the last ``capacity`` intervals (what parked sandboxes' samples are dated by).
        self._rounds: deque[Round] = deque(maxlen=capacity)
        self._round_count = 0

    def samples(self, sandbox_id: str) -> list[Sample]:
        """The sandbox's samples, oldest first; [] for one never sampled or forgotten."""
        series = self._series.get(sandbox_id)
        if series is None:
            return []
        kept = series.ring.samples()
        if series.parked:
            kept = (kept + series.parked_samples(self._rounds))[-self.capacity :]
        return kept

    def forget(self, sandbox_id: str) -> None:
        """Drop a sandbox's samples (the node forgot the sandbox)."""
        self._series.pop(sandbox_id, None)

    async def park(self, target: SampleTarget) -> None:
        """The sandbox is parked: read its counters once, then no more until :meth:`unpark`."""
        usage = await self._read_usage(target.sandbox_id)
        if usage is None:
            return
        series = self._series.get(target.sandbox_id)
        if series is None:
            series = self._series[target.sandbox_id] = SandboxSeries(self.capacity)
        series.park(target, usage)

    def unpark(self, sandbox_id: str) -> None:
        """The sandbox is awake again or terminated: its parked samples are kept, reading goes on."""
        series = self._series.get(sandbox_id)
        if series is not None:
            series.unpark(self._rounds)

    async def _read_usage(self, sandbox_id: str) -> BackendUsage | None:
        """The sandbox's counters; None when it has none (gone) or they cannot be read (logged)."""
        try:
            return await self._usage(sandbox_id)
        except OSError as exc:
            log.warning("sandbox counters unreadable", extra={"sandbox": sandbox_id, "error": str(exc)})
            return None

    async def sample_once(self) -> None:
        """One round: read and record every target once."""
        started = self._clock()
        current = Round(self._round_count, started, self._wall())
        self._round_count += 1
        self._rounds.append(current)
        for target in list(self._targets()):
            # Terminated (perhaps forgotten) since the round began: never sampled after the end.
            if not target.running():
                continue
            series = self._series.get(target.sandbox_id)
            if series is None:
                series = self._series[target.sandbox_id] = SandboxSeries(self.capacity)
            usage = await self._read_usage(target.sandbox_id)
            # Gone, unreadable, or forgotten while its counters were read: the sample goes nowhere rather than
            # bring the series back.
            if usage is None or self._series.get(target.sandbox_id) is not series:
                continue
            series.observe(target, usage, self._clock(), self._wall(), current.index)
            # Let requests in between sandboxes: a round over hundreds of them must not hold the loop at once.
            await asyncio.sleep(0)
        self.last_round_secs = self._clock() - started

    async def start(self) -> None:
        """Start sampling (the first round at once)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        # Rounds on a fixed grid so samples stay interval_secs apart; a round that overruns skips ticks.
        next_at = self._clock()
        while True:
            try:
                await self.sample_once()
            except Exception:
                log.exception("metrics sampling round failed")
            now = self._clock()
            next_at += self.interval_secs * (int((now - next_at) // self.interval_secs) + 1)
            await asyncio.sleep(max(0.0, next_at - now))


def running_targets(manager: SandboxManager) -> list[SampleTarget]:
    """The manager's running sandboxes that are not parked (pending, suspended, parked and terminated ones are
    not read), from its index of them: no walk over the idle ones."""
    return [target_of(s) for s in manager.awake()]


def target_of(sandbox: Sandbox) -> SampleTarget:
    """What the sampler reads of ``sandbox``."""
    record = sandbox.record
    return SampleTarget(record.id, record.cpus, record.memory_mb * 1024 * 1024, partial(_is_awake, sandbox))


def _is_awake(sandbox: Sandbox) -> bool:
    return sandbox.record.state is SandboxState.RUNNING and not sandbox.parked
