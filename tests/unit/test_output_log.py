"""The process output log: append, cap, exit record, rebuild after a restart, follow from the start."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sbx.node.output_log import OutputLog


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


async def test_cap_counts_dropped_bytes(tmp_path: Path) -> None:
    path = tmp_path / "2.out"
    log = OutputLog(path, cap_bytes=10)
    await log.append("stdout", b"0123456789abcdef")
    await log.append("stdout", b"more")
    await log.finish(0, 1.0)
    again = OutputLog(path, cap_bytes=10)
    # The agent was acknowledged for everything; only the first 10 bytes are kept.
    assert again.offsets["stdout"] == 20 and again.kept["stdout"] == 10 and again.truncated
    assert b"".join(d for _, d in await _collect(again)) == b"0123456789"


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
