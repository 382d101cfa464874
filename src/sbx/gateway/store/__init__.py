"""The gateway's store: one interface (``Store``, in ``base``), two implementations — SQLite (``--state FILE``,
the embedded default) and PostgreSQL (``--database URL``) — and ``open_store``, the only place that picks one.

Everything above this package (server, services, jobs, secrets, SSH, the command line) uses ``Store`` and the
write operations of ``ops`` only. docs/ha.md tells which to choose and how to move from one to the other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sbx.gateway.state import StateError, StateLocked
from sbx.gateway.store.base import Store
from sbx.gateway.store.ops import Delete, Insert, Op, Update, Upsert
from sbx.gateway.store.schema import SCHEMA_VERSION, TABLES

__all__ = [
    "SCHEMA_VERSION",
    "TABLES",
    "Delete",
    "Insert",
    "Op",
    "StateError",
    "StateLocked",
    "Store",
    "StoreLocation",
    "Update",
    "Upsert",
    "check_database_url",
    "copy_state",
    "open_store",
]


@dataclass(frozen=True)
class StoreLocation:
    """Where the state is: a SQLite file (``state``) or a PostgreSQL URL (``database``); exactly one is set."""

    state: Path | None = None
    database: str | None = None

    def __post_init__(self) -> None:
        if (self.state is None) == (self.database is None):
            raise ValueError("give exactly one of a state file and a database URL")

    def __str__(self) -> str:
        return str(self.state) if self.state is not None else str(self.database)


def check_database_url(url: str) -> None:
    """Raise ``StateError`` (saying what to change) for a ``--database`` value that cannot be used: not a
    ``postgresql://`` URL, or one carrying a password."""
    from sbx.gateway.store.postgres import DatabaseUrlError, check_url

    try:
        check_url(url)
    except DatabaseUrlError as exc:
        raise StateError(str(exc)) from None


def open_store(location: StoreLocation, serving: bool = False) -> Store:
    """Open the store at ``location`` as its owner: ``StateLocked`` while another process (a serving gateway, an
    offline command) owns it, ``StateError`` when it cannot be used; migrated to ``SCHEMA_VERSION``.

    ``serving``: for ``serve``. A database is then owned in shared mode, with the other serving replicas (only an
    offline command or a migrate is refused, and refuses); a SQLite file has one owner either way."""
    # Each back-end is imported when named: a SQLite gateway never loads psycopg.
    if location.state is not None:
        from sbx.gateway.store.sqlite import SqliteStore, acquire_lock

        fd = acquire_lock(location.state)
        try:
            return SqliteStore.open(location.state, lock_fd=fd)
        except BaseException:
            os.close(fd)
            raise
    from sbx.gateway.store.postgres import DatabaseUrlError, PostgresStore

    assert location.database is not None
    try:
        return PostgresStore.open(location.database, shared=serving)
    except DatabaseUrlError as exc:
        raise StateError(str(exc)) from None


def copy_state(source: Store, target: Store) -> dict[str, int]:
    """Copy every row of every table from ``source`` into ``target`` in one transaction of the target; the rows
    copied per table. The caller checks the target holds no state first (``Store.holds_state``)."""
    ops: list[Op] = []
    counts: dict[str, int] = {}
    for name, table in TABLES.items():
        rows = source.select(name, table.columns)
        counts[name] = len(rows)
        ops += [Insert(name, dict(zip(table.columns, row, strict=True))) for row in rows]
    target.apply(ops)
    target.after_copy()
    return counts
