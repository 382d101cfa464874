"""Copies of a sandbox's writable layer: consistent copies of a live ext4 image, and resizing a copy.

Snapshots keep the layer's ext4 image file (see layers.py) as it was at one moment; a fork starts from a
copy of it. Copies are sparse (holes stay holes), so a 10 GiB layer holding 50 MiB costs about 50 MiB.
"""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

from sbx.backends.base import BackendError
from sbx.backends.host_tool import run_tool

MIB = 1024 * 1024


def _copy_sparse(source: Path, dest: Path) -> None:
    with open(source, "rb") as src, open(dest, "wb") as dst:
        size = os.fstat(src.fileno()).st_size
        dst.truncate(size)
        offset = 0
        while offset < size:
            try:
                data = os.lseek(src.fileno(), offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # only a hole is left
                    break
                raise
            hole = os.lseek(src.fileno(), data, os.SEEK_HOLE)
            while data < hole:
                copied = os.copy_file_range(src.fileno(), dst.fileno(), hole - data, data, data)
                if copied == 0:
                    raise OSError(errno.EIO, f"{source} ended early while being copied")
                data += copied
            offset = hole


async def copy_sparse(source: Path, dest: Path) -> None:
    """Copy ``source`` to ``dest`` keeping holes (data extents only, copied in the kernel with
    copy_file_range); ``dest`` is replaced. In-process: a ``cp`` process costs milliseconds per copy."""
    try:
        await asyncio.to_thread(_copy_sparse, source, dest)
    except OSError as exc:
        raise BackendError(f"cannot copy {source} to {dest}: {exc.strerror or exc}") from exc


async def copy_frozen(mount_point: Path, image_file: Path, dest: Path) -> None:
    """Copy the ext4 image ``image_file`` mounted on ``mount_point`` while the file system is frozen.

    Freezing flushes it and holds every writer (they wait, they do not fail) until the copy is made, so the
    copy is a consistent file system. The thaw runs even when the copy fails or is cancelled.
    """
    await run_tool("fsfreeze", "--freeze", str(mount_point))
    try:
        await copy_sparse(image_file, dest)
    finally:
        # Shielded: a frozen file system left behind would hang the sandbox's every write.
        await asyncio.shield(run_tool("fsfreeze", "--unfreeze", str(mount_point)))


async def resize_ext4(image_file: Path, size_mb: int) -> None:
    """Make the (unmounted) ext4 image ``image_file`` exactly ``size_mb`` MiB, growing or shrinking it.

    Raises BackendError when the files on it do not fit in ``size_mb``.
    """
    current = image_file.stat().st_size
    target = size_mb * MIB
    if current == target:
        return
    # resize2fs wants a freshly checked file system; -p keeps e2fsck from asking questions.
    proc = await asyncio.create_subprocess_exec(
        "e2fsck", "-f", "-p", str(image_file),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    if proc.returncode not in (0, 1):  # 1: errors corrected
        raise BackendError(
            f"e2fsck of the snapshot's disk failed (exit {proc.returncode}): {out.decode()[-500:]}"
        )
    if target > current:
        with open(image_file, "r+b") as f:  # noqa: ASYNC230 - a sparse truncate, no data written
            f.truncate(target)
        await run_tool("resize2fs", "-f", str(image_file), f"{size_mb}M")
        return
    try:
        await run_tool("resize2fs", str(image_file), f"{size_mb}M")
    except BackendError as exc:
        raise BackendError(
            f"the snapshot's files do not fit in disk_mb {size_mb}; ask for more disk ({exc})"
        ) from exc
    with open(image_file, "r+b") as f:  # noqa: ASYNC230 - a truncate after resize2fs shrank the file system
        f.truncate(target)


def allocated_bytes(path: Path) -> int:
    """Bytes of storage a file or directory tree takes (allocated blocks, holes not counted); 0 if gone."""
    total = 0
    try:
        paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for p in paths:
            try:
                total += p.stat().st_blocks * 512
            except OSError:
                pass
    except OSError:
        return 0
    return total
