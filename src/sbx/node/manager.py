"""The sandbox lifecycle on one node: create, look up, change, terminate, idle out, and take back on restart.

State on disk, under ``<state>/sandboxes/<id>/``: ``sandbox.json`` (the record, replaced atomically),
``image-config.json`` (how processes run: the image's Env and WorkingDir, fixed at create) and
``processes/`` (see processes.py). The backend keeps its own files under ``<state>/<backend name>/``.
``<state>/runtime.json`` names the runsc that last served the state (runtimes.py).
Warm pools (pools.py) boot sandboxes through :meth:`SandboxManager.boot` and hand them over with
:meth:`SandboxManager.adopt`; until then the manager does not know them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sbx.agent.client import AgentClient, AgentError
from sbx.api.errors import (
    Conflict,
    Internal,
    InvalidRequest,
    NotFound,
    Refused,
    SandboxError,
    Unavailable,
    Unsupported,
)
from sbx.api.network_policy import MODE_ORDER
from sbx.api.node import Resources
from sbx.api.requests import CreateSpec, PatchSpec
from sbx.backends.base import Backend, BackendError, CheckpointBackend, PersistentBackend, VolumeBind
from sbx.images.store import ImageStore, InstalledImage
from sbx.node.activity import hold_for_request
from sbx.node.audit import AuditLog
from sbx.node.checkpoints import Checkpoints
from sbx.node.config import NodeConfig
from sbx.node.host import PoolSource
from sbx.node.idle import IdleTimers
from sbx.node.images import ImageService
from sbx.node.parking import Parking
from sbx.node.persistent import PersistentSandboxes
from sbx.node.records import SandboxRecord, SandboxState, new_sandbox_id, utc_now
from sbx.node.reservations import Reservations
from sbx.node.runtimes import RuntimeLedger, current_runsc, describe, differs
from sbx.node.sandbox import Sandbox
from sbx.node.snapshots import SnapshotStore
from sbx.node.volumes import VolumeStore, check_mount_points
from sbx.statefile import read_json, remove_stale_tmp_files

if TYPE_CHECKING:
    from sbx.node.pools import PooledSandbox
    from sbx.node.snapshots import SnapshotRecord

log = logging.getLogger(__name__)

#: Terminated sandboxes a node remembers (spec: the 100 newest).
KEEP_TERMINATED = 100
#: How long to wait for a freshly booted agent to accept the host's connection, in seconds.
AGENT_CONNECT_TIMEOUT_SECS = 10.0
#: How long a stopping sandboxd waits for teardowns under way, in seconds (a restart finishes the rest).
DESTROY_GRACE_SECS = 10.0
#: Labels a gateway stamps on the sandboxes it creates; names are unique per value of the pair (docs/node-api.md).
NAME_SCOPE_LABELS = ("gateway.owner", "gateway.tenant")


def name_scope(labels: dict[str, str]) -> tuple[str | None, ...]:
    """Within what a sandbox's name must be unique: its gateway owner and tenant labels (absent = None), so a
    gateway's users may each have a sandbox called ``web`` on one node while plain node users share one scope."""
    return tuple(labels.get(key) for key in NAME_SCOPE_LABELS)


class SandboxManager:
    """Owns every sandbox of the node. All methods run on the server's event loop."""

    def __init__(
        self,
        config: NodeConfig,
        state_dir: Path,
        backend: Backend,
        images: ImageStore,
        audit: AuditLog,
        reservations: Reservations,
        node_id: str | None = None,
        image_service: ImageService | None = None,
    ) -> None:
        self.config = config
        self.state_dir = state_dir
        self.root = state_dir / "sandboxes"
        self.backend = backend
        #: The runsc sandboxes boot and restore on (None: a backend without one); recorded in each sandbox.
        self.runsc_version = current_runsc(backend)
        self.images = images
        self.image_service = image_service or ImageService(config, images)
        self.image_service.users = self.image_users
        self.audit = audit
        #: The node's capacity and who holds it: the live sandboxes (reported here), the pools.
        self.reservations = reservations
        reservations.add_holder("sandboxes", self._held)
        # A dormant persistent sandbox holds its disk only, and takes no place among max_sandboxes.
        reservations.add_holder("dormant", self._held_dormant, counted=False)
        self.node_id = node_id
        #: Volumes (see volumes.py): held by live sandboxes from create to terminate.
        self.volumes = VolumeStore(state_dir / "volumes", backend.volumes)
        #: Suspend, snapshots, forks and schedules (checkpoints.py); None when the backend cannot checkpoint.
        self.checkpoints: Checkpoints | None = (
            Checkpoints(self, backend, SnapshotStore(state_dir / "snapshots"), self.runsc_version)
            if isinstance(backend, CheckpointBackend)
            else None
        )
        #: Stop, start and wake of persistent sandboxes (persistent.py); None when the backend cannot stop a
        #: sandbox and boot it again from its disk.
        self.persistent: PersistentSandboxes | None = (
            PersistentSandboxes(self, backend, self.checkpoints, reservations, self.volumes, images)
            if self.checkpoints is not None and isinstance(backend, PersistentBackend)
            else None
        )
        self.cordoned = False
        #: Where a create finds a sandbox booted ahead of it (the warm pools; None: a node without them).
        self.pools: PoolSource | None = None
        self._sandboxes: dict[str, Sandbox] = {}
        #: The running sandboxes that are not parked (what the metrics sampler reads), kept by _state_changed.
        self._awake: dict[str, Sandbox] = {}
        #: Idle timeouts and parks, one timer per sandbox (idle.py), and the parking itself (parking.py).
        self.timers = IdleTimers(config.parking.park_after_secs, self._idle_out, self._park_soon)
        self.parking = Parking(
            backend, config.parking.park_after_secs, self._state_changed, self.reattach_agent
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._destroys: set[asyncio.Task[None]] = set()
        #: Called with a sandbox's id when the node forgets it (what is kept of it elsewhere goes too).
        self.on_forget: list[Callable[[str], None]] = []
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    # -- start and stop ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Take back the sandboxes of a previous run, then start the idle checker."""
        await self.volumes.start()
        ledger = RuntimeLedger(self.state_dir, self.runsc_version)
        if self.checkpoints is not None:
            store = self.checkpoints.store
            store.load()
            for snapshot in store.records():
                if (stamped := ledger.stamp(snapshot.runsc_version)) != snapshot.runsc_version:
                    store.set_runsc_version(snapshot.id, stamped)
        for path in sorted(self.root.glob("*/sandbox.json")):
            # Temporary files a kill left mid-write; the records themselves are always whole.
            remove_stale_tmp_files(path.parent)
            remove_stale_tmp_files(path.parent / "processes")
            data = read_json(path)
            if not isinstance(data, dict):
                continue
            record = SandboxRecord.from_disk(data)
            sandbox = self._new_sandbox(record, path.parent)
            self._sandboxes[record.id] = sandbox
            # Before anything can fail: a sandbox that is lost or was stopping releases its volumes later.
            self.volumes.take_back(record.id, record.volumes, live=record.live)
            if record.state is SandboxState.TERMINATED:
                # Finish a teardown a stop or kill interrupted (destroy is idempotent and cheap when done);
                # the process records stay listable, their output goes (as at terminate).
                self._spawn_destroy(record.id)
                sandbox.processes.load()
                await sandbox.processes.kill_all()
                continue
            if (stamped := ledger.stamp(record.runsc_version)) != record.runsc_version:
                record.runsc_version = stamped
                sandbox.save()
            if not sandbox.load_image_config():
                self._image_config_from_store(sandbox)
            try:
                await self._take_back(sandbox)
            except (AgentError, BackendError, OSError) as exc:
                log.warning(
                    "sandbox could not be taken back", extra={"sandbox": record.id, "error": str(exc)}
                )
                # A persistent one is stopped (reason crash), its disk as last written: a host crash or reboot
                # took its processes, never its workspace. (A pending one never answered its create.)
                if record.state is SandboxState.PENDING:
                    await self._terminate(sandbox, "lost")
                else:
                    await self._lose(sandbox, "lost")
            else:
                self._state_changed(sandbox)
        self._forget_old_terminated()
        self._report_runtime_change(ledger)
        ledger.save()
        await self.volumes.settle()
        if self.checkpoints is not None:
            self.checkpoints.start()

    def _report_runtime_change(self, ledger: RuntimeLedger) -> None:
        """Log what another runsc left here that this one cannot checkpoint or restore (once per start)."""
        current = self.runsc_version
        other = [s.record.state.value for s in self.live() if differs(s.record.runsc_version, current)]
        memory = [
            s.id
            for s in (self.checkpoints.store.records() if self.checkpoints is not None else [])
            if s.kind == "memory" and differs(s.runsc_version, current)
        ]
        if other or memory:
            log.warning(
                "state made by another runsc: its running sandboxes cannot be suspended or memory-snapshotted, "
                "its suspended ones cannot be resumed, its memory snapshots cannot be forked (disk snapshots, "
                "their forks and deletes work; docs/backends.md)",
                extra={"runsc": current, "last_served_by": describe(ledger.last),
                       "running": other.count("running"), "suspended": other.count("suspended"),
                       "memory_snapshots": len(memory)},
            )  # fmt: skip

    def _image_config_from_store(self, sandbox: Sandbox) -> None:
        try:
            image = self.images.get(sandbox.record.image)
        except SandboxError:  # a damaged image record: run with the base environment
            image = None
        if image is not None:
            sandbox.set_image_config(image.config, image.rootfs)

    async def _take_back(self, sandbox: Sandbox) -> None:
        record = sandbox.record
        if record.state in (SandboxState.SUSPENDED, SandboxState.STOPPED):
            # Nothing runs: a suspended one's checkpoint waits on disk for a resume, a stopped one's disk for a
            # start.
            sandbox.processes.load()
            sandbox.processes.paused_reason = record.state.value
            log.info(f"{record.state.value} sandbox taken back", extra={"sandbox": record.id})
            return
        if record.state is SandboxState.PENDING:
            raise BackendError("the sandbox was still starting when sandboxd stopped")
        if await self.parking.take_back(sandbox):
            # Parked: left so. Its agent is connected when it is first woken (parking.py).
            sandbox.processes.load()
            log.info("parked sandbox taken back", extra={"sandbox": record.id})
            return
        if not await self.backend.is_running(record.id):
            if self.checkpoints is not None and await self.checkpoints.take_back_stopped(sandbox):
                return
            raise BackendError("the sandbox stopped while sandboxd was not running")
        sandbox.processes.load()
        await self.reattach_agent(sandbox)
        log.info("sandbox taken back", extra={"sandbox": record.id})

    async def close(self) -> None:
        """Stop background work and disconnect agents; sandboxes keep running (SIGTERM semantics).

        Teardowns of terminated sandboxes under way are given up to ``DESTROY_GRACE_SECS`` to finish.
        """
        if self._destroys:
            await asyncio.wait(set(self._destroys), timeout=DESTROY_GRACE_SECS)
        if self.checkpoints is not None:
            await self.checkpoints.close()
        for task in list(self._tasks):
            task.cancel()
        for sandbox in self._sandboxes.values():
            agent = sandbox.processes.agent
            if agent is not None:
                await agent.close()

    def _new_sandbox(self, record: SandboxRecord, directory: Path) -> Sandbox:
        """A Sandbox for ``record`` whose activity drives its idle timer and whose wake unparks it."""
        sandbox = Sandbox(record, directory, self.audit, self.backend.guest)
        sandbox.on_change = self.timers.changed
        sandbox.waker = self.parking.wake
        return sandbox

    def _state_changed(self, sandbox: Sandbox) -> None:
        """After a sandbox's state or parked flag changed: keep the awake index and its timer right."""
        if sandbox.record.state is SandboxState.RUNNING and not sandbox.parked:
            self._awake[sandbox.record.id] = sandbox
        else:
            self._awake.pop(sandbox.record.id, None)
        if sandbox.record.live:
            self.timers.changed(sandbox)
        else:
            self.timers.cancel(sandbox)

    def state_changed(self, sandbox: Sandbox) -> None:
        """Tell the manager that ``sandbox``'s state changed (suspended, resumed, restored)."""
        self._state_changed(sandbox)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _spawn_destroy(self, sandbox_id: str) -> None:
        task = self._spawn(self._destroy(sandbox_id))
        self._destroys.add(task)
        task.add_done_callback(self._destroys.discard)

    # -- lookups ----------------------------------------------------------------------------------------

    def resolve(self, ref: str, touch: bool = True) -> Sandbox:
        """The sandbox with id ``ref``, or the live one named ``ref``; NotFound otherwise. A name two live
        sandboxes share (their gateway owners differ, see :func:`name_scope`) is 409 naming both ids, never
        one of them picked silently."""
        sandbox = self._sandboxes.get(ref)
        if sandbox is None:
            named = [s for s in self._sandboxes.values() if s.record.live and s.record.name == ref]
            if len(named) > 1:
                ids = ", ".join(sorted(s.record.id for s in named))
                raise Conflict(f"the name {ref!r} matches {len(named)} live sandboxes ({ids}); use the id")
            sandbox = named[0] if named else None
        if sandbox is None:
            raise NotFound(f"no sandbox {ref!r} on this node")
        if touch:
            hold_for_request(sandbox)  # before the touch: a park starting now sees the hold
            sandbox.touch()
        return sandbox

    def resolve_or_none(self, ref: str) -> Sandbox | None:
        """Like resolve, without noting activity; None when there is no such sandbox."""
        try:
            return self.resolve(ref, touch=False)
        except NotFound:
            return None

    def resolve_running(self, ref: str) -> Sandbox:
        """Like resolve, but a sandbox that is not running is 409."""
        sandbox = self.resolve(ref)
        if sandbox.record.state is not SandboxState.RUNNING:
            raise Conflict(f"sandbox {sandbox.record.id} is {sandbox.record.state.value}, not running")
        return sandbox

    def resolve_guest(self, ref: str) -> Sandbox:
        """Like :meth:`resolve_running` for a request that needs the guest, but a dormant persistent sandbox
        (suspended, stopped) passes too: the request parses its input, then calls :meth:`wake_for_guest`, so a bad
        request never wakes one."""
        sandbox = self.resolve(ref)
        record = sandbox.record
        if record.state is not SandboxState.RUNNING and not (record.dormant and self.persistent is not None):
            raise Conflict(f"sandbox {record.id} is {record.state.value}, not running")
        return sandbox

    async def wake_for_guest(self, sandbox: Sandbox, running: bool = True) -> Sandbox:
        """Wake ``sandbox`` when it is a dormant persistent one (persistent.py), then, with ``running``, 409 when
        it is not running (a DELETE won a race). The request's hold keeps it awake until the request ends."""
        if sandbox.record.dormant and self.persistent is not None:
            await self.persistent.wake(sandbox)
        if running and sandbox.record.state is not SandboxState.RUNNING:
            raise Conflict(f"sandbox {sandbox.record.id} is {sandbox.record.state.value}, not running")
        return sandbox

    def records(self, labels: dict[str, str] | None = None) -> list[SandboxRecord]:
        """Sandboxes, newest first, terminated ones included until forgotten; all ``labels`` must match."""
        wanted = labels or {}
        records = [
            s.record
            for s in self._sandboxes.values()
            if all(s.record.labels.get(k) == v for k, v in wanted.items())
        ]
        return sorted(records, key=lambda r: r.created_at, reverse=True)

    def live(self) -> Iterable[Sandbox]:
        return (s for s in self._sandboxes.values() if s.record.live)

    def awake(self) -> Iterable[Sandbox]:
        """The running sandboxes that are not parked (kept as an index: no walk over idle ones)."""
        return self._awake.values()

    def parked_count(self) -> int:
        return len(self.parking.parked)

    @property
    def capacity(self) -> Resources:
        """What the node offers."""
        return self.reservations.capacity

    def _held(self) -> Iterable[Resources]:
        """What each live sandbox that is awake (or waking) holds (the reservations' holder ``sandboxes``)."""
        return (
            Resources(s.record.cpus, s.record.memory_mb, s.record.disk_mb)
            for s in self.live()
            if s.waking or not s.record.dormant
        )

    def _held_dormant(self) -> Iterable[Resources]:
        """The disk each dormant persistent sandbox holds (the holder ``dormant``, not counted among
        max_sandboxes)."""
        return (Resources(0, 0, s.record.disk_mb) for s in self.live() if s.record.dormant and not s.waking)

    def image_users(self, reference: str) -> int:
        """Live sandboxes (starting or running) whose root is the image ``reference``."""
        return sum(1 for s in self.live() if s.record.image == reference)

    def free(self) -> Resources:
        """Capacity less what every live sandboxes holds, pooled ones included, never negative."""
        return self.reservations.free()

    def count_by_state(self) -> dict[str, int]:
        counts = {state.value: 0 for state in SandboxState}
        for sandbox in self._sandboxes.values():
            counts[sandbox.record.state.value] += 1
        return counts

    def processes_running(self) -> int:
        return sum(s.processes.running for s in self.live())

    # -- create -----------------------------------------------------------------------------------------

    def _check_create(self, req: CreateSpec) -> None:
        """Every refusal that must leave nothing behind, in the order a user would fix them (capacity is
        checked apart, in :meth:`_check_capacity`, because a pooled sandbox brings its own)."""
        if self.cordoned:
            raise Unavailable("this node is cordoned and takes no new sandboxes; uncordon it with "
                              "POST /v1/node/cordon {\"cordoned\": false}")  # fmt: skip
        self.volumes.check("", req.volumes)
        if req.persistent and self.persistent is None:
            raise Unsupported(
                f"the {self.backend.name} backend cannot keep a sandbox's disk while it sleeps (capability "
                "persistent); omit persistent"
            )
        if req.snapshot_every_secs:
            if self.checkpoints is None:
                raise Unsupported(
                    f"the {self.backend.name} backend takes no snapshots, so it keeps no snapshot schedule; "
                    "omit snapshot_every_secs"
                )
            if req.volumes:
                raise Conflict(
                    "a sandbox with volumes cannot be snapshotted, so it cannot have a snapshot schedule; "
                    "drop volumes or snapshot_every_secs"
                )
        if req.network.mode not in self.backend.network_modes:
            raise Refused(
                f"network mode {req.network.mode!r} is not enforced by this node's {self.backend.name} backend; "
                f"ask for one of: {', '.join(m for m in MODE_ORDER if m in self.backend.network_modes)}"
            )
        scope = name_scope(req.labels)
        if req.name is not None and any(
            s.record.name == req.name and name_scope(s.record.labels) == scope for s in self.live()
        ):
            raise Conflict(
                f"the name {req.name!r} is in use by a live sandbox; pick another or delete that one"
            )

    async def create(self, req: CreateSpec) -> SandboxRecord:
        """Boot a sandbox for a validated request (or take a pooled one that fits, or fork a snapshot); on
        failure nothing is left behind. An image not installed yet is installed first, and the create waits
        for it."""
        snapshot = None
        if req.snapshot_id is not None:
            if self.checkpoints is None:
                raise Unsupported(
                    f"the {self.backend.name} backend cannot fork snapshots (capabilities memory_snapshot, "
                    "disk_snapshot); omit snapshot_id"
                )
            snapshot, req = self.checkpoints.fork_request(req)
        self._check_create(req)
        image = await self.image_service.ensure(req.image)
        self._check_create(req)  # again: the install may have taken a while
        check_mount_points(image.rootfs, req.volumes)
        # A persistent sandbox boots on a journaled disk of its own: never one of the pools' (which have none).
        pooled = (
            self.pools.take(image.reference, req)
            if self.pools is not None and snapshot is None and not req.persistent
            else None
        )
        if pooled is not None:
            return self.adopt(pooled, req)
        self.reservations.check(Resources(req.cpus, req.memory_mb, req.disk_mb))
        record = SandboxRecord(
            id=new_sandbox_id(self.node_id),
            state=SandboxState.PENDING,
            image=image.reference,
            cpus=req.cpus,
            memory_mb=req.memory_mb,
            disk_mb=req.disk_mb,
            network=req.network,
            idle_timeout_secs=req.idle_timeout_secs,
            created_at=utc_now(),
            name=req.name,
            env=dict(req.env),
            labels=dict(req.labels),
            volumes=req.volumes,
            snapshot_id=req.snapshot_id,
            snapshot_every_secs=req.snapshot_every_secs or 0,
            snapshot_keep=(req.snapshot_keep or 1) if req.snapshot_every_secs else 0,
            secret_env_names=sorted(req.secret_env),
            secret_env=dict(req.secret_env),
            persistent=req.persistent,
        )
        try:
            sandbox = await self._start(record, image, req, snapshot)
        except (BackendError, AgentError, OSError) as exc:
            raise Internal(f"the sandbox could not be started: {exc}") from exc
        record.state = SandboxState.RUNNING
        sandbox.touch()
        sandbox.save()
        self._state_changed(sandbox)
        self._audit_created(record)
        if record.snapshot_every_secs and self.checkpoints is not None:
            self.checkpoints.set_schedule(record.id, record.snapshot_every_secs, record.snapshot_keep)
        return record

    async def _start(
        self, record: SandboxRecord, image: InstalledImage, req: CreateSpec, snapshot: SnapshotRecord | None
    ) -> Sandbox:
        """Every step of making ``record``'s sandbox, each undone (last first, by one cleanup stack) when a later
        one fails or the create is cancelled: nothing of a failed create is left."""
        async with contextlib.AsyncExitStack() as undo:
            directory = self.root / record.id
            directory.mkdir(mode=0o700)
            undo.callback(shutil.rmtree, directory, True)
            sandbox = self._new_sandbox(record, directory)
            sandbox.set_image_config(image.config, image.rootfs)
            # Registered before the first await, so a concurrent create sees the name and the capacity taken.
            self._sandboxes[record.id] = sandbox
            undo.callback(self._sandboxes.pop, record.id, None)
            # No await since _check_create: the volumes it found free still are.
            self.volumes.hold(record.id, req.volumes)
            undo.push_async_callback(_shielded, self.volumes.release, record.id)
            # Not durable: a pending record that a crash loses is a sandbox that never answered its create.
            sandbox.save(durable=False)
            sandbox.save_image_config()
            undo.push_async_callback(_shielded, self.backend.destroy, record.id)
            if snapshot is not None and self.checkpoints is not None:
                await self.checkpoints.boot_fork(snapshot, sandbox, image.rootfs)
                agent = await self.connect_agent(record.id)
            else:
                binds = await self.volumes.mount(record.id, req.volumes)
                agent = await self.boot(record, image, binds)
            await sandbox.processes.attach_agent(agent)
            self._watch_agent(sandbox, agent)
            undo.pop_all()  # made: nothing to undo
            return sandbox
        raise AssertionError("unreachable")  # pragma: no cover - the stack re-raises what failed

    def _audit_created(self, record: SandboxRecord, **extra: object) -> None:
        self.audit.record(
            "sandbox.created", record.id,
            name=record.name, image=record.image, labels=record.labels, network=record.network.to_wire(),
            env_names=sorted(record.env), snapshot=record.snapshot_id,
            volumes=[{"name": m.name, "path": m.path, "read_only": m.read_only} for m in record.volumes],
            **({"secret_env_names": record.secret_env_names} if record.secret_env_names else {}),
            **({"persistent": True} if record.persistent else {}), **extra,
        )  # fmt: skip

    async def boot(
        self, record: SandboxRecord, image: InstalledImage, volumes: tuple[VolumeBind, ...] = ()
    ) -> AgentClient:
        """Boot ``record``'s sandbox from ``image`` with ``volumes`` bound in and connect to its agent; on
        failure (or cancellation) the backend's part is destroyed again, and backend errors become Internal."""
        record.runsc_version = self.runsc_version
        try:
            await self.backend.boot(record.boot_spec(image.rootfs, volumes))
            return await self.connect_agent(record.id)
        except BaseException as exc:
            await asyncio.shield(self.backend.destroy(record.id))
            if isinstance(exc, (BackendError, AgentError, OSError)):
                raise Internal(f"the sandbox could not be started: {exc}") from exc
            raise

    def adopt(self, pooled: PooledSandbox, req: CreateSpec) -> SandboxRecord:
        """Make a pooled sandbox the requester's: name, labels, env (secret env too), network and idle timeout
        from ``req``.

        Nothing inside the sandbox changes (env is given per process; nothing has run in it), so this only
        writes the record and the create answers in milliseconds. Audit ``sandbox.created`` reason ``pool``.
        """
        record = pooled.record
        record.name = req.name
        record.labels = dict(req.labels)
        record.env = dict(req.env)
        record.secret_env_names = sorted(req.secret_env)
        record.secret_env = dict(req.secret_env)
        record.network = req.network
        record.idle_timeout_secs = req.idle_timeout_secs
        record.created_at = utc_now()
        record.state = SandboxState.RUNNING
        directory = self.root / record.id
        directory.mkdir(mode=0o700)
        sandbox = self._new_sandbox(record, directory)
        sandbox.set_image_config(pooled.image.config, pooled.image.rootfs)
        sandbox.processes.agent = pooled.agent  # a fresh table, and the agent has run nothing yet
        if pooled.parked:
            self.parking.adopt(sandbox)  # its first request wakes it
        self._sandboxes[record.id] = sandbox
        sandbox.save_image_config()
        sandbox.save()
        pooled.release()  # after the record is saved: a restart now takes it back instead of destroying it
        self._watch_agent(sandbox, pooled.agent)
        sandbox.touch()
        self._state_changed(sandbox)
        self._audit_created(record, reason="pool")
        return record

    # -- change -----------------------------------------------------------------------------------------

    async def patch(self, ref: str, req: PatchSpec) -> SandboxRecord:
        """Apply a validated PATCH: all fields or none."""
        sandbox = self.resolve(ref)
        record = sandbox.record
        if req.network is not None and req.network != record.network and self.persistent is not None:
            await self.persistent.wake(sandbox)  # a policy is applied to a guest that runs
        async with sandbox.lock:
            if not record.live:
                raise Conflict(f"sandbox {record.id} is terminated and cannot be changed")
            if record.persistent and req.name == "":
                raise InvalidRequest(
                    f"name: sandbox {record.id} is persistent and keeps a name (it is found again by it); give "
                    "another name instead of removing it"
                )
            # The name after the PATCH must be free in the name scope after it (labels may move it).
            new_name = (req.name or None) if req.name is not None else record.name
            new_scope = name_scope(req.labels if req.labels is not None else record.labels)
            if (
                new_name is not None
                and (new_name != record.name or new_scope != name_scope(record.labels))
                and any(
                    s.record.name == new_name and name_scope(s.record.labels) == new_scope
                    for s in self.live()
                    if s is not sandbox
                )
            ):
                raise Conflict(f"the name {new_name!r} is in use by a live sandbox")
            if req.network is not None and req.network != record.network:
                # Last check, first change: applied live by the backend (open connections the new policy
                # does not permit are cut); when it cannot be, nothing of the PATCH has changed.
                try:
                    await sandbox.wake()  # a parked sandbox's connections are cut as a running one's
                    await self.backend.update_network(record.id, req.network)
                except BackendError as exc:
                    raise Conflict(
                        f"the network policy of sandbox {record.id} cannot change: {exc}"
                    ) from None
                record.network = req.network
                sandbox.save()
                self.audit.record("sandbox.network_updated", record.id, network=record.network.to_wire())
            changed: dict[str, object] = {}
            if req.name is not None:
                new_name = req.name or None
                if new_name != record.name:
                    record.name = new_name
                    changed["name"] = new_name
            if req.labels is not None and req.labels != record.labels:
                record.labels = dict(req.labels)
                changed["labels"] = record.labels
            if req.idle_timeout_secs is not None and req.idle_timeout_secs != record.idle_timeout_secs:
                record.idle_timeout_secs = req.idle_timeout_secs
                changed["idle_timeout_secs"] = record.idle_timeout_secs
                self.timers.changed(sandbox)  # a shorter timeout needs an earlier timer
            if changed:
                sandbox.save()
                self.audit.record("sandbox.updated", record.id, **changed)
            return record

    # -- terminate --------------------------------------------------------------------------------------

    async def delete(self, ref: str) -> None:
        """Terminate (idempotent: a terminated sandbox is fine)."""
        sandbox = self.resolve(ref)
        async with sandbox.lock:
            if sandbox.record.live:
                await self._terminate(sandbox, "request")

    async def terminate_locked(self, sandbox: Sandbox, reason: str) -> None:
        """Terminate ``sandbox`` (live) for ``reason``; the caller holds ``sandbox.lock``."""
        await self._terminate(sandbox, reason)

    async def lose_locked(self, sandbox: Sandbox, reason: str) -> None:
        """``sandbox`` (live) crashed or cannot be brought back (``reason``, e.g. ``crashed``); the caller holds
        its lock. A persistent one is stopped (reason ``crash``: its disk is kept), any other terminated."""
        await self._lose(sandbox, reason)

    async def _lose(self, sandbox: Sandbox, reason: str) -> None:
        if sandbox.record.persistent and self.persistent is not None:
            await self.persistent.stop_locked(sandbox, "crash")
        else:
            await self._terminate(sandbox, reason)

    def forget_parked(self, sandbox: Sandbox) -> None:
        """``sandbox`` stops running: it is parked no longer (its backend's stop unparks it)."""
        self.parking.forget(sandbox)

    async def _terminate(self, sandbox: Sandbox, reason: str) -> None:
        record = sandbox.record
        record.state = SandboxState.TERMINATED
        record.terminated_at = utc_now()
        record.terminated_reason = reason
        record.secret_env = {}  # no process will start again: the values are not kept a moment longer
        sandbox.save()
        self.parking.forget(sandbox)  # the backend's destroy unparks it
        self._state_changed(sandbox)
        self.volumes.drop_holder(record.id)  # rule 1 counts live sandboxes; the mount stays until _destroy
        agent = sandbox.processes.agent
        sandbox.processes.agent = None
        if agent is not None:
            await agent.close()
        await sandbox.processes.kill_all()
        sandbox.processes.paused_reason = None
        if self.checkpoints is not None:
            self.checkpoints.stop_schedule(record.id)
            self.checkpoints.discard_suspend_image(sandbox)
        self.audit.record("sandbox.terminated", record.id, reason=reason)
        # Tearing down the runsc sandbox takes about a second: the answer does not wait for it, and a restart
        # finishes it (destroy is idempotent).
        self._spawn_destroy(record.id)
        self._forget_old_terminated()

    async def _destroy(self, sandbox_id: str) -> None:
        try:
            await self.backend.destroy(sandbox_id)
        except BackendError as exc:
            log.error("sandbox teardown failed", extra={"sandbox": sandbox_id, "error": str(exc)})
        await self.volumes.release(sandbox_id)  # flushed, and unmounted when no one else uses it

    def _forget_old_terminated(self) -> None:
        terminated = sorted(
            (s for s in self._sandboxes.values() if not s.record.live),
            key=lambda s: s.record.terminated_at or s.record.created_at,
            reverse=True,
        )
        for sandbox in terminated[KEEP_TERMINATED:]:
            del self._sandboxes[sandbox.record.id]
            shutil.rmtree(sandbox.directory, ignore_errors=True)
            for hook in self.on_forget:
                hook(sandbox.record.id)

    async def connect_agent(self, sandbox_id: str) -> AgentClient:
        """A new connection to the sandbox's agent (waiting up to AGENT_CONNECT_TIMEOUT_SECS for it)."""
        return await self.backend.connect_agent(sandbox_id, AGENT_CONNECT_TIMEOUT_SECS)

    async def reattach_agent(self, sandbox: Sandbox) -> None:
        """Connect to the sandbox's agent again and take its processes back: after a restart, a lost channel
        or a restore. Its output goes on from what the process records hold."""
        agent = await self.connect_agent(sandbox.record.id)
        sandbox.processes.paused_reason = None
        await sandbox.processes.attach_agent(agent)
        self._watch_agent(sandbox, agent)

    def watch_agent(self, sandbox: Sandbox, agent: AgentClient) -> None:
        """Watch ``agent``, the sandbox's new connection (see :meth:`_watch_agent`)."""
        self._watch_agent(sandbox, agent)

    def _watch_agent(self, sandbox: Sandbox, agent: AgentClient) -> None:
        """When the agent's channel closes on its own: reconnect if the sandbox still runs, else terminate it."""

        async def watch() -> None:
            await agent.closed.wait()
            # Closed by this host (terminate, shutdown) means the sandbox is no longer live or no longer ours.
            if not (sandbox.record.live and sandbox.processes.agent is agent):
                return
            async with sandbox.lock:
                if not (sandbox.record.live and sandbox.processes.agent is agent):
                    return
                sandbox_id = sandbox.record.id
                if await self.backend.is_running(sandbox_id):
                    try:
                        await self.reattach_agent(sandbox)
                    except AgentError as exc:
                        log.warning(
                            "agent reconnect failed", extra={"sandbox": sandbox_id, "error": str(exc)}
                        )
                    else:
                        log.info("agent channel re-established", extra={"sandbox": sandbox_id})
                        return
                log.warning("sandbox agent went away", extra={"sandbox": sandbox_id})
                await self._lose(sandbox, "crashed")

        self._spawn(watch())

    # -- idle timeout and parking (idle.py, parking.py) ----------------------------------------------------

    def _idle_out(self, sandbox: Sandbox) -> None:
        """Its timer says the sandbox is idle past its timeout: terminate it (reason ``idle``), or suspend it
        when it is persistent (persistent.py)."""

        async def terminate() -> None:
            async with sandbox.lock:
                # Checked again under the lock: a request may have come meanwhile.
                if sandbox.record.live and self.timers.idle_now(sandbox):
                    if sandbox.record.persistent and self.persistent is not None:
                        await self.persistent.idle_out(sandbox)
                    else:
                        await self._terminate(sandbox, "idle")
                elif sandbox.record.live:
                    self.timers.changed(sandbox)

        self._spawn(terminate())

    def _park_soon(self, sandbox: Sandbox) -> None:
        """Its timer says the sandbox may be parked: try (parking.py decides), then look at its timer again."""

        async def park() -> None:
            try:
                await self.parking.try_park(sandbox)
            finally:
                if sandbox.record.live:
                    self.timers.changed(sandbox)

        self._spawn(park())


async def _shielded(step: Callable[[str], Coroutine[Any, Any, None]], sandbox_id: str) -> None:
    """Run an undo step to its end even when the create was cancelled (a teardown must not be cut short)."""
    await asyncio.shield(step(sandbox_id))
