"""The SQLite store (``--state FILE``, the embedded default for one machine): one database file in WAL mode and
a lock file that makes one process its owner.

Durability: every commit is in the WAL file before a call returns, so a SIGKILL at any moment loses nothing
acknowledged. ``full`` writes are also fsynced (``synchronous=FULL``); the others use ``NORMAL`` (see
``Store.apply``), and a later full commit syncs the earlier ones too.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sbx.gateway.state import StateError, StateLocked
from sbx.gateway.store.base import Result, Store
from sbx.gateway.store.ops import Op, render, select_sql
from sbx.gateway.store.schema import SQLITE_MIGRATIONS
from sbx.statefile import try_lock

# Seconds a connection waits for another's lock before "database is locked".
_BUSY_S = 5.0


def lock_path_for(state_path: Path) -> Path:
    return state_path.with_name(state_path.name + ".lock")


def acquire_lock(state_path: Path) -> int:
    """Take the state file's exclusive lock (non-blocking) and return its descriptor; held until closed.

    Raises ``StateLocked`` while another process holds it.
    """
    path = lock_path_for(state_path)
    fd = try_lock(path)
    if fd is None:
        raise StateLocked(
            f"another process holds the state file lock {path} (a sandbox-gateway serving {state_path}); "
            "stop that gateway first, or make the change through the admin API while it runs"
        )
    return fd


class SqliteStore(Store):
    """The state file. ``open`` does not lock: ``open_store`` takes ``acquire_lock`` first and hands the
    descriptor over (closed with the store)."""

    def __init__(self, path: Path, conn: sqlite3.Connection, lock_fd: int | None = None) -> None:
        super().__init__()
        self.path = path
        self.location = str(path)
        self._conn = conn
        self._lock = threading.Lock()
        self._lock_fd = lock_fd
        self._full = True
        self._load()

    @classmethod
    def open(cls, path: Path, lock_fd: int | None = None) -> SqliteStore:
        """Open (creating if absent, mode 0600) and migrate the database at ``path``."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not path.exists():
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        try:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=_BUSY_S)
            _enable_wal(conn)
            # FULL: every commit is fsynced (WAL's NORMAL may lose the last commits on power loss).
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            _migrate(conn)
            return cls(path, conn, lock_fd)
        except sqlite3.DatabaseError as exc:
            raise StateError(f"cannot use the state file {path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._conn.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def schema_version(self) -> int:
        with self._lock:
            return _version(self._conn)

    def apply(self, ops: Sequence[Op], full: bool = True) -> list[int]:
        statements = [render(op, "?") for op in ops]
        with self._transaction(full):
            return [self._conn.execute(sql, params).rowcount for sql, params in statements]

    def run(self, statements: Sequence[tuple[str, tuple[Any, ...]]], full: bool = True) -> list[Result]:
        with self._transaction(full):
            results = []
            for sql, params in statements:
                cursor = self._conn.execute(sql, params)
                results.append(Result(cursor.rowcount, cursor.fetchall()))
            return results

    @contextmanager
    def _transaction(self, full: bool) -> Iterator[None]:
        """One write transaction under the connection lock: committed when the body returns, rolled back when
        it raises. ``full`` picks the fsync level (see the module docstring)."""
        with self._lock:
            if full != self._full:
                self._conn.execute(f"PRAGMA synchronous={'FULL' if full else 'NORMAL'}")
                self._full = full
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def select(
        self, table: str, columns: Sequence[str], order_by: str | None = None
    ) -> list[tuple[Any, ...]]:
        sql = select_sql(table, list(columns), order_by)
        with self._lock:
            return list(self._conn.execute(sql))


def _enable_wal(conn: sqlite3.Connection) -> None:
    """Switch the file to WAL (persistent, so a no-op after the first open), retrying for ``_BUSY_S`` seconds.

    Why a loop: SQLite answers this pragma "database is locked" at once, without its busy handler, while
    another connection is converting the same new file, so openers racing on a new file would fail.
    """
    deadline = time.monotonic() + _BUSY_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


def _version(conn: sqlite3.Connection) -> int:
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _migrate(conn: sqlite3.Connection) -> None:
    """Apply the missing migrations in one transaction (all or none).

    IMMEDIATE takes the write lock before reading the version, so a second process opening the same file
    waits (busy handler), then sees the version this one wrote and applies nothing.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        current = _version(conn)
        if current > len(SQLITE_MIGRATIONS):
            raise StateError(
                f"schema version {current} is newer than this sandbox-gateway knows ({len(SQLITE_MIGRATIONS)}): "
                "run a newer sandbox-gateway"
            )
        for version in range(current + 1, len(SQLITE_MIGRATIONS) + 1):
            for statement in SQLITE_MIGRATIONS[version - 1].split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
