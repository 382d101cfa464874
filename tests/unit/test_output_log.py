"""The process output log: append, the sandbox's budget, drop markers, exit record, rebuild after a restart,
follow from the start, and dropping the output of exited processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sbx.node import output_log
from sbx.node.output_log import SUMMARY_BYTES, OutputBudget, OutputLog

HEADER = 5


async def _collect(log: OutputLog) -> list[tuple[str, bytes]]:
    return [item async for item in log.follow()]


async def test_append_finish_and_rebuild(tmp_path: Path) -> None:
    path = tmp_path / "1.out"
    log = OutputLog(path)
    await log.append("stdout", b"hello ")
    await log.append("stderr", b"oops")
    await log.append("stdout", b"world")
    await log.finish(7, 1_700_000_000.5)
    again = OutputLog(path)
    assert again.offsets == {"stdout": 11, "stderr": 4}
    assert (again.exit_code, again.exited_at, again.closed) == (7, 1_700_000_000.5, True)
    assert await _collect(again) == [("stdout", b"hello "), ("stderr", b"oops"), ("stdout", b"world")]


async def test_the_budget_counts_dropped_bytes(tmp_path: Path) -> None:
    path = tmp_path / "2.out"
    log = OutputLog(path, OutputBudget(HEADER + 10))
    await log.append("stdout", b"0123456789abcdef")
    await log.append("stdout", b"more")
    await log.finish(0, 1.0)
    again = OutputLog(path, OutputBudget(HEADER + 10))
    # The agent was acknowledged for everything; only the first 10 bytes are kept.
    assert again.offsets["stdout"] == 20 and again.kept["stdout"] == 10 and again.truncated
    assert again.budget.used_bytes == HEADER + 10
    assert b"".join(d for _, d in await _collect(again)) == b"0123456789"


async def test_output_past_the_budget_never_grows_the_file(tmp_path: Path) -> None:
    path = tmp_path / "5.out"
    log = OutputLog(path, OutputBudget(HEADER + 4))
    await log.append("stdout", b"keep")
    size = path.stat().st_size
    for _ in range(1000):  # both streams, interleaved: one drop marker each, updated in place
        await log.append("stdout", b"x" * 100)
        await log.append("stderr", b"y" * 7)
    assert path.stat().st_size == size + 2 * HEADER
    await log.finish(3, 4.0)
    again = OutputLog(path)
    assert again.offsets == {"stdout": 4 + 100_000, "stderr": 7000}
    assert again.kept == {"stdout": 4, "stderr": 0} and again.truncated and again.exit_code == 3


async def test_a_marker_that_would_overflow_starts_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(output_log, "_MAX_RECORD", 10)
    path = tmp_path / "6.out"
    log = OutputLog(path, OutputBudget(0))
    for _ in range(5):
        await log.append("stdout", b"abcd")
    assert path.stat().st_size == 3 * HEADER  # markers of 8, 8 and 4 bytes
    assert OutputLog(path).offsets["stdout"] == 20


async def test_logs_share_the_sandboxs_budget(tmp_path: Path) -> None:
    budget = OutputBudget(2 * (HEADER + 10))
    first, second, third = (OutputLog(tmp_path / f"{n}.out", budget) for n in range(3))
    await first.append("stdout", b"a" * 10)
    await second.append("stdout", b"b" * 10)
    await third.append("stdout", b"c" * 10)  # nothing reclaims: dropped
    assert third.kept["stdout"] == 0 and third.truncated and budget.used_bytes == budget.limit_bytes
    second.remove()
    assert budget.used_bytes == HEADER + 10 and not (tmp_path / "1.out").exists()
    await third.append("stdout", b"c" * 10)
    assert third.kept["stdout"] == 10


async def test_reclaim_is_asked_for_what_is_missing(tmp_path: Path) -> None:
    asked: list[int] = []
    exited = OutputLog(tmp_path / "old.out", OutputBudget(100))
    budget = OutputBudget(HEADER + 10, reclaim=lambda n: asked.append(n) or exited.drop_output())
    exited.budget = budget
    await exited.append("stdout", b"o" * 10)
    await exited.finish(0, 1.0)
    running = OutputLog(tmp_path / "new.out", budget)
    await running.append("stdout", b"n" * 4)
    assert asked == [HEADER + 4] and running.kept["stdout"] == 4 and not running.truncated
    assert exited.kept["stdout"] == 0 and exited.truncated


async def test_dropping_an_exited_logs_output_keeps_its_summary(tmp_path: Path) -> None:
    path = tmp_path / "7.out"
    budget = OutputBudget()
    log = OutputLog(path, budget)
    await log.append("stdout", b"out" * 1000)
    await log.append("stderr", b"err")
    assert log.drop_output() == 0  # still running: nothing dropped
    await log.finish(9, 5.5)
    follower = log.follow()
    assert await follower.__anext__() == ("stdout", b"out" * 1000)
    assert log.drop_output() == 2 * HEADER + 3003 and budget.used_bytes == 0
    assert [item async for item in follower] == []  # a follower stops where it was
    assert path.stat().st_size == SUMMARY_BYTES
    again = OutputLog(path, budget)
    assert again.offsets == {"stdout": 3000, "stderr": 3} and again.kept == {"stdout": 0, "stderr": 0}
    assert (again.exit_code, again.exited_at, again.truncated) == (9, 5.5, True)
    assert await _collect(again) == [] and budget.used_bytes == 0
    assert again.drop_output() == 0


async def test_a_record_cut_by_a_kill_is_dropped(tmp_path: Path) -> None:
    path = tmp_path / "3.out"
    log = OutputLog(path)
    await log.append("stdout", b"whole")
    await log.close()
    path.write_bytes(path.read_bytes() + b"\x01\x00\x00\x00\x10par")  # promises 16 bytes, has 3
    again = OutputLog(path)
    assert again.offsets["stdout"] == 5 and again.exit_code is None and not again.closed
    assert path.stat().st_size == 5 + 5


async def test_follow_waits_for_output_until_the_exit(tmp_path: Path) -> None:
    log = OutputLog(tmp_path / "4.out")
    follower = asyncio.create_task(_collect(log))
    await asyncio.sleep(0.01)
    await log.append("stdout", b"a")
    await asyncio.sleep(0.01)
    await log.append("stdout", b"b")
    assert not follower.done()
    await log.finish(0, 2.0)
    assert await asyncio.wait_for(follower, 5) == [("stdout", b"a"), ("stdout", b"b")]


async def test_a_process_that_prints_nothing_has_no_file(tmp_path: Path) -> None:
    path = tmp_path / "8.out"
    log = OutputLog(path, new=True)
    follower = asyncio.create_task(_collect(log))
    await asyncio.sleep(0)
    await log.finish(0, 3.0)  # its exit is in its record (the process journal), not in a file of its own
    assert not path.exists() and (log.exit_code, log.exited_at, log.closed) == (0, 3.0, True)
    assert await asyncio.wait_for(follower, 5) == []
    assert log.drop_output() == 0 and not path.exists()
    log.remove()
