"""Read-your-writes across replicas (docs/ha.md): ``CatchUp``, the calls of ``Store.caught_up`` shared by concurrent
callers (a newcomer never shares a call already running, at most one runs at a time, a timeout or a failure is
False), and the HTTP layer's use of it — every read waits for it before its key is looked up, a write does not, a
read is refused 503 while a replica cannot catch up, and a SQLite gateway never calls it. Then the whole path on
PostgreSQL: a gateway in this process answering reads of what a second store (another replica) has just committed."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pg_cluster import PgCluster

from sbx.gateway import keys
from sbx.gateway.catchup import CatchUp
from sbx.gateway.jobs.controller import JobOptions
from sbx.gateway.middlewares import make_middlewares
from sbx.gateway.nodes import Registry
from sbx.gateway.routes import install
from sbx.gateway.server import NOT_CAUGHT_UP, Gateway, GatewayOptions
from sbx.gateway.state import Quota
from sbx.gateway.store import Store, StoreLocation, open_store
from sbx.gateway.store.sqlite import SqliteStore

# -- CatchUp ------------------------------------------------------------------------------------------------


class Calls:
    """A stand-in for ``Store.caught_up``: each call blocks until released (``release``), then returns what
    ``results`` says for its number (1-based; True past the end) or raises it; counts how many run at once."""

    def __init__(self, results: list[bool | Exception] | None = None) -> None:
        self.results = results or []
        self.started = 0
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()
        self._go = threading.Semaphore(0)

    def __call__(self) -> bool:
        with self._lock:
            self.started += 1
            number = self.started
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        self._go.acquire()
        with self._lock:
            self.running -= 1
        result = self.results[number - 1] if number <= len(self.results) else True
        if isinstance(result, Exception):
            raise result
        return result

    async def awaited(self) -> bool:
        """A call as ``CatchUp`` makes it (blocking, so on a thread)."""
        return await asyncio.to_thread(self)

    def release(self, calls: int = 1) -> None:
        for _ in range(calls):
            self._go.release()


async def started(calls: Calls, count: int) -> None:
    deadline = time.monotonic() + 10
    while calls.started < count:
        assert time.monotonic() < deadline, f"call {count} did not start"
        await asyncio.sleep(0.001)


async def test_one_caller_is_answered_by_one_call() -> None:
    calls = Calls()
    catch_up = CatchUp(calls.awaited, timeout_secs=10)
    waiting = asyncio.create_task(catch_up())
    await started(calls, 1)
    calls.release()
    assert await waiting is True
    assert (calls.started, catch_up.calls) == (1, 1)


async def test_callers_arriving_during_a_call_share_the_next_one_never_the_running_one() -> None:
    # The running call (the first) answers False; had a newcomer shared it, it would be told False too.
    calls = Calls([False])
    catch_up = CatchUp(calls.awaited, timeout_secs=10)
    first = asyncio.create_task(catch_up())
    await started(calls, 1)
    newcomers = [asyncio.create_task(catch_up()) for _ in range(20)]
    await asyncio.sleep(0.05)
    assert calls.started == 1  # they wait for the running call to end: one call at a time
    calls.release()
    await started(calls, 2)
    calls.release()
    assert await first is False
    assert await asyncio.gather(*newcomers) == [True] * 20
    assert (calls.started, calls.most_at_once) == (2, 1)


async def test_a_call_that_does_not_end_in_time_is_false_and_the_next_caller_gets_a_call_of_its_own() -> None:
    calls = Calls()
    catch_up = CatchUp(calls.awaited, timeout_secs=0.1)
    assert await catch_up() is False  # the first call is still blocked
    calls.release()  # it ends now; nobody waits for it any more
    later = asyncio.create_task(catch_up())
    await started(calls, 2)
    calls.release()
    assert await later is True


async def test_a_call_that_fails_is_false_and_the_next_one_is_made(caplog: pytest.LogCaptureFixture) -> None:
    calls = Calls([RuntimeError("the database went away")])
    catch_up = CatchUp(calls.awaited, timeout_secs=10)
    calls.release(2)
    assert await catch_up() is False
    assert "catching up with the other replicas failed" in caplog.text
    assert await catch_up() is True


async def test_a_cancelled_caller_leaves_the_others_answered() -> None:
    calls = Calls()
    catch_up = CatchUp(calls.awaited, timeout_secs=10)
    leaving, staying = asyncio.create_task(catch_up()), asyncio.create_task(catch_up())
    await started(calls, 1)
    leaving.cancel()
    calls.release()
    assert await staying is True
    with pytest.raises(asyncio.CancelledError):
        await leaving


async def test_a_cancel_arriving_with_the_answer_is_not_lost() -> None:
    # A caller cancelled in the very turn its answer arrives (a service's control loop ended by a delete): the
    # cancellation wins. asyncio.wait_for on Python 3.11 returned the answer instead, and the loop ran on.
    calls = Calls()
    catch_up = CatchUp(calls.awaited, timeout_secs=10)
    first = asyncio.create_task(catch_up())
    await started(calls, 1)
    second = asyncio.create_task(catch_up())
    await asyncio.sleep(0)
    [answer] = catch_up._waiting  # the second caller's, for the next call
    answer.set_result(True)
    second.cancel()
    try:
        with pytest.raises(asyncio.CancelledError):
            await second
    finally:
        calls.release(2)
    assert await first is True


# -- the HTTP layer -----------------------------------------------------------------------------------------


class Behind(SqliteStore):
    """A SQLite store posing as one shared with other replicas, whose catch-up says ``caught`` (a replica whose
    database or notifications are out of reach when False)."""

    caught = True

    @property
    def shared(self) -> bool:
        return True

    def caught_up(self, timeout_secs: float) -> bool:
        return self.caught


@dataclass
class Served:
    client: TestClient  # type: ignore[type-arg]
    gateway: Gateway
    admin: str


@pytest.fixture
async def served_ones() -> AsyncIterator[list[Served]]:
    """The gateways ``serve`` started, each stopped at the end with its store."""
    ones: list[Served] = []
    yield ones
    for served in ones:
        await served.client.close()
        await served.gateway.close()
        served.gateway.store.close()


async def serve(store: Store, tmp_path: Path, ones: list[Served]) -> Served:
    """A gateway (no nodes) on ``store``, served over HTTP; its admin key."""
    admin_key, admin = keys.new_key("root", "", {"admin"})
    store.add_key(admin_key)
    gateway = Gateway(
        store, Registry(poll_interval_secs=0.05), None, GatewayOptions(jobs=JobOptions(tmp_path))
    )
    await gateway.start()
    app = web.Application(middlewares=make_middlewares(gateway))
    install(app, gateway)
    client = TestClient(TestServer(app))
    await client.start_server()
    ones.append(Served(client, gateway, admin))
    return ones[-1]


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_every_read_catches_up_first_and_a_write_does_not(
    tmp_path: Path, served_ones: list[Served]
) -> None:
    s = await serve(Behind.open(tmp_path / "gw.db"), tmp_path, served_ones)
    for path in ("/v1/whoami", "/v1/admin/keys", "/v1/admin/quotas", "/v1/orgs", "/v1/services", "/v1/jobs"):
        before = s.gateway.catch_up.calls
        resp = await s.client.get(path, headers=bearer(s.admin))
        assert resp.status == 200, (path, resp.status, await resp.text())
        assert s.gateway.catch_up.calls == before + 1, path
    before = s.gateway.catch_up.calls
    resp = await s.client.put("/v1/admin/quotas/acme", json={"sandboxes": 3}, headers=bearer(s.admin))
    assert resp.status == 200, await resp.text()
    assert s.gateway.catch_up.calls == before  # a write with a known key: nothing to wait for
    # No credential, no wait: nothing is read for it (neither for the health and readiness checks).
    for path in ("/v1/admin/keys", "/v1/health", "/v1/ready"):
        await s.client.get(path)
    assert s.gateway.catch_up.calls == before


async def test_a_read_is_refused_while_the_replica_cannot_catch_up(
    tmp_path: Path, served_ones: list[Served]
) -> None:
    store = Behind.open(tmp_path / "gw.db")
    s = await serve(store, tmp_path, served_ones)
    store.caught = False
    resp = await s.client.get("/v1/admin/keys", headers=bearer(s.admin))
    assert resp.status == 503
    assert (await resp.json())["error"] == {"code": "unavailable", "message": NOT_CAUGHT_UP}
    # A write goes on: it does not answer from memory alone (its own checks catch up where they must).
    resp = await s.client.put("/v1/admin/quotas/acme", json={"sandboxes": 3}, headers=bearer(s.admin))
    assert resp.status == 200, await resp.text()
    store.caught = True
    assert (await s.client.get("/v1/admin/keys", headers=bearer(s.admin))).status == 200


async def test_a_sqlite_gateway_never_catches_up(tmp_path: Path, served_ones: list[Served]) -> None:
    s = await serve(open_store(StoreLocation(state=tmp_path / "gw.db"), serving=True), tmp_path, served_ones)
    for _ in range(5):
        assert (await s.client.get("/v1/admin/keys", headers=bearer(s.admin))).status == 200
    assert s.gateway.catch_up.calls == 0


# -- on PostgreSQL: another replica's commit in the very next answer ----------------------------------------------


async def test_a_commit_of_another_replica_is_in_the_next_answer(
    pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, served_ones: list[Served]
) -> None:
    """Another store on the same database plays the other replica: each of its commits (a key, a revocation, a
    quota set and removed: a row carried in the notification, one read back, one deleted) is in this gateway's
    next answer, round after round, with nothing waited for in between."""
    for name, value in pg_cluster.env().items():
        monkeypatch.setenv(name, value)
    location = StoreLocation(database=pg_cluster.create_database())
    s = await serve(open_store(location, serving=True), tmp_path, served_ones)
    other = open_store(location, serving=True)
    try:
        for i in range(30):
            key, secret = keys.new_key(f"u{i}", "acme", {"sandbox:read"})
            await asyncio.to_thread(other.add_key, key)
            listed = await (await s.client.get("/v1/admin/keys", headers=bearer(s.admin))).json()
            assert key.id in [k["id"] for k in listed["keys"]], i
            assert (await s.client.get("/v1/whoami", headers=bearer(secret))).status == 200, i
            await asyncio.to_thread(other.revoke_key, key.id)
            assert (await s.client.get("/v1/whoami", headers=bearer(secret))).status == 401, i
            await asyncio.to_thread(other.set_quota, f"t{i}", Quota(max_sandboxes=i + 1))
            quotas = await (await s.client.get("/v1/admin/quotas", headers=bearer(s.admin))).json()
            assert [q["sandboxes"] for q in quotas["quotas"] if q["tenant"] == f"t{i}"] == [i + 1], i
            await asyncio.to_thread(other.set_quota, f"t{i}", Quota())
            quotas = await (await s.client.get("/v1/admin/quotas", headers=bearer(s.admin))).json()
            assert f"t{i}" not in [q["tenant"] for q in quotas["quotas"]], i
    finally:
        other.close()
