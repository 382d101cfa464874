"""Atomic JSON state files: round trip, missing file, leftovers, and SIGKILL at any moment."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from sbx.statefile import read_json, remove_stale_tmp_files, try_lock, write_json_atomic


def test_round_trip(tmp_path: Path) -> None:
    obj = {"sandboxes": [{"id": "sbx_1", "labels": {"é": "ü"}}], "n": 3, "none": None}
    write_json_atomic(tmp_path / "state.json", obj)
    assert read_json(tmp_path / "state.json") == obj


def test_replace_leaves_only_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_json_atomic(path, {"v": 1})
    write_json_atomic(path, {"v": 2})
    assert read_json(path) == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_mode_is_0600(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_json_atomic(path, {})
    assert path.stat().st_mode & 0o777 == 0o600


def test_missing_file_is_none(tmp_path: Path) -> None:
    assert read_json(tmp_path / "absent.json") is None


def test_leftover_tmp_file_is_ignored_and_removed(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_json_atomic(path, {"v": 1})
    # What a writer killed between mkstemp and rename leaves behind: a partial temp file.
    leftover = tmp_path / ".state.json.abc123.sbx-tmp"
    leftover.write_bytes(b'{"v": 2, "trunc')
    assert read_json(path) == {"v": 1}
    unrelated = tmp_path / "other.tmp"
    unrelated.write_bytes(b"keep me")
    assert remove_stale_tmp_files(tmp_path) == 1
    assert not leftover.exists()
    assert unrelated.exists()
    assert remove_stale_tmp_files(tmp_path / "nope") == 0


def test_unserialisable_object_leaves_file_untouched(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    write_json_atomic(path, {"v": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"v": object()})
    assert read_json(path) == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_failed_rename_leaves_no_temp_file(tmp_path: Path) -> None:
    # A directory in the file's place makes the rename fail after the temp file was written.
    path = tmp_path / "state.json"
    path.mkdir()
    (path / "inside").write_bytes(b"")
    with pytest.raises(OSError):
        write_json_atomic(path, {"v": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_corrupt_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_bytes(b"{not json")
    with pytest.raises(ValueError, match="state.json"):
        read_json(path)


_WRITER = """
import sys
from pathlib import Path
from sbx.statefile import write_json_atomic
path = Path(sys.argv[1])
i = 0
while True:
    i += 1
    # Sizes vary so a torn write would show as a length mismatch even if it parsed.
    payload = "x" * (1000 + (i * 7919) % 200000)
    write_json_atomic(path, {"n": i, "len": len(payload), "payload": payload, "check": i})
    if i == 1:
        print("ready", flush=True)
"""


def _assert_complete(obj: Any) -> int:
    assert isinstance(obj, dict)
    assert obj["n"] == obj["check"]
    assert len(obj["payload"]) == obj["len"]
    n = obj["n"]
    assert isinstance(n, int)
    return n


def test_sigkill_at_any_moment_leaves_old_or_new_version(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = (
        str(Path(__file__).resolve().parents[2] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    )
    rng = random.Random(1234)
    last_seen = 0
    kills = 40
    for _ in range(kills):
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, env=env)
        assert child.stdout is not None
        assert child.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0, 0.05))
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        obj = read_json(path)
        n = _assert_complete(obj)
        assert n >= 1
        last_seen = n
    assert last_seen >= 1
    # Every writer was killed mid-loop; each left at most one temp file, all ignorable.
    leftovers = [p for p in tmp_path.iterdir() if p.name != "state.json"]
    assert len(leftovers) <= kills
    remove_stale_tmp_files(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    json.loads(path.read_bytes())


def test_try_lock_is_exclusive_across_processes(tmp_path: Path) -> None:
    import stat

    path = tmp_path / "deep" / "server.lock"
    fd = try_lock(path)
    assert fd is not None and stat.S_IMODE(path.stat().st_mode) == 0o600
    probe = (
        "import sys; from pathlib import Path; from sbx.statefile import try_lock; "
        "sys.exit(0 if try_lock(Path(sys.argv[1])) is None else 1)"
    )
    # Held by this process: another one is refused at once; released, it gets the lock.
    assert subprocess.run([sys.executable, "-c", probe, str(path)], check=False).returncode == 0
    os.close(fd)
    assert subprocess.run([sys.executable, "-c", probe, str(path)], check=False).returncode == 1
