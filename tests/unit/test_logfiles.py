"""Rotating append-only logs (the node's and the gateway's audit logs)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sbx import logfiles


@pytest.mark.parametrize(
    ("before", "after"),
    [(None, b""), (b"", b""), (b"a\n", b"a\n"), (b'{"cut', b'{"cut\n')],
)
def test_open_append_creates_0600_and_ends_a_cut_line(
    tmp_path: Path, before: bytes | None, after: bytes
) -> None:
    path = tmp_path / "log.jsonl"
    if before is not None:
        path.write_bytes(before)
    fd, size, inode = logfiles.open_append(path)
    try:
        assert size == len(after) and inode == os.fstat(fd).st_ino
        os.write(fd, b"next\n")
    finally:
        os.close(fd)
    assert path.read_bytes() == after + b"next\n"
    if before is None:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_rotate_keeps_the_newest_generations(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "log"
    for n in range(5):
        path.write_text(f"gen {n}")
        logfiles.rotate(path, keep)
    assert not path.exists()
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == [f"log.{n}" for n in range(1, keep + 1)]
    for n in range(1, keep + 1):
        assert logfiles.generation(path, n).read_text() == f"gen {5 - n}"
    assert logfiles.generation(path, 0) == path
