"""Copies and resizes of ext4 layer images (snapshots and forks), and the in-process loop mount."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from sbx.backends.base import BackendError
from sbx.backends.disk_copy import allocated_bytes, copy_frozen, copy_sparse, resize_ext4
from sbx.backends.host_tool import run_tool
from sbx.backends.layers import is_mounted, make_ext4_image, mount_loop

MIB = 1024 * 1024
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("mkfs.ext4"), reason="needs root and e2fsprogs (loop mounts)"
)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_sparse(path: Path, size: int, pieces: tuple[tuple[int, bytes], ...]) -> None:
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in pieces:
            f.seek(offset)
            f.write(data)


async def test_copy_keeps_content_and_holes(tmp_path: Path) -> None:
    source = tmp_path / "src"
    write_sparse(source, 64 * MIB, ((0, b"head"), (MIB, os.urandom(300_000)), (64 * MIB - 3, b"end")))
    await copy_sparse(source, tmp_path / "dst")
    assert digest(source) == digest(tmp_path / "dst")
    assert (tmp_path / "dst").stat().st_size == 64 * MIB
    assert allocated_bytes(tmp_path / "dst") < 2 * MIB  # the holes stayed holes


async def test_copy_of_a_missing_file_is_a_backend_error(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="cannot copy"):
        await copy_sparse(tmp_path / "absent", tmp_path / "dst")


@needs_root
async def test_frozen_copy_resize_and_mount(tmp_path: Path) -> None:
    image, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    await make_ext4_image(image, 64, journal=False)
    await mount_loop(image, mnt)
    try:
        (mnt / "file").write_bytes(b"x" * 20 * MIB)
        await copy_frozen(mnt, image, tmp_path / "copy.img")
        (mnt / "after").write_text("writers go on after the thaw")
    finally:
        await run_tool("umount", str(mnt))
    copy = tmp_path / "copy.img"
    await resize_ext4(copy, 128)  # grow
    assert copy.stat().st_size == 128 * MIB
    await mount_loop(copy, mnt)
    try:
        assert is_mounted(mnt) and (mnt / "file").stat().st_size == 20 * MIB
        assert not (mnt / "after").exists()  # the copy is the file system as it was when frozen
        total_mib = os.statvfs(mnt).f_blocks * os.statvfs(mnt).f_frsize // MIB
        assert 100 < total_mib <= 128
    finally:
        await run_tool("umount", str(mnt))
    await resize_ext4(copy, 48)  # shrink, the files fit
    assert copy.stat().st_size == 48 * MIB
    with pytest.raises(BackendError, match="do not fit in disk_mb 8"):
        await resize_ext4(copy, 8)
    # No loop device is left behind once unmounted (autoclear).
    assert str(tmp_path) not in await run_tool("losetup", "-a")
