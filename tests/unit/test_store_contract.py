"""One contract for both stores: every store operation, its round trip through a reopen, the owner lock, the
migrations (once, also when two processes start together), run against SQLite and against PostgreSQL (a private
cluster, tests/support/pg_cluster.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psycopg
import pytest
from pg_cluster import PgCluster

from sbx.api.jobs import JobSpec, KeptFile
from sbx.api.services import ServiceSpec
from sbx.gateway import keys
from sbx.gateway.jobs.store import JobRecord, JobStore, RunRecord
from sbx.gateway.ports.store import PortStore, PortTokenRecord
from sbx.gateway.services.store import ReplicaRecord, RolloutRecord, ServiceRecord, ServiceStore
from sbx.gateway.state import (
    MemberRecord,
    NodeDef,
    NodeFlags,
    OrgRecord,
    Quota,
    SandboxRecord,
    SnapshotRecord,
    SshKeyRecord,
    SshTokenRecord,
    StateError,
    StateLocked,
    VolumeRecord,
)
from sbx.gateway.store import (
    SCHEMA_VERSION,
    TABLES,
    Delete,
    Insert,
    Store,
    StoreLocation,
    Update,
    Upsert,
    open_store,
)
from sbx.gateway.store.base import Change
from sbx.gateway.store.schema import BOOKKEEPING, POSTGRES_MIGRATIONS, SQLITE_MIGRATIONS

T0 = "2026-01-02T03:04:05Z"


@dataclass
class Backend:
    """One store location and a way to read its database behind the store's back."""

    kind: str
    location: StoreLocation
    sql: Callable[[str], list[tuple[Any, ...]]]

    def open(self) -> Store:
        return open_store(self.location)


def _sqlite_sql(path: Path) -> Callable[[str], list[tuple[Any, ...]]]:
    def run(sql: str) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            return list(conn.execute(sql))
        finally:
            conn.close()

    return run


def _pg_sql(cluster: PgCluster, url: str) -> Callable[[str], list[tuple[Any, ...]]]:
    dbname = url.split("/")[3].split("?")[0]

    def run(sql: str) -> list[tuple[Any, ...]]:
        with cluster.connect(dbname) as conn:
            cur = conn.execute(sql)
            return cur.fetchall() if cur.description else []

    return run


@pytest.fixture(params=["sqlite", "postgres"])
def backend(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Backend]:
    if request.param == "sqlite":
        path = tmp_path / "gw.db"
        yield Backend("sqlite", StoreLocation(state=path), _sqlite_sql(path))
        return
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    for name, value in cluster.env().items():
        monkeypatch.setenv(name, value)
    url = cluster.create_database()
    yield Backend("postgres", StoreLocation(database=url), _pg_sql(cluster, url))


@pytest.fixture
def store(backend: Backend) -> Iterator[Store]:
    s = backend.open()
    yield s
    s.close()


def reopened(backend: Backend, store: Store) -> Store:
    store.close()
    return backend.open()


# -- schema ------------------------------------------------------------------------------------------------


def test_both_dialects_have_the_same_migrations() -> None:
    assert len(SQLITE_MIGRATIONS) == len(POSTGRES_MIGRATIONS) == SCHEMA_VERSION


def test_a_fresh_store_is_migrated_once(backend: Backend) -> None:
    store = backend.open()
    assert store.schema_version() == SCHEMA_VERSION
    store.close()
    again = backend.open()
    assert again.schema_version() == SCHEMA_VERSION
    again.close()
    assert backend.sql("SELECT version FROM schema_version ORDER BY version") == [
        (v,) for v in range(1, SCHEMA_VERSION + 1)
    ]


def test_the_tables_are_those_the_copy_knows(store: Store, backend: Backend) -> None:
    """Every table the migrations make, with its columns in order, is in ``TABLES`` (what migrate copies) or is the
    store's own bookkeeping (``BOOKKEEPING``: not copied)."""
    if backend.kind == "sqlite":
        names = [r[0] for r in backend.sql("SELECT name FROM sqlite_master WHERE type = 'table'")]
        found = {
            n: tuple(r[1] for r in backend.sql(f"PRAGMA table_info({n})"))
            for n in names
            if n not in ("schema_version", "sqlite_sequence")
        }
    else:
        rows = backend.sql(
            "SELECT table_name, column_name FROM information_schema.columns WHERE table_schema = 'public' "
            "ORDER BY table_name, ordinal_position"
        )
        found = {}
        for table, column in rows:
            if table != "schema_version":
                found[table] = (*found.get(table, ()), column)
    assert found == {name: t.columns for name, t in {**TABLES, **BOOKKEEPING}.items()}


def test_a_newer_schema_is_refused(backend: Backend) -> None:
    backend.open().close()
    backend.sql(f"INSERT INTO schema_version (version) VALUES ({SCHEMA_VERSION + 1})")
    with pytest.raises(StateError, match="newer than this sandbox-gateway knows"):
        backend.open()


def test_two_processes_starting_together_migrate_once(backend: Backend) -> None:
    """Eight openers race on an empty store: each migration is applied exactly once and all of them open it."""
    if backend.kind == "sqlite":
        from sbx.gateway.store.sqlite import SqliteStore

        def opener() -> Store:
            assert backend.location.state is not None
            return SqliteStore.open(backend.location.state)
    else:
        from sbx.gateway.store.postgres import PostgresStore

        def opener() -> Store:
            assert backend.location.database is not None
            return PostgresStore.open(backend.location.database, lock=False)

    barrier = threading.Barrier(8)
    opened: list[Store] = []
    errors: list[BaseException] = []

    def run() -> None:
        barrier.wait()
        try:
            opened.append(opener())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for s in opened:
        s.close()
    assert errors == []
    assert len(opened) == 8
    assert backend.sql("SELECT version FROM schema_version ORDER BY version") == [
        (v,) for v in range(1, SCHEMA_VERSION + 1)
    ]


_WRITER = """
import sys
from pathlib import Path
from sbx.gateway import keys
from sbx.gateway.store import StoreLocation, open_store
where = sys.argv[2]
store = open_store(StoreLocation(state=Path(where)) if sys.argv[1] == "sqlite" else StoreLocation(database=where))
while True:
    key, secret = keys.new_key("u", "", {"sandbox:read"})
    store.add_key(key)
    print(key.id, flush=True)
"""


def test_sigkill_loses_nothing_acknowledged_and_frees_the_store(backend: Backend) -> None:
    where = str(backend.location.state or backend.location.database)
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, backend.kind, where], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    acknowledged = [proc.stdout.readline().strip() for _ in range(40)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # The dead owner's lock goes with it (PostgreSQL: once the server sees the connection end).
    deadline = time.monotonic() + 30
    while True:
        try:
            store = backend.open()
            break
        except StateLocked:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert set(acknowledged) <= set(store.keys)
    store.close()


# -- the owner lock ----------------------------------------------------------------------------------------


def test_one_owner_at_a_time(backend: Backend) -> None:
    first = backend.open()
    first.add_key(keys.new_key("alice", "", {"admin"})[0])
    with pytest.raises(StateLocked, match="stop that gateway first") as refused:
        backend.open()
    assert ("state file lock" in str(refused.value)) == (backend.kind == "sqlite")
    assert ("another sandbox-gateway holds the database" in str(refused.value)) == (
        backend.kind == "postgres"
    )
    assert "password" not in str(refused.value).lower()
    # The refused opener changed nothing; once the owner closes, the next one opens and sees its key.
    first.close()
    second = backend.open()
    assert [k.user for k in second.keys.values()] == ["alice"]
    second.close()


@pytest.mark.parametrize(
    ("first", "second", "opens"),
    [
        # (what holds the store, what tries next, whether it opens: PostgreSQL / SQLite)
        ("serve", "serve", (True, False)),  # replicas share a database; a SQLite file has one owner
        ("serve", "offline", (False, False)),  # the spec's rule: offline commands refused while one serves
        ("offline", "serve", (False, False)),
        ("offline", "offline", (False, False)),
    ],
)
def test_serving_replicas_share_the_owner_lock_and_offline_commands_stay_refused(
    backend: Backend, first: str, second: str, opens: tuple[bool, bool]
) -> None:
    holder = open_store(backend.location, serving=first == "serve")
    holder.add_key(keys.new_key("alice", "", {"admin"})[0])
    try:
        if opens[backend.kind == "sqlite"]:
            other = open_store(backend.location, serving=second == "serve")
            assert [k.user for k in other.keys.values()] == ["alice"]
            # A third process, an offline command, is refused while either replica serves.
            with pytest.raises(StateLocked, match="stop that gateway first"):
                open_store(backend.location)
            other.close()
            with pytest.raises(StateLocked, match="stop that gateway first"):
                open_store(backend.location)  # the first replica still serves
        else:
            with pytest.raises(StateLocked, match="stop that gateway first"):
                open_store(backend.location, serving=second == "serve")
    finally:
        holder.close()
    # Once every holder is gone, an offline command owns it alone, and nothing was changed by the refusals.
    alone = open_store(backend.location)
    assert [k.user for k in alone.keys.values()] == ["alice"]
    alone.close()


def test_one_replica_leads_and_another_takes_over_when_it_closes(backend: Backend) -> None:
    """SQLite: the one process leads at once. PostgreSQL: of two serving replicas exactly one is elected; once it
    closes (its session ends, as at a SIGKILL), the other is within the retry interval."""
    first = open_store(backend.location, serving=True)
    if backend.kind == "sqlite":
        told: list[bool] = []
        first.lead(told.append)
        assert told == [True] and not first.elects
        first.close()
        return
    second = open_store(backend.location, serving=True)
    elected: dict[str, threading.Event] = {"first": threading.Event(), "second": threading.Event()}
    lost: list[str] = []
    try:
        for name, store in (("first", first), ("second", second)):
            store.lead(lambda leading, n=name: elected[n].set() if leading else lost.append(n))
        deadline = time.monotonic() + 10
        while not any(e.is_set() for e in elected.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2.5)  # more than a retry interval: the other has tried again, and was refused
        leaders = [n for n, e in elected.items() if e.is_set()]
        assert len(leaders) == 1, leaders
        leader = first if leaders == ["first"] else second
        leader.close()
        started = time.monotonic()
        assert elected["second" if leaders == ["first"] else "first"].wait(10)
        assert time.monotonic() - started < 8  # the retry interval is 2 s; generous for a loaded machine
        assert lost == []  # closing is not losing
    finally:
        for store in (first, second):
            store.close()


def test_a_replica_sees_the_rows_another_commits(backend: Backend) -> None:
    """Writes on one store reach another's memory through ``listen``/``refresh``: a row by its key, a delete not
    bounded by a key (the whole table read again), and ``caught_up`` returns once every earlier commit arrived.
    SQLite has one process: nothing to listen to, and caught up at once."""
    writer = open_store(backend.location, serving=True)
    if backend.kind == "sqlite":
        writer.listen(lambda changes: pytest.fail("SQLite has no other writer"))
        assert writer.caught_up(0.1) and not writer.shared
        writer.close()
        return
    reader = open_store(backend.location, serving=True)
    arrived: list[Change] = []
    lock = threading.Lock()

    def on_changes(changes: list[Change]) -> None:  # the listener's thread; the gateway hands it to its loop
        with lock:
            arrived.extend(changes)
            reader.refresh(changes)

    try:
        reader.listen(on_changes)
        writer.listen(lambda changes: None)
        assert reader.shared
        # Listening starts with every table read again (what was committed since the store loaded).
        assert reader.caught_up(5)
        with lock:
            assert {(c.table, c.key) for c in arrived} == {(t, None) for t in reader.mirrors}
            arrived.clear()
        key = keys.new_key("alice", "acme", {"admin"})[0]
        writer.add_key(key)
        assert reader.caught_up(5)
        with lock:
            assert reader.keys[key.id] == key and reader.keys_by_hash[key.secret_sha256] == key
            assert [(c.table, c.key, c.local) for c in arrived] == [("keys", (key.id,), False)]
        revoked = writer.revoke_key(key.id)
        writer.put_sandbox(SandboxRecord("sb1", "alice", "acme", "n1", None, 1, 512, T0))
        writer.put_sandbox(SandboxRecord("sb2", "alice", "acme", "n2", None, 1, 512, T0))
        assert reader.caught_up(5)
        with lock:
            assert reader.keys[key.id] == revoked and set(reader.sandboxes) == {"sb1", "sb2"}
        writer.execute([Delete("sandboxes", {"node": "n1"})])  # not by key: the table is read again whole
        assert reader.caught_up(5)
        with lock:
            assert set(reader.sandboxes) == {"sb2"}
            assert ("sandboxes", None) in [(c.table, c.key) for c in arrived]
        # The reader's own write comes back marked local.
        reader.set_quota("acme", Quota(max_sandboxes=3))
        assert reader.caught_up(5)
        with lock:
            assert [c.local for c in arrived if c.table == "quotas"] == [True]
    finally:
        reader.close()
        writer.close()


def test_the_commit_counter_advances_once_per_write_transaction(backend: Backend, store: Store) -> None:
    """Every write transaction on PostgreSQL advances the commit counter by exactly one (however many rows it
    writes); a failing one, SQL of ``run`` (the tables no replica holds in memory) and a signal do not. SQLite
    (one process, nothing to catch up with) never writes it."""

    def counter() -> list[tuple[Any, ...]]:
        return backend.sql("SELECT id, n FROM commit_counter")

    assert counter() == []
    store.add_key(keys.new_key("alice", "acme", {"admin"})[0])
    store.add_org(OrgRecord("acme", T0, "alice", ""), MemberRecord("acme", "alice", "", "owner", T0))
    with pytest.raises(Exception):  # noqa: B017 - the driver's own error for a duplicate key
        store.add_org(OrgRecord("acme", T0, "alice", ""), MemberRecord("acme", "alice", "", "owner", T0))
    store.audit_append([(1, '{"type": "x"}')])
    store.signal("cancel", ["job", "1"])
    assert counter() == ([] if backend.kind == "sqlite" else [(1, 2)])


class OnALoop:
    """``store.caught_up`` as the gateway calls it: ``caught_up_on_loop`` awaited on one event loop of its own."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.loop = asyncio.new_event_loop()

    def __call__(self, timeout_secs: float) -> bool:
        return self.loop.run_until_complete(self.store.caught_up_on_loop(timeout_secs))

    def close(self) -> None:
        self.loop.close()


@pytest.mark.parametrize("form", ["blocking", "on the loop"])
def test_caught_up_sends_nothing_and_holds_every_commit_before_it(
    pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    """``caught_up`` reads the commit counter and waits for the listener to have handed that far on: after each
    write of the other store, memory holds it (a row carried in the notification, one read back, a whole table
    read again, a transaction whose notifications are split in parts), and no notification is sent for it (the
    other replicas pay nothing). The same of ``caught_up_on_loop``, which asks its query on the event loop."""
    from sbx.gateway.store.postgres import CHANNEL

    writer, reader, location = _pg_stores(pg_cluster, monkeypatch)
    on_loop = OnALoop(reader)
    caught_up = reader.caught_up if form == "blocking" else on_loop
    lock = threading.Lock()

    def on_changes(changes: list[Change]) -> None:
        with lock:
            reader.refresh(changes)

    assert location.database is not None
    watching = pg_cluster.connect(location.database.split("/")[3].split("?")[0])
    watching.execute(f"LISTEN {CHANNEL}")
    try:
        reader.listen(on_changes)
        writer.listen(lambda changes: None)
        assert caught_up(5)
        for _ in range(20):
            assert caught_up(5)
        assert list(watching.notifies(timeout=0.5)) == []
        for i in range(40):
            key = keys.new_key(f"u{i}", "acme", {"admin"})[0]
            writer.add_key(key)  # carried
            assert caught_up(5)
            with lock:
                assert reader.keys[key.id] == key, i
            writer.revoke_key(key.id)  # an update: read back
            assert caught_up(5)
            with lock:
                assert reader.keys[key.id].revoked is not None, i
            writer.put_sandbox(SandboxRecord(f"sb{i}", "u", "", f"n{i}", None, 1, 512, T0))
            writer.execute([Delete("sandboxes", {"node": f"n{i}"})])  # not by key: the table read again
            assert caught_up(5)
            with lock:
                assert f"sb{i}" not in reader.sandboxes, i
        # One transaction, many notifications (large rows): memory has all of it once caught up.
        writer.apply([Upsert("sandboxes", {**SB, "id": f"big{i}", "name": "n" * 1000}) for i in range(40)])
        assert caught_up(5)
        with lock:
            assert {f"big{i}" for i in range(40)} <= set(reader.sandboxes)
    finally:
        on_loop.close()
        watching.close()
        reader.close()
        writer.close()


@pytest.mark.parametrize(
    ("batches", "handed"),
    [
        ([[(1, 1)]], [1]),
        ([[(1, 1), (2, 1), (3, 1)]], [3]),
        # A transaction of three notifications split over batches is handed on once its last arrives.
        ([[(4, 3), (4, 3)], [(4, 3), (5, 1)]], [0, 5]),
        ([[(6, 1), (7, 2)], [(7, 2)]], [6, 7]),
        ([[]], [0]),
    ],
)
def test_a_transaction_is_handed_on_once_all_its_notifications_arrived(
    batches: list[list[tuple[int, int]]], handed: list[int]
) -> None:
    from sbx.gateway.store.postgres import _complete

    parts_seen: dict[int, int] = {}
    assert [_complete(batch, parts_seen) for batch in batches] == handed
    assert parts_seen == {}


def test_notifications_of_the_version_before_are_read_without_a_reload(
    pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A replica of the version before (mid-upgrade) sends catch-up markers and notifications without the commit
    counter: both are read as they are (no reload of every table), and catching up goes on working."""
    from sbx.gateway.store.postgres import CHANNEL

    writer, reader, _ = _pg_stores(pg_cluster, monkeypatch)
    lock = threading.Lock()

    def on_changes(changes: list[Change]) -> None:
        with lock:
            reader.refresh(changes)

    caplog.set_level(logging.WARNING, logger="sbx.gateway.store.postgres")
    try:
        reader.listen(on_changes)
        writer.listen(lambda changes: None)
        assert reader.caught_up(5)
        row = '["sandboxes", ["old1"], ["old1", "u", "", "n1", null, 1, 512, "' + T0 + '"]]'
        writer.run([
            ("SELECT pg_notify(%s, %s)", (CHANNEL, '{"marker": "0123abcd"}')),
            ("SELECT pg_notify(%s, %s)", (CHANNEL, '{"origin": "old", "rows": [' + row + "]}")),
        ])  # fmt: skip
        key = keys.new_key("alice", "acme", {"admin"})[0]
        writer.add_key(key)
        assert reader.caught_up(5)
        with lock:
            assert reader.keys[key.id] == key and "old1" in reader.sandboxes
        assert "cannot read" not in caplog.text
    finally:
        reader.close()
        writer.close()


def _pg_stores(cluster: PgCluster, monkeypatch: pytest.MonkeyPatch) -> tuple[Store, Store, StoreLocation]:
    for name, value in cluster.env().items():
        monkeypatch.setenv(name, value)
    location = StoreLocation(database=cluster.create_database())
    return open_store(location, serving=True), open_store(location, serving=True), location


MEMORY = ("keys", "keys_by_hash", "nodes", "node_flags", "sandboxes", "volumes", "snapshots", "orgs", "members",
          "quotas", "ssh_keys", "ssh_tokens")  # fmt: skip


def test_rows_carried_in_notifications_leave_memory_as_a_fresh_load(
    pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every kind of write of the store's own tables, through one replica: the other replica's memory, kept in
    step only by notifications (rows written whole carried in them, the others read), ends equal to a store
    loaded afresh; and rows written whole or deleted by key cost the listener no read."""
    writer, reader, location = _pg_stores(pg_cluster, monkeypatch)
    reads: list[tuple[str, Any]] = []
    rows_of = reader._rows  # type: ignore[attr-defined]

    def counted(table: str, key: Any = None) -> Any:
        reads.append((table, key))
        return rows_of(table, key)

    reader._rows = counted  # type: ignore[attr-defined]
    lock = threading.Lock()

    def on_changes(changes: list[Change]) -> None:
        with lock:
            reader.refresh(changes)

    try:
        reader.listen(on_changes)
        writer.listen(lambda changes: None)
        assert reader.caught_up(5)
        reads.clear()
        # Rows written whole (inserts, upserts) and deleted by key: carried, no read.
        writer.put_sandbox(SandboxRecord("sb1", "alice", "acme", "n1", "web", 2, 2**40, T0))
        writer.put_sandbox(SandboxRecord("sb2", "bob", "", "n1", None, None, None, T0))
        writer.put_sandbox(SandboxRecord("sb1", "alice", "acme", "n2", "web2", 1, 512, T0))  # replaced
        writer.forget_sandboxes(["sb2", "sb_unknown"])
        writer.add_node(NodeDef("n1", "https://10.0.0.1:7070", "/t", None, None, None, T0))
        writer.set_node_flags("n1", NodeFlags(cordoned=True, drained=False))
        writer.put_volume(VolumeRecord("data", "alice", "acme", "n1", T0))
        writer.put_snapshot(SnapshotRecord("snap_1", "bob", "", "n1", None, T0))
        writer.add_org(OrgRecord("acme", T0, "alice", ""), MemberRecord("acme", "alice", "", "owner", T0))
        writer.put_member(MemberRecord("acme", "bob", "bobs", "member", T0))
        writer.remove_member("acme", "bob")
        writer.set_quota("acme", Quota(max_cpus=4, max_memory_mb=2**40))
        writer.add_ssh_key(
            SshKeyRecord("sshk_1", "alice", "", "acme", "SHA256:x", "ssh-ed25519 AAAA", None, T0)
        )
        writer.add_ssh_token(SshTokenRecord("f" * 64, "alice", "acme", "sb1", 1767225600.25, T0))
        key = keys.new_key("alice", "acme", {"admin"})[0]
        writer.add_key(key)
        assert reader.caught_up(5)
        with lock:
            assert reads == []
        # Writes that leave the row unknown to the writer (an update; a delete not by key alone): read.
        writer.revoke_key(key.id)
        writer.set_quota("acme", Quota())  # the row goes
        writer.execute([Delete("sandboxes", {"node": "n2"})])  # not by key: the whole table
        assert reader.caught_up(5)
        with lock:
            assert reads and {t for t, _ in reads} <= {"keys", "quotas", "sandboxes"}
        fresh = open_store(location, serving=True)
        try:
            with lock:
                for name in MEMORY:
                    assert getattr(reader, name) == getattr(fresh, name), name
            assert reader.keys[key.id].revoked is not None and reader.sandboxes == {}
        finally:
            fresh.close()
    finally:
        reader.close()
        writer.close()


def test_a_write_not_full_commits_without_waiting_for_the_wal_flush(
    pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``full=False`` runs its statements with ``synchronous_commit`` off, for its transaction only; ``full`` with
    the database's own level (on). What the commit goes with is set by the transaction's last statement (the
    commit counter's)."""
    from sbx.gateway.store.postgres import ADVANCE_COUNTER

    store, other, _ = _pg_stores(pg_cluster, monkeypatch)
    other.close()
    seen: list[str] = []
    original = psycopg.Connection.execute

    def execute(self: psycopg.Connection[Any], query: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, query, *args, **kwargs)
        if isinstance(query, str) and query.startswith(ADVANCE_COUNTER):
            seen.append(original(self, "SHOW synchronous_commit").fetchone()[0])
        return result

    monkeypatch.setattr(psycopg.Connection, "execute", execute)
    try:
        store.put_sandbox(SandboxRecord("sb1", "u", "", "n1", None, 1, 512, T0))  # full=False
        store.set_quota("acme", Quota(max_cpus=1))  # full
        store.put_sandbox(SandboxRecord("sb2", "u", "", "n1", None, 1, 512, T0))
        assert seen == ["off", "on", "off"]
    finally:
        store.close()


def test_a_notification_it_cannot_read_or_a_failing_apply_makes_the_listener_reload(
    pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A notification not of this version's form (a replica of another version mid-upgrade) makes the listener
    read every table again; a defect while applying changes makes it connect again and reload, never die: in
    both cases later writes keep arriving."""
    from sbx.gateway.store.postgres import CHANNEL

    writer, reader, _ = _pg_stores(pg_cluster, monkeypatch)
    arrived: list[Change] = []
    lock = threading.Lock()
    fail_once = threading.Event()

    def on_changes(changes: list[Change]) -> None:
        with lock:
            if fail_once.is_set() and any(c.table == "quotas" for c in changes):
                fail_once.clear()
                raise RuntimeError("a defect applying changes")
            arrived.extend(changes)
            reader.refresh(changes)

    caplog.set_level(logging.WARNING, logger="sbx.gateway.store.postgres")
    try:
        reader.listen(on_changes)
        writer.listen(lambda changes: None)
        assert reader.caught_up(5)
        with lock:
            arrived.clear()
        writer.run([("SELECT pg_notify(%s, %s)", (CHANNEL, '{"origin": "x", "rows": [["keys"]]}'))])
        key = keys.new_key("alice", "acme", {"admin"})[0]
        writer.add_key(key)
        assert reader.caught_up(5)
        with lock:
            assert ("keys", None) in [(c.table, c.key) for c in arrived]  # every table read again
            assert reader.keys[key.id] == key
        assert "a change notification this replica cannot read; reloading every table" in caplog.text
        fail_once.set()
        writer.set_quota("acme", Quota(max_cpus=2))
        deadline = time.monotonic() + 30
        while "could not apply the database's change notifications" not in caplog.text:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        writer.put_sandbox(SandboxRecord("sb1", "alice", "acme", "n1", None, 1, 512, T0))
        deadline = time.monotonic() + 30
        while not (reader.caught_up(1) and "sb1" in reader.sandboxes):
            assert time.monotonic() < deadline
        assert reader.quotas["acme"] == Quota(max_cpus=2)  # the change lost to the defect, read again
    finally:
        reader.close()
        writer.close()


def _payload_rows(ops: list[Any]) -> list[list[Any]]:
    from sbx.gateway.store.postgres import _payloads

    return [row for p in _payloads("me", ops) for row in msgspec.json.decode(p)["rows"]]


SB = {"id": "sb1", "user": "u", "tenant": "", "node": "n1", "name": None, "cpus": 1, "memory_mb": 512,
      "created": T0, "persistent": 0, "asleep": 0}  # fmt: skip
SB_ROW = ["sb1", "u", "", "n1", None, 1, 512, T0, 0, 0]


@pytest.mark.parametrize(
    ("ops", "rows"),
    [
        ([Upsert("sandboxes", SB)], [["sandboxes", ["sb1"], SB_ROW]]),
        ([Insert("sandboxes", SB)], [["sandboxes", ["sb1"], SB_ROW]]),
        # Not every column: listeners read the row.
        ([Upsert("sandboxes", {k: v for k, v in SB.items() if k != "name"})], [["sandboxes", ["sb1"]]]),
        ([Delete("sandboxes", {"id": "sb1"})], [["sandboxes", ["sb1"], None]]),
        # A delete with more than the key may leave the row: read.
        ([Delete("notifications", {"id": 3, "lease_owner": "x"})], [["notifications", [3]]]),
        ([Delete("service_revisions", {"service": "s"}, below={"revision": 3})], [["service_revisions", None]]),
        ([Update("sandboxes", {"node": "n2"}, {"id": "sb1"})], [["sandboxes", ["sb1"]]]),
        # The transaction's last write of a row decides.
        ([Upsert("sandboxes", SB), Update("sandboxes", {"node": "n2"}, {"id": "sb1"})], [["sandboxes", ["sb1"]]]),
        ([Update("sandboxes", {"node": "n2"}, {"id": "sb1"}), Upsert("sandboxes", SB)],
         [["sandboxes", ["sb1"], SB_ROW]]),
        ([Upsert("sandboxes", SB), Delete("sandboxes", {"id": "sb1"})], [["sandboxes", ["sb1"], None]]),
        # Bytes, or a row too large, are not carried.
        ([Upsert("secrets", {"tenant": "t", "name": "A", "nonce": b"n", "ciphertext": b"c", "updated": T0})],
         [["secrets", ["t", "A"]]]),
        ([Upsert("sandboxes", {**SB, "name": "x" * 2000})], [["sandboxes", ["sb1"]]]),
    ],
)  # fmt: skip
def test_what_a_notification_carries(ops: list[Any], rows: list[list[Any]]) -> None:
    assert _payload_rows(ops) == rows


def test_notifications_of_a_large_transaction_are_split_within_the_limit() -> None:
    from sbx.gateway.store.postgres import PAYLOAD_MAX, _payloads

    ops = [Upsert("sandboxes", {**SB, "id": f"sb{i}", "name": "n" * 1000}) for i in range(40)]
    payloads = _payloads("origin-" + "x" * 36, ops)
    assert len(payloads) > 1 and all(len(p.encode()) <= PAYLOAD_MAX for p in payloads)
    assert [r[1] for p in payloads for r in msgspec.json.decode(p)["rows"]] == [[f"sb{i}"] for i in range(40)]


# -- every operation, and its round trip through a reopen -------------------------------------------------


def test_keys(backend: Backend, store: Store) -> None:
    key, secret = keys.new_key("alice", "acme", {"sandbox:read", "sandbox:create"})
    store.add_key(key)
    assert store.keys_by_hash[keys.hash_secret(secret)] == key
    with pytest.raises(Exception):  # noqa: B017 - each driver raises its own IntegrityError
        store.add_key(key)
    store = reopened(backend, store)
    assert store.keys[key.id] == key
    assert store.revoke_key("key_unknown") is None
    revoked = store.revoke_key(key.id)
    assert revoked is not None and revoked.revoked is not None
    assert store.revoke_key(key.id) == revoked
    store = reopened(backend, store)
    assert store.keys[key.id] == revoked and store.keys_by_hash[key.secret_sha256] == revoked
    assert secret not in repr(backend.sql("SELECT * FROM keys"))
    store.close()


def test_nodes_and_flags(backend: Backend, store: Store) -> None:
    node = NodeDef("n1", "https://10.0.0.1:7070", "/etc/t", "/etc/ca", "/etc/c", "/etc/k")
    store.add_node(node)
    store.set_node_flags("n1", NodeFlags(cordoned=True))
    store.set_node_flags("file-node", NodeFlags(True, True))
    store = reopened(backend, store)
    assert store.nodes == {"n1": node}
    assert store.node_flags == {"n1": NodeFlags(True, False), "file-node": NodeFlags(True, True)}
    store.set_node_flags("n1", NodeFlags(False, True))
    assert store.remove_node("n1") is True
    assert store.remove_node("n1") is False
    store = reopened(backend, store)
    assert store.nodes == {} and store.node_flags == {"file-node": NodeFlags(True, True)}
    store.close()


def test_ownership_records(backend: Backend, store: Store) -> None:
    a = SandboxRecord("sbx_a", "alice", "", "n1", "web", 2, 2**40, T0)
    b = SandboxRecord("sbx_b", "bob", "acme", "n2", None, 1, 512, T0)
    store.put_sandbox(a)
    store.put_sandbox(b)
    store.put_sandbox(SandboxRecord("sbx_a", "alice", "", "n3", "web", 2, 1024, T0))  # replaced, not doubled
    vol = VolumeRecord("data", "alice", "", "n1", T0)
    snap = SnapshotRecord("snap_1", "bob", "acme", "n2", "sbx_b", T0)
    store.put_volume(vol)
    store.put_snapshot(snap)
    store.put_snapshot(SnapshotRecord("snap_2", "bob", "acme", "n2", None, T0))
    store = reopened(backend, store)
    assert store.sandboxes == {
        "sbx_a": SandboxRecord("sbx_a", "alice", "", "n3", "web", 2, 1024, T0),
        "sbx_b": b,
    }
    assert store.volumes == {"data": vol}
    assert store.snapshots["snap_1"] == snap and store.snapshots["snap_2"].sandbox is None
    store.forget_sandboxes(["sbx_a", "sbx_unknown"])
    store.forget_sandboxes([])
    store.forget_volume("data")
    store.forget_snapshot("snap_1")
    store = reopened(backend, store)
    assert list(store.sandboxes) == ["sbx_b"] and store.volumes == {} and list(store.snapshots) == ["snap_2"]
    store.close()


def test_orgs_and_members(backend: Backend, store: Store) -> None:
    owner = MemberRecord("acme", "alice", "", "owner", T0)
    store.add_org(OrgRecord("acme", T0, "alice", ""), owner)
    store.put_member(MemberRecord("acme", "bob", "bobs", "member", T0))
    store.put_member(MemberRecord("acme", "bob", "bobs", "owner", T0))  # a role change replaces
    with pytest.raises(Exception):  # noqa: B017 - the org exists: neither row is written again
        store.add_org(OrgRecord("acme", T0, "eve", ""), MemberRecord("acme", "eve", "", "owner", T0))
    store = reopened(backend, store)
    assert store.orgs == {"acme": OrgRecord("acme", T0, "alice", "")}
    assert store.members == {
        ("acme", "alice"): owner,
        ("acme", "bob"): MemberRecord("acme", "bob", "bobs", "owner", T0),
    }
    store.remove_member("acme", "bob")
    store = reopened(backend, store)
    assert list(store.members) == [("acme", "alice")]
    store.close()


def test_quotas(backend: Backend, store: Store) -> None:
    store.set_quota("acme", Quota(max_cpus=8, max_memory_mb=2**40))
    store.set_quota("", Quota(max_sandboxes=3))
    store.set_quota("acme", Quota(max_cpus=4, max_memory_mb=2**40))
    store = reopened(backend, store)
    assert store.quotas == {"acme": Quota(4, 2**40, None), "": Quota(None, None, 3)}
    store.set_quota("acme", Quota())  # no limit at all: the row goes
    store = reopened(backend, store)
    assert store.quotas == {"": Quota(None, None, 3)}
    assert backend.sql("SELECT tenant FROM quotas") == [("",)]
    store.close()


def test_ssh_keys_and_tokens(backend: Backend, store: Store) -> None:
    key = SshKeyRecord("sshk_1", "alice", "", "acme", "SHA256:abc", "ssh-ed25519 AAAA alice@x", None, T0)
    pinned = SshKeyRecord("sshk_2", "alice", "", "", "SHA256:def", "ssh-ed25519 BBBB", "sbx_a", T0)
    store.add_ssh_key(key)
    store.add_ssh_key(pinned)
    token = SshTokenRecord("f" * 64, "alice", "acme", "sbx_a", 1767225600.25, T0)
    store.add_ssh_token(token)
    store.add_ssh_token(SshTokenRecord("e" * 64, "bob", "", "sbx_b", 1.5, T0))
    store = reopened(backend, store)
    assert store.ssh_keys == {"sshk_1": key, "sshk_2": pinned}
    assert store.ssh_tokens["f" * 64] == token
    assert store.remove_ssh_key("sshk_1") is True and store.remove_ssh_key("sshk_1") is False
    store.forget_ssh_tokens(["e" * 64, "0" * 64])
    store.forget_ssh_tokens([])
    store = reopened(backend, store)
    assert list(store.ssh_keys) == ["sshk_2"] and list(store.ssh_tokens) == ["f" * 64]
    store.close()


# -- the write operations other modules use ----------------------------------------------------------------


def test_a_failing_write_leaves_nothing_of_its_transaction(backend: Backend, store: Store) -> None:
    store.execute([Insert("secrets", {"tenant": "t", "name": "A", "nonce": b"n", "ciphertext": b"c",
                                      "updated": T0})])  # fmt: skip
    before = backend.sql("SELECT tenant, name FROM secrets ORDER BY name")
    with pytest.raises(Exception):  # noqa: B017 - the duplicate key; the first insert must go too
        store.execute([
            Insert("secrets", {"tenant": "t", "name": "B", "nonce": b"n", "ciphertext": b"c", "updated": T0}),
            Insert("secrets", {"tenant": "t", "name": "A", "nonce": b"n", "ciphertext": b"c", "updated": T0}),
        ])  # fmt: skip
    assert backend.sql("SELECT tenant, name FROM secrets ORDER BY name") == before == [("t", "A")]


def test_upsert_update_delete_and_bytes(backend: Backend, store: Store) -> None:
    nonce, sealed = bytes(range(12)), bytes(range(256))
    store.execute([Upsert("secrets", {"tenant": "t", "name": "K", "nonce": b"old", "ciphertext": b"old",
                                      "updated": T0})])  # fmt: skip
    store.execute([Upsert("secrets", {"tenant": "t", "name": "K", "nonce": nonce, "ciphertext": sealed,
                                      "updated": "later"})], full=False)  # fmt: skip
    store = reopened(backend, store)
    [(n, c, updated)] = store.query("secrets", ("nonce", "ciphertext", "updated"))
    assert (bytes(n), bytes(c), updated) == (nonce, sealed, "later")
    for rev in (1, 2, 3):
        store.execute([Upsert("service_revisions", {"service": "svc_1", "revision": rev, "spec": "{}"})])
    store.execute([Upsert("service_revisions", {"service": "svc_2", "revision": 1, "spec": "{}"})])
    store.execute([Delete("service_revisions", {"service": "svc_1"}, below={"revision": 3})])
    assert sorted(store.query("service_revisions", ("service", "revision"))) == [("svc_1", 3), ("svc_2", 1)]
    store.execute([Insert("notifications", {"job": "job_1", "url": "https://x/", "body": "{}", "attempts": 0,
                                            "first_try": 1.5, "next_try": 1.5}) for _ in range(3)])  # fmt: skip
    rows = store.query("notifications", ("id", "attempts", "next_try"), "id")
    assert [r[1:] for r in rows] == [(0, 1.5)] * 3 and [r[0] for r in rows] == sorted(r[0] for r in rows)
    store.execute([Update("notifications", {"attempts": 1, "next_try": 99.25}, {"id": rows[1][0]})])
    store.execute([Delete("notifications", {"id": rows[0][0]})])
    store = reopened(backend, store)
    assert store.query("notifications", ("id", "attempts", "next_try"), "id") == [
        (rows[1][0], 1, 99.25), (rows[2][0], 0, 1.5)
    ]  # fmt: skip
    store.close()


@pytest.mark.parametrize(
    ("op", "message"),
    [
        (Insert("no_such_table", {"a": 1}), "no table 'no_such_table'"),
        (Upsert("keys", {"id": "k", "password": "x"}), "table 'keys' has no column 'password'"),
        (Delete("keys", {}), "a delete from 'keys' names no row"),
        (
            Update("keys", {"revoked": T0}, {"id; DROP TABLE keys": "x"}),
            "has no column 'id; DROP TABLE keys'",
        ),
    ],
)
def test_a_write_naming_what_is_not_there_is_refused(
    backend: Backend, store: Store, op: Any, message: str
) -> None:
    store.add_key(keys.new_key("alice", "", {"admin"})[0])
    before = backend.sql("SELECT id FROM keys")
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        store.execute([op])
    assert backend.sql("SELECT id FROM keys") == before


async def _write(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


async def test_services_tables_round_trip(backend: Backend, store: Store) -> None:
    spec = msgspec.convert({"name": "web", "image": "debian", "command": ["sleep", "1d"]}, ServiceSpec)
    db = ServiceStore(store, _write)
    svc = ServiceRecord("svc_1", "acme", "web", "alice", spec, 2, 1, 2, 0,
                        RolloutRecord("rolling", 1, 2, 1767225600.5, 1, None), T0, T0)  # fmt: skip
    await db.put_service(svc, new_revision=spec)
    await db.put_replica(ReplicaRecord("sbx_r1", "svc_1", "n1", 2, 4242, 1, True, T0))
    await db.put_replica(ReplicaRecord("sbx_r2", "svc_1", "n1", 2, None, 0, False, T0))
    await db.forget_replica("sbx_r2")
    # A replica's health (written by the leader on a change of state), kept by a later write of its record.
    await db.put_replica(ReplicaRecord("sbx_r3", "svc_1", "n1", 2, None, 0, False, T0))
    await db.put_health("sbx_r3", "unhealthy", "GET / answered HTTP 500", T0)
    await db.put_replica(ReplicaRecord("sbx_r3", "svc_1", "n1", 2, 99, 0, True, T0))
    unhealthy = ReplicaRecord(
        "sbx_r3", "svc_1", "n1", 2, 99, 0, True, T0, "unhealthy", "GET / answered HTTP 500", T0
    )
    assert db.replicas["sbx_r3"] == unhealthy
    store = reopened(backend, store)
    again = ServiceStore(store, _write)
    assert again.services == {"svc_1": svc}
    assert again.revisions == {("svc_1", 2): spec}
    assert again.replicas == {"sbx_r1": ReplicaRecord("sbx_r1", "svc_1", "n1", 2, 4242, 1, True, T0),
                              "sbx_r3": unhealthy}  # fmt: skip
    assert again.replicas["sbx_r1"].state == "starting"  # as a replica is until its first check
    await again.delete_service("svc_1")
    store = reopened(backend, store)
    empty = ServiceStore(store, _write)
    assert (empty.services, empty.revisions, empty.replicas) == ({}, {}, {})
    store.close()


async def test_ports_tables_round_trip(backend: Backend, store: Store) -> None:
    db = PortStore(store, _write)
    await db.set_public("sbx_a", 8080, True, T0)
    await db.set_public("sbx_a", 3000, True, T0)
    await db.set_public("sbx_b", 8080, True, T0)
    await db.set_public("sbx_a", 3000, False, T0)
    await db.set_public("sbx_a", 3000, False, T0)  # already private: nothing to write
    live = PortTokenRecord("a" * 64, "sbx_a", 8080, "key_1", "alice", "acme", 1767225600.5, T0)
    expired = PortTokenRecord("b" * 64, "sbx_a", 8080, "key_1", "alice", "acme", 10.0, T0)
    of_b = PortTokenRecord("c" * 64, "sbx_b", 8080, "key_2", "bob", "", 1767225600.5, T0)
    for token in (live, expired, of_b):
        await db.add_token(token)
    store = reopened(backend, store)
    again = PortStore(store, _write)
    assert again.public == {("sbx_a", 8080): T0, ("sbx_b", 8080): T0}
    assert again.tokens == {t.token_sha256: t for t in (live, expired, of_b)}
    assert again.public_of("sbx_a") == [8080] and again.is_public("sbx_b", 8080)
    # A sandbox ended: its flags and tokens go, and expired tokens with them; the others stay.
    await again.forget({"sbx_b"}, now=1000.0)
    store = reopened(backend, store)
    last = PortStore(store, _write)
    assert last.public == {("sbx_a", 8080): T0} and last.tokens == {live.token_sha256: live}
    store.close()


async def test_jobs_tables_round_trip(backend: Backend, store: Store) -> None:
    spec = msgspec.convert({"image": "debian", "command": ["true"]}, JobSpec)
    db = JobStore(store, _write)
    job = JobRecord("job_1", "alice", "", "claude", spec, "fix the bug ✓", "running", None, T0, T0)
    run = RunRecord("job_1", 1, "succeeded", "sbx_j", "n1", 77, 0, T0, T0, None, True,
                    (KeptFile(path="out/a.txt", bytes=3),))  # fmt: skip
    await db.put(job=job, run=run, extra=[Insert("notifications", {
        "job": "job_1", "url": "https://x/", "body": "{}", "attempts": 0, "first_try": 1.0, "next_try": 1.0})])  # fmt: skip
    await db.put(run=RunRecord("job_1", 2, "pending"), full=False)
    store = reopened(backend, store)
    again = JobStore(store, _write)
    assert again.jobs == {"job_1": job}
    assert again.runs == {("job_1", 1): run, ("job_1", 2): RunRecord("job_1", 2, "pending")}
    assert len(store.query("notifications", ("id",))) == 1
    await again.delete(["job_1"])
    store = reopened(backend, store)
    assert (JobStore(store, _write).jobs, JobStore(store, _write).runs) == ({}, {})
    store.close()


def test_holds_state(store: Store) -> None:
    assert store.holds_state() is False
    store.set_node_flags("n1", NodeFlags())
    assert store.holds_state() is True


# -- PostgreSQL only: the URL and the password ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql://gw:hunter2@db.example/gw", "the database URL carries a password"),
        ("postgresql:///gw?host=/run/pg&password=hunter2", "the database URL carries a password"),
        (
            "postgresql://gw@db.example/gw?sslkey=/k&sslpassword=hunter2",
            "the database URL carries a password",
        ),
        ("mysql://gw@db.example/gw", "'mysql' is not a PostgreSQL URL"),
        ("/var/lib/gw.db", "is not a PostgreSQL URL"),
    ],
)
def test_a_database_url_that_cannot_be_used_is_refused(url: str, message: str) -> None:
    with pytest.raises(StateError, match=message) as refused:
        open_store(StoreLocation(database=url))
    assert "hunter2" not in str(refused.value)


def test_the_password_comes_from_the_environment(
    pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = pg_cluster.create_database()
    monkeypatch.delenv("SANDBOX_GATEWAY_DATABASE_PASSWORD", raising=False)
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", "/nonexistent")
    with pytest.raises(StateError, match="cannot use the database .*(password|authentication)"):
        open_store(StoreLocation(database=url))
    monkeypatch.setenv("SANDBOX_GATEWAY_DATABASE_PASSWORD", "wrong")
    with pytest.raises(StateError, match="password authentication failed") as refused:
        open_store(StoreLocation(database=url))
    assert "wrong" not in str(refused.value)
    monkeypatch.delenv("SANDBOX_GATEWAY_DATABASE_PASSWORD")
    monkeypatch.setenv("PGPASSWORD", pg_cluster.password)  # libpq's own variable works too
    open_store(StoreLocation(database=url)).close()
    with psycopg.connect(url, password=pg_cluster.password) as conn:
        assert conn.execute("SELECT MAX(version) FROM schema_version").fetchone() == (SCHEMA_VERSION,)


def test_a_database_that_goes_away_answers_503_and_the_owner_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL stops (as in a crash): a write is refused with 503 and leaves memory as it was, the owner lock's
    watcher reports the loss; once PostgreSQL is back, writes go through again (the pool reconnects)."""
    from sbx.api.errors import Unavailable

    cluster = PgCluster.start()  # its own: this one is stopped under the store
    try:
        for name, value in cluster.env().items():
            monkeypatch.setenv(name, value)
        url = cluster.create_database()
        store = open_store(StoreLocation(database=url))
        lost: list[str] = []
        store.watch_owner(lost.append)
        store.listen(store.refresh)
        first, second, third = (keys.new_key(u, "", {"admin"})[0] for u in ("a", "b", "c"))
        store.add_key(first)
        on_loop = OnALoop(store)
        assert store.caught_up(5) and on_loop(5)
        cluster.pause()
        with pytest.raises(Unavailable, match="the gateway cannot reach its database now; try again shortly"):
            store.add_key(second)
        assert set(store.keys) == {first.id}
        assert not store.caught_up(1)  # the commit counter cannot be read: not caught up, at once
        assert not on_loop(1)  # nor on the loop: its connection (made before) gets no answer in time
        deadline = time.monotonic() + 60
        while not lost and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(lost) == 1 and "password" not in lost[0]
        cluster.resume()
        store.add_key(third)
        deadline = time.monotonic() + 60
        while not store.caught_up(1):  # once the listener has connected again and reloaded
            assert time.monotonic() < deadline
        assert on_loop(5)  # a connection made anew
        on_loop.close()
        store.close()
        again = open_store(StoreLocation(database=url))
        assert set(again.keys) == {first.id, third.id}
        again.close()
    finally:
        cluster.stop()


def test_an_unreachable_database_says_so(tmp_path: Path) -> None:
    with pytest.raises(StateError, match=f"cannot use the database .*{tmp_path}"):
        open_store(StoreLocation(database=f"postgresql://gw@/gw?host={tmp_path}"))


# -- the offline commands, against both ----------------------------------------------------------------------


def _flag(backend: Backend) -> list[str]:
    if backend.location.state is not None:
        return ["--state", str(backend.location.state)]
    assert backend.location.database is not None
    return ["--database", backend.location.database]


def test_offline_keys_nodes_and_quotas(backend: Backend) -> None:
    from click.testing import CliRunner

    from sbx.gateway.main import main

    runner, where = CliRunner(), _flag(backend)

    def run(*args: str) -> Any:
        return runner.invoke(main, [*args, *where])

    made = run("keys", "create", "--user", "admin", "--scope", "admin", "--json")
    assert made.exit_code == 0, made.output
    created = msgspec.json.decode(made.output)
    listed = run("keys", "list", "--json")
    assert listed.exit_code == 0 and created["secret"] not in listed.output
    assert [k["id"] for k in msgspec.json.decode(listed.output)["keys"]] == [created["id"]]
    assert run("keys", "revoke", created["id"]).exit_code == 0
    assert "revoked" in msgspec.json.decode(run("keys", "list", "--json").output)["keys"][0]
    unknown = run("keys", "revoke", "key_nope")
    assert unknown.exit_code == 1 and "no key 'key_nope'" in unknown.output
    assert run("nodes", "add", "n1", "unix:///run/n1.sock").exit_code == 0
    twice = run("nodes", "add", "n1", "unix:///run/n1.sock")
    assert twice.exit_code == 1 and "a node named 'n1' exists" in twice.output
    assert msgspec.json.decode(run("nodes", "list", "--json").output) == {
        "nodes": [{"name": "n1", "endpoint": "unix:///run/n1.sock", "cordoned": False}]
    }
    assert run("quotas", "set", "acme", "--sandboxes", "3").exit_code == 0
    assert "acme  cpus=None memory_mb=None sandboxes=3" in run("quotas", "list").output
    assert run("nodes", "remove", "n1").exit_code == 0
    assert run("nodes", "remove", "n1").exit_code == 1
    store = backend.open()
    assert [k.revoked is not None for k in store.keys.values()] == [True]
    assert store.nodes == {} and store.quotas["acme"].max_sandboxes == 3
    store.close()


@pytest.mark.parametrize(
    "args",
    [
        ["keys", "create", "--user", "a", "--scope", "admin"],
        ["keys", "list"],
        ["keys", "revoke", "key_x"],
        ["nodes", "add", "n1", "unix:///run/x.sock"],
        ["nodes", "list"],
        ["nodes", "remove", "n1"],
        ["quotas", "set", "acme", "--cpus", "2"],
    ],
)
def test_offline_commands_refuse_while_the_store_is_owned(backend: Backend, args: list[str]) -> None:
    from click.testing import CliRunner

    from sbx.gateway.main import main

    owner = backend.open()
    owner.add_key(keys.new_key("alice", "", {"admin"})[0])
    before = [backend.sql(f"SELECT * FROM {name}") for name in ("keys", "nodes", "quotas")]
    try:
        result = CliRunner().invoke(main, [*args, *_flag(backend)])
    finally:
        owner.close()
    assert result.exit_code == 1
    assert "stop that gateway first" in result.output
    assert [backend.sql(f"SELECT * FROM {name}") for name in ("keys", "nodes", "quotas")] == before


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give the gateway's state: --state FILE"),
        (["--state", "/tmp/x.db", "--database", "postgresql://gw@db/gw"], "not both"),
        (["--database", "postgresql://gw:hunter2@db/gw"], "the database URL carries a password"),
    ],
)
def test_the_store_flags_are_checked(args: list[str], message: str) -> None:
    from click.testing import CliRunner

    from sbx.gateway.main import main

    for command in (["keys", "list"], ["serve"], ["nodes", "list"]):
        result = CliRunner().invoke(main, [*command, *args])
        assert result.exit_code == 2 and message in result.output, result.output
        assert "hunter2" not in result.output


def test_serve_on_a_database_needs_a_data_dir() -> None:
    from click.testing import CliRunner

    from sbx.gateway.main import main

    result = CliRunner().invoke(main, ["serve", "--database", "postgresql://gw@db.invalid/gw"])
    assert result.exit_code == 2 and "with --database give --data-dir DIR too" in result.output
