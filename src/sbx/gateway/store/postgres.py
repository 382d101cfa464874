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

import os
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

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
#: Connections in the pool: writes are serialised by the gateway's callers, reads at start-up; 4 leaves room.
POOL_SIZE = 4
CONNECT_TIMEOUT_SECS = 10


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
    if "password" in params:
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
        "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
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
        self._load()

    @classmethod
    def open(cls, url: str, lock: bool = True) -> PostgresStore:
        """Connect, take the owner lock (``lock``; ``StateLocked`` while another process has it), migrate."""
        check_url(url)
        kwargs = _connect_kwargs()
        owner: psycopg.Connection[Any] | None = None
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
            pool: ConnectionPool = ConnectionPool(
                url, kwargs=kwargs, min_size=1, max_size=POOL_SIZE, open=False, name="sandbox-gateway",
                check=ConnectionPool.check_connection, timeout=30.0,
            )  # fmt: skip
            pool.open(wait=True, timeout=CONNECT_TIMEOUT_SECS)
        except psycopg.Error as exc:
            if owner is not None:
                owner.close()
            raise StateError(f"cannot use the database {url}: {str(exc).strip()}") from exc
        except (PoolTimeout, StateLocked, StateError):
            if owner is not None:
                owner.close()
            raise
        if not lock:
            owner.close()
            owner = None
        return cls(url, owner, pool)

    def close(self) -> None:
        self._pool.close()
        if self._owner is not None:
            self._owner.close()
            self._owner = None

    def schema_version(self) -> int:
        with self._pool.connection() as conn:
            return _version(conn)

    def apply(self, ops: Sequence[Op], full: bool = True) -> list[int]:
        statements = [render(op, "%s") for op in ops]
        with self._pool.connection() as conn, conn.transaction():
            if not full:
                conn.execute("SET LOCAL synchronous_commit TO OFF")
            return [conn.execute(sql, params).rowcount for sql, params in statements]

    def select(
        self, table: str, columns: Sequence[str], order_by: str | None = None
    ) -> list[tuple[Any, ...]]:
        with self._pool.connection() as conn:
            return conn.execute(select_sql(table, list(columns), order_by)).fetchall()

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
