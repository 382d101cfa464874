"""The job notification outbox's per-row lease on PostgreSQL (a private cluster): claims made at once by several
workers never share a row, two outbox workers on one database deliver each notification once (in each job's
order), and a worker SIGKILLed after its claim and before its end has its row delivered again by the other only
once its lease has ended (the one delivery that stays at-least-once: the receiver got it, its answer was lost)."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from aiohttp import web
from hook_receiver import Writer, receiver
from pg_cluster import PgCluster

from sbx.api.jobs import JobNotification
from sbx.gateway.jobs import notify
from sbx.gateway.jobs.notify import Notifier, NotifyPolicy
from sbx.gateway.store import Store, StoreLocation, open_store


@pytest.fixture
def url(pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in pg_cluster.env().items():
        monkeypatch.setenv(name, value)
    return pg_cluster.create_database()


@pytest.fixture
def stores(url: str) -> Iterator[list[Store]]:
    opened = [open_store(StoreLocation(database=url), serving=True) for _ in range(2)]
    yield opened
    for s in opened:
        s.close()


def _note(job: str, event: str) -> JobNotification:
    return JobNotification(
        event=event, job=job, job_state="succeeded" if event == "job.finished" else "running"
    )


def test_claims_made_at_once_never_share_a_row(stores: list[Store], url: str) -> None:
    notifier = Notifier(Writer(), stores[0], NotifyPolicy(allow_private=True))  # type: ignore[arg-type]
    stores[0].execute(
        [
            notifier.statement(f"job_{i}", "https://hooks.example/x", _note(f"job_{i}", "job.finished"))
            for i in range(40)
        ]
    )
    claimers = [*stores, *(open_store(StoreLocation(database=url), serving=True) for _ in range(4))]
    claimed: list[list[Any]] = [[] for _ in claimers]
    barrier = threading.Barrier(len(claimers))

    def claim(i: int) -> None:
        barrier.wait()
        for _ in range(3):
            claimed[i] += [row[0] for row in claimers[i].claim_notifications(f"w{i}", 60.0)]

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(claimers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in claimers[2:]:
        s.close()
    every = [row_id for ids in claimed for row_id in ids]
    assert len(every) == len(set(every)) == 40  # each row claimed once, by one worker
    # A claim ended by another worker than its owner changes nothing; by its owner, it deletes the row.
    owner = next(i for i, ids in enumerate(claimed) if ids)
    row_id = claimed[owner][0]
    assert stores[0].end_claim(row_id, "someone-else", None) is False
    assert stores[0].end_claim(row_id, f"w{owner}", None) is True
    assert row_id not in [r[0] for r in stores[0].query("notifications", ("id",))]


async def test_two_workers_deliver_each_notification_once_in_order(stores: list[Store]) -> None:
    received: list[tuple[str, str]] = []

    async def hook(request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        await asyncio.sleep(0.02)
        received.append((body["job"], body["event"]))
        return web.Response(status=204)

    async with receiver(hook) as hook_url:
        workers = [Notifier(Writer(), s, NotifyPolicy(allow_private=True)) for s in stores]  # type: ignore[arg-type]
        for w in workers:
            await w.start()
        try:
            wanted: list[tuple[str, str]] = []
            # Written in batches while both run, each batch waking both: they claim together every time.
            for batch in range(6):
                rows = []
                for i in range(8):
                    job = f"job_{batch}_{i}"
                    for event in ("run.finished", "job.finished"):
                        rows.append(workers[0].statement(job, hook_url, _note(job, event)))
                        wanted.append((job, event))
                await asyncio.to_thread(stores[batch % 2].execute, rows)
                for w in workers:
                    w.wake()
                await asyncio.sleep(0.05)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and (
                len(received) < len(wanted) or stores[0].query("notifications", ("id",))
            ):
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # a duplicate would arrive by now
        finally:
            for w in workers:
                await w.close()
    assert sorted(received) == sorted(wanted)  # each once
    for job in {j for j, _ in wanted}:
        assert [e for j, e in received if j == job] == ["run.finished", "job.finished"]
    assert stores[0].query("notifications", ("id",)) == []


_WORKER = """
import asyncio, sys
from sbx.gateway.jobs import notify
from sbx.gateway.jobs.notify import Notifier, NotifyPolicy
from sbx.gateway.store import StoreLocation, open_store
notify.LEASE_SECS = float(sys.argv[2])
notify.LEASE_MARGIN_SECS = 1.0

class Writer:
    async def write(self, fn, *args):
        return await asyncio.to_thread(fn, *args)

async def main():
    store = open_store(StoreLocation(database=sys.argv[1]), serving=True)
    worker = Notifier(Writer(), store, NotifyPolicy(allow_private=True))
    await worker.start()
    await asyncio.sleep(600)

asyncio.run(main())
"""

#: The lease in the SIGKILL test (seconds): the other worker must not deliver the row before about this long.
TEST_LEASE_SECS = 8.0


async def test_a_worker_killed_mid_delivery_has_its_row_delivered_again_after_its_lease(
    stores: list[Store], url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(notify, "LEASE_SECS", TEST_LEASE_SECS)
    monkeypatch.setattr(notify, "LEASE_MARGIN_SECS", 1.0)
    arrivals: list[float] = []
    first = asyncio.Event()
    release = asyncio.Event()

    async def hook(request: web.Request) -> web.Response:
        await request.read()
        arrivals.append(time.monotonic())
        if len(arrivals) == 1:
            first.set()
            await release.wait()  # the first worker's answer never comes: it is killed meanwhile
        return web.Response(status=204)

    proc: asyncio.subprocess.Process | None = None
    survivor: Notifier | None = None
    async with receiver(hook) as hook_url:
        try:
            writer = Notifier(Writer(), stores[0], NotifyPolicy(allow_private=True))  # type: ignore[arg-type]
            await asyncio.to_thread(
                stores[0].execute, [writer.statement("job_1", hook_url, _note("job_1", "job.finished"))]
            )
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _WORKER, url, str(TEST_LEASE_SECS)
            )
            async with asyncio.timeout(60):
                await first.wait()  # claimed and posted: now killed before it can end its claim
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            survivor = Notifier(Writer(), stores[1], NotifyPolicy(allow_private=True))  # type: ignore[arg-type]
            await survivor.start()
            deadline = time.monotonic() + 60
            while len(arrivals) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert len(arrivals) == 2
            # Not before the lease ended (it began a moment before the first arrival).
            assert arrivals[1] - arrivals[0] >= TEST_LEASE_SECS - 2.0, arrivals
            deadline = time.monotonic() + 30
            while stores[1].query("notifications", ("id",)) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert stores[1].query("notifications", ("id",)) == []
            await asyncio.sleep(1.0)
            assert len(arrivals) == 2  # and once only by the survivor
        finally:
            release.set()
            if proc is not None and proc.returncode is None:
                proc.kill()
                await proc.wait()
            if survivor is not None:
                await survivor.close()
