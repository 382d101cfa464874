"""A sandbox's root filesystem on the host: the shared read-only image root under a private writable layer.

The writable layer lives on its own ext4 file system in a sparse file of exactly ``disk_mb`` MiB, mounted
through a loop device, so a write past the size fails with ENOSPC inside the sandbox and never fills the host
disk (the node also refuses to give out more disk than its capacity). An overlay mount joins it with the image
root; gVisor's gofer serves that overlay as the sandbox's ``/``.

Layout under the layer directory::

    disk.img        sparse file holding the ext4 file system of the writable layer
    disk/           its mount point; holds upper/ and work/ of the overlay
    rootfs/         the overlay mount the sandbox sees as /
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

from sbx.backends.base import BackendError

#: uid and gid of the sandbox user inside every sandbox; its home is /sandbox/home.
SANDBOX_UID = 1000
SANDBOX_GID = 1000


async def run_tool(*argv: str) -> str:
    """Run a host tool, returning its stdout; raise BackendError with its stderr when it fails."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        detail = err.decode(errors="replace").strip() or out.decode(errors="replace").strip()
        raise BackendError(f"{argv[0]} failed (exit {proc.returncode}): {detail}")
    return out.decode(errors="replace")


def is_mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point, read from /proc/self/mountinfo (cheap, no subprocess)."""
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            # Field 5 is the mount point, with spaces and the like escaped as octal.
            mount_point = line.split(" ", 5)[4].encode().decode("unicode_escape")
            if mount_point == target:
                return True
    return False


class WritableLayer:
    """The writable layer and overlay root of one sandbox, in its own directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.image_file = directory / "disk.img"
        self.disk_dir = directory / "disk"
        self.rootfs = directory / "rootfs"

    async def create(self, image_root: Path, disk_mb: int) -> None:
        """Make the ext4 layer of ``disk_mb`` MiB and mount the overlay at ``rootfs``.

        On failure, whatever was made is removed again.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.disk_dir.mkdir(exist_ok=True)
            self.rootfs.mkdir(exist_ok=True)
            with open(self.image_file, "wb") as f:  # noqa: ASYNC230 - a sparse truncate, no data written
                f.truncate(disk_mb * 1024 * 1024)
            # Lazy init and no journal keep mkfs at a few milliseconds even for many GiB; the layer is
            # discarded with the sandbox, so a journal would buy nothing after a host crash.
            await run_tool(
                "mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal",
                "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1", str(self.image_file),
            )  # fmt: skip
            await run_tool("mount", "-o", "loop,nodev,nosuid", str(self.image_file), str(self.disk_dir))
            upper = self.disk_dir / "upper"
            upper.mkdir(exist_ok=True)
            (self.disk_dir / "work").mkdir(exist_ok=True)
            self._prepare_upper(upper, image_root)
            await run_tool(
                "mount", "-t", "overlay", "overlay", "-o",
                f"lowerdir={image_root},upperdir={upper},workdir={self.disk_dir / 'work'},nodev,nosuid",
                str(self.rootfs),
            )  # fmt: skip
        except BaseException:
            await self.remove()
            raise

    @staticmethod
    def _prepare_upper(upper: Path, image_root: Path) -> None:
        """Give every sandbox a home and the agent's mount points, whatever the image holds."""
        home = upper / "sandbox" / "home"
        if not (image_root / "sandbox" / "home").is_dir():
            home.mkdir(parents=True, exist_ok=True)
            os.chown(home, SANDBOX_UID, SANDBOX_GID)
            os.chmod(home, 0o755)
        for mount_point in (".sbx/ctl", "tmp"):
            if not (image_root / mount_point).is_dir():
                (upper / mount_point).mkdir(parents=True, exist_ok=True)
        if not (image_root / ".sbx" / "agent").exists():
            (upper / ".sbx" / "agent").touch()
        if not (image_root / "tmp").is_dir():
            os.chmod(upper / "tmp", 0o1777)

    def used_bytes(self) -> int:
        """Bytes used on the writable layer's file system (0 when not mounted)."""
        try:
            st = os.statvfs(self.disk_dir)
        except OSError:
            return 0
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    async def remove(self) -> None:
        """Unmount and delete everything; idempotent."""
        for mount_point in (self.rootfs, self.disk_dir):
            if mount_point.exists() and is_mounted(mount_point):
                try:
                    await run_tool("umount", str(mount_point))
                except BackendError:
                    # A gofer that has not exited yet may still hold it; detach so the loop device is freed
                    # once the last user goes.
                    await run_tool("umount", "-l", str(mount_point))
        shutil.rmtree(self.directory, ignore_errors=True)
