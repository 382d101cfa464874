"""Writes as data, rendered to SQL by the back-end: what services, jobs, secrets and the store's own methods ask
for, in one form both dialects run.

Both SQLite (3.24 and later) and PostgreSQL take ``INSERT ... ON CONFLICT (key) DO UPDATE SET c = excluded.c``
and double-quoted identifiers; they differ in the placeholder (``?`` against ``%s``), which the back-end passes
to :func:`render`. Table and column names are checked against ``schema.TABLES``, so a typo fails at once (and no
name from a request could ever become SQL).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sbx.gateway.store.schema import TABLES


@dataclass(frozen=True)
class Insert:
    """A new row (fails on a duplicate key)."""

    table: str
    row: Mapping[str, Any]


@dataclass(frozen=True)
class Upsert:
    """A row inserted, or replacing the columns of the row with the same primary key."""

    table: str
    row: Mapping[str, Any]


@dataclass(frozen=True)
class Update:
    """``values`` set on the rows matching every ``where`` equality."""

    table: str
    values: Mapping[str, Any]
    where: Mapping[str, Any]


@dataclass(frozen=True)
class Delete:
    """The rows matching every ``where`` equality and every ``below`` (column < value)."""

    table: str
    where: Mapping[str, Any]
    below: Mapping[str, Any] = field(default_factory=dict)


Op = Insert | Upsert | Update | Delete


def _check(table: str, columns: list[str]) -> list[str]:
    known = TABLES.get(table)
    if known is None:
        raise ValueError(f"no table {table!r}")
    unknown = [c for c in columns if c not in known.columns]
    if unknown:
        raise ValueError(f"table {table!r} has no column {unknown[0]!r}")
    return columns


def quote(name: str) -> str:
    return f'"{name}"'


def render(op: Op, mark: str) -> tuple[str, tuple[Any, ...]]:
    """The SQL of ``op`` with ``mark`` as the placeholder, and its parameters."""
    if isinstance(op, Insert | Upsert):
        cols = _check(op.table, list(op.row))
        sql = (
            f"INSERT INTO {quote(op.table)} ({', '.join(map(quote, cols))}) "
            f"VALUES ({', '.join(mark for _ in cols)})"
        )
        if isinstance(op, Upsert):
            key = TABLES[op.table].key
            rest = [c for c in cols if c not in key]
            sets = ", ".join(f"{quote(c)} = excluded.{quote(c)}" for c in rest)
            sql += f" ON CONFLICT ({', '.join(map(quote, key))}) " + (
                f"DO UPDATE SET {sets}" if rest else "DO NOTHING"
            )
        return sql, tuple(op.row.values())
    if isinstance(op, Update):
        assigned = _check(op.table, list(op.values))
        where = _check(op.table, list(op.where))
        sql = (
            f"UPDATE {quote(op.table)} SET {', '.join(f'{quote(c)} = {mark}' for c in assigned)}"
            f" WHERE {' AND '.join(f'{quote(c)} = {mark}' for c in where)}"
        )
        return sql, (*op.values.values(), *op.where.values())
    where = _check(op.table, list(op.where))
    below = _check(op.table, list(op.below))
    conditions = [f"{quote(c)} = {mark}" for c in where] + [f"{quote(c)} < {mark}" for c in below]
    if not conditions:
        raise ValueError(f"a delete from {op.table!r} names no row")  # never a whole table by mistake
    sql = f"DELETE FROM {quote(op.table)} WHERE {' AND '.join(conditions)}"
    return sql, (*op.where.values(), *op.below.values())


def select_sql(table: str, columns: tuple[str, ...] | list[str], order_by: str | None = None) -> str:
    """``SELECT columns FROM table [ORDER BY order_by]`` with checked, quoted names."""
    cols = _check(table, list(columns))
    sql = f"SELECT {', '.join(map(quote, cols))} FROM {quote(table)}"
    if order_by is not None:
        sql += f" ORDER BY {quote(_check(table, [order_by])[0])}"
    return sql
