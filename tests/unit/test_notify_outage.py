"""The job notification outbox outlives its database going away: PostgreSQL (a private cluster) is stopped as in
a crash while the notifier starts, and once it is back a notification written then is delivered."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest
from aiohttp import web
from hook_receiver import Writer, receiver
from pg_cluster import PgCluster

from sbx.api.jobs import JobNotification
from sbx.gateway.jobs import notify
from sbx.gateway.jobs.notify import Notifier, NotifyPolicy
from sbx.gateway.store import StoreLocation, open_store


async def test_the_outbox_outlives_its_database_going_away(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(notify, "STORE_RETRY_SECS", 0.5)
    caplog.set_level(logging.WARNING, logger="sbx.gateway.jobs.notify")
    received: list[bytes] = []

    async def hook(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.Response(status=204)

    async with receiver(hook) as hook_url:
        cluster = await asyncio.to_thread(PgCluster.start)  # its own: this one is stopped under the notifier
        notifier: Notifier | None = None
        try:
            for name, value in cluster.env().items():
                monkeypatch.setenv(name, value)
            url = await asyncio.to_thread(cluster.create_database)
            store = await asyncio.to_thread(open_store, StoreLocation(database=url))
            notifier = Notifier(Writer(), store, NotifyPolicy(enabled=True, allow_private=True))  # type: ignore[arg-type]
            await asyncio.to_thread(cluster.pause)
            await notifier.start()
            # Down until the outbox's first read has failed (the pool waits up to 10 s for a connection first).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (
                "the outbox cannot be used now" in caplog.text
                or (notifier._task is not None and notifier._task.done())
            ):
                await asyncio.sleep(0.1)
            assert "the outbox cannot be used now" in caplog.text
            await asyncio.to_thread(cluster.resume)
            note = JobNotification(event="job.finished", job="job_1", job_state="succeeded")
            await asyncio.to_thread(store.execute, [notifier.statement("job_1", hook_url, note)])
            notifier.wake()
            deadline = time.monotonic() + 60
            while not received and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert len(received) == 1 and b'"job":"job_1"' in received[0]
            deadline = time.monotonic() + 30
            while store.query("notifications", ("id",)) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert store.query("notifications", ("id",)) == []  # delivered once, then taken out of the outbox
            await notifier.close()
            notifier = None
            store.close()
        finally:
            try:
                if notifier is not None:
                    with contextlib.suppress(Exception):  # a notifier that died already said why above
                        await notifier.close()
            finally:
                await asyncio.to_thread(cluster.stop)
