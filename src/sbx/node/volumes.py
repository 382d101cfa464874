"""Volumes: named ext4 file systems of a fixed size that outlive sandboxes and sandboxd restarts.

State on disk, under ``<state>/volumes/<name>/``: ``volume.json``, the record {name, size_mb, created_at},
written last on create (atomically, fsynced), beside the backend's storage of the volume (its
:class:`~sbx.backends.base.VolumeDisks`; gVisor's is an ext4 image loop-mounted on the host, loop_volumes.py).

A volume is attached by the backend's storage when the first sandbox takes it and detached (flushed) when the
last one has stopped; the backend shows it in each sandbox, read-only where asked.

Two kinds of bookkeeping, both in memory and rebuilt from the sandbox records on restart:

- *holders*: the live sandboxes that mount the volume, each reader or writer. Mount rule 1 is checked against
  them: one writer, or any number of readers. A sandbox stops holding when it is terminated (a suspended one
  still holds).
- *users*: the sandboxes whose backend may still touch the host mount: the holders plus terminated sandboxes
  whose teardown has not finished. The host mount goes only when the last user goes, so it is never
  unmounted under a sandbox that is still stopping, and never mounted twice.

A volume whose sandboxes keep running across a sandboxd restart stays attached; a restart takes the holders back
from the sandbox records and detaches volumes nobody uses any more.
"""

from __future__ import annotations

import asyncio
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
from sbx.backends.base import BackendError, VolumeBind, VolumeDisks
from sbx.node.records import utc_now
from sbx.statefile import fsync_dir, read_json, remove_stale_tmp_files, write_json_atomic

log = logging.getLogger(__name__)

RECORD_NAME = "volume.json"
#: How long a volume DELETE waits for the teardowns of terminated sandboxes that used it, in seconds.
DELETE_WAIT_SECS = 30.0


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


class VolumeStore:
    """Every volume of the node, their attachments and who holds them, over the backend's ``disks``. Runs
    on the server's event loop."""

    def __init__(self, directory: Path, disks: VolumeDisks) -> None:
        self.directory = directory
        self.disks = disks
        self._records: dict[str, VolumeRecord] = {}
        #: name -> {sandbox id: read_only} of live sandboxes (mount rule 1).
        self._holders: dict[str, dict[str, bool]] = {}
        #: name -> sandbox ids whose backend may still use the volume (holders and those stopping).
        self._users: dict[str, set[str]] = {}
        #: names being created or deleted: not listed, not mountable.
        self._busy: set[str] = set()
        #: One lock per volume around attach and detach.
        self._locks: dict[str, asyncio.Lock] = {}
        #: Set whenever a user goes, so a waiting DELETE looks again.
        self._released = asyncio.Event()

    # -- paths ------------------------------------------------------------------------------------------

    def _dir(self, name: str) -> Path:
        return self.directory / name

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    # -- start ------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the records; remove what an interrupted create or delete left (detached first)."""
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
            if self.disks.is_attached(entry):
                await self.disks.detach(entry)
            shutil.rmtree(entry, ignore_errors=True)
            log.info("unfinished volume removed", extra={"volume": entry.name})

    async def settle(self) -> None:
        """After a restart has taken back its sandboxes: detach volumes that no sandbox uses any more, and
        attach those that live sandboxes hold but the host lost (after a reboot a suspended sandbox resumes
        with its volumes bound from the attached volume, never from an empty directory)."""
        for name in sorted(self._records):
            directory = self._dir(name)
            async with self._lock(name):
                attached = self.disks.is_attached(directory)
                if not self._users.get(name) and attached:
                    await self.disks.detach(directory)
                elif self._holders.get(name) and not attached:
                    try:
                        await self.disks.attach(directory)
                    except BackendError as exc:  # the holder's resume then fails; create retries the attach
                        log.error(
                            "volume could not be attached again", extra={"volume": name, "error": str(exc)}
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
                await self.disks.create(directory, size_mb)
                record = VolumeRecord(name=name, size_mb=size_mb, created_at=utc_now())
                write_json_atomic(directory / RECORD_NAME, record.to_disk())
                fsync_dir(self.directory)
            except BaseException:
                if self.disks.is_attached(directory):
                    await self.disks.detach(directory)
                shutil.rmtree(directory, ignore_errors=True)
                raise
        except (BackendError, OSError) as exc:
            raise Internal(f"volume {name!r} could not be created: {exc}") from exc
        finally:
            self._busy.discard(name)
        self._records[name] = record
        log.info("volume created", extra={"volume": name, "size_mb": size_mb})
        return self.wire(record)

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
                await self.disks.detach(directory)
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
        """Make sure every volume of a holder is attached; the backend's binds, in order."""
        binds = []
        for mount in mounts:
            async with self._lock(mount.name):
                source = await self.disks.attach(self._dir(mount.name))
            binds.append(VolumeBind(source=source, path=mount.path, read_only=mount.read_only))
        return tuple(binds)

    async def flush_of(self, sandbox_id: str) -> None:
        """Write what ``sandbox_id`` wrote to its volumes to their storage (it stopped, and keeps them)."""
        for name in self.holders_of(sandbox_id):
            directory = self._dir(name)
            async with self._lock(name):
                if self.disks.is_attached(directory):
                    await self.disks.flush(directory)

    def drop_holder(self, sandbox_id: str) -> None:
        """The sandbox is terminated: it no longer holds its volumes (it stays a user until ``release``)."""
        for holders in self._holders.values():
            holders.pop(sandbox_id, None)

    async def release(self, sandbox_id: str) -> None:
        """The sandbox's backend is gone (torn down, or never booted): flush its volumes, and detach those
        no one else uses. Idempotent."""
        names = [name for name, users in self._users.items() if sandbox_id in users]
        self.drop_holder(sandbox_id)
        for name in names:
            directory = self._dir(name)
            async with self._lock(name):
                users = self._users.get(name, set())
                users.discard(sandbox_id)
                if not self.disks.is_attached(directory):
                    continue
                if users:
                    await self.disks.flush(directory)  # mount rule 4: flushed when a sandbox stops
                    continue
                try:
                    await self.disks.detach(directory)
                except BackendError as exc:  # left attached: settle() at the next start tries again
                    log.error("volume detach failed", extra={"volume": name, "error": str(exc)})
        if names:
            self._released.set()

    def holders_of(self, sandbox_id: str) -> list[str]:
        """Names of the volumes ``sandbox_id`` holds."""
        return sorted(name for name, holders in self._holders.items() if sandbox_id in holders)
