"""``LoopQuery`` (``sbx.gateway.store.pgloop``): a prepared query asked on the event loop through libpq's
non-blocking calls, against a real PostgreSQL. Its answer, no row, calls taking turns, and a query that fails,
is cancelled or times out leaving its connection closed so the next call gets a clean one."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from pg_cluster import PgCluster

from sbx.gateway.store.pgloop import LoopQuery


@pytest.fixture
def connect(pg_cluster: PgCluster) -> Iterator[Any]:
    url = pg_cluster.create_database()
    made: list[psycopg.Connection[Any]] = []

    def connect() -> psycopg.Connection[Any]:
        made.append(psycopg.connect(url, autocommit=True, password=pg_cluster.password))
        return made[-1]

    connect.made = made  # type: ignore[attr-defined]
    yield connect
    for conn in made:
        conn.close()


@pytest.mark.parametrize(
    ("sql", "answer"),
    [
        ("SELECT 41 + 1", "42"),
        ("SELECT 'a' WHERE false", None),  # no row
        ("SELECT NULL::int", None),
        ("SELECT x FROM generate_series(7, 9) AS x", "7"),  # the first row's
    ],
)
async def test_the_first_value_of_the_answer(connect: Any, sql: str, answer: str | None) -> None:
    query = LoopQuery(connect, sql, b"q")
    assert [await query() for _ in range(3)] == [answer] * 3
    assert len(connect.made) == 1  # one connection, prepared once, asked three times
    query.close()


async def test_calls_take_turns_on_one_connection(connect: Any) -> None:
    query = LoopQuery(connect, "SELECT 5 FROM pg_sleep(0.05)", b"q")
    assert await asyncio.gather(*(query() for _ in range(5))) == ["5"] * 5
    assert len(connect.made) == 1
    query.close()


@pytest.mark.parametrize(
    ("sql", "message"),
    [
        ("SELECT n FROM no_such_table", 'relation "no_such_table" does not exist'),  # refused when prepared
        ("SELECT 1 / (random() > 2)::int", "division by zero"),  # refused when run
    ],
)
async def test_a_failing_query_raises_and_the_next_call_connects_anew(
    connect: Any, sql: str, message: str
) -> None:
    query = LoopQuery(connect, sql, b"q")
    for calls in (1, 2):
        with pytest.raises(psycopg.OperationalError, match=message):
            await query()
        assert len(connect.made) == calls and connect.made[-1].closed


@pytest.mark.parametrize("ending", ["timeout", "cancel"])
async def test_a_query_cut_short_closes_its_connection(connect: Any, ending: str) -> None:
    query = LoopQuery(connect, "SELECT 3 FROM pg_sleep(0.5)", b"q")
    assert await query() == "3"  # connected: what follows is cut mid-answer, never while connecting
    if ending == "timeout":
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await query()
    else:
        asked = asyncio.create_task(query())
        await asyncio.sleep(0.1)
        asked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asked
    assert connect.made[0].closed  # mid-answer: never used again
    assert await query() == "3"
    assert len(connect.made) == 2
    query.close()
    assert connect.made[1].closed


async def test_one_connection_attempt_at_a_time_however_many_calls_give_up(connect: Any) -> None:
    """While the database does not answer a connection, each call times out; they share the one attempt
    instead of each starting another on a thread, and the next call after it connects uses it."""
    answering = threading.Event()
    attempts: list[int] = []

    def slow_connect() -> psycopg.Connection[Any]:
        attempts.append(1)
        assert answering.wait(10)
        return connect()

    query = LoopQuery(slow_connect, "SELECT 6 * 7", b"q")
    for _ in range(3):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await query()
    assert attempts == [1]
    answering.set()
    assert await query() == "42"
    assert attempts == [1] and len(connect.made) == 1
    query.close()
    assert connect.made[0].closed
