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
import ctypes
import errno
import fcntl
import logging
import os
import shutil
from pathlib import Path

from sbx.backends.base import BackendError
from sbx.backends.disk_copy import copy_sparse, resize_ext4
from sbx.backends.host_tool import run_tool
from sbx.images.store import SANDBOX_GID, SANDBOX_UID

log = logging.getLogger(__name__)


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


_MS_RDONLY = 0x1
_MS_NOSUID = 0x2
_MS_NODEV = 0x4
_MS_REMOUNT = 0x20
_MS_BIND = 0x1000
_MNT_DETACH = 0x2
_libc = ctypes.CDLL(None, use_errno=True)


def mount_overlay(lower: Path, upper: Path, work: Path, target: Path) -> None:
    """Mount an overlay with mount(2) directly: a ``mount`` process would cost milliseconds per create."""
    options = f"lowerdir={lower},upperdir={upper},workdir={work}".encode()
    if _libc.mount(b"overlay", str(target).encode(), b"overlay", _MS_NODEV | _MS_NOSUID, options) != 0:
        err = ctypes.get_errno()
        raise BackendError(f"cannot mount the sandbox's root overlay at {target}: {os.strerror(err)}")


def bind_read_only(source: Path, target: Path) -> None:
    """Bind-mount the directory ``source`` on ``target`` (created) read-only, nosuid and nodev, so the host's
    kernel refuses every write through it whatever the process asks: a bind takes no flags of its own, so it
    is made first and remounted read-only next (undone when that fails)."""
    target.mkdir(parents=True, exist_ok=True)
    if _libc.mount(str(source).encode(), str(target).encode(), None, _MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise BackendError(f"cannot bind {source} on {target}: {os.strerror(err)}")
    flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV
    if _libc.mount(None, str(target).encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        _libc.umount2(str(target).encode(), 0)
        raise BackendError(f"cannot make the bind of {source} on {target} read-only: {os.strerror(err)}")


def detach_all(mount_point: Path, most: int = 64) -> int:
    """Lazily detach every mount stacked on ``mount_point`` (``umount2`` with ``MNT_DETACH``, at most ``most``
    of them); how many there were. Nothing mounted there (or no such path) is 0. Idempotent."""
    target = str(mount_point).encode()
    for done in range(most):
        if _libc.umount2(target, _MNT_DETACH) != 0:
            return done
    return most


async def unmount_all(mount_points: list[Path]) -> None:
    """Unmount each of ``mount_points`` that is mounted; detach lazily one still busy (a process that has
    not exited yet holds it: it goes when that process does). Idempotent."""
    for mount_point in mount_points:
        if mount_point.exists() and is_mounted(mount_point):
            try:
                await run_tool("umount", str(mount_point))
            except BackendError:
                await run_tool("umount", "-l", str(mount_point))


async def make_ext4_image(image_file: Path, size_mb: int, journal: bool) -> None:
    """Make ``image_file`` a sparse file of exactly ``size_mb`` MiB holding a fresh ext4 file system.

    No blocks are reserved for root (``-m 0``), so root gets no more room than anyone and a write past the
    size fails with ENOSPC. Lazy init keeps mkfs at a few milliseconds even for many GiB (unwritten parts of
    a sparse file read as zeros). ``journal``: for file systems that must come back whole after a host crash.
    """
    with open(image_file, "wb") as f:  # noqa: ASYNC230 - a sparse truncate, no data written
        f.truncate(size_mb * 1024 * 1024)
    features = () if journal else ("-O", "^has_journal")
    await run_tool(
        "mkfs.ext4", "-q", "-F", "-m", "0", *features,
        "-E", "nodiscard,lazy_itable_init=1,lazy_journal_init=1", str(image_file),
    )  # fmt: skip


_LOOP_CTL_GET_FREE = 0x4C82
_LOOP_CONFIGURE = 0x4C0A
_LO_FLAGS_AUTOCLEAR = 4


class _LoopInfo64(ctypes.Structure):
    _fields_ = [
        ("lo_device", ctypes.c_uint64), ("lo_inode", ctypes.c_uint64), ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64), ("lo_sizelimit", ctypes.c_uint64), ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32), ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32), ("lo_file_name", ctypes.c_uint8 * 64),
        ("lo_crypt_name", ctypes.c_uint8 * 64), ("lo_encrypt_key", ctypes.c_uint8 * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    ]  # fmt: skip


class _LoopConfig(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_uint32), ("block_size", ctypes.c_uint32), ("info", _LoopInfo64),
                ("reserved", ctypes.c_uint64 * 8)]  # fmt: skip


def _attach_loop(image_file: Path) -> int:
    """An open loop device backed by ``image_file``, detached by the kernel once its last user (the mount)
    goes (autoclear, as ``mount -o loop`` does). Retries when another process takes the free device first."""
    control = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    backing = os.open(image_file, os.O_RDWR | os.O_CLOEXEC)
    try:
        for _ in range(20):
            number = fcntl.ioctl(control, _LOOP_CTL_GET_FREE)
            device = os.open(f"/dev/loop{number}", os.O_RDWR | os.O_CLOEXEC)
            config = _LoopConfig(fd=backing)
            config.info.lo_flags = _LO_FLAGS_AUTOCLEAR
            try:
                fcntl.ioctl(device, _LOOP_CONFIGURE, config)
            except OSError as exc:
                os.close(device)
                if exc.errno == errno.EBUSY:
                    continue  # taken between GET_FREE and CONFIGURE
                raise
            return device
        raise OSError(errno.EBUSY, "no free loop device after 20 tries")
    finally:
        os.close(backing)
        os.close(control)


def loop_devices_of(image_file: Path) -> list[str]:
    """Loop devices (``loop3``) whose backing file is ``image_file``."""
    target = os.path.realpath(image_file)
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text(encoding="utf-8").strip() == target:
                found.append(backing.parent.parent.name)
        except OSError:
            continue
    return found


def _open_bound_loop(image_file: Path) -> int | None:
    """An open descriptor of a loop device still bound to ``image_file``, or None.

    One outlives our unmount when another mount namespace holds the file system: one that a process on the
    host made while it was mounted (``unshare -m``, ``ip netns exec``) keeps its own copy of the mount, which
    our unmount does not reach where the host's mounts are private (no systemd: this machine's), and a
    stopping sandbox's file server holds one until it exits. Mounting that device again gives the same
    superblock; a second loop device over the file would give a second one, and two ext4 superblocks
    writing one file corrupt it. Held open, it cannot be cleared meanwhile."""
    for name in loop_devices_of(image_file):
        try:
            device = os.open(f"/dev/{name}", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue  # cleared meanwhile
        if name in loop_devices_of(image_file):
            return device
        os.close(device)
    return None


def _mount_loop(image_file: Path, target: Path, fresh: bool) -> None:
    device = None if fresh else _open_bound_loop(image_file)
    if device is None:
        device = _attach_loop(image_file)
    try:
        source = os.readlink(f"/proc/self/fd/{device}").encode()
        if _libc.mount(source, str(target).encode(), b"ext4", _MS_NODEV | _MS_NOSUID, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mount of {image_file} on {target}: {os.strerror(err)}")
    finally:
        os.close(device)  # the mount holds the device now; with autoclear it goes with the unmount


async def mount_loop(image_file: Path, target: Path, fresh: bool = False) -> None:
    """Mount the ext4 image ``image_file`` on ``target`` through a loop device (nodev, nosuid): the one still
    bound to it where there is one (:func:`_open_bound_loop`), else a new one. ``fresh``: a file made just now
    (formatted or copied), which no loop device can be bound to: the search (about 0.03 ms per loop device on
    the host, on every create) is skipped.

    With ioctl and mount(2) directly: a ``mount`` process costs 10 to 30 ms per call here (measured).
    """
    try:
        await asyncio.to_thread(_mount_loop, image_file, target, fresh)
    except OSError as exc:
        raise BackendError(f"cannot mount {image_file} on {target}: {exc.strerror or exc}") from exc


class WritableLayer:
    """The writable layer and overlay root of one sandbox, in its own directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.image_file = directory / "disk.img"
        self.disk_dir = directory / "disk"
        self.rootfs = directory / "rootfs"
        #: Names the image root the overlay lies on, so that it can be mounted again after a reboot.
        self.lower_file = directory / "lower"

    async def create(
        self, image_root: Path, disk_mb: int, pool: LayerPool | None = None, journal: bool = False
    ) -> None:
        """Make the ext4 layer of ``disk_mb`` MiB (or take a ready one from ``pool``) and mount the overlay.
        ``journal``: a layer that must come back whole after a host crash (a persistent sandbox's); the pool's
        have none, so it is then never used.

        On failure, whatever was made is removed again.
        """
        try:
            if journal or pool is None or not pool.take(disk_mb, self.directory):
                await self.format_disk(disk_mb, journal)
            self.rootfs.mkdir(exist_ok=True)
            upper = self.disk_dir / "upper"
            self._prepare_upper(upper, image_root)
            self.lower_file.write_text(str(image_root), encoding="utf-8")
            mount_overlay(image_root, upper, self.disk_dir / "work", self.rootfs)
        except BaseException:
            await self.remove()
            raise

    async def create_from_copy(
        self, image_root: Path, disk_image: Path, disk_mb: int, journal: bool = False
    ) -> None:
        """Like create, but the ext4 layer is a copy of ``disk_image`` (a snapshot's), resized to ``disk_mb``,
        and given a journal with ``journal`` (snapshots are taken of layers without one).

        On failure (files that do not fit, among others) whatever was made is removed again.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.disk_dir.mkdir(exist_ok=True)
            await copy_sparse(disk_image, self.image_file)
            await resize_ext4(self.image_file, disk_mb)
            if journal:
                await run_tool("tune2fs", "-O", "has_journal", str(self.image_file))
            await mount_loop(self.image_file, self.disk_dir, fresh=True)
            self.rootfs.mkdir(exist_ok=True)
            self.lower_file.write_text(str(image_root), encoding="utf-8")
            mount_overlay(image_root, self.disk_dir / "upper", self.disk_dir / "work", self.rootfs)
        except BaseException:
            await self.remove()
            raise

    async def format_disk(self, disk_mb: int, journal: bool = False) -> None:
        """Make and mount the ext4 file system of the writable layer, with empty upper/ and work/."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.disk_dir.mkdir(exist_ok=True)
        # No journal unless asked: a sandbox's layer is discarded with it, so a journal would buy nothing after a
        # crash; a persistent sandbox's is kept, and must then mount whole.
        await make_ext4_image(self.image_file, disk_mb, journal=journal)
        await mount_loop(self.image_file, self.disk_dir, fresh=True)
        (self.disk_dir / "upper").mkdir(exist_ok=True)
        (self.disk_dir / "work").mkdir(exist_ok=True)

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

    async def ensure_mounted(self, image_root: Path | None = None) -> None:
        """Mount the layer and its overlay on ``image_root`` (default: the one it was made on) again wherever
        they are not (a host reboot took the mounts), the journal replayed first; nothing when both are
        mounted. BackendError when the layer's file is gone or its file system cannot be repaired.

        The check is skipped while a loop device is still bound to the file: the kernel then still holds its
        file system (another mount namespace has a copy of the mount, :func:`_open_bound_loop`), which is
        mounted again as it is. e2fsck would repair, and replay the journal of, a file system in use, and
        does not see that it is: the mount is not in this namespace."""
        if not is_mounted(self.disk_dir):
            if not self.image_file.is_file():
                raise BackendError(f"the sandbox's disk {self.image_file} is missing")
            if not loop_devices_of(self.image_file):
                await self._repair()
            self.disk_dir.mkdir(exist_ok=True)
            await mount_loop(self.image_file, self.disk_dir)
        if not is_mounted(self.rootfs):
            if image_root is None:
                try:
                    image_root = Path(self.lower_file.read_text(encoding="utf-8"))
                except OSError as exc:
                    raise BackendError(f"the image root of {self.rootfs} is not recorded: {exc}") from exc
            self.rootfs.mkdir(exist_ok=True)
            mount_overlay(image_root, self.disk_dir / "upper", self.disk_dir / "work", self.rootfs)

    async def _repair(self) -> None:
        """``e2fsck -p`` the layer's file (not mounted anywhere): the journal replayed, what it can fix
        fixed; BackendError when it needs a person."""
        proc = await asyncio.create_subprocess_exec(
            "e2fsck", "-p", str(self.image_file),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await proc.communicate()
        if proc.returncode not in (0, 1):  # 1: errors found and corrected
            detail = out.decode(errors="replace").strip()[-500:]
            raise BackendError(
                f"the sandbox's disk needs a manual fsck (e2fsck exit {proc.returncode}): {detail}"
            )

    async def sync(self) -> None:
        """Write what the layer holds to its file on the host's disk (syncfs of its file system and the file)."""

        def sync() -> None:
            if is_mounted(self.disk_dir):
                fd = os.open(self.disk_dir, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    if _libc.syncfs(fd) != 0:
                        err = ctypes.get_errno()
                        raise BackendError(f"syncfs of {self.disk_dir}: {os.strerror(err)}")
                finally:
                    os.close(fd)
            if self.image_file.is_file():
                fd = os.open(self.image_file, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

        await asyncio.to_thread(sync)

    def used_bytes(self) -> int:
        """Bytes used on the writable layer's file system (0 when not mounted)."""
        try:
            st = os.statvfs(self.disk_dir)
        except OSError:
            return 0
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    async def remove(self) -> None:
        """Unmount and delete everything; idempotent. (A gofer that has not exited yet may still hold a
        mount: it is then detached, and the loop device freed once the last user goes.)"""
        await unmount_all([self.rootfs, self.disk_dir])
        shutil.rmtree(self.directory, ignore_errors=True)


class LayerPool:
    """Writable layers of one size formatted and mounted ahead of time, so a create only mounts its overlay.

    Entries live in ``directory`` as ``<n>/`` (a WritableLayer without its overlay); ``take`` renames one
    into the new sandbox's layer directory (the loop mount moves with it) and a refill starts in the
    background. Entries are removed at ``close``, and those a killed run left behind at ``start``.
    """

    def __init__(self, directory: Path, disk_mb: int, target: int = 2) -> None:
        self.directory = directory
        self.disk_mb = disk_mb
        self.target = target
        self._ready: list[Path] = []
        self._counter = 0
        self._refilling: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Clear leftovers, then fill the pool in the background."""
        if self.directory.exists():
            for leftover in self.directory.iterdir():
                await WritableLayer(leftover).remove()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._refill_soon()

    def take(self, disk_mb: int, dest: Path) -> bool:
        """Move a ready layer of ``disk_mb`` MiB to ``dest``; False when none is ready."""
        if disk_mb != self.disk_mb or not self._ready:
            return False
        entry = self._ready.pop()
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.rename(entry, dest)
        self._refill_soon()
        return True

    def _refill_soon(self) -> None:
        if self.target > 0 and (self._refilling is None or self._refilling.done()):
            self._refilling = asyncio.get_running_loop().create_task(self._refill())

    async def _refill(self) -> None:
        while len(self._ready) < self.target:
            self._counter += 1
            entry = self.directory / f"{os.getpid()}-{self._counter}"
            try:
                await WritableLayer(entry).format_disk(self.disk_mb)
            except (BackendError, OSError) as exc:
                log.warning("layer pool refill failed", extra={"error": str(exc)})
                await WritableLayer(entry).remove()
                return
            self._ready.append(entry)

    async def close(self) -> None:
        """Stop refilling and unmount the ready entries (a stopped node leaves no loop device behind)."""
        if self._refilling is not None:
            self._refilling.cancel()
        while self._ready:
            await WritableLayer(self._ready.pop()).remove()
