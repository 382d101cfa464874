"""The record, size, flag and disk use of an ephemeral sandbox's root overlay (sbx.backends.root_overlay); what
the guest sees with it is tests/integration/test_root_overlay.py's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sbx.backends.base import BackendError
from sbx.backends.root_overlay import (
    MIN_SIZE_BYTES,
    RECORD,
    TAR_MARGIN_BYTES,
    RootOverlay,
    filestore_bytes,
    overlay_refusal,
    read_record,
    sized,
    tar_refusal,
    write_record,
)
from sbx.backends.runsc import RunscInfo

MIB = 1024 * 1024

# (case, disk_mb, bytes the ext4 layer below holds, overlay size)
SIZE_CASES = [
    ("a fresh layer", 2048, 36864, 2048 * MIB - 36864),
    ("a fork's layer holding files", 300, 100 * MIB, 200 * MIB),
    ("a layer as large as the disk: still room to write", 300, 300 * MIB, MIN_SIZE_BYTES),
    ("a layer larger than the disk", 100, 400 * MIB, MIN_SIZE_BYTES),
]  # fmt: skip


@pytest.mark.parametrize(
    ("disk_mb", "used", "size"), [c[1:] for c in SIZE_CASES], ids=[c[0] for c in SIZE_CASES]
)
def test_size_is_the_disk_less_the_layer_below(disk_mb: int, used: int, size: int) -> None:
    assert sized(disk_mb, used) == RootOverlay(size)


def test_flag_names_the_directory_and_size(tmp_path: Path) -> None:
    assert RootOverlay(5 * MIB).flag(tmp_path) == f"--overlay2=root:dir={tmp_path},size={5 * MIB}"


def test_record_round_trip_and_removal(tmp_path: Path) -> None:
    assert read_record(tmp_path) is None  # no record: no overlay
    write_record(tmp_path, RootOverlay(3 * MIB))
    assert read_record(tmp_path) == RootOverlay(3 * MIB)
    assert [p.name for p in tmp_path.iterdir()] == [RECORD]  # replaced whole, nothing left beside it
    write_record(tmp_path, None)
    assert read_record(tmp_path) is None and not (tmp_path / RECORD).exists()


@pytest.mark.parametrize(
    "text",
    ["not json", "[]", "{}", '{"size_bytes": "big"}', '{"size_bytes": true}', '{"size_bytes": 12}'],
    ids=["not-json", "a-list", "no-size", "a-string", "a-bool", "under-the-minimum"],
)
def test_a_damaged_record_is_a_clear_error(tmp_path: Path, text: str) -> None:
    (tmp_path / RECORD).write_text(text)
    with pytest.raises(BackendError, match="record of the sandbox's root overlay"):
        read_record(tmp_path)


def test_filestore_bytes_reads_the_open_unlinked_file(tmp_path: Path) -> None:
    """As runsc leaves it: made in the directory, unlinked, held open (here by this process, twice)."""
    path = tmp_path / "runsc-filestore-123"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    other = os.open(path, os.O_RDONLY)
    try:
        os.pwrite(fd, b"x" * (3 * MIB), 0)
        os.fsync(fd)
        path.unlink()
        (tmp_path / "runsc-filestore-not-open").write_bytes(b"y" * MIB)  # a file nobody holds counts nothing
        got = filestore_bytes([os.getpid()], tmp_path)
        assert 3 * MIB <= got < 4 * MIB  # once, though held twice
        assert filestore_bytes([os.getpid()], tmp_path / "elsewhere") == 0
        assert filestore_bytes([2**22 + 7], tmp_path) == 0  # no such process
    finally:
        os.close(fd)
        os.close(other)


# (case, overlay bytes, unreclaimable memory, limit, refused)
TAR_CASES = [
    ("small files, much free", 10 * MIB, 100 * MIB, 512 * MIB, False),
    ("just fits with the margin", 512 * MIB - 100 * MIB - TAR_MARGIN_BYTES, 100 * MIB, 512 * MIB, False),
    ("one byte over", 512 * MIB - 100 * MIB - TAR_MARGIN_BYTES + 1, 100 * MIB, 512 * MIB, True),
    ("the measured kill: 500 MB in 512 MiB", 500_000_000, 40 * MIB, 512 * MIB, True),
    ("memory already over the limit", 1, 600 * MIB, 512 * MIB, True),
    ("no limit known", 10**12, 0, 0, False),
]  # fmt: skip


@pytest.mark.parametrize(
    ("overlay", "memory", "limit", "refused"), [c[1:] for c in TAR_CASES], ids=[c[0] for c in TAR_CASES]
)
def test_saving_the_overlay_needs_its_bytes_free_in_memory(
    overlay: int, memory: int, limit: int, refused: bool
) -> None:
    refusal = tar_refusal(overlay, memory, limit)
    assert (refusal is not None) is refused
    if refusal is not None:
        assert f"free of {limit // MIB} MiB" in refusal and "Delete large files in it" in refusal


# (case, release, patches it was built with, why not (None: the overlay is used))
REFUSAL_CASES = [
    ("the runsc scripts/install.sh builds", 20260803, {"tmpfs-tar-streams-files"}, None),
    ("the same release built another way", 20260803, set(), "not built by scripts/install.sh with runsc/patches/"),
    ("bookworm-backports", 20240729, set(), "cannot size it or write it out (release 20250721 or later can)"),
    ("a build naming no release", 0, {"tmpfs-tar-streams-files"}, "cannot size it"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("release", "patches", "why"), [c[1:] for c in REFUSAL_CASES], ids=[c[0] for c in REFUSAL_CASES]
)
def test_the_overlay_needs_a_runsc_that_sizes_it_and_streams_its_tar(
    release: int, patches: set[str], why: str | None
) -> None:
    info = RunscInfo("/r/runsc", f"v{release}", release, frozenset(), ("systrap",), frozenset(patches))
    refusal = overlay_refusal(info)
    if why is None:
        assert refusal is None
    else:
        assert refusal is not None and why in refusal and f"runsc v{release}" in refusal, refusal
