"""The PostgreSQL store (``--database postgresql://USER@HOST[:PORT]/DB``): psycopg 3 and its connection pool.

The password never travels on a command line: a URL carrying one is refused. It comes from the environment
variable ``SANDBOX_GATEWAY_DATABASE_PASSWORD`` when set, else from libpq's own sources (``PGPASSWORD``,
``PGPASSFILE`` or ``~/.pgpass``), or is not needed (peer or certificate authentication).

Two advisory locks (``pg_advisory_lock``, two int4 keys under ``LOCK_CLASS``):

- the **owner lock**, held on a connection of its own for as long as the store is open: a serving gateway and
  the offline commands take it without waiting and refuse while another process has it, the rule the SQLite
  store keeps with its lock file. (Several replicas on one database are not served yet: docs/ha.md.)
- the **migration lock**, a transaction lock taken before the schema version is read: of two processes starting
  on an empty database together, one migrates and the other waits, then finds the schema current.

Durability: a ``full`` write waits for PostgreSQL's ``synchronous_commit`` (its WAL flushed, and a synchronous
standby's when one is configured); the others set ``synchronous_commit = off`` for their transaction (a
PostgreSQL crash may lose the last ~0.6 s of them; a gateway crash loses nothing it was answered for).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from sbx.api.errors import Unavailable
from sbx.gateway.state import StateError, StateLocked
from sbx.gateway.store.base import Store
from sbx.gateway.store.ops import Op, render, select_sql
from sbx.gateway.store.schema import POSTGRES_MIGRATIONS

#: Environment variable holding the database password (when libpq's PGPASSWORD/PGPASSFILE are not used).
PASSWORD_ENV = "SANDBOX_GATEWAY_DATABASE_PASSWORD"
#: First key of the gateway's advisory locks ("sbx\0"), and the second of each lock.
LOCK_CLASS = 0x73627800
OWNER_LOCK = 1
MIGRATION_LOCK = 2
#: Connections in the pool: as many as the threads that call the store at once (asyncio's default executor).
POOL_SIZE = 8
#: A connection attempt, and the wait for a free (or new) connection of the pool, give up after this long.
CONNECT_TIMEOUT_SECS = 10
#: How often the owner lock's connection is checked (``watch_owner``).
OWNER_CHECK_SECS = 2.0
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

    def __init__(self, url: str, owner: psycopg.Connection[Any] | None, pool: ConnectionPool) -> None:
        super().__init__()
        self.location = url
        self._owner = owner
        self._pool = pool
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._load()

    @classmethod
    def open(cls, url: str, lock: bool = True) -> PostgresStore:
        """Connect, take the owner lock (``lock``; ``StateLocked`` while another process has it), migrate."""
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
                row = owner.execute(
                    "SELECT pg_try_advisory_lock(%s, %s)", (LOCK_CLASS, OWNER_LOCK)
                ).fetchone()
                if not row or not row[0]:
                    raise StateLocked(
                        f"another sandbox-gateway holds the database {url} (one serves it, or an offline command "
                        "or a migrate runs on it); stop that gateway first, or make the change through the admin "
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
        self._pool.close()
        if self._owner is not None:
            self._owner.close()
            self._owner = None

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
                        on_lost(str(exc).strip() or type(exc).__name__)
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
        try:
            with self._pool.connection() as conn, conn.transaction():
                if not full:
                    conn.execute("SET LOCAL synchronous_commit TO OFF")
                return [conn.execute(sql, params).rowcount for sql, params in statements]
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

    def after_copy(self) -> None:
        """After rows were copied in with their ids: the notification ids go on after the highest copied."""
        with self._pool.connection() as conn:
            conn.execute(
                "SELECT setval(pg_get_serial_sequence('notifications', 'id'), "
                "GREATEST((SELECT MAX(id) FROM notifications), 1))"
            )


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
