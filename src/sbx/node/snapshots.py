"""Snapshots kept on this node: their records and files, and how a finished one is stored.

Layout under ``<state>/snapshots/``::

    <id>/snapshot.json     the record, written last: a directory without it is not a snapshot
    <id>/disk.img          the sandbox's writable layer (an ext4 image, sparse)
    <id>/memory/           memory snapshots only: the backend's checkpoint (memory and processes)
    <id>/processes/        memory snapshots only: the host's process records and output logs
    .staging-<id>/         a snapshot being taken; removed at start (an unfinished one leaves nothing)

Storing (:meth:`SnapshotStore.commit`) fsyncs every file, then writes the record and renames the directory
into place, so a snapshot that was listed survives a restart and a host crash whole.
"""

from __future__ import annotations

import os
import secrets
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from msgspec import UNSET

from sbx.api.errors import NotFound
from sbx.api.snapshots import Snapshot, SnapshotKind
from sbx.statefile import fsync_dir, read_json, write_json_atomic

RECORD_NAME = "snapshot.json"
STAGING_PREFIX = ".staging-"


def new_snapshot_id(node_id: str | None) -> str:
    """``snap_<16 hex>``, or ``snap_<node>_<16 hex>`` on a node started with ``--node-id``."""
    suffix = secrets.token_hex(8)
    return f"snap_{node_id}_{suffix}" if node_id else f"snap_{suffix}"


@dataclass
class SnapshotRecord:
    """One snapshot. ``bytes`` is the storage it takes (allocated blocks). ``cpus``, ``memory_mb``,
    ``disk_mb`` and ``network`` (wire form) are the original sandbox's, for forks; ``next_pid`` is the
    original's next process handle (a memory fork goes on from it). ``runsc_version``: the runsc whose sentry
    ran the original when it was taken, the one that made a memory snapshot's checkpoint and the only one
    that restores it (a disk snapshot boots on any); None on a backend without runsc, or from before versions
    were recorded (stamped at start, sbx.node.runtimes)."""

    id: str
    sandbox: str
    image: str
    kind: SnapshotKind
    bytes: int
    created_at: str
    cpus: int
    memory_mb: int
    disk_mb: int
    network: dict[str, Any]
    scheduled: bool = False
    next_pid: int = 1
    runsc_version: str | None = None

    def wire(self) -> Snapshot:
        """The spec's Snapshot object: ``scheduled`` appears only when true; the original's resources too."""
        return Snapshot(
            id=self.id, sandbox=self.sandbox, image=self.image, kind=self.kind, bytes=self.bytes,
            created_at=self.created_at, scheduled=True if self.scheduled else UNSET, cpus=self.cpus,
            memory_mb=self.memory_mb, disk_mb=self.disk_mb,
        )  # fmt: skip


class SnapshotStore:
    """Every finished snapshot of this node, on disk under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._records: dict[str, SnapshotRecord] = {}

    def load(self) -> None:
        """Read the snapshots on disk; remove the staging directories of snapshots a stop interrupted."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for entry in self.root.iterdir():
            if entry.name.startswith(STAGING_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)
                continue
            data = read_json(entry / RECORD_NAME)
            if isinstance(data, dict):
                self._records[entry.name] = SnapshotRecord(**data)
            elif entry.is_dir():
                # A removal cut short (the record goes first): finish it.
                shutil.rmtree(entry, ignore_errors=True)

    def staging(self, snapshot_id: str) -> Path:
        """A fresh directory to take the snapshot ``snapshot_id`` into."""
        path = self.root / f"{STAGING_PREFIX}{snapshot_id}"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=0o700)
        return path

    def commit(self, staging: Path, record: SnapshotRecord) -> None:
        """Make the snapshot taken into ``staging`` durable and listed (slow: fsyncs every file)."""
        for dirpath, _dirs, files in os.walk(staging):
            for name in files:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            fsync_dir(Path(dirpath))
        write_json_atomic(staging / RECORD_NAME, asdict(record), durable=True)
        final = self.root / record.id
        os.rename(staging, final)
        fsync_dir(self.root)
        self._records[record.id] = record

    def set_runsc_version(self, snapshot_id: str, version: str | None) -> None:
        """Record which runsc made the snapshot (its record rewritten atomically and durably)."""
        record = replace(self.get(snapshot_id), runsc_version=version)
        write_json_atomic(self.root / snapshot_id / RECORD_NAME, asdict(record), durable=True)
        self._records[snapshot_id] = record

    def get(self, snapshot_id: str) -> SnapshotRecord:
        """The snapshot ``snapshot_id``; NotFound otherwise."""
        record = self._records.get(snapshot_id)
        if record is None:
            raise NotFound(f"no snapshot {snapshot_id!r} on this node; list them with GET /v1/snapshots")
        return record

    def records(self) -> list[SnapshotRecord]:
        """Every snapshot, newest first."""
        return sorted(self._records.values(), key=lambda r: r.created_at, reverse=True)

    def of_sandbox(self, sandbox_id: str) -> list[SnapshotRecord]:
        """The snapshots of one sandbox, oldest first."""
        return sorted(
            (r for r in self._records.values() if r.sandbox == sandbox_id), key=lambda r: r.created_at
        )

    def remove(self, snapshot_id: str) -> SnapshotRecord:
        """Delete a snapshot and its files; NotFound when there is none. The record goes first, so a crash
        midway leaves a directory that the next start removes."""
        record = self.get(snapshot_id)
        directory = self.root / snapshot_id
        (directory / RECORD_NAME).unlink(missing_ok=True)
        del self._records[snapshot_id]
        shutil.rmtree(directory, ignore_errors=True)
        return record

    def disk_image(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id / "disk.img"

    def memory_image(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id / "memory"

    def processes_dir(self, snapshot_id: str) -> Path:
        return self.root / snapshot_id / "processes"
