"""Node audit log: event shape, rotation, reading back per sandbox, best-effort writes."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from sbx.node.audit import (
    LOG_NAME,
    AuditLog,
    args_sha256,
    process_exited_fields,
    process_started_fields,
)

TIME_RE = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


def test_event_shape(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path)
    audit.record("sandbox.terminated", "sbx_1", reason="idle")
    (event,) = _lines(tmp_path / LOG_NAME)
    assert list(event) == ["time", "type", "sandbox", "reason"]
    assert TIME_RE.match(str(event["time"]))
    assert event["type"] == "sandbox.terminated"
    assert event["sandbox"] == "sbx_1"
    assert event["reason"] == "idle"
    assert (tmp_path / LOG_NAME).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("field", ["env", "argv", "args", "data", "content", "time"])
def test_value_carrying_and_reserved_fields_are_dropped(tmp_path: Path, field: str) -> None:
    audit = AuditLog(tmp_path)
    audit.record("process.started", "sbx_1", **{field: "SECRET"}, cwd="/sandbox/home")
    raw = (tmp_path / LOG_NAME).read_text()
    assert "SECRET" not in raw
    assert json.loads(raw)["cwd"] == "/sandbox/home"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # printf -- '-c\0print(1)\0' | sha256sum
        (["python3", "-c", "print(1)"], "ebd2132a18430a511abbd7b26ef7510b3da6200480550f057cd533a701e579a0"),
        # printf '' | sha256sum: no arguments hash nothing
        (["ls"], "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
        # printf -- 'a b\0\0' | sha256sum: a space stays inside its argument; an empty one still ends in NUL
        (["x", "a b", ""], "fc4790f5bea8a3ca134dde24ab097fa9e422eb0446842755dc1c4a5a333ae9d5"),
    ],
)
def test_args_sha256(argv: list[str], expected: str) -> None:
    assert args_sha256(argv) == expected


def test_process_started_fields_carry_no_arguments_or_env_values(tmp_path: Path) -> None:
    argv = ["python3", "-c", "print('hunter2')"]
    env = {"API_KEY": "value-never-recorded", "A": "1"}
    fields = process_started_fields(7, argv, "/sandbox/home", env)
    assert fields == {
        "pid": 7,
        "program": "python3",
        "arg_count": 2,
        "args_sha256": args_sha256(argv),
        "cwd": "/sandbox/home",
        "env_names": ["A", "API_KEY"],
    }
    audit = AuditLog(tmp_path)
    audit.record("process.started", "sbx_1", **fields)
    audit.record("process.exited", "sbx_1", **process_exited_fields(7, 0, 12))
    raw = (tmp_path / LOG_NAME).read_text()
    assert "hunter2" not in raw and "value-never-recorded" not in raw
    with pytest.raises(ValueError):
        process_started_fields(1, [], "/", [])


def test_rotation_at_size_keeps_five_generations(tmp_path: Path) -> None:
    max_bytes = 1000
    audit = AuditLog(tmp_path, max_bytes=max_bytes, keep=5)
    total = 400
    for i in range(total):
        audit.record("file.read", "sbx_a", path=f"/sandbox/home/f{i:04d}", bytes=i)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [LOG_NAME] + [f"{LOG_NAME}.{n}" for n in range(1, 6)]
    line_len = len((tmp_path / LOG_NAME).read_bytes().splitlines()[0]) + 1
    for n in range(1, 6):
        size = (tmp_path / f"{LOG_NAME}.{n}").stat().st_size
        # Rotated because one more line would have passed the size, not earlier.
        assert max_bytes - line_len < size <= max_bytes
    kept = [
        e
        for p in ["5", "4", "3", "2", "1", ""]
        for e in _lines(tmp_path / f"{LOG_NAME}{'.' if p else ''}{p}")
    ]
    numbers = [e["bytes"] for e in kept]
    # Oldest first, contiguous, ending with the last one; the sixth generation and older were dropped.
    assert numbers == list(range(total - len(kept), total))
    assert numbers[0] > 0
    events, truncated = audit.events_for("sbx_a")
    assert [e["bytes"] for e in events] == numbers
    assert truncated is False


def test_events_for_across_generations_filters_and_survives_restart(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path, max_bytes=2000)
    for i in range(60):
        audit.record("file.written", "sbx_1", path=f"/p{i}", bytes=i)
        audit.record("file.written", "sbx_10", path=f"/q{i}", bytes=i)
        # A nested object naming sbx_1 must not count as an event of sbx_1.
        audit.record("snapshot.created", "sbx_2", snapshot={"id": "snap", "sandbox": "sbx_1"}, bytes=i)
    audit.close()
    assert (tmp_path / f"{LOG_NAME}.2").exists()
    reopened = AuditLog(tmp_path, max_bytes=2000)
    events, truncated = reopened.events_for("sbx_1")
    assert truncated is False
    assert {e["sandbox"] for e in events} == {"sbx_1"}
    assert [e["bytes"] for e in events] == list(range(60 - len(events), 60))
    assert len(events) > 10  # more than one file's worth
    assert reopened.events_for("sbx_nope") == ([], False)
    reopened.record("sandbox.terminated", "sbx_1", reason="request")
    last = reopened.events_for("sbx_1")[0][-1]
    assert last["type"] == "sandbox.terminated"


def test_newest_limit_and_truncated(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path)
    for i in range(5003):
        audit.record("file.read", "sbx_a", path="/f", bytes=i)
        if i % 100 == 0:
            audit.record("file.read", "sbx_b", path="/f", bytes=i)
    events, truncated = audit.events_for("sbx_a")
    assert truncated is True
    assert len(events) == 5000
    assert events[0]["bytes"] == 3 and events[-1]["bytes"] == 5002
    exact, truncated = audit.events_for("sbx_b", limit=51)
    assert (len(exact), truncated) == (51, False)
    fewer, truncated = audit.events_for("sbx_b", limit=50)
    assert truncated is True and [e["bytes"] for e in fewer][:2] == [100, 200]


def test_limit_spanning_rotated_files(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path, max_bytes=1500)
    for i in range(100):
        audit.record("tunnel.opened", "sbx_a", port=i)
    events, truncated = audit.events_for("sbx_a", limit=30)
    assert truncated is True
    assert [e["port"] for e in events] == list(range(70, 100))


def test_fragment_left_by_a_crash_is_skipped_and_ended(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path)
    audit.record("sandbox.suspended", "sbx_a")
    audit.close()
    with open(tmp_path / LOG_NAME, "ab") as f:
        f.write(b'{"time":"2024-01-01T00:00:00.000Z","type":"sandbox.res')
    restarted = AuditLog(tmp_path)
    restarted.record("sandbox.resumed", "sbx_a")
    events, _ = restarted.events_for("sbx_a")
    assert [e["type"] for e in events] == ["sandbox.suspended", "sandbox.resumed"]


def test_failing_write_does_not_raise_and_recovers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "audit"
    blocker.write_bytes(b"a file where the log directory should be")
    audit = AuditLog(blocker)
    with caplog.at_level(logging.WARNING, logger="sbx.node.audit"):
        audit.record("sandbox.terminated", "sbx_a", reason="request")
        audit.record("sandbox.terminated", "sbx_b", reason="request")
    failures = [r for r in caplog.records if "could not record" in r.getMessage()]
    assert len(failures) == 1  # logged once, not once per event while the disk stays broken
    with pytest.raises(OSError):  # reading is not best-effort: the server answers it as an error
        audit.events_for("sbx_a")
    blocker.unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sbx.node.audit"):
        audit.record("sandbox.terminated", "sbx_c", reason="request")
    assert any("writable again" in r.getMessage() for r in caplog.records)
    assert len(audit.events_for("sbx_c")[0]) == 1


def test_write_error_on_open_file_does_not_raise(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path)
    audit.record("sandbox.created", "sbx_a", name="n")
    # Swap the descriptor for one opened read-only: the next write fails with EBADF.
    assert audit._fd is not None
    os.close(audit._fd)
    audit._fd = os.open(tmp_path / LOG_NAME, os.O_RDONLY)
    audit.record("sandbox.updated", "sbx_a", name="m")  # must not raise
    audit.record("sandbox.updated", "sbx_a", name="o")  # reopened after the failure
    assert [e.get("name") for e in audit.events_for("sbx_a")[0]] == ["n", "o"]


def test_threads_never_interleave_lines(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path, max_bytes=60_000)

    def writer(sandbox: str) -> None:
        for i in range(300):
            audit.record("file.read", sandbox, path="/x" * 20, bytes=i)

    threads = [threading.Thread(target=writer, args=(f"sbx_{t}",)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for t in range(4):
        events, _ = audit.events_for(f"sbx_{t}")
        numbers = [e["bytes"] for e in events]
        assert numbers == sorted(numbers)
        assert numbers[-1] == 299
    for path in tmp_path.iterdir():
        _lines(path)  # every line of every generation parses


@pytest.mark.parametrize("restart", [False, True])
def test_sandbox_only_in_an_old_generation_is_found(tmp_path: Path, restart: bool) -> None:
    # Exercises the per-file index (files written by this process) and its absence (after a restart).
    audit = AuditLog(tmp_path, max_bytes=1000)
    audit.record("sandbox.created", "sbx_old", name="old", labels={"k": "v"})
    for i in range(20):
        audit.record("tunnel.opened", "sbx_new", port=i)
    if restart:
        audit.close()
        audit = AuditLog(tmp_path, max_bytes=1000)
        audit.record("tunnel.opened", "sbx_new", port=99)
    assert not (tmp_path / LOG_NAME).read_text().count("sbx_old")
    events, truncated = audit.events_for("sbx_old")
    assert ([e["name"] for e in events], truncated) == (["old"], False)
    assert len(audit.events_for("sbx_new")[0]) == (21 if restart else 20)
