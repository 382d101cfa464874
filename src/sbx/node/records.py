"""The sandbox record: what sandboxd knows of one sandbox, kept on disk and turned into the wire form."""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from msgspec import UNSET

from sbx.api.codec import convert_answer
from sbx.api.network_policy import NetworkPolicy
from sbx.api.sandboxes import Sandbox, SnapshotProgress, VolumeMount
from sbx.backends.base import BootSpec, VolumeBind


class SandboxState(str, Enum):
    """States of the spec's sandbox state machine that this node implements."""

    PENDING = "pending"
    RUNNING = "running"
    SUSPENDED = "suspended"
    #: A persistent sandbox's disk without its memory (POST .../stop, or a crash): started again on its next wake.
    STOPPED = "stopped"
    TERMINATED = "terminated"


def utc_now() -> str:
    """Now as an RFC 3339 UTC timestamp with milliseconds."""
    return iso_utc(time.time())


#: The last whole second :func:`iso_utc` formatted, and its text up to the seconds: a run writes three
#: timestamps, nearly always in the same second, and formatting one through ``datetime`` cost more than the
#: rest of the record.
_last_second: tuple[int, str] = (-1, "")


def iso_utc(unix_time: float) -> str:
    """A Unix time (seconds) as an RFC 3339 UTC timestamp with milliseconds (``2024-05-01T12:00:00.123Z``),
    exactly as ``datetime.fromtimestamp(unix_time, UTC).isoformat(timespec="milliseconds")`` writes it (rounded
    to the microsecond, half to even, then cut to the millisecond)."""
    global _last_second
    fraction, whole = math.modf(unix_time)
    second, micros = int(whole), round(fraction * 1e6)
    if micros >= 1_000_000:
        second, micros = second + 1, micros - 1_000_000
    elif micros < 0:
        second, micros = second - 1, micros + 1_000_000
    cached, text = _last_second
    if cached != second:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _last_second = (second, text)
    return f"{text}.{micros // 1000:03d}Z"


def new_sandbox_id(node_id: str | None) -> str:
    """``sbx_<16 hex>``, or ``sbx_<node>_<16 hex>`` on a node started with ``--node-id``."""
    suffix = secrets.token_hex(8)
    return f"sbx_{node_id}_{suffix}" if node_id else f"sbx_{suffix}"


@dataclass
class SandboxRecord:
    """One sandbox. ``env`` holds values and is never put on the wire or in a log; only its names are.
    ``secret_env`` holds values in memory only: never on disk either (see :meth:`to_disk`)."""

    id: str
    state: SandboxState
    image: str
    cpus: int
    memory_mb: int
    disk_mb: int
    network: NetworkPolicy
    idle_timeout_secs: int
    created_at: str
    name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    snapshot_every_secs: int = 0
    snapshot_keep: int = 0
    terminated_at: str | None = None
    terminated_reason: str | None = None
    #: Next process handle to give out; persisted so a restart never reuses one.
    next_pid: int = 1
    #: Volumes mounted at create (fixed for the sandbox's life; held until it is terminated).
    volumes: tuple[VolumeMount, ...] = ()
    #: The snapshot this sandbox was forked from, None for a sandbox booted from its image.
    snapshot_id: str | None = None
    #: The runsc (its version) that booted or last restored the sandbox: its sentry runs it, checkpoints it, and
    #: made its checkpoint while it is suspended; only that runsc restores the checkpoint (sbx.node.runtimes).
    #: None: a backend without runsc, or a record from before versions were recorded (stamped at start).
    runsc_version: str | None = None
    #: The spec's Snapshot progress while a snapshot is being taken; in memory only (never on disk).
    snapshotting: SnapshotProgress | None = field(default=None, compare=False)
    #: Names of the environment given as ``secret_env`` at create (on disk: names only).
    secret_env_names: list[str] = field(default_factory=list)
    #: Their values, in memory only: never on disk, on the wire or in a log. A restart of sandboxd reads the
    #: record back without them (``secret_env_lost``); processes started since do not get them.
    secret_env: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    #: Suspended, not terminated, at its idle timeout; woken by the next request that needs its guest (and it has
    #: a name). Fixed at create.
    persistent: bool = False
    #: Why a persistent sandbox is stopped (``request``, ``restore_failed``, ``crash``, ``suspend_failed``); None
    #: in every other state.
    stopped_reason: str | None = None

    @property
    def dormant(self) -> bool:
        """A persistent sandbox that sleeps (suspended or stopped): it holds its disk, not its cpus and memory,
        and the next request that needs its guest wakes it."""
        return self.persistent and self.state in (SandboxState.SUSPENDED, SandboxState.STOPPED)

    @property
    def secret_env_lost(self) -> bool:
        """A live sandbox given secret environment that this sandboxd does not hold (it restarted since).
        (A terminated sandbox holds none: no process starts in it again.)"""
        return self.live and bool(self.secret_env_names) and not self.secret_env

    @property
    def live(self) -> bool:
        """Not terminated: holds its name and counts against capacity."""
        return self.state is not SandboxState.TERMINATED

    def boot_spec(self, image_root: Path, volumes: tuple[VolumeBind, ...] = ()) -> BootSpec:
        """What the backend needs to boot this sandbox on ``image_root`` with ``volumes`` bound in."""
        return BootSpec(
            sandbox_id=self.id, image_root=image_root, cpus=self.cpus, memory_mb=self.memory_mb,
            disk_mb=self.disk_mb, network=self.network, volumes=volumes, durable_disk=self.persistent,
        )  # fmt: skip

    def wire(self) -> Sandbox:
        """The spec's Sandbox (env names only, never values)."""
        return Sandbox(
            id=self.id, name=self.name, state=self.state.value, image=self.image, cpus=self.cpus,
            memory_mb=self.memory_mb, disk_mb=self.disk_mb, env_names=sorted(self.env), network=self.network,
            labels=dict(self.labels), idle_timeout_secs=self.idle_timeout_secs,
            snapshot_every_secs=self.snapshot_every_secs, snapshot_keep=self.snapshot_keep,
            created_at=self.created_at,
            snapshotting=self.snapshotting if self.snapshotting is not None else UNSET,
            terminated_at=self.terminated_at if self.terminated_at is not None else UNSET,
            terminated_reason=self.terminated_reason if self.terminated_reason is not None else UNSET,
            secret_env_names=list(self.secret_env_names) if self.secret_env_names else UNSET,
            secret_env_lost=self.secret_env_lost if self.secret_env_names else UNSET,
            persistent=self.persistent,
            stopped_reason=(
                self.stopped_reason or "request" if self.state is SandboxState.STOPPED else UNSET
            ),
        )  # fmt: skip

    def to_disk(self) -> dict[str, Any]:
        """The on-disk form: env values included (the state dir is root-only), secret env values never."""
        data = asdict(self)
        del data["snapshotting"], data["secret_env"]
        data["state"] = self.state.value
        data["network"] = self.network.to_wire()
        data["volumes"] = [{"name": m.name, "path": m.path, "read_only": m.read_only} for m in self.volumes]
        return data

    @classmethod
    def from_disk(cls, data: dict[str, Any]) -> SandboxRecord:
        """Inverse of ``to_disk``."""
        data = dict(data)
        data["network"] = NetworkPolicy.from_wire(data["network"])
        data["state"] = SandboxState(data["state"])
        data["volumes"] = tuple(
            convert_answer(m, VolumeMount, "volume mount") for m in data.get("volumes") or ()
        )
        return cls(**data)
