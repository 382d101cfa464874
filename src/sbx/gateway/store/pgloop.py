"""One prepared single-value query at a time on the calling event loop, through libpq's non-blocking interface.

Why not a thread or psycopg's ``AsyncConnection``: a read that comes alone on a replica pays for its catch-up's
query of the commit counter (docs/ha.md). Measured here (2026-12-02, 3 rounds of 3,000 reads one at a time on a
private cluster): a blocking connection's ``execute`` behind ``asyncio.to_thread`` cost 127-159 µs of CPU and
241-368 µs of wall time per read, the same read through libpq's non-blocking calls on the loop 29-37 µs and
77-123 µs; ``AsyncConnection`` saved only ~40 µs of the thread's (its cursor and generator machinery). This module
uses psycopg's connection only to connect (the same options and password as every other connection) and its
``pgconn``, the thin libpq wrapper, for the rest.

A connection whose query did not end cleanly (cancelled, timed out, failed) is closed: it may be mid-answer, so
the next query makes a new one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import pq


class LoopQuery:
    """``await query()``: the first column of the first row ``sql`` returns, as text (None without a row or for
    NULL), asked on a connection of its own made by ``connect`` (blocking; run on a thread) when first needed or
    after a failure. Calls take turns (one connection, one query at a time). A ``psycopg.Error`` or ``OSError``
    is raised as it is, and the connection is made anew at the next call."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], sql: str, name: bytes) -> None:
        self._connect = connect
        self._sql = sql.encode()
        self._name = name
        self._conn: psycopg.Connection[Any] | None = None
        #: The connection being made on a thread, while it is: a call cut short meanwhile leaves it to the next
        #: (one connection attempt at a time, however many calls time out while the database does not answer).
        self._connecting: asyncio.Future[psycopg.Connection[Any]] | None = None
        self._turn: asyncio.Lock | None = None

    async def __call__(self) -> Any:
        if self._turn is None:
            self._turn = asyncio.Lock()
        async with self._turn:
            conn = await self._connection()
            clean = False
            try:
                value = await _ask(conn.pgconn, self._name)
                clean = True
                return value
            finally:
                if not clean:
                    self.close()

    async def _connection(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(asyncio.to_thread(self._prepared))
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)  # a caller cut short leaves the attempt running
        finally:
            if connecting.done():  # made or failed: taken now (a failure is tried anew at the next call)
                self._connecting = None
                if not connecting.cancelled() and connecting.exception() is None:
                    self._conn = connecting.result()

    def close(self) -> None:
        """Close the connection, and one made meanwhile for a call cut short (the next call makes another)."""
        conn, self._conn = self._conn, None
        connecting, self._connecting = self._connecting, None
        # Made after its caller gave up, and not taken since (one taken is ``_conn``, and no longer here).
        if (
            connecting is not None
            and connecting.done()
            and not connecting.cancelled()
            and not connecting.exception()
        ):
            connecting.result().close()
        if conn is not None:
            conn.close()

    def _prepared(self) -> psycopg.Connection[Any]:
        conn = self._connect()
        try:
            result = conn.pgconn.prepare(self._name, self._sql)
            if result.status != pq.ExecStatus.COMMAND_OK:
                raise psycopg.OperationalError(_message(result))
            conn.pgconn.nonblocking = 1
        except BaseException:
            conn.close()
            raise
        return conn


async def _ask(pgconn: pq.abc.PGconn, name: bytes) -> Any:
    """Send the prepared statement ``name`` and read its answer, waiting on the socket through the loop."""
    pgconn.send_query_prepared(name, None)
    while pgconn.flush():  # 1 while part of the query is still to be sent (a full socket buffer)
        await _ready(pgconn.socket, write=True)
    answer: pq.abc.PGresult | None = None
    while True:
        pgconn.consume_input()
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:  # the end of the query's answers
                if answer is None:
                    raise psycopg.OperationalError("the database sent no answer")
                if answer.status != pq.ExecStatus.TUPLES_OK:
                    raise psycopg.OperationalError(_message(answer))
                value = answer.get_value(0, 0) if answer.ntuples else None
                return value.decode() if isinstance(value, bytes) else value
            answer = result
        await _ready(pgconn.socket)


async def _ready(fd: int, write: bool = False) -> None:
    """Until ``fd`` can be read (or written)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await ready
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


def _message(result: pq.abc.PGresult) -> str:
    said = (result.error_message or b"").decode(errors="replace").strip()
    return said or f"query failed ({pq.ExecStatus(result.status).name})"
