"""The PostgreSQL store (``--database postgresql://USER@HOST[:PORT]/DB``): psycopg 3 and its connection pool.

The password never travels on a command line: a URL carrying one is refused. It comes from the environment
variable ``SANDBOX_GATEWAY_DATABASE_PASSWORD`` when set, else from libpq's own sources (``PGPASSWORD``,
``PGPASSFILE`` or ``~/.pgpass``), or is not needed (peer or certificate authentication).

Two advisory locks (``pg_advisory_lock``, two int4 keys under ``LOCK_CLASS``):

- the **owner lock**, held on a connection of its own for as long as the store is open, taken without waiting:
  a serving replica takes it in shared mode (``pg_try_advisory_lock_shared``), so any number of replicas serve
  one database together, and the offline commands and ``migrate`` take it exclusively, so they are refused while
  any replica serves (and a replica is refused while one of them runs) — the rule the SQLite store keeps with its
  lock file (docs/ha.md).
- the **migration lock**, a transaction lock taken before the schema version is read: of two processes starting
  on an empty database together, one migrates and the other waits, then finds the schema current.

Replicas keep their memory in step: every write transaction also sends ``NOTIFY sbx_gateway`` naming the rows it
changed (table and primary key; a whole table for a write not bounded by a key), delivered to every listener at
its commit, in commit order. A row the transaction wrote whole (an insert or upsert of every column, small and of
JSON's types) travels in the notification, and a row deleted by its key travels as gone: what the row is at that
commit, so no listener reads it. ``listen`` holds one more connection, LISTENing, and a thread that reloads the
other named rows through the pool and hands them on; after its connection is lost it connects again and reloads
every table (notifications sent meanwhile are lost).

Read-your-writes (``caught_up``): every write transaction also advances the **commit counter** (the one row of
``commit_counter``, updated as the transaction's last statement), and its notifications carry the new value. The
row's lock makes the transactions that write take their numbers in the order they commit, one after another, and a
rolled-back one takes none; the notifications arrive in that same order. So once the listener has handed on the
changes of the transaction numbered ``n`` it has handed on those of every transaction committed before it, and a
caller that reads the counter (one small query on a connection of its own) knows which number to wait for: every
write committed before it read is numbered at most what it read.

Durability: a ``full`` write waits for PostgreSQL's ``synchronous_commit`` (its WAL flushed, and a synchronous
standby's when one is configured); the others set ``synchronous_commit = off`` for their transaction (a
PostgreSQL crash may lose the last ~0.6 s of them; a gateway crash loses nothing it was answered for).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from sbx.api.errors import Unavailable
from sbx.gateway.state import StateError, StateLocked
from sbx.gateway.store.base import Change, Result, Row, Store
from sbx.gateway.store.ops import Delete, Insert, Op, Update, Upsert, quote, render, select_sql
from sbx.gateway.store.pgloop import LoopQuery
from sbx.gateway.store.schema import POSTGRES_MIGRATIONS, TABLES

#: Environment variable holding the database password (when libpq's PGPASSWORD/PGPASSFILE are not used).
PASSWORD_ENV = "SANDBOX_GATEWAY_DATABASE_PASSWORD"
#: First key of the gateway's advisory locks ("sbx\0"), and the second of each lock.
LOCK_CLASS = 0x73627800
OWNER_LOCK = 1
MIGRATION_LOCK = 2
LEADER_LOCK = 3
#: First keys of the locks the replicas share (``Store.lock``; the second key is ``hashtext(name)``: a collision
#: only makes two names' holders wait for each other): a tenant's quota, a node's cordon, a name being created.
TENANT_LOCK_CLASS = 0x73627801
NODE_LOCK_CLASS = 0x73627802
NAME_LOCK_CLASS = 0x73627803
LOCK_KINDS = {"tenant": TENANT_LOCK_CLASS, "node": NODE_LOCK_CLASS, "name": NAME_LOCK_CLASS}
#: A lock held by another replica (its create stuck on a node) is waited for this long before a 503.
LOCK_WAIT_SECS = 60
#: Connections of the lock pool: the most locks' holders a replica has at once (one connection each, however
#: many locks it holds); more wait for one of them.
LOCK_POOL_SIZE = 8
#: How long a holder-to-be waits for a free lock connection before a 503.
LOCK_POOL_WAIT_SECS = 30
#: A replica that does not lead tries to take the leader lock this often (bounds a takeover after the leader's
#: process ends: its session, and the lock, end with it).
LEADER_TRY_SECS = 2.0
#: The leader checks its lock's connection this often.
LEADER_CHECK_SECS = 2.0
#: Server-side keepalives of the leader's connection (seconds: idle, interval, count; and the send timeout in ms):
#: PostgreSQL ends the session of a leader whose machine vanished after about 4 + 2 * 3 = 10 s, so another
#: replica takes over within ~12 s, under the 15 s the operator is promised.
LEADER_KEEPALIVES = {"tcp_keepalives_idle": 4, "tcp_keepalives_interval": 2, "tcp_keepalives_count": 3,
                     "tcp_user_timeout": 10000}  # fmt: skip
#: Connections in the pool: as many as the threads that call the store at once (asyncio's default executor).
POOL_SIZE = 8
#: A connection attempt, and the wait for a free (or new) connection of the pool, give up after this long.
CONNECT_TIMEOUT_SECS = 10
#: How often the owner lock's connection is checked (``watch_owner``).
OWNER_CHECK_SECS = 2.0
#: The readiness check's round trip (a pooled connection and ``SELECT 1``) gives up after this long.
READY_CHECK_SECS = 2.0
#: The channel of the changes' notifications, and the most a payload holds (PostgreSQL's limit is 8000 bytes).
CHANNEL = "sbx_gateway"
PAYLOAD_MAX = 7000
#: The listener waits this long between reconnection attempts after losing its connection.
LISTEN_RETRY_SECS = 1.0
#: The commit counter: advanced by a write transaction as its last statement (the row made by the first), and read.
ADVANCE_COUNTER = (
    "WITH counter AS (INSERT INTO commit_counter (id, n) VALUES (1, 1) "
    "ON CONFLICT (id) DO UPDATE SET n = commit_counter.n + 1 RETURNING n) "
)
READ_COUNTER = "SELECT n FROM commit_counter WHERE id = 1"
#: What a client is told while the database cannot be reached (the log has libpq's reason).
UNREACHABLE = "the gateway cannot reach its database now; try again shortly"

log = logging.getLogger(__name__)


class DatabaseUrlError(ValueError):
    """A ``--database`` value that cannot be used (the message says what to change)."""


def check_url(url: str) -> dict[str, str]:
    """The connection parameters of ``url``; ``DatabaseUrlError`` for anything but a ``postgresql://`` URL
    without a password."""
    if not url.startswith(("postgresql://", "postgres://")):
        raise DatabaseUrlError(
            f"{url.split('://')[0] if '://' in url else url!r} is not a PostgreSQL URL: give "
            "postgresql://USER@HOST[:PORT]/DATABASE (or postgresql:///DATABASE?host=/SOCKET/DIR)"
        )
    try:
        params = conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise DatabaseUrlError(f"cannot read the database URL: {exc}") from None
    if "password" in params or "sslpassword" in params:
        raise DatabaseUrlError(
            "the database URL carries a password, which would show in the process list and shell history: "
            f"remove it from the URL and set {PASSWORD_ENV} (or PGPASSWORD, or a PGPASSFILE/~/.pgpass entry)"
        )
    return {k: str(v) for k, v in params.items()}


def _connect_kwargs() -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "autocommit": True,
        "application_name": "sandbox-gateway",
        "connect_timeout": CONNECT_TIMEOUT_SECS,
        # A replica whose machine vanishes lets go of its owner lock once the server sees the connection dead.
        # tcp_user_timeout bounds a write to a peer that stopped answering (no keepalive runs meanwhile).
        "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
        "tcp_user_timeout": CONNECT_TIMEOUT_SECS * 1000,
    }  # fmt: skip
    password = os.environ.get(PASSWORD_ENV)
    if password:
        kwargs["password"] = password
    return kwargs


class PostgresStore(Store):
    """A PostgreSQL database holding the gateway's tables (in the connecting role's default schema)."""

    elects = True

    def __init__(self, url: str, owner: psycopg.Connection[Any] | None, pool: ConnectionPool) -> None:
        super().__init__()
        self.location = url
        self._owner = owner
        self._pool = pool
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._listener: threading.Thread | None = None
        self._leader: threading.Thread | None = None
        #: Names this store's own notifications (``Change.local``) and its catch-up markers.
        self.origin = uuid.uuid4().hex
        #: Why the owner lock is gone (``watch_owner`` found its connection failing), None while held.
        self._owner_lost: str | None = None
        #: Whether the listener holds a connection that LISTENs (``listen``); None before ``listen`` is called.
        self._listening: bool | None = None
        #: The commit counter's value up to which the listener has handed every change on (``caught_up``); -1
        #: until its first reload of every table is handed on (even a database never written waits for that).
        self._handed = -1
        self._handed_changed = threading.Condition()
        #: The connection the counter is read on (``_read_counter``), made when first needed.
        self._counter_conn: psycopg.Connection[Any] | None = None
        self._counter_lock = threading.Lock()
        #: The same read on the serving event loop (``caught_up_on_loop``), on a connection of its own.
        self._loop_counter = LoopQuery(
            lambda: psycopg.connect(url, **_connect_kwargs()), READ_COUNTER, b"sbx_counter"
        )
        self._load()
        #: The lock connections (``lock``), made when first needed.
        self._locks = ConnectionPool(
            url, kwargs=_connect_kwargs(), min_size=0, max_size=LOCK_POOL_SIZE, open=True,
            name="sandbox-gateway-locks", check=ConnectionPool.check_connection, timeout=LOCK_POOL_WAIT_SECS,
            configure=_lock_session,
        )  # fmt: skip

    @classmethod
    def open(cls, url: str, lock: bool = True, shared: bool = False) -> PostgresStore:
        """Connect, take the owner lock (``lock``; ``StateLocked`` while another process holds it in a mode that
        conflicts: ``shared`` for a serving replica, exclusive for the offline commands), migrate."""
        check_url(url)
        kwargs = _connect_kwargs()
        owner: psycopg.Connection[Any] | None = None
        pool: ConnectionPool | None = None

        def let_go() -> None:
            if pool is not None:
                pool.close()
            if owner is not None:
                owner.close()

        try:
            # One direct connection first: its error (refused, bad password, no such database) is the one shown.
            owner = psycopg.connect(url, **kwargs)
            if lock:
                try_lock = "pg_try_advisory_lock_shared" if shared else "pg_try_advisory_lock"
                row = owner.execute(f"SELECT {try_lock}(%s, %s)", (LOCK_CLASS, OWNER_LOCK)).fetchone()
                if not row or not row[0]:
                    raise StateLocked(
                        f"another sandbox-gateway holds the database {url} (replicas serve it, or an offline "
                        "command or a migrate runs on it); stop that gateway first (every replica), or make the change through the admin "
                        "API while it runs"
                    )
            _migrate(owner, url)
            pool = ConnectionPool(
                url, kwargs=kwargs, min_size=1, max_size=POOL_SIZE, open=False, name="sandbox-gateway",
                check=ConnectionPool.check_connection, timeout=CONNECT_TIMEOUT_SECS,
            )  # fmt: skip
            pool.open(wait=True, timeout=CONNECT_TIMEOUT_SECS)
            if not lock:
                owner.close()
                owner = None
            return cls(url, owner, pool)
        except psycopg.Error as exc:  # PoolTimeout is one too
            let_go()
            raise StateError(f"cannot use the database {url}: {str(exc).strip()}") from exc
        except Unavailable as exc:  # lost while the tables were read
            let_go()
            raise StateError(
                f"cannot use the database {url}: it stopped answering while the tables were read"
            ) from exc
        except BaseException:
            let_go()
            raise

    def close(self) -> None:
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join()
        for thread in (self._listener, self._leader):
            if thread is not None:
                thread.join()
        self._locks.close()
        self._pool.close()
        with self._counter_lock:
            if self._counter_conn is not None:
                self._counter_conn.close()
                self._counter_conn = None
        self._loop_counter.close()
        if self._owner is not None:
            # Let go of the owner lock before closing: PostgreSQL releases a closed session's locks only once its
            # backend has seen the end of the connection, so the next owner (a restart, an offline command run
            # right after) could otherwise still find it held, the more so on a loaded machine (seen:
            # test_one_owner_at_a_time under two busy loops).
            with contextlib.suppress(psycopg.Error):
                self._owner.execute("SELECT pg_advisory_unlock_all()")
            self._owner.close()
            self._owner = None

    def not_ready(self) -> str | None:
        """As ``Store.not_ready``: the owner lock lost, the listener without its connection (memory may miss
        other replicas' writes until it reloads), or no pooled connection answering ``SELECT 1`` within
        ``READY_CHECK_SECS`` (libpq's reason in the log, not in the answer)."""
        if self._owner_lost is not None:
            return "it lost the database's owner lock and is stopping"
        if self._listening is False:
            return "it lost the database's change notifications and is connecting again"
        try:
            with self._pool.connection(timeout=READY_CHECK_SECS) as conn:
                conn.execute("SELECT 1")
        except psycopg.Error as exc:  # PoolTimeout is one too
            log.warning("readiness: the database does not answer", extra={"error": str(exc).strip()})
            return "it cannot reach its database"
        return None

    def watch_owner(self, on_lost: Callable[[str], None]) -> None:
        """Check the owner lock's connection every ``OWNER_CHECK_SECS``; once it fails (PostgreSQL restarted or
        failed over, the network cut it), call ``on_lost(reason)`` once, from the watching thread.

        The lock went with that connection, so another process may take it: the owner must stop rather than
        take it again, since its memory would no longer be known to match the database."""
        owner = self._owner
        if owner is None:
            return

        def watch() -> None:
            while not self._closed.wait(OWNER_CHECK_SECS):
                try:
                    owner.execute("SELECT 1")
                except psycopg.Error as exc:
                    if not self._closed.is_set():
                        self._owner_lost = str(exc).strip() or type(exc).__name__
                        on_lost(self._owner_lost)
                    return

        self._watcher = threading.Thread(target=watch, name="store-owner-watch", daemon=True)
        self._watcher.start()

    def schema_version(self) -> int:
        with self._pool.connection() as conn:
            return _version(conn)

    def apply(self, ops: Sequence[Op], full: bool = True) -> list[int]:
        """As ``Store.apply``; ``Unavailable`` (503) while the database cannot be reached (memory is then left as
        it was: a commit whose answer was lost is found again at the next start)."""
        statements = [render(op, "%s") for op in ops]
        closing = _closing(_payloads(self.origin, ops), full)
        try:
            with self._pool.connection() as conn, conn.transaction():
                counts = [conn.execute(sql, params).rowcount for sql, params in statements]
                if closing is not None:
                    conn.execute(*closing)
                return counts
        except (psycopg.OperationalError, PoolTimeout) as exc:
            log.error("database unreachable", extra={"error": str(exc).strip() or type(exc).__name__})
            raise Unavailable(UNREACHABLE) from exc

    mark = "%s"

    def run(self, statements: Sequence[tuple[str, tuple[Any, ...]]], full: bool = True) -> list[Result]:
        """As ``Store.run``; ``Unavailable`` (503) while the database cannot be reached."""
        try:
            with self._pool.connection() as conn, conn.transaction():
                if not full:
                    conn.execute("SET LOCAL synchronous_commit TO OFF")
                results = []
                for sql, params in statements:
                    cursor = conn.execute(sql, params)
                    rows = cursor.fetchall() if cursor.description else []
                    results.append(Result(cursor.rowcount, rows))
                return results
        except (psycopg.OperationalError, PoolTimeout) as exc:
            log.error("database unreachable", extra={"error": str(exc).strip() or type(exc).__name__})
            raise Unavailable(UNREACHABLE) from exc

    def audit_append(self, entries: Sequence[tuple[int, str]]) -> None:
        """As ``Store.audit_append``, through ``COPY`` (a batch of audit lines costs a fraction of the CPU of an
        ``INSERT`` of many rows: measured in docs/benchmarks.md)."""
        if not entries:
            return
        try:
            with self._pool.connection() as conn, conn.transaction():
                conn.execute("SET LOCAL synchronous_commit TO OFF")
                with conn.cursor().copy("COPY audit (time_ms, bytes, line) FROM STDIN") as copy:
                    for when, line in entries:
                        copy.write_row((when, len(line.encode()), line))
        except (psycopg.OperationalError, PoolTimeout) as exc:
            log.error("database unreachable", extra={"error": str(exc).strip() or type(exc).__name__})
            raise Unavailable(UNREACHABLE) from exc

    def select(
        self, table: str, columns: Sequence[str], order_by: str | None = None
    ) -> list[tuple[Any, ...]]:
        try:
            with self._pool.connection() as conn:
                return conn.execute(select_sql(table, list(columns), order_by)).fetchall()
        except (psycopg.OperationalError, PoolTimeout) as exc:
            log.error("database unreachable", extra={"error": str(exc).strip() or type(exc).__name__})
            raise Unavailable(UNREACHABLE) from exc

    def listen(self, on_changes: Callable[[list[Change]], None]) -> None:
        """As ``Store.listen``: a thread LISTENing on a connection of its own (see the module's docstring). The
        first connection is made before this returns (``StateError`` if it cannot be), so nothing committed
        after it returns is missed; what was committed between the store's loading and then is read again: every
        table is, whenever a connection starts listening."""
        try:
            first = psycopg.connect(self.location, **_connect_kwargs())
            first.execute(f"LISTEN {CHANNEL}")
        except psycopg.Error as exc:
            raise StateError(f"cannot listen to the database {self.location}: {str(exc).strip()}") from exc

        conn: psycopg.Connection[Any] | None = first
        self._listening = True

        def run() -> None:
            nonlocal conn
            while not self._closed.is_set():
                try:
                    if conn is None:
                        conn = psycopg.connect(self.location, **_connect_kwargs())
                        conn.execute(f"LISTEN {CHANNEL}")
                        log.info("listening to the database's changes again; reloading every table")
                    with conn:
                        # Read before the tables: each of them then holds every commit up to it, at least.
                        counter = self._read_counter()
                        on_changes([Change(t, None, self._rows(t)) for t in list(self.mirrors)])
                        self._hand(counter)
                        # Ready again only once memory has caught up with what was missed meanwhile.
                        self._listening = True
                        self._listen_on(conn, on_changes)
                except Exception as exc:  # whatever it was, memory is read again whole
                    self._listening = False
                    if self._closed.is_set():
                        return
                    if isinstance(exc, psycopg.Error | Unavailable):
                        log.warning("lost the database's change notifications; connecting again",
                                    extra={"error": str(exc).strip() or type(exc).__name__})  # fmt: skip
                    else:  # a defect: the thread must not die, leaving memory behind the database for good
                        log.exception("could not apply the database's change notifications; connecting again",
                                      extra={"error": repr(exc)[:500]})  # fmt: skip
                    self._closed.wait(LISTEN_RETRY_SECS)
                conn = None

        self._listener = threading.Thread(target=run, name="store-listener", daemon=True)
        self._listener.start()

    def _listen_on(self, conn: psycopg.Connection[Any], on_changes: Callable[[list[Change]], None]) -> None:
        # Of each transaction whose notifications are split over batches: its counter value, the parts seen.
        parts_seen: dict[int, int] = {}
        while not self._closed.is_set():
            # The first notification (or a timeout, to see close()), then whatever else already arrived: the rows
            # of one batch are read once each, the newest state of every row named.
            batch = list(conn.notifies(timeout=0.5, stop_after=1))
            if not batch:
                continue
            batch += list(conn.notifies(timeout=0.001))
            named: dict[tuple[str, Row | None], bool] = {}
            # A row as its last notification in the batch carried it (None: that one did not; read it). Carried
            # rows apply in commit order, so the last is the row as of the batch's last commit naming it.
            carried: dict[tuple[str, Row | None], list[Row] | None] = {}
            counters: list[tuple[int, int]] = []
            reloaded: int | None = None
            for note in batch:
                try:
                    self._note(note.payload, named, carried, counters)
                except (ValueError, KeyError, TypeError, IndexError) as exc:
                    # Not this version's form (a replica of another version, mid-upgrade): what it changed is
                    # unknown, so every table is read again, after the counter (as at a reconnection).
                    log.warning("a change notification this replica cannot read; reloading every table",
                                extra={"error": repr(exc)[:200]})  # fmt: skip
                    named.update({(t, None): False for t in self.mirrors})
                    if reloaded is None:
                        reloaded = self._read_counter()
            if any(key is None for _, key in named):  # a table reloaded whole covers its single rows
                whole = {
                    t: all(v for (t2, _), v in named.items() if t2 == t) for t, key in named if key is None
                }
                named = {(t, k): v for (t, k), v in named.items() if t not in whole}
                named.update({(t, None): local for t, local in whole.items()})  # local only if all of it was
            # A table memory does not hold (the notification outbox) is named without its rows.
            changes = []
            for (table, key), local in named.items():
                rows = carried.get((table, key))
                if rows is None:
                    rows = self._rows(table, key) if table in self.mirrors else []
                changes.append(Change(table, key, rows, local))
            if changes:
                on_changes(changes)
            # Handed on: every transaction whose notifications have all arrived (and each committed before it).
            self._hand(max(reloaded or 0, _complete(counters, parts_seen)))

    def _note(
        self, payload: str, named: dict[tuple[str, Row | None], bool],
        carried: dict[tuple[str, Row | None], list[Row] | None], counters: list[tuple[int, int]],
    ) -> None:  # fmt: skip
        """Add one notification to its batch: the rows it names (``local`` unless another writer named them too),
        the rows it carries (see ``_payloads``), its transaction's commit counter and number of notifications.
        Raises on a payload not of this form."""
        body = json.loads(payload)
        if "marker" in body:  # a catch-up marker of a replica of the version before: nothing changed
            return
        local = body["origin"] == self.origin
        if "n" in body:  # absent from a replica of the version before (which does not advance the counter)
            counters.append((int(body["n"]), int(body.get("parts", 1))))
        if "signal" in body:
            named[(f"signal:{body['signal']}", tuple(body["args"]))] = local
            return
        for table, key, *row in body["rows"]:
            entry = (str(table), tuple(key) if key is not None else None)
            named[entry] = named.get(entry, True) and local
            carried[entry] = ([tuple(row[0])] if row[0] is not None else []) if row else None

    def _rows(self, table: str, key: Row | None = None) -> list[Row]:
        """Every row of ``table``, or the one with primary key ``key`` (none when it is gone)."""
        sql = select_sql(table, TABLES[table].columns)
        if key is None:
            return self.select(table, TABLES[table].columns)
        sql += " WHERE " + " AND ".join(f"{quote(c)} = %s" for c in TABLES[table].key)
        try:
            with self._pool.connection() as conn:
                return conn.execute(sql, key).fetchall()
        except (psycopg.OperationalError, PoolTimeout) as exc:
            raise Unavailable(UNREACHABLE) from exc

    def lead(self, on_change: Callable[[bool], None]) -> None:
        """As ``Store.lead``: a thread holding a connection of its own tries ``pg_try_advisory_lock(LOCK_CLASS,
        LEADER_LOCK)`` every ``LEADER_TRY_SECS`` until it has it; the session holds it until it ends (the
        process exits or is killed: at once; its machine vanishes: the keepalives above). Losing that connection
        while leading calls ``on_change(False)`` once and ends the thread."""

        def run() -> None:
            while not self._closed.is_set():
                leading = False
                try:
                    with psycopg.connect(self.location, **_connect_kwargs()) as conn:
                        for name, value in LEADER_KEEPALIVES.items():
                            conn.execute(f"SET {name} = {int(value)}")
                        while not self._closed.is_set():
                            row = conn.execute(
                                "SELECT pg_try_advisory_lock(%s, %s)", (LOCK_CLASS, LEADER_LOCK)
                            ).fetchone()
                            if row and row[0]:
                                break
                            self._closed.wait(LEADER_TRY_SECS)
                        if self._closed.is_set():
                            return
                        leading = True
                        on_change(True)
                        while not self._closed.wait(LEADER_CHECK_SECS):
                            conn.execute("SELECT 1")
                        return
                except psycopg.Error as exc:
                    if self._closed.is_set():
                        return
                    reason = str(exc).strip() or type(exc).__name__
                    if leading:
                        on_change(False)
                        log.error("lost the leader lock's connection", extra={"error": reason})
                        return
                    log.warning("cannot run for leader now; trying again", extra={"error": reason})
                    self._closed.wait(LEADER_TRY_SECS)

        self._leader = threading.Thread(target=run, name="store-leader", daemon=True)
        self._leader.start()

    def lock(self, names: Sequence[tuple[str, str]]) -> object:
        """As ``Store.lock``: session advisory locks (``pg_advisory_lock(class of the kind, hashtext(name))``),
        taken in a fixed order on one connection of the lock pool (``LOCK_POOL_SIZE`` of them: a replica never
        holds more, however many creates wait), let go of at :meth:`unlock` or when the session ends (the
        replica died: at once).

        503 ``Unavailable`` when every lock connection stays busy for ``LOCK_POOL_WAIT_SECS`` (nothing was
        taken), when a lock stays held elsewhere for ``LOCK_WAIT_SECS``, or while the database is out of reach."""
        wanted = sorted({(LOCK_KINDS[kind], name) for kind, name in names})
        try:
            conn = self._locks.getconn(timeout=LOCK_POOL_WAIT_SECS)
        except PoolTimeout as exc:
            if self._locks_reachable():
                log.warning("every lock connection is busy", extra={"lock_connections": LOCK_POOL_SIZE})
                raise Unavailable(
                    f"this gateway replica has all its {LOCK_POOL_SIZE} database lock connections in use (creates "
                    "under a quota or naming a sandbox, service, volume, organisation, node or SSH key, and "
                    f"cordons) for {LOCK_POOL_WAIT_SECS} s; try again shortly"
                ) from exc
            log.error("database unreachable", extra={"error": str(exc).strip() or type(exc).__name__})
            raise Unavailable(UNREACHABLE) from exc
        except psycopg.OperationalError as exc:
            log.error("database unreachable", extra={"error": str(exc).strip() or type(exc).__name__})
            raise Unavailable(UNREACHABLE) from exc
        try:
            for lock_class, name in wanted:
                try:
                    conn.execute("SELECT pg_advisory_lock(%s, hashtext(%s))", (lock_class, name))
                except psycopg.errors.LockNotAvailable:
                    kind = next(k for k, c in LOCK_KINDS.items() if c == lock_class)
                    raise Unavailable(_held_too_long(kind, name)) from None
        except Unavailable:
            self.unlock(conn)
            raise
        except psycopg.Error as exc:
            self.unlock(conn)
            log.error("database unreachable", extra={"error": str(exc).strip() or type(exc).__name__})
            raise Unavailable(UNREACHABLE) from exc
        return conn

    def unlock(self, handle: object) -> None:
        """Let go of every lock of ``handle`` and give its connection back to the lock pool (closed first when
        the unlock fails: the session's end lets go of them)."""
        assert isinstance(handle, psycopg.Connection)
        try:
            handle.execute("SELECT pg_advisory_unlock_all()")
        except psycopg.Error:
            handle.close()
        self._locks.putconn(handle)

    def _locks_reachable(self) -> bool:
        """After a wait for a lock connection timed out: whether the database answers (the pool's connections
        were all busy) or not (none could be made)."""
        return self._locks.get_stats().get("pool_size", 0) >= LOCK_POOL_SIZE

    def claim_notifications(self, owner: str, lease_secs: float) -> list[Row]:
        """As ``Store.claim_notifications``: in one transaction, the due rows no other worker holds a lease on are
        locked (``FOR UPDATE SKIP LOCKED``: two workers claiming at once never get one row both) and leased to
        ``owner`` until the database's clock says ``lease_secs`` more."""
        columns = ", ".join(quote(c) for c in self.OUTBOX_COLUMNS)
        sql = f"""
            UPDATE notifications SET lease_owner = %(owner)s,
                lease_until = EXTRACT(EPOCH FROM clock_timestamp()) + %(lease)s
            WHERE id IN (
                SELECT id FROM notifications
                WHERE id IN (SELECT MIN(id) FROM notifications GROUP BY job) AND next_try <= %(now)s
                    AND (lease_until IS NULL OR lease_until < EXTRACT(EPOCH FROM clock_timestamp()))
                FOR UPDATE SKIP LOCKED
            )
            RETURNING {columns}
        """
        try:
            with self._pool.connection() as conn, conn.transaction():
                rows = conn.execute(sql, {"owner": owner, "lease": lease_secs, "now": time.time()}).fetchall()
        except (psycopg.OperationalError, PoolTimeout) as exc:
            log.error("database unreachable", extra={"error": str(exc).strip() or type(exc).__name__})
            raise Unavailable(UNREACHABLE) from exc
        return sorted(rows, key=lambda r: r[5])

    @property
    def shared(self) -> bool:
        return self._listener is not None

    def signal(self, name: str, args: Sequence[str]) -> None:
        """As ``Store.signal``: a notification of its own (after every commit made before it)."""
        payload = json.dumps({"origin": self.origin, "signal": name, "args": list(args)})
        try:
            with self._pool.connection() as conn:
                conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))
        except (psycopg.OperationalError, PoolTimeout) as exc:
            log.error("database unreachable", extra={"error": str(exc).strip() or type(exc).__name__})
            raise Unavailable(UNREACHABLE) from exc

    def caught_up(self, timeout_secs: float) -> bool:
        """As ``Store.caught_up``: the commit counter read (one query: every transaction committed before it is
        numbered at most what it says), then a wait until the listener has handed on the changes up to that
        number (at once when it has: the common case). False when the database cannot be reached or the
        listener does not get there within ``timeout_secs``. Nothing is sent to the other replicas."""
        if self._listener is None:
            return True
        try:
            wanted = self._read_counter()
        except Unavailable:
            return False
        return self._wait_handed(wanted, timeout_secs)

    async def caught_up_on_loop(self, timeout_secs: float) -> bool:
        """As :meth:`caught_up`, its query asked on the calling event loop (``pgloop``: a quarter of the CPU of a
        blocking query behind a thread), and a thread taken only when the listener is not that far yet."""
        if self._listener is None:
            return True
        try:
            async with asyncio.timeout(timeout_secs):
                value = await self._loop_counter()
        except (psycopg.Error, OSError, TimeoutError) as exc:
            reason = (
                f"no answer within {timeout_secs} s" if isinstance(exc, TimeoutError) else str(exc).strip()
            )
            log.error("database unreachable", extra={"error": reason or type(exc).__name__})
            return False
        wanted = int(value) if value is not None else 0
        if self._handed >= wanted:  # the common case; an int only ever raised (by the listener), read whole
            return True
        return await asyncio.to_thread(self._wait_handed, wanted, timeout_secs)

    def _wait_handed(self, wanted: int, timeout_secs: float) -> bool:
        with self._handed_changed:
            return self._handed_changed.wait_for(lambda: self._handed >= wanted, timeout_secs)

    def _read_counter(self) -> int:
        """The commit counter now (0 before the first write), on a connection of its own (not the pool's: a
        pooled connection costs its check's round trip too); ``Unavailable`` while the database cannot be
        reached (the connection is made again at the next call)."""
        with self._counter_lock:
            try:
                if self._counter_conn is None or self._counter_conn.closed:
                    self._counter_conn = psycopg.connect(self.location, **_connect_kwargs())
                row = self._counter_conn.execute(READ_COUNTER).fetchone()
            except psycopg.Error as exc:
                if self._counter_conn is not None:
                    self._counter_conn.close()
                    self._counter_conn = None
                log.error("database unreachable", extra={"error": str(exc).strip() or type(exc).__name__})
                raise Unavailable(UNREACHABLE) from exc
        return int(row[0]) if row else 0

    def _hand(self, counter: int) -> None:
        """The listener has handed on every change up to commit ``counter``: wake whoever waits for it."""
        with self._handed_changed:
            if counter > self._handed:
                self._handed = counter
                self._handed_changed.notify_all()

    def after_copy(self) -> None:
        """After rows were copied in with their ids: the notification ids go on after the highest copied."""
        with self._pool.connection() as conn:
            for table in ("notifications", "audit"):
                conn.execute(
                    f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                    f"GREATEST((SELECT MAX(id) FROM {table}), 1))"
                )


def _lock_session(conn: psycopg.Connection[Any]) -> None:
    """A lock connection waits ``LOCK_WAIT_SECS`` at most for a lock."""
    conn.execute(f"SET lock_timeout = '{LOCK_WAIT_SECS}s'")


def _held_too_long(kind: str, name: str) -> str:
    """The 503's message for a lock another replica held for ``LOCK_WAIT_SECS``."""
    what = {
        "tenant": f"another create of tenant {name or 'default'} has held its quota",
        "node": f"another replica has held node {name}'s cordon",
        "name": "another create of this name has held it",
    }[kind]
    return f"{what} for {LOCK_WAIT_SECS} s; try again shortly"


def _version(conn: psycopg.Connection[Any]) -> int:
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _migrate(conn: psycopg.Connection[Any], url: str) -> None:
    """Apply the missing migrations in one transaction, under the migration lock (so two processes starting
    together apply each once)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s, %s)", (LOCK_CLASS, MIGRATION_LOCK))
        current = _version(conn)
        if current > len(POSTGRES_MIGRATIONS):
            raise StateError(
                f"the database {url} is at schema version {current}, newer than this sandbox-gateway knows "
                f"({len(POSTGRES_MIGRATIONS)}): run a newer sandbox-gateway"
            )
        for version in range(current + 1, len(POSTGRES_MIGRATIONS) + 1):
            conn.execute(POSTGRES_MIGRATIONS[version - 1])
            conn.execute("INSERT INTO schema_version (version) VALUES (%s)", (version,))


def _key_of(op: Op) -> Row | None:
    """The primary key of the one row ``op`` changes; None when it is not bounded by one (a whole table then)."""
    key = TABLES[op.table].key
    if isinstance(op, Insert | Upsert):
        return tuple(op.row[c] for c in key) if all(c in op.row for c in key) else None
    if isinstance(op, Update) and any(c in op.values for c in key):
        return None
    if isinstance(op, Delete) and op.below:
        return None
    where = op.where
    return tuple(where[c] for c in key) if all(c in where for c in key) else None


#: A row larger than this (JSON) is named in its notification, not carried: listeners read it.
CARRY_MAX = 1500


def _carried(op: Op) -> tuple[bool, list[Any] | None]:
    """Whether ``op`` leaves its one row fully known without reading it back, and that row (every column of
    ``schema.TABLES``, in order; None: gone). An insert or upsert of every column (JSON's types only: no
    bytes), or a delete by exactly the primary key (a delete with more conditions may leave the row)."""
    table = TABLES[op.table]
    if isinstance(op, Insert | Upsert) and set(op.row) == set(table.columns):
        row = [op.row[c] for c in table.columns]
        if all(v is None or isinstance(v, str | int | float) for v in row):
            return True, row
    if isinstance(op, Delete) and not op.below and set(op.where) == set(table.key):
        return True, None
    return False, None


def _complete(counters: Sequence[tuple[int, int]], parts_seen: dict[int, int]) -> int:
    """The highest commit counter of a transaction all of whose notifications have now arrived, 0 for none:
    ``counters`` are this batch's, ``(counter, notifications of its transaction)`` each; ``parts_seen`` keeps,
    from batch to batch, how many arrived of a transaction split over batches. A transaction's notifications
    arrive one after another, after every earlier transaction's, so the highest complete one is the position."""
    done = 0
    for counter, parts in counters:
        parts_seen[counter] = parts_seen.get(counter, 0) + 1
        if parts_seen[counter] >= parts:
            del parts_seen[counter]
            done = max(done, counter)
    return done


def _closing(payloads: list[str], full: bool) -> tuple[str, list[Any]] | None:
    """The last statement of a write transaction (one round trip, however many notifications): the commit
    counter advanced, each payload sent with the new value and the transaction's number of notifications added
    (``"n"``, ``"parts"``), and the commit level of ``full=False``. None for a transaction writing nothing.

    Last, so the counter row's lock is held from there to the commit only; PostgreSQL sends the notifications at
    the commit, whatever their place in the transaction, and a rollback drops them with the counter's advance."""
    if not payloads:
        return None
    # Each payload is a JSON object: its closing brace becomes the counter's fields.
    parts = f', "parts": {len(payloads)}, "n": '
    notes = ["pg_notify(%s, left(%s, -1) || %s || counter.n || '}')" for _ in payloads]
    args: list[Any] = [arg for payload in payloads for arg in (CHANNEL, payload, parts)]
    if not full:
        notes.append("set_config('synchronous_commit', 'off', true)")
    return ADVANCE_COUNTER + "SELECT " + ", ".join(notes) + " FROM counter", args


def _payloads(origin: str, ops: Sequence[Op]) -> list[str]:
    """The notifications of a transaction running ``ops``, each within PAYLOAD_MAX: every row changed, as
    ``[table, key]`` (listeners read it; key None: the whole table) or ``[table, key, row]`` (the row as this
    transaction leaves it, null when gone; see ``_carried``)."""
    entries: dict[tuple[str, Row | None], list[Any]] = {}
    for op in ops:
        key = _key_of(op)
        entry: list[Any] = [op.table, key]
        if key is not None:
            known, row = _carried(op)
            # The transaction's last write of the row decides: a later one not carried makes listeners read it.
            if known and len(json.dumps(row)) <= CARRY_MAX:
                entry.append(row)
        entries.pop((op.table, key), None)  # kept in the order of each row's last write
        entries[(op.table, key)] = entry
    payloads: list[str] = []
    chunk: list[list[Any]] = []
    size = 0
    for entry in entries.values():
        length = len(json.dumps(entry)) + 1
        if chunk and size + length > PAYLOAD_MAX - len(origin) - 32:
            payloads.append(json.dumps({"origin": origin, "rows": chunk}))
            chunk, size = [], 0
        chunk.append(entry)
        size += length
    if chunk:
        payloads.append(json.dumps({"origin": origin, "rows": chunk}))
    return payloads
