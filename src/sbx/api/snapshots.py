"""Wire types of snapshots and schedules (spec: Snapshot, Suspend, resume, snapshots)."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType

SnapshotKind = Literal["memory", "disk"]


class Snapshot(msgspec.Struct, kw_only=True):
    """The spec's Snapshot; ``bytes`` is the storage it takes; ``scheduled`` present (true) only when a
    schedule took it. Additions: ``cpus``, ``memory_mb`` and ``disk_mb`` of the sandbox it was taken from (a
    memory fork keeps them; a disk fork defaults to them)."""

    id: str
    sandbox: str
    image: str
    kind: SnapshotKind
    bytes: int
    created_at: str
    scheduled: bool | UnsetType = UNSET
    cpus: int | UnsetType = UNSET
    memory_mb: int | UnsetType = UNSET
    disk_mb: int | UnsetType = UNSET


class SnapshotList(msgspec.Struct):
    """``GET /v1/snapshots``."""

    snapshots: list[Snapshot]


class SnapshotRequest(msgspec.Struct):
    """``POST .../snapshots``: ``{kind?}``, ``memory`` (the default) or ``disk``; an empty body is ``{}``."""

    kind: str | UnsetType = UNSET


class ScheduleRequest(msgspec.Struct):
    """``PUT .../snapshot-schedule``: ``every_secs`` 0 stops the schedule; ``keep`` defaults to 1."""

    required_hints: ClassVar[dict[str, str]] = {
        "every_secs": "every_secs is required; give 0 to stop the schedule"
    }

    every_secs: int
    keep: int | UnsetType = UNSET
