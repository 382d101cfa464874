"""The locks the replicas share (``Store.lock``) on PostgreSQL (a private cluster): held on a bounded pool of
connections however many wait, a 503 with its message when every one stays busy (and nothing taken), a lock
held elsewhere waited for and a 503 after the wait, and a dead holder's locks free at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from pg_cluster import PgCluster

from sbx.api.errors import Unavailable
from sbx.gateway.store import Store, StoreLocation, open_store
from sbx.gateway.store import postgres as pg

#: pg_locks shows an advisory lock on two int4 keys as classid, objid and objsubid 2.
_CLASSES = f"{pg.TENANT_LOCK_CLASS}, {pg.NODE_LOCK_CLASS}, {pg.NAME_LOCK_CLASS}"
_HELD = (
    "SELECT classid::bigint, objid::bigint, pid FROM pg_locks "
    f"WHERE locktype = 'advisory' AND objsubid = 2 AND granted AND classid::bigint IN ({_CLASSES})"
)


@pytest.fixture
def url(pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in pg_cluster.env().items():
        monkeypatch.setenv(name, value)
    return pg_cluster.create_database()


def _open(url: str) -> Store:
    return open_store(StoreLocation(database=url), serving=True)


def _held(cluster: PgCluster, url: str) -> list[tuple[int, int, int]]:
    with cluster.connect(url.split("/")[3].split("?")[0]) as conn:
        return [tuple(r) for r in conn.execute(_HELD).fetchall()]


@pytest.fixture
def store(url: str) -> Iterator[Store]:
    s = _open(url)
    yield s
    s.close()


def test_many_lockers_never_hold_more_than_the_pool(pg_cluster: PgCluster, url: str, store: Store) -> None:
    """Thirty threads lock thirty tenants at once, each holding its lock a while: all of them get it in turn,
    and never more than LOCK_POOL_SIZE sessions hold locks at once (before the pool, thirty did)."""
    done: list[str] = []
    errors: list[BaseException] = []
    most = 0
    stop = threading.Event()

    def locker(i: int) -> None:
        try:
            handle = store.lock([("tenant", f"t{i}"), ("name", f"sandbox/u{i}/t{i}")])
            time.sleep(0.3)
            store.unlock(handle)
            done.append(f"t{i}")
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)

    def sample() -> None:
        nonlocal most
        while not stop.is_set():
            most = max(most, len({pid for _, _, pid in _held(pg_cluster, url)}))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=locker, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    sampler.join()
    assert errors == [] and len(done) == 30
    assert 1 < most <= pg.LOCK_POOL_SIZE  # concurrent, and bounded
    assert _held(pg_cluster, url) == []  # every lock let go of


def test_every_lock_connection_busy_is_a_503_and_takes_nothing(
    pg_cluster: PgCluster, url: str, store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg, "LOCK_POOL_WAIT_SECS", 1)
    handles = [store.lock([("tenant", f"busy{i}")]) for i in range(pg.LOCK_POOL_SIZE)]
    before = sorted(_held(pg_cluster, url))
    started = time.monotonic()
    with pytest.raises(Unavailable) as caught:
        store.lock([("tenant", "late"), ("name", "service/late/web")])
    assert time.monotonic() - started >= 0.9  # it waited for a connection first
    assert caught.value.status == 503 and caught.value.code == "unavailable"
    assert caught.value.message == (
        f"this gateway replica has all its {pg.LOCK_POOL_SIZE} database lock connections in use (creates under "
        "a quota or naming a sandbox, service, volume, organisation, node or SSH key, and cordons) for 1 s; "
        "try again shortly"
    )
    assert sorted(_held(pg_cluster, url)) == before  # nothing taken
    store.unlock(handles.pop())
    handle = store.lock([("tenant", "late")])  # a connection free again: served
    store.unlock(handle)
    for h in handles:
        store.unlock(h)
    assert _held(pg_cluster, url) == []


def test_a_lock_held_by_another_replica_is_waited_for(
    pg_cluster: PgCluster, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pg, "LOCK_WAIT_SECS", 2)  # read when a lock connection is made
    a, b = _open(url), _open(url)
    try:
        held = a.lock([("node", "n1")])
        with pytest.raises(Unavailable) as caught:
            b.lock([("node", "n1"), ("tenant", "t")])
        assert caught.value.message == "another replica has held node n1's cordon for 2 s; try again shortly"
        assert [(c, p) for c, _, p in _held(pg_cluster, url)] == [
            (pg.NODE_LOCK_CLASS, _held(pg_cluster, url)[0][2])
        ]
        got: list[object] = []
        waiter = threading.Thread(target=lambda: got.append(b.lock([("node", "n1")])))
        waiter.start()
        time.sleep(0.5)
        assert got == []  # still waiting
        a.unlock(held)
        waiter.join(30)
        assert len(got) == 1
        b.unlock(got[0])
    finally:
        a.close()
        b.close()


_HOLDER = """
import sys, time
from sbx.gateway.store import StoreLocation, open_store
store = open_store(StoreLocation(database=sys.argv[1]), serving=True)
held = store.lock([("tenant", "acme"), ("name", "volume/data")])
print("held", flush=True)
time.sleep(600)
"""


def test_a_dead_holder_lets_go_at_once(pg_cluster: PgCluster, url: str, store: Store) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, url], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        got: list[object] = []
        waiter = threading.Thread(target=lambda: got.append(store.lock([("name", "volume/data")])))
        waiter.start()
        time.sleep(1)
        assert got == []  # the holder has it
        killed = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        waiter.join(30)
        assert len(got) == 1 and time.monotonic() - killed < 10  # as the session ended, not a timeout
        store.unlock(got[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
