"""The journal of a sandbox's process records (sbx.node.process_journal), and a process table read back from it
and from the record files of sandboxd before it."""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

from sbx.api.processes import OutputChunk, OutputExit
from sbx.backends.base import GuestUser
from sbx.node.audit import AuditLog
from sbx.node.output_log import OutputLog
from sbx.node.process_journal import COMPACT_FACTOR, COMPACT_SLACK, JOURNAL_NAME, ProcessJournal
from sbx.node.processes import ProcessTable

GUEST = GuestUser(uid=1000, gid=1000, name="sandbox", home="/sandbox/home")


def started(pid: int) -> dict[str, object]:
    return {"pid": pid, "argv": ["echo", str(pid)], "started_at": "2026-12-01T00:00:00.000Z", "tty": False}


def test_entries_merge_by_pid_and_forgotten_ones_go(tmp_path: Path) -> None:
    journal = ProcessJournal(tmp_path / JOURNAL_NAME)
    assert journal.read() == {}
    for pid in (1, 2, 3):
        journal.append(started(pid))
    journal.append({"pid": 1, "exit_code": 0, "finished_at": "2026-12-01T00:00:01.000Z"})
    journal.forgotten(2)
    again = ProcessJournal(tmp_path / JOURNAL_NAME)
    found = again.read()
    assert list(found) == [1, 3] and again.lines == 5
    assert found[1]["exit_code"] == 0 and found[1]["argv"] == ["echo", "1"] and "exit_code" not in found[3]


def test_a_line_cut_by_a_kill_is_dropped_and_the_next_starts_its_own(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL_NAME
    journal = ProcessJournal(path)
    journal.append(started(1))
    with open(path, "ab") as f:
        f.write(b'{"pid":2,"argv":["ec')  # a kill mid-write
    assert list(ProcessJournal(path).read()) == [1]
    assert path.read_bytes().endswith(b"}\n")
    journal.append(started(3))
    path.write_bytes(path.read_bytes() + b"not json\n")  # damage is skipped, never guessed at
    assert list(ProcessJournal(path).read()) == [1, 3]


def test_a_rewrite_keeps_one_line_per_process_once_due(tmp_path: Path) -> None:
    journal = ProcessJournal(tmp_path / JOURNAL_NAME)
    for pid in range(1, 201):
        journal.append(started(pid))
        journal.append({"pid": pid, "exit_code": pid, "finished_at": "2026-12-01T00:00:01.000Z"})
        if pid <= 190:
            journal.forgotten(pid)
    remembered = journal.read()
    assert len(remembered) == 10 and journal.lines == 590
    assert journal.due(10)  # 590 lines for 10 processes
    assert not journal.due(-(-(590 - COMPACT_SLACK) // COMPACT_FACTOR))  # as many lines as 112 may hold
    journal.rewrite({"pid": pid, **fields} for pid, fields in remembered.items())
    assert journal.lines == 10 and len((tmp_path / JOURNAL_NAME).read_bytes().splitlines()) == 10
    assert ProcessJournal(tmp_path / JOURNAL_NAME).read() == remembered


async def test_a_table_reads_the_journal_and_the_record_files_before_it(tmp_path: Path) -> None:
    directory = tmp_path / "processes"
    directory.mkdir()
    # Written by a sandboxd before the journal: a record file per process, the exit at the end of its log.
    (directory / "1.json").write_text(json.dumps({**started(1), "exit_code": None, "finished_at": None}))
    log = OutputLog(directory / "1.out")
    await log.append("stdout", b"1\n")
    await log.finish(5, 1_700_000_000.0)
    (directory / "2.json").write_text(json.dumps({**started(2), "exit_code": None, "finished_at": None}))
    # Written since: the journal, one process that printed nothing and has no log.
    journal = ProcessJournal(directory / JOURNAL_NAME)
    for pid in (3, 4, 5):
        journal.append(started(pid))
    journal.append({"pid": 3, "exit_code": 0, "finished_at": "2026-12-01T00:00:01.000Z"})
    journal.forgotten(4)
    table = ProcessTable("sbx_test", directory, AuditLog(tmp_path / "audit"), GUEST)
    table.load()
    assert [(r.pid, r.exit_code) for r in table.records()] == [(1, 5), (2, None), (3, 0), (5, None)]
    assert table.records()[0].finished_at == "2023-11-14T22:13:20.000Z"
    assert table.running == 2 and table.next_pid == 6
    # Followed after the restart: an exited process that printed nothing ends at once, as one that printed.
    assert await asyncio.wait_for(_followed(table, 3), 5) == [OutputExit(0)]
    assert await asyncio.wait_for(_followed(table, 1), 5) == [OutputChunk("stdout", b"1\n"), OutputExit(5)]


async def _followed(table: ProcessTable, pid: int) -> list[OutputChunk | OutputExit]:
    return [event async for event in table.follow(pid)]
    assert table.output_budget.used_bytes == struct.calcsize(">BI") + 2
