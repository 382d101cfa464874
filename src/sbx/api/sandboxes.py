"""Wire types of the sandbox resource (spec: Sandbox, Create request, PATCH, Snapshot progress)."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType

from sbx.api.network_policy import NetworkPolicy, NetworkRequest

SandboxState = Literal["pending", "running", "suspended", "stopped", "terminated"]


class VolumeMount(msgspec.Struct, frozen=True):
    """One mount of a create request: a volume name, an absolute guest path, read-only or not."""

    name: str
    path: str
    read_only: bool = False


class SnapshotProgress(msgspec.Struct):
    """The ``snapshotting`` field while a snapshot is taken: phase ``capture`` then ``store``; ``bytes`` read
    so far (may pass ``estimated_bytes``, present only where the backend has an estimate)."""

    started_at: str
    phase: Literal["capture", "store"]
    bytes: int
    scheduled: bool
    estimated_bytes: int | UnsetType = UNSET


class Sandbox(msgspec.Struct, kw_only=True):
    """The spec's Sandbox. ``env_names`` are names only (values are never returned). ``snapshotting`` is
    present only while a snapshot is being taken; ``terminated_at`` and ``terminated_reason`` (``request``,
    ``idle``, ``crashed``, ``lost``) only once terminated. Additions, present only for a sandbox created with
    ``secret_env``: ``secret_env_names`` (names only) and ``secret_env_lost``, true once a restart of the node
    dropped the values it held in memory (processes started since do not get them). ``persistent`` (an addition,
    capability ``persistent``, always present): suspended rather than terminated at its idle timeout, woken by the
    next request that needs it; ``stopped_reason`` (``request``, ``restore_failed``, ``crash``, ``suspend_failed``)
    only while it is ``stopped``."""

    id: str
    name: str | None
    state: SandboxState
    image: str
    cpus: int
    memory_mb: int
    disk_mb: int
    env_names: list[str]
    network: NetworkPolicy
    labels: dict[str, str]
    idle_timeout_secs: int
    snapshot_every_secs: int
    snapshot_keep: int
    created_at: str
    snapshotting: SnapshotProgress | UnsetType = UNSET
    terminated_at: str | UnsetType = UNSET
    terminated_reason: str | UnsetType = UNSET
    secret_env_names: list[str] | UnsetType = UNSET
    secret_env_lost: bool | UnsetType = UNSET
    persistent: bool = False
    stopped_reason: str | UnsetType = UNSET


class SandboxList(msgspec.Struct):
    """``GET /v1/sandboxes``: newest first, terminated ones included until forgotten."""

    sandboxes: list[Sandbox]


_BIND_REMOVED = (
    "field 'bind' is not supported: host directory mounts were removed from the API; "
    "use volumes to keep files across sandboxes and the files API to copy files in"
)


class CreateRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/sandboxes``: every field optional (UNSET: the server's default or nothing).

    ``secret_env`` (an addition, capability ``secret_env``): environment like ``env``, whose values the node holds
    in memory only, never on its disk, in its audit log or in an answer; a restart of the node loses them
    (docs/node-api.md, "Secret environment"). A name may not be in both. ``persistent`` (an addition, capability
    ``persistent``; default false): suspend at the idle timeout instead of terminating; needs a ``name``."""

    removed_fields: ClassVar[dict[str, str]] = {"bind": _BIND_REMOVED}

    name: str | UnsetType = UNSET
    image: str | UnsetType = UNSET
    cpus: int | UnsetType = UNSET
    memory_mb: int | UnsetType = UNSET
    disk_mb: int | UnsetType = UNSET
    env: dict[str, str] | UnsetType = UNSET
    network: NetworkRequest | UnsetType = UNSET
    labels: dict[str, str] | UnsetType = UNSET
    idle_timeout_secs: int | UnsetType = UNSET
    snapshot_every_secs: int | UnsetType = UNSET
    snapshot_keep: int | UnsetType = UNSET
    volumes: list[VolumeMount] | UnsetType = UNSET
    snapshot_id: str | UnsetType = UNSET
    secret_env: dict[str, str] | UnsetType = UNSET
    persistent: bool | UnsetType = UNSET


class PatchRequest(msgspec.Struct, kw_only=True):
    """``PATCH /v1/sandboxes/{ref}``: any of these; omitted ones stay as they are (``{}`` changes nothing).
    ``name`` ``""`` removes the name; ``labels`` replaces the whole set."""

    removed_fields: ClassVar[dict[str, str]] = {"bind": _BIND_REMOVED}

    network: NetworkRequest | UnsetType = UNSET
    name: str | UnsetType = UNSET
    labels: dict[str, str] | UnsetType = UNSET
    idle_timeout_secs: int | UnsetType = UNSET
