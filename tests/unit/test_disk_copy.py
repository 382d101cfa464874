"""Copies and resizes of ext4 layer images (snapshots and forks), and the in-process loop mount."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from mount_holder import holding_mount

from sbx.backends.base import BackendError
from sbx.backends.disk_copy import allocated_bytes, copy_frozen, copy_sparse, resize_ext4
from sbx.backends.host_tool import run_tool
from sbx.backends.layers import (
    WritableLayer,
    is_mounted,
    loop_devices_of,
    make_ext4_image,
    mount_loop,
    unmount_all,
)

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


@needs_root
@pytest.mark.parametrize("held", [False, True], ids=["unmounted everywhere", "held by a copy of its mount"])
async def test_a_layer_is_checked_before_it_is_mounted_again_only_when_no_namespace_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool
) -> None:
    """ensure_mounted runs e2fsck on a layer that is mounted nowhere (a reboot took its mounts), and never on
    one whose file system another mount namespace still holds: e2fsck would repair a file system in use,
    and does not see that it is. Either way the layer comes back with what it held. The test holds a copy of
    the one mount (tests/support/mount_holder.py), the state another namespace's copy leaves."""
    lower = tmp_path / "lower"
    lower.mkdir()
    layer = WritableLayer(tmp_path / "layer")
    await layer.create(lower, 32)
    (layer.rootfs / "kept").write_text("written before", encoding="utf-8")
    checked: list[tuple[str, ...]] = []
    spawn = asyncio.create_subprocess_exec

    async def spy(*args: str, **kwargs: Any) -> asyncio.subprocess.Process:
        if args[0] == "e2fsck":
            checked.append(args)
        return await spawn(*args, **kwargs)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", spy)
    with contextlib.ExitStack() as stack:
        if held:
            stack.enter_context(holding_mount(layer.disk_dir))
        (device,) = loop_devices_of(layer.image_file)
        await unmount_all([layer.rootfs, layer.disk_dir])
        assert loop_devices_of(layer.image_file) == ([device] if held else [])
        try:
            await layer.ensure_mounted()
            assert checked == ([] if held else [("e2fsck", "-p", str(layer.image_file))])
            # The same device again where the kernel held it; a new one (the old was cleared) where it did not.
            devices = loop_devices_of(layer.image_file)
            assert len(devices) == 1
            if held:
                assert devices == [device]
            assert (layer.rootfs / "kept").read_text(encoding="utf-8") == "written before"
        finally:
            await layer.remove()
