"""Volumes as ext4 file systems in sparse files, loop-mounted on the host while sandboxes use them.

In a volume's directory::

    disk.img    sparse file of exactly size_mb MiB holding an ext4 file system (with a journal)
    mnt/        its loop mount point on the host while attached: the source of the sandboxes' binds

Because the size is that of the file system, a write past ``size_mb`` fails with ENOSPC inside the sandbox and
never fills the host disk beyond it. Backends that bind host directories into sandboxes (gVisor) use this.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
from pathlib import Path

from sbx.backends.base import BackendError, GuestUser
from sbx.backends.host_tool import run_tool
from sbx.backends.layers import is_mounted, make_ext4_image, mount_loop

log = logging.getLogger(__name__)

#: How long a detach waits for a stopping sandbox's file server to let go, in seconds, before detaching
#: lazily (the next attach mounts the loop device that stays bound meanwhile: layers.mount_loop).
UNMOUNT_WAIT_SECS = 5.0

_libc = ctypes.CDLL(None, use_errno=True)


def _syncfs(path: Path) -> None:
    """Flush the file system holding ``path`` to its disk (syncfs(2)); errors are logged, not raised."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        log.warning("volume flush: cannot open mount", extra={"path": str(path), "error": str(exc)})
        return
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            log.warning("volume flush failed", extra={"path": str(path), "error": os.strerror(err)})
    finally:
        os.close(fd)


class LoopVolumes:
    """:class:`~sbx.backends.base.VolumeDisks` of ext4 images; each volume's root is owned by ``owner``."""

    def __init__(self, owner: GuestUser) -> None:
        self.owner = owner

    async def create(self, directory: Path, size_mb: int) -> None:
        """The ext4 image with an empty root the guest user owns (lost+found removed: a new volume is empty;
        e2fsck makes it again when it needs one), fsynced."""
        image = directory / "disk.img"
        mnt = directory / "mnt"
        mnt.mkdir()
        # A journal: a volume's contents must come back whole after a host crash.
        await make_ext4_image(image, size_mb, journal=True)
        await mount_loop(image, mnt, fresh=True)
        try:
            shutil.rmtree(mnt / "lost+found", ignore_errors=True)
            os.chown(mnt, self.owner.uid, self.owner.gid)
            os.chmod(mnt, 0o755)
        finally:
            await run_tool("umount", str(mnt))  # nothing else has seen it: never busy
        # The node's record written next is durable; the file system it names must be too.
        fd = os.open(image, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def is_attached(self, directory: Path) -> bool:
        return is_mounted(directory / "mnt")

    async def attach(self, directory: Path) -> Path:
        """Loop-mount the image on ``mnt/`` unless it is; the mount point is the binds' source."""
        mnt = directory / "mnt"
        if is_mounted(mnt):
            return mnt
        # A loop device left bound to the image by an earlier mount (a lazy unmount while a stopped sandbox's
        # file server held it, or another mount namespace's copy of the mount) is mounted again: never two.
        mnt.mkdir(exist_ok=True)
        await mount_loop(directory / "disk.img", mnt)
        log.info("volume mounted", extra={"volume": directory.name})
        return mnt

    async def flush(self, directory: Path) -> None:
        mnt = directory / "mnt"
        if is_mounted(mnt):
            await asyncio.to_thread(_syncfs, mnt)

    async def detach(self, directory: Path) -> None:
        """Flush and unmount; a file server still exiting gets ``UNMOUNT_WAIT_SECS``, then the mount is
        detached lazily (the loop device goes when it lets go, and :meth:`attach` waits for that)."""
        mnt = directory / "mnt"
        if not is_mounted(mnt):
            return
        await asyncio.to_thread(_syncfs, mnt)
        deadline = asyncio.get_running_loop().time() + UNMOUNT_WAIT_SECS
        while True:
            try:
                await run_tool("umount", str(mnt))
                break
            except BackendError as exc:
                if not is_mounted(mnt):
                    break
                if asyncio.get_running_loop().time() >= deadline:
                    log.warning(
                        "volume busy; detaching it", extra={"volume": directory.name, "error": str(exc)}
                    )
                    await run_tool("umount", "-l", str(mnt))
                    break
                await asyncio.sleep(0.1)
        log.info("volume unmounted", extra={"volume": directory.name})
