"""An EROFS image of each image's ``/usr``, which the sentry reads itself instead of asking the host per file.

Looking files up on the host is where file work under gVisor spends its time (docs/backends.md): each
directory listed costs an ``fstatat`` per entry through directfs, each open and close a host call. An EROFS
image is one host file the sentry reads and parses in its own memory, so ``find /usr`` took 0.29x and reading
the Python standard library 0.78x of the overlay's time (raw runsc, bench/bench_runsc_options.py).

Only ``/usr`` is served that way, and only when nothing in it is writable by anyone but root: the guest's user
(uid 1000) could not write there anyway, so a read-only mount changes nothing it can do, and every write a
sandbox can make still lands in its writable layer (``disk_mb``, ENOSPC, ``df``, disk snapshots, forks and
restarts unchanged). Root in the guest, which no API grants, gets EROFS there.

Layout, in the image's own directory of the image store (``<images>/<name>/``; removed with the image)::

    rootfs/             the image root (never written)
    usr.erofs           the EROFS image of rootfs/usr, complete once it has this name (one rename)
    usr.erofs.lock      flock held while one process builds it (another waits, then finds it made)
    .usr.erofs.<pid>    a build in progress, removed when it fails or is cancelled, or by the next build
                        when a killed process left it

The image is built in the background at the first boot of an image (about 6 s and as many bytes as ``/usr``
holds, 790 MB for the default image); boots before it is ready get the host's ``/usr`` through the overlay as
before. An image root that is not in an image store's layout (``rootfs`` beside ``image.json``) never gets one.
A running or checkpointed sandbox keeps what it booted with: the bundle names the file, and a checkpoint
records which file (:func:`identity`) so that a fork restored from it mounts the same one or is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sbx.statefile import fsync_dir

log = logging.getLogger(__name__)

#: The file's name in the image's directory.
USR_EROFS: Final = "usr.erofs"
#: The guest path served from it.
GUEST_USR: Final = "/usr"
#: What tells an image store's image directory (sbx.images.store): its root beside its record.
_IMAGE_ROOT_NAME: Final = "rootfs"
_IMAGE_RECORD: Final = "image.json"
#: mkfs.erofs without inline data: the sentry's EROFS reader needs each file's data in blocks of its own
#: (measured on release 20240729, kept for the pinned release).
MKFS_ARGS: Final = ("--quiet", "-E", "noinline_data")
#: How often a process waiting for another's build tries the lock again, in seconds.
_LOCK_POLL_SECS: Final = 0.2


@dataclass(frozen=True)
class ErofsFile:
    """A built image: its ``path`` and ``identity`` (device, inode, size, mtime), which a restore compares."""

    path: Path
    identity: str


def identity(path: Path) -> str:
    """Which file ``path`` is, as text: a file replaced at the same path (the image installed again) differs."""
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def writable_entry(usr: Path) -> str | None:
    """The first entry under ``usr`` (itself included) that someone other than root owns or that group or others
    may write, as a path relative to ``usr``'s parent; None when there is none (the tree may be read-only).
    Symbolic links are not judged (their mode means nothing); what they point to is judged where it is."""
    for top, dirs, files in os.walk(usr):
        for name in (None, *dirs, *files):
            path = top if name is None else os.path.join(top, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                continue
            if st.st_uid != 0 or st.st_mode & 0o022:
                return os.path.relpath(path, usr.parent)
    return None


class UsrImages:
    """Finds and builds the EROFS image of each image's ``/usr``; ``enabled`` False (``[gvisor] usr_erofs``)
    or no ``mkfs`` found: never any. One build at a time in this process."""

    def __init__(self, enabled: bool = True, mkfs: str | None = None) -> None:
        self.mkfs = (mkfs or shutil.which("mkfs.erofs")) if enabled else None
        #: Image roots judged unfit (a writable entry, a failed build): not tried again until sandboxd restarts.
        self._refused: set[Path] = set()
        self._builds: dict[Path, asyncio.Task[None]] = {}
        self._one_at_a_time = asyncio.Lock()

    def ready(self, image_root: Path) -> ErofsFile | None:
        """The built image of ``image_root``'s ``/usr``, or None (and its build started when it can have one)."""
        if self.mkfs is None or not self._in_store(image_root):
            return None
        path = image_root.parent / USR_EROFS
        with contextlib.suppress(FileNotFoundError):
            return ErofsFile(path, identity(path))
        if image_root not in self._refused and image_root not in self._builds:
            task = asyncio.get_running_loop().create_task(self._build(image_root))
            self._builds[image_root] = task
            task.add_done_callback(lambda _: self._builds.pop(image_root, None))
        return None

    async def wait(self, image_root: Path) -> ErofsFile | None:
        """:meth:`ready`, after the build it starts (if any) has ended: for tests and benchmarks."""
        found = self.ready(image_root)
        task = self._builds.get(image_root)
        if task is not None:
            await asyncio.shield(task)
            found = self.ready(image_root)
        return found

    async def close(self) -> None:
        """Cancel the builds in progress (their temporary files are removed)."""
        tasks = list(self._builds.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @staticmethod
    def _in_store(image_root: Path) -> bool:
        return image_root.name == _IMAGE_ROOT_NAME and (image_root.parent / _IMAGE_RECORD).is_file()

    async def _build(self, image_root: Path) -> None:
        async with self._one_at_a_time:
            try:
                await self._build_locked(image_root)
            except (OSError, RuntimeError) as exc:  # an optimisation: boots go on with the host's /usr
                self._refused.add(image_root)
                log.warning("no EROFS /usr for image %s: %s", image_root.parent.name, exc)

    async def _build_locked(self, image_root: Path) -> None:
        assert self.mkfs is not None
        directory = image_root.parent
        lock_fd = os.open(directory / f"{USR_EROFS}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        tmp = directory / f".{USR_EROFS}.{os.getpid()}"
        try:
            # Another sandboxd on this image store may be building it: wait for it rather than build twice.
            # Polled, not a blocking flock on a thread, so a cancel never leaves a thread waiting on this fd.
            while True:
                try:
                    fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(_LOCK_POLL_SECS)
            if (directory / USR_EROFS).exists():
                return
            for leftover in directory.glob(f".{USR_EROFS}.*"):  # a killed builder's: the lock is ours now
                leftover.unlink(missing_ok=True)
            found = await asyncio.to_thread(writable_entry, image_root / "usr")
            if found is not None:
                self._refused.add(image_root)
                log.info(
                    "image %s keeps its /usr on the host: %s is owned by a user other than root or writable by "
                    "group or others",
                    directory.name,
                    found,
                )
                return
            started = asyncio.get_running_loop().time()
            proc = await asyncio.create_subprocess_exec(
                self.mkfs, *MKFS_ARGS, str(tmp), str(image_root / "usr"),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            try:
                _, err = await proc.communicate()
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                raise
            if proc.returncode != 0:
                raise RuntimeError(
                    f"mkfs.erofs exited {proc.returncode}: {err.decode(errors='replace')[-400:]}"
                )
            await asyncio.to_thread(_durable_rename, tmp, directory / USR_EROFS)
            log.info(
                "EROFS /usr of image %s built in %.1f s (%d bytes)", directory.name,
                asyncio.get_running_loop().time() - started, (directory / USR_EROFS).stat().st_size,
            )  # fmt: skip
        finally:
            tmp.unlink(missing_ok=True)
            os.close(lock_fd)  # releases the flock


def _durable_rename(tmp: Path, final: Path) -> None:
    """Flush ``tmp`` and give it its final name, so the name only ever points at a whole image."""
    fd = os.open(tmp, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def main(argv: list[str] | None = None) -> int:
    """``python -m sbx.backends.usr_erofs IMAGE_ROOT...``: build each image root's EROFS /usr now (the install
    does it for the default image, so its first sandboxes get it too). Exit 1 when one could not have one."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("image_roots", nargs="+", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    async def build_all() -> int:
        images = UsrImages()
        if images.mkfs is None:
            log.error("mkfs.erofs is not installed (Debian: erofs-utils)")
            return 1
        missing = [root for root in args.image_roots if await images.wait(root.resolve()) is None]
        for root in missing:
            log.error("%s has no EROFS /usr (see above; it must be an image store's rootfs)", root)
        return 1 if missing else 0

    return asyncio.run(build_all())


if __name__ == "__main__":
    raise SystemExit(main())
