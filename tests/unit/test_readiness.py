"""The readiness check (``GET /v1/ready``, docs/ha.md): the store's part on both stores — ready while it can serve,
not ready (with a reason and nothing secret) while PostgreSQL is unreachable and once the owner lock is lost —
and the route's part: a flood of checks asks the store once a second at most, and a draining gateway is not
ready whatever the store says."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from pg_cluster import PgCluster

from sbx.api.errors import Unavailable
from sbx.gateway.routes.meta import READY_CACHE_SECS, MetaRoutes
from sbx.gateway.store import StoreLocation, open_store
from sbx.gateway.store.base import Store


def test_a_sqlite_store_is_always_ready(tmp_path: Path) -> None:
    store = open_store(StoreLocation(state=tmp_path / "gateway.db"), serving=True)
    try:
        assert store.not_ready() is None
    finally:
        store.close()


def test_a_postgres_store_is_not_ready_while_its_database_is_away(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = PgCluster.start()  # its own: this one is stopped under the store
    try:
        for name, value in cluster.env().items():
            monkeypatch.setenv(name, value)
        url = cluster.create_database()
        store = open_store(StoreLocation(database=url), serving=True)
        lost: list[str] = []
        store.watch_owner(lost.append)
        store.listen(lambda changes: None)
        assert store.not_ready() is None
        cluster.pause()
        reason = store.not_ready()
        assert reason is not None and reason.startswith("it ")
        assert (
            cluster.password not in reason and "sbx" not in reason
        )  # no URL, user or password in the answer
        deadline = time.monotonic() + 60
        while not lost and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lost
        assert store.not_ready() == "it lost the database's owner lock and is stopping"
        cluster.resume()
        # The database is back, but the lock was lost: this replica stays not ready until it is restarted.
        assert store.not_ready() == "it lost the database's owner lock and is stopping"
        store.close()
    finally:
        cluster.stop()


class CountingStore:
    """A real SQLite store whose readiness answers are counted and can be set."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.calls = 0
        self.answer: str | None = None

    def not_ready(self) -> str | None:
        self.calls += 1
        time.sleep(0.05)  # a round trip: requests meanwhile share it
        assert self.store.not_ready() is None
        return self.answer


class Gw:
    def __init__(self, store: CountingStore) -> None:
        self.store = store
        self.draining = False


async def _ask(meta: MetaRoutes) -> tuple[int, dict[str, Any]]:
    try:
        answer = await meta.ready(None)  # type: ignore[arg-type]
    except Unavailable as exc:
        return 503, {"message": exc.message}
    assert isinstance(answer, web.Response) and answer.body is not None
    return answer.status, msgspec.json.decode(answer.body)  # type: ignore[arg-type]


async def test_a_flood_of_checks_asks_the_store_once_a_second_and_draining_is_not_ready(
    tmp_path: Path,
) -> None:
    store = open_store(StoreLocation(state=tmp_path / "gateway.db"), serving=True)
    try:
        counting = CountingStore(store)
        gw = Gw(counting)
        meta = MetaRoutes(gw)  # type: ignore[arg-type]
        answers = await asyncio.gather(*(_ask(meta) for _ in range(200)))
        assert answers == [(200, {"status": "ready"})] * 200
        assert counting.calls == 1
        counting.answer = "it cannot reach its database"
        assert (await _ask(meta))[0] == 200  # cached for READY_CACHE_SECS
        await asyncio.sleep(READY_CACHE_SECS + 0.1)
        assert await _ask(meta) == (
            503,
            {"message": "this gateway is not ready: it cannot reach its database"},
        )
        assert counting.calls == 2
        counting.answer = None
        gw.draining = True
        await asyncio.sleep(READY_CACHE_SECS + 0.1)
        assert await _ask(meta) == (503, {"message": "this gateway is not ready: it is stopping"})
    finally:
        store.close()
