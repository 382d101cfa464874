"""Volumes: named ext4 file systems of a fixed size that outlive sandboxes and sandboxd restarts.

State on disk, under ``<state>/volumes/<name>/``::

    volume.json   the record {name, size_mb, created_at}, written last on create (atomically, fsynced)
    disk.img      sparse file of exactly size_mb MiB holding an ext4 file system (with a journal)
    mnt/          its loop mount point on the host while any sandbox uses the volume

A volume is loop-mounted on the host when the first sandbox takes it and unmounted (after a syncfs) when the
last one has stopped; the backend bind-mounts ``mnt/`` into each sandbox, read-only where asked. Because the
size is that of the file system, a write past ``size_mb`` fails with ENOSPC inside the sandbox and never fills
the host disk beyond it.

Two kinds of bookkeeping, both in memory and rebuilt from the sandbox records on restart:

- *holders*: the live sandboxes that mount the volume, each reader or writer. Mount rule 1 is checked against
  them: one writer, or any number of readers. A sandbox stops holding when it is terminated (a suspended one
  still holds).
- *users*: the sandboxes whose backend may still touch the host mount: the holders plus terminated sandboxes
  whose teardown has not finished. The host mount goes only when the last user goes, so it is never
  unmounted under a sandbox that is still stopping, and never mounted twice.

A volume whose sandboxes keep running across a sandboxd restart stays mounted; a restart takes the holders back
from the sandbox records and unmounts volumes nobody uses any more.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sbx.api.errors import Conflict, Internal, InvalidRequest, NotFound
from sbx.api.sandboxes import VolumeMount
from sbx.api.volumes import Volume
from sbx.backends.base import BackendError, VolumeBind
from sbx.backends.layers import SANDBOX_GID, SANDBOX_UID, is_mounted, make_ext4_image, mount_loop, run_tool
from sbx.node.records import utc_now
from sbx.statefile import fsync_dir, read_json, remove_stale_tmp_files, write_json_atomic

log = logging.getLogger(__name__)

RECORD_NAME = "volume.json"
#: How long an unmount waits for a stopping sandbox's file server to let go, in seconds, before detaching.
UNMOUNT_WAIT_SECS = 5.0
#: How long a volume DELETE waits for the teardowns of terminated sandboxes that used it, in seconds.
DELETE_WAIT_SECS = 30.0

_libc = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class VolumeRecord:
    """One volume as kept on disk: ``size_mb`` in MiB, ``created_at`` an RFC 3339 timestamp."""

    name: str
    size_mb: int
    created_at: str

    def to_disk(self) -> dict[str, Any]:
        return {"name": self.name, "size_mb": self.size_mb, "created_at": self.created_at}

    @classmethod
    def from_disk(cls, data: dict[str, Any]) -> VolumeRecord:
        return cls(name=str(data["name"]), size_mb=int(data["size_mb"]), created_at=str(data["created_at"]))


def holder_conflict(name: str, holders: dict[str, bool], sandbox_id: str, read_only: bool) -> str | None:
    """Why ``sandbox_id`` may not mount volume ``name`` (read-only or not) beside ``holders`` (sandbox id to
    read_only), by mount rule 1; None when it may. The message names a holder and says what to do."""
    others = {sid: ro for sid, ro in holders.items() if sid != sandbox_id}
    if not others:
        return None
    writer = next((sid for sid, ro in others.items() if not ro), None)
    if writer is not None:
        return (
            f"volume {name!r} is mounted writable by sandbox {writer}; a volume has one writer or any number "
            "of readers: delete that sandbox first"
        )
    if not read_only:
        readers = sorted(others)
        return (
            f"volume {name!r} is mounted read-only by {len(readers)} sandbox(es) ({', '.join(readers[:3])}"
            f"{', ...' if len(readers) > 3 else ''}); a writable mount needs it to be held by no other sandbox: "
            "mount it read_only or delete those sandboxes first"
        )
    return None


def _first_holder(holders: dict[str, bool]) -> str | None:
    """The holder a volume is shown and refused under: the writer if there is one, else the first reader by
    sandbox id; None when nobody holds it."""
    writer = next((sid for sid, ro in holders.items() if not ro), None)
    return writer if writer is not None else min(holders, default=None)


def check_mount_points(image_root: Path, mounts: Sequence[VolumeMount]) -> None:
    """Refuse (400) a mount path that the image makes a file or a symlink on the way.

    A mount over a file cannot be made, and one through a symlink would land somewhere other than the path
    the rules were checked on (``/var/run`` is a link to ``/run`` in many images). Missing directories are
    fine: the backend creates them. ``lstat`` only: a link in an image must never lead the host outside it.
    """
    for i, mount in enumerate(mounts):
        current = image_root
        for part in mount.path.strip("/").split("/"):
            current = current / part
            try:
                st = os.lstat(current)
            except OSError:  # missing: the backend makes it (and everything below)
                break
            if stat.S_ISLNK(st.st_mode):
                raise InvalidRequest(
                    f"volumes[{i}].path: {mount.path!r} passes through a symbolic link in the image "
                    f"(/{current.relative_to(image_root)}); give the path it points to"
                )
            if not stat.S_ISDIR(st.st_mode):
                raise InvalidRequest(
                    f"volumes[{i}].path: /{current.relative_to(image_root)} is a file in the image, not a "
                    "directory; choose another mount path"
                )


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


def _loop_devices_of(image_file: Path) -> list[str]:
    """Loop devices whose backing file is ``image_file`` (one may outlive a lazy unmount while busy)."""
    target = os.path.realpath(image_file)
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text(encoding="utf-8").strip() == target:
                found.append(backing.parent.parent.name)
        except OSError:
            continue
    return found


class VolumeStore:
    """Every volume of the node, their host mounts and who holds them. Runs on the server's event loop."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._records: dict[str, VolumeRecord] = {}
        #: name -> {sandbox id: read_only} of live sandboxes (mount rule 1).
        self._holders: dict[str, dict[str, bool]] = {}
        #: name -> sandbox ids whose backend may still use the host mount (holders and those stopping).
        self._users: dict[str, set[str]] = {}
        #: names being created or deleted: not listed, not mountable.
        self._busy: set[str] = set()
        #: One lock per volume around mount and unmount.
        self._locks: dict[str, asyncio.Lock] = {}
        #: Set whenever a user goes, so a waiting DELETE looks again.
        self._released = asyncio.Event()

    # -- paths ------------------------------------------------------------------------------------------

    def _dir(self, name: str) -> Path:
        return self.directory / name

    def mount_point(self, name: str) -> Path:
        """The host directory the volume is mounted on while used (the backend's bind source)."""
        return self._dir(name) / "mnt"

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    # -- start ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the records; remove what an interrupted create or delete left (never a mounted volume)."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        for entry in sorted(self.directory.iterdir()):
            if not entry.is_dir():
                continue
            remove_stale_tmp_files(entry)
            data = read_json(entry / RECORD_NAME)
            if isinstance(data, dict):
                try:
                    record = VolumeRecord.from_disk(data)
                except (KeyError, TypeError, ValueError) as exc:
                    log.error("volume record unreadable; left alone",
                              extra={"volume": entry.name, "error": str(exc)})  # fmt: skip
                    continue
                self._records[record.name] = record
                continue
            # No record: a create that never finished or a delete that did not. Its contents were never
            # promised to anyone (create answers after the record is written).
            if (entry / "mnt").exists() and is_mounted(entry / "mnt"):
                await self._unmount(entry.name, entry / "mnt")
            shutil.rmtree(entry, ignore_errors=True)
            log.info("unfinished volume removed", extra={"volume": entry.name})

    async def settle(self) -> None:
        """After a restart has taken back its sandboxes: unmount volumes that no sandbox uses any more, and
        mount those that live sandboxes hold but the host lost (after a reboot a suspended sandbox resumes
        with its volumes bound from the host's mount, never from an empty directory)."""
        for name in sorted(self._records):
            mnt = self.mount_point(name)
            async with self._lock(name):
                mounted = is_mounted(mnt)
                if not self._users.get(name) and mounted:
                    await self._unmount(name, mnt)
                elif self._holders.get(name) and not mounted:
                    try:
                        await self._mount(name, mnt)
                    except BackendError as exc:  # the holder's resume then fails; create retries the mount
                        log.error(
                            "volume could not be mounted again", extra={"volume": name, "error": str(exc)}
                        )

    # -- the API ----------------------------------------------------------------------------------------

    def listing(self) -> list[Volume]:
        """Every volume in wire form, by name."""
        return [self.wire(r) for name, r in sorted(self._records.items()) if name not in self._busy]

    def wire(self, record: VolumeRecord) -> Volume:
        """The spec's Volume: ``attached_to`` names one holder, the writer if there is one, else the first
        reader by sandbox id; null when no live sandbox holds it."""
        holder = _first_holder(self._holders.get(record.name) or {})
        return Volume(record.name, record.size_mb, record.created_at, holder)

    async def create(self, name: str, size_mb: int) -> Volume:
        """Make an empty volume of ``size_mb`` MiB; 409 when the name exists. Nothing is left on failure."""
        if name in self._records or name in self._busy:
            raise Conflict(f"a volume named {name!r} exists; pick another name or delete that volume first")
        self._busy.add(name)
        directory = self._dir(name)
        try:
            if directory.exists():  # a leftover start() could not remove, or one with an unreadable record
                raise Conflict(
                    f"volume {name!r} has leftover state on this node (see the sandboxd log); "
                    "pick another name or ask the operator to remove it"
                )
            directory.mkdir(mode=0o700)
            try:
                await self._format(directory, size_mb)
                record = VolumeRecord(name=name, size_mb=size_mb, created_at=utc_now())
                write_json_atomic(directory / RECORD_NAME, record.to_disk())
                fsync_dir(self.directory)
            except BaseException:
                if is_mounted(directory / "mnt"):
                    await self._unmount(name, directory / "mnt")
                shutil.rmtree(directory, ignore_errors=True)
                raise
        except (BackendError, OSError) as exc:
            raise Internal(f"volume {name!r} could not be created: {exc}") from exc
        finally:
            self._busy.discard(name)
        self._records[name] = record
        log.info("volume created", extra={"volume": name, "size_mb": size_mb})
        return self.wire(record)

    async def _format(self, directory: Path, size_mb: int) -> None:
        """The ext4 image with an empty root the sandbox user owns (lost+found removed: a new volume is
        empty; e2fsck makes it again when it needs one)."""
        image = directory / "disk.img"
        mnt = directory / "mnt"
        mnt.mkdir()
        # A journal: a volume's contents must come back whole after a host crash.
        await make_ext4_image(image, size_mb, journal=True)
        await mount_loop(image, mnt)
        try:
            shutil.rmtree(mnt / "lost+found", ignore_errors=True)
            os.chown(mnt, SANDBOX_UID, SANDBOX_GID)
            os.chmod(mnt, 0o755)
        finally:
            await run_tool("umount", str(mnt))  # nothing else has seen it: never busy
        # The record written next is durable; the file system it names must be too.
        fd = os.open(image, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def delete(self, name: str) -> None:
        """Delete the volume with its contents; 404 when there is none, 409 while a live sandbox holds it.

        Terminated sandboxes still stopping are waited for (up to ``DELETE_WAIT_SECS``), so a DELETE right
        after the sandbox's DELETE succeeds.
        """
        record = self._records.get(name)
        if record is None or name in self._busy:
            raise NotFound(f"no volume {name!r} on this node")
        self._refuse_if_held(name)
        self._busy.add(name)
        try:
            deadline = asyncio.get_running_loop().time() + DELETE_WAIT_SECS
            while self._users.get(name):
                self._released.clear()
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise Conflict(
                        f"volume {name!r} is still used by stopping sandbox(es) "
                        f"{', '.join(sorted(self._users[name]))}; retry in a moment"
                    )
                try:
                    await asyncio.wait_for(self._released.wait(), left)
                except TimeoutError:
                    pass
            async with self._lock(name):
                directory = self._dir(name)
                if is_mounted(directory / "mnt"):
                    await self._unmount(name, directory / "mnt")
                # The record goes first: a crash mid-delete leaves a directory start() removes, never a
                # listed volume with half its contents.
                (directory / RECORD_NAME).unlink(missing_ok=True)
                fsync_dir(directory)
                del self._records[name]
                await asyncio.to_thread(shutil.rmtree, directory, True)
        finally:
            self._busy.discard(name)
        self._locks.pop(name, None)
        log.info("volume deleted", extra={"volume": name})

    def _refuse_if_held(self, name: str) -> None:
        holders = self._holders.get(name) or {}
        holder = _first_holder(holders)
        if holder is not None:
            raise Conflict(
                f"volume {name!r} is mounted by sandbox {holder}"
                f"{f' and {len(holders) - 1} other(s)' if len(holders) > 1 else ''}; "
                "delete the sandboxes that mount it first"
            )

    # -- holders ----------------------------------------------------------------------------------------

    def check(self, sandbox_id: str, mounts: Sequence[VolumeMount]) -> None:
        """Refuse what ``hold`` would: a volume that does not exist (404) or mount rule 1 (409)."""
        for i, mount in enumerate(mounts):
            if mount.name not in self._records or mount.name in self._busy:
                raise NotFound(
                    f"volumes[{i}].name: no volume {mount.name!r} on this node; create it with "
                    "POST /v1/volumes first"
                )
            why = holder_conflict(
                mount.name, self._holders.get(mount.name) or {}, sandbox_id, mount.read_only
            )
            if why is not None:
                raise Conflict(why)

    def hold(self, sandbox_id: str, mounts: Sequence[VolumeMount]) -> None:
        """Make ``sandbox_id`` a holder and user of every mount, or raise (404, 409) and change nothing.

        Synchronous, so no other request can slip in between the check and the bookkeeping.
        """
        self.check(sandbox_id, mounts)
        for mount in mounts:
            self._holders.setdefault(mount.name, {})[sandbox_id] = mount.read_only
            self._users.setdefault(mount.name, set()).add(sandbox_id)

    def take_back(self, sandbox_id: str, mounts: Sequence[VolumeMount], live: bool) -> None:
        """After a restart: note a sandbox found in a record as a user (and a holder when ``live``), without
        checking rule 1 again (it held when it was created). A volume deleted meanwhile is skipped."""
        for mount in mounts:
            if mount.name not in self._records:
                log.warning("a sandbox's volume no longer exists",
                            extra={"sandbox": sandbox_id, "volume": mount.name})  # fmt: skip
                continue
            if live:
                self._holders.setdefault(mount.name, {})[sandbox_id] = mount.read_only
            self._users.setdefault(mount.name, set()).add(sandbox_id)

    async def mount(self, sandbox_id: str, mounts: Sequence[VolumeMount]) -> tuple[VolumeBind, ...]:
        """Make sure every volume of a holder is mounted on the host; the backend's binds, in order."""
        binds = []
        for mount in mounts:
            mnt = self.mount_point(mount.name)
            async with self._lock(mount.name):
                if not is_mounted(mnt):
                    await self._mount(mount.name, mnt)
            binds.append(VolumeBind(source=mnt, path=mount.path, read_only=mount.read_only))
        return tuple(binds)

    async def _mount(self, name: str, mnt: Path) -> None:
        image = self._dir(name) / "disk.img"
        # Never two loop mounts of one ext4 image: that corrupts it. One left by a lazy unmount while a
        # stopped sandbox's file server still held it goes away when that server exits.
        for _ in range(int(UNMOUNT_WAIT_SECS / 0.1)):
            if not _loop_devices_of(image):
                break
            await asyncio.sleep(0.1)
        else:
            raise BackendError(f"volume {name!r} is still attached from an earlier mount; retry in a moment")
        mnt.mkdir(exist_ok=True)
        await mount_loop(image, mnt)
        log.info("volume mounted", extra={"volume": name})

    def drop_holder(self, sandbox_id: str) -> None:
        """The sandbox is terminated: it no longer holds its volumes (it stays a user until ``release``)."""
        for holders in self._holders.values():
            holders.pop(sandbox_id, None)

    async def release(self, sandbox_id: str) -> None:
        """The sandbox's backend is gone (torn down, or never booted): flush its volumes, and unmount those
        no one else uses. Idempotent."""
        names = [name for name, users in self._users.items() if sandbox_id in users]
        self.drop_holder(sandbox_id)
        for name in names:
            mnt = self.mount_point(name)
            async with self._lock(name):
                users = self._users.get(name, set())
                users.discard(sandbox_id)
                if not is_mounted(mnt):
                    continue
                if users:
                    await asyncio.to_thread(_syncfs, mnt)  # mount rule 4: flushed when a sandbox stops
                    continue
                try:
                    await self._unmount(name, mnt)
                except BackendError as exc:  # left mounted: settle() at the next start tries again
                    log.error("volume unmount failed", extra={"volume": name, "error": str(exc)})
        if names:
            self._released.set()

    def holders_of(self, sandbox_id: str) -> list[str]:
        """Names of the volumes ``sandbox_id`` holds."""
        return sorted(name for name, holders in self._holders.items() if sandbox_id in holders)

    async def _unmount(self, name: str, mnt: Path) -> None:
        """Flush and unmount; a file server still exiting gets ``UNMOUNT_WAIT_SECS``, then it is detached
        (the loop device goes when it lets go, and ``_mount`` waits for that)."""
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
                    log.warning("volume busy; detaching it", extra={"volume": name, "error": str(exc)})
                    await run_tool("umount", "-l", str(mnt))
                    break
                await asyncio.sleep(0.1)
        log.info("volume unmounted", extra={"volume": name})
