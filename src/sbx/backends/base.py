"""The backend interface: what sandboxd needs from whatever isolates a sandbox (gVisor now, QEMU later).

A backend boots a sandbox from a read-only image root plus a private writable layer, with an agent inside
listening on a channel the host can connect to (see docs/agent-protocol.md). Everything that runs inside the
sandbox goes through that agent; the backend only boots, finds and destroys sandboxes, hands out agent
connections (:meth:`Backend.connect_agent`), stores volumes (:class:`VolumeDisks`) and says who processes run
as (:class:`GuestUser`). sandboxd picks one by ``[backend] kind`` (sbx.node.backend_kinds); nothing outside
``backends/`` knows which.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from sbx.agent.client import AgentClient
from sbx.api.network_policy import NetworkPolicy
from sbx.api.node import Runtime


@dataclass(frozen=True)
class GuestUser:
    """Who processes and file transfers run as inside the backend's sandboxes: ``uid`` and ``gid``, the user
    ``name`` (USER, LOGNAME) and ``home``, an absolute guest path, the default working directory and HOME.
    ``read_only_trees``: guest directories the backend may mount read-only because nothing in them is this
    user's to write (gVisor's EROFS /usr), where a write is refused as a permission the user lacks."""

    uid: int
    gid: int
    name: str
    home: str
    read_only_trees: tuple[str, ...] = ()

    def in_read_only_tree(self, path: str) -> bool:
        """Whether the normalised guest ``path`` is in one of :attr:`read_only_trees`."""
        return any(path == top or path.startswith(top + "/") for top in self.read_only_trees)


@dataclass(frozen=True)
class VolumeBind:
    """A volume to show inside a sandbox: what :meth:`VolumeDisks.attach` gave for it (``source``), the
    absolute guest ``path`` (checked by the mount rules), and whether the sandbox may only read it (enforced
    by the backend for every guest user, root included: writes fail with EROFS)."""

    source: Path
    path: str
    read_only: bool


@dataclass(frozen=True)
class BootSpec:
    """What a backend needs to boot one sandbox.

    ``cpus`` is a count of vCPUs (whole cores of CPU time), ``memory_mb`` and ``disk_mb`` are MiB;
    ``disk_mb`` bounds the sandbox's writable layer. ``volumes``: bind mounts of volumes, none by default.
    ``durable_disk``: the disk must come back whole after a host crash (a persistent sandbox's: journaled, never
    one made ahead of time without a journal).
    """

    sandbox_id: str
    image_root: Path
    cpus: int
    memory_mb: int
    disk_mb: int
    network: NetworkPolicy
    hostname: str = "sandbox"
    volumes: tuple[VolumeBind, ...] = ()
    durable_disk: bool = False


@dataclass(frozen=True)
class BackendUsage:
    """Host-side counters of one sandbox, measured without asking the guest. Byte and time counts are totals
    since the sandbox booted; a total may go back when one of the sandbox's host processes exits (readers that
    need monotonic totals keep them).

    ``cpu_ns``: CPU time of all its host processes, nanoseconds. ``memory_bytes``: resident memory of its VMM
    processes, guest memory included. ``memory_limit_bytes``: the limit enforced on it, 0 when none is known.
    ``net_rx_bytes``/``net_tx_bytes``: received/sent by the sandbox, 0 without a network interface.
    ``disk_read_bytes``/``disk_write_bytes``: read from/written to storage. ``processes``: processes in the
    guest, 0 when the backend cannot see into it.
    """

    cpu_ns: int = 0
    memory_bytes: int = 0
    memory_limit_bytes: int = 0
    net_rx_bytes: int = 0
    net_tx_bytes: int = 0
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0
    processes: int = 0


class BackendError(Exception):
    """A backend operation failed; the message says what happened and is safe to show."""


class VolumeDisks(Protocol):
    """How a backend stores volumes and readies them for its sandboxes. Which volumes exist, who holds them
    and the mount rules are the node's (sbx.node.volumes); this is the storage under them.

    A volume lives in a directory of its own that the node makes and removes; the backend keeps its files
    in it. A volume holds at most its size (a write past it fails ENOSPC in the guest) and its root is owned
    by the backend's guest user.
    """

    async def create(self, directory: Path, size_mb: int) -> None:
        """Make an empty volume of ``size_mb`` MiB in the empty ``directory``, durable on return. On failure
        the directory may hold leftovers; the node removes it."""

    def is_attached(self, directory: Path) -> bool:
        """Whether the volume is ready for binds (after :meth:`attach`, until :meth:`detach`)."""

    async def attach(self, directory: Path) -> Path:
        """Ready the volume for sandboxes and return the ``source`` of its binds. Idempotent: an attached
        volume is returned as it is. Never attaches one volume twice at once (that corrupts it)."""

    async def flush(self, directory: Path) -> None:
        """Write what sandboxes wrote to the volume's storage (a sandbox using it has stopped). Errors are
        logged, not raised."""

    async def detach(self, directory: Path) -> None:
        """Flush and release the volume; idempotent. A user still letting go delays the release of its
        storage, never the return, and a later :meth:`attach` waits for it."""


class Backend(Protocol):
    """Boots, finds and destroys sandboxes. Implementations must be idempotent where stated."""

    #: The backend's name as reported in capabilities (e.g. ``gvisor``).
    name: str
    #: The network modes this backend can enforce; a stricter server never pretends to offer more.
    network_modes: frozenset[str]
    #: Why idle sandboxes must not be parked on this host (one sentence for an operator), or None when
    #: :meth:`park` is safe; known after :meth:`check`. The node then never parks, whatever its configuration.
    parking_refused: str | None
    #: Who processes and file transfers run as in its sandboxes.
    guest: GuestUser
    #: Where its volumes are stored.
    volumes: VolumeDisks

    def check(self) -> None:
        """Raise BackendError naming what to install or fix when the host cannot run sandboxes."""

    async def start(self) -> None:
        """Start the backend's background work (called once before the first boot)."""

    async def close(self) -> None:
        """Stop background work; running sandboxes are left alone."""

    async def boot(self, spec: BootSpec) -> None:
        """Boot the sandbox; on return its agent is listening (:meth:`connect_agent` reaches it).

        On failure nothing of it is left behind (mounts, files, runtime state).
        """

    async def connect_agent(self, sandbox_id: str, timeout_secs: float) -> AgentClient:
        """A new connection to the sandbox's agent, waiting up to ``timeout_secs`` for it to listen (after a
        boot or a restore). Any number may be made, across sandboxd restarts too."""

    async def is_running(self, sandbox_id: str) -> bool:
        """Whether the sandbox still runs, parked or not (used when sandboxd restarts to take sandboxes
        back)."""

    async def destroy(self, sandbox_id: str) -> None:
        """Stop the sandbox and discard its disk; idempotent (a missing sandbox is not an error). A parked
        sandbox is destroyed as well (unparked first where the backend needs it)."""

    async def usage(self, sandbox_id: str) -> BackendUsage | None:
        """Host-side counters of a running sandbox (parked too), None when it is not running. Cheap (file
        reads, no subprocess): the metrics sampler calls it for every awake running sandbox every few seconds,
        and once for one being parked."""

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> None:
        """Apply ``policy`` to a running or suspended sandbox at once, cutting connections it no longer
        permits; BackendError (message safe to show) when this sandbox's policy cannot change."""

    async def park(self, sandbox_id: str) -> None:
        """Stop every host process of a running sandbox where it stands, so that it uses no CPU at all; its
        memory, disk and connections stay as they are, and nothing inside notices but the time that passed.

        While it is parked its agent does not answer (a request to it waits for :meth:`unpark`), and the
        backend's own commands about it (a checkpoint, a kill) would wait too: the node unparks a sandbox
        before anything that reaches it, and :meth:`destroy` and :meth:`is_running` work on a parked one by
        themselves. Idempotent: a parked sandbox stays parked. On failure (BackendError, message safe to show)
        the sandbox is left running, not parked.
        """

    async def unpark(self, sandbox_id: str) -> None:
        """Let a parked sandbox run again from where it stood (in a few milliseconds). Idempotent: a sandbox
        that is not parked, or not running at all, is left as it is. On failure (BackendError) the sandbox may
        still be parked, and a retry is safe."""

    async def is_parked(self, sandbox_id: str) -> bool:
        """Whether the sandbox is parked, read from the host (a restarted sandboxd finds it so). A park that a
        crash left half done counts as not parked (:meth:`unpark` finishes undoing it)."""

    def runtime_report(self) -> Runtime:
        """What runs the sandboxes (platform, why, limitations), as ``GET /v1/node`` reports it; valid after
        :meth:`check`."""


@runtime_checkable
class CheckpointBackend(Backend, Protocol):
    """A backend that can save a running sandbox (memory, processes) and start it again from the save:
    suspend/resume, memory and disk snapshots, and forks. The host quiesces the sandbox's agent (QUIESCE
    with ``wake_path``) before :meth:`checkpoint`; a restore or :meth:`wake` ends the quiesce."""

    #: The guest path the agent's QUIESCE waits for (see docs/agent-protocol.md).
    wake_path: str

    def has_checkpoint(self, image_dir: Path) -> bool:
        """Whether ``image_dir`` holds a whole checkpoint :meth:`restore` can start from (the node asks after
        a crash which steps of a suspend or snapshot were done)."""

    async def checkpoint(self, sandbox_id: str, image_dir: Path, restored_at_once: bool = False) -> None:
        """Save the sandbox into ``image_dir``; the sandbox then stops, its disk stays (a disk copy of the
        stopped sandbox gives every file it had). ``restored_at_once``: the caller restores it from
        ``image_dir`` right after copying its disk with ``below_checkpoint`` (a memory snapshot), so its disk
        need not be readable apart from the checkpoint meanwhile. On failure ``image_dir`` is removed and the
        sandbox may still run (then wake it) or be gone."""

    async def restore(self, sandbox_id: str, image_dir: Path) -> None:
        """Start the checkpointed sandbox again from ``image_dir``, on its own disk."""

    async def wake(self, sandbox_id: str) -> None:
        """End the agent's quiesce in a sandbox that still runs."""

    async def copy_disk(self, sandbox_id: str, dest: Path, below_checkpoint: bool = False) -> None:
        """Copy the sandbox's disk to the file ``dest``, consistent (writers wait during the copy), holding
        every file the sandbox sees. ``below_checkpoint``: the copy goes with the checkpoint just taken with
        ``restored_at_once`` and is only restored with it (a memory snapshot): what that checkpoint holds of
        the disk itself may be left out."""

    def disk_used_bytes(self, sandbox_id: str) -> int:
        """Bytes in use on the sandbox's disk."""

    async def boot_from_snapshot(self, spec: BootSpec, disk_image: Path, memory_image: Path | None) -> None:
        """Boot a new sandbox on a copy of ``disk_image`` (resized to ``spec.disk_mb``); with ``memory_image``
        restored from that checkpoint, processes running, else booted afresh. Nothing is left on failure."""


@runtime_checkable
class PersistentBackend(CheckpointBackend, Protocol):
    """A checkpoint backend that can also stop a sandbox while keeping its disk, and boot it again from that disk
    (persistent sandboxes: ``POST .../stop``, a crash, a checkpoint that cannot be restored)."""

    async def stop(self, sandbox_id: str) -> None:
        """End every process of the sandbox and free its memory, keeping its disk (written to the host's storage
        on return) and whatever :meth:`restart` needs. Idempotent: a stopped, checkpointed or crashed sandbox is
        fine; a parked one is stopped too. A sandbox being destroyed is BackendError."""

    async def restart(self, spec: BootSpec) -> None:
        """Boot the stopped (or checkpointed, or crashed) sandbox ``spec.sandbox_id`` afresh on the disk it kept,
        with ``spec``'s volumes bound again; on return its agent is listening. On failure the sandbox is stopped
        again and its disk kept, so a retry may succeed; never is the disk discarded here."""
