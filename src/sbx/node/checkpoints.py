"""Suspend and resume, snapshots, forks and snapshot schedules: everything that saves a sandbox's state.

Each of them needs a :class:`~sbx.backends.base.CheckpointBackend`. A memory capture goes:

1. QUIESCE the agent (it closes its host sockets; processes run on, their output waits in the agent),
2. checkpoint the sandbox (memory and processes saved; the sandbox stops),
3. suspend: stop here. Snapshot: copy the host's process records and the disk, then restore the sandbox
   from the checkpoint just made and reconnect, so it carries on where it was (paused for the capture,
   about half a second here; see docs/snapshots.md).

A disk snapshot only copies the disk, with the file system frozen meanwhile (writers wait), of a running or a
suspended sandbox. Snapshots are taken by a task of their own: neither a closed connection nor a DELETE of the
sandbox cancels one.

A checkpoint is restored only by the runsc that made it: what would need another (suspending or memory-
snapshotting a sandbox another runsc started, resuming one another suspended, forking another's memory
snapshot) is refused here, before anything is touched (sbx.node.runtimes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from sbx.agent.client import AgentError, AgentProtocolError
from sbx.api.errors import Conflict, Internal, InvalidRequest, SandboxError, Unsupported
from sbx.api.requests import CreateSpec
from sbx.api.sandboxes import SnapshotProgress
from sbx.api.snapshots import SnapshotKind
from sbx.backends.base import BackendError, CheckpointBackend
from sbx.backends.disk_copy import allocated_bytes
from sbx.node.records import SandboxRecord, SandboxState, utc_now
from sbx.node.runtimes import checkpoint_refusal, differs, fork_refusal, resume_refusal
from sbx.node.snapshots import SnapshotRecord, SnapshotStore, new_snapshot_id

if TYPE_CHECKING:
    from sbx.node.host import SandboxHost
    from sbx.node.sandbox import Sandbox

log = logging.getLogger(__name__)

#: How often the ``snapshotting.bytes`` progress is refreshed, in seconds.
PROGRESS_INTERVAL_SECS = 0.1
#: Where a suspended sandbox's checkpoint lives, inside its state directory.
SUSPEND_IMAGE = "suspend-image"
#: Where a memory snapshot's checkpoint is made, inside the sandbox's state directory, until it is stored.
CAPTURE_IMAGE = "capture-image"
#: How long a quiesced agent may take to close its connection, in seconds.
QUIESCE_TIMEOUT_SECS = 10.0


class Checkpoints:
    """Suspend/resume, snapshots, forks and schedules of the manager's sandboxes."""

    def __init__(
        self,
        host: SandboxHost,
        backend: CheckpointBackend,
        store: SnapshotStore,
        runsc_version: str | None = None,
    ) -> None:
        """``runsc_version``: the runsc this node runs (None: a backend without one, which compares nothing)."""
        self.host = host
        self.backend = backend
        self.store = store
        self.runsc_version = runsc_version
        #: Snapshots being taken, by sandbox id (one at a time per sandbox).
        self._taking: dict[str, asyncio.Task[SnapshotRecord]] = {}
        #: Schedule loops, by sandbox id.
        self._schedules: dict[str, asyncio.Task[None]] = {}

    # -- start and stop ---------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the schedules of the sandboxes taken back (call after the manager's start)."""
        for record in self.host.records():
            if record.live and record.snapshot_every_secs > 0:
                self._start_schedule(record.id)

    async def close(self) -> None:
        """Stop the schedules; snapshots under way are given no time (their staging is removed at start)."""
        for task in [*self._schedules.values(), *self._taking.values()]:
            task.cancel()

    # -- the agent around a checkpoint ------------------------------------------------------------------

    async def _quiesce(self, sandbox: Sandbox, reason: str) -> None:
        """Make the agent give up its host sockets; requests meanwhile get 409 naming ``reason``."""
        agent = sandbox.processes.require_agent()
        sandbox.processes.agent = None  # the watcher must not take the close for a crash
        sandbox.processes.paused_reason = reason
        try:
            await agent.quiesce(self.backend.wake_path, QUIESCE_TIMEOUT_SECS)
        except AgentProtocolError as exc:  # an agent older than QUIESCE: nothing happened
            sandbox.processes.agent = agent
            sandbox.processes.paused_reason = None
            raise Unsupported(str(exc)) from exc
        except AgentError as exc:
            await self._recover(sandbox)
            raise Internal(f"the sandbox's agent could not be quiesced: {exc}") from exc

    async def _recover(self, sandbox: Sandbox) -> None:
        """After a failed checkpoint: wake and reconnect a sandbox that still runs, else terminate it."""
        sandbox_id = sandbox.record.id
        try:
            if sandbox.record.live and await self.backend.is_running(sandbox_id):
                await self.backend.wake(sandbox_id)
                await self.host.reattach_agent(sandbox)
                return
        except (AgentError, BackendError, OSError) as exc:
            log.warning("sandbox could not be reconnected", extra={"sandbox": sandbox_id, "error": str(exc)})
        sandbox.processes.paused_reason = None
        if sandbox.record.live:
            await self.host.lose_locked(sandbox, "crashed")

    # -- suspend and resume -----------------------------------------------------------------------------

    async def suspend(self, ref: str) -> SandboxRecord:
        """Save a running sandbox with no process running and stop it (memory given back); 409 otherwise."""
        sandbox = self.host.resolve(ref)
        async with sandbox.lock:
            return await self.suspend_locked(sandbox)

    async def suspend_locked(self, sandbox: Sandbox, reason: str | None = None) -> SandboxRecord:
        """:meth:`suspend` of ``sandbox`` under its lock (held by the caller); audit ``sandbox.suspended`` with
        ``reason`` when given (``idle``: a persistent sandbox's idle timeout)."""
        record = sandbox.record
        if record.state is not SandboxState.RUNNING:
            raise Conflict(
                f"sandbox {record.id} is {record.state.value}; only a running sandbox can be suspended"
            )
        refusal = checkpoint_refusal(
            record.id, record.runsc_version, self.runsc_version, "it is not suspended"
        )
        if refusal is not None:
            raise refusal
        running = [p.pid for p in sandbox.processes.records() if p.exit_code is None]
        if running:
            raise Conflict(
                f"sandbox {record.id} has {len(running)} process(es) running (pid "
                f"{', '.join(map(str, running))}); wait for them to exit or signal them, then suspend"
            )
        if record.id in self._taking:
            raise Conflict(f"a snapshot of sandbox {record.id} is being taken; suspend it when that is done")
        image = sandbox.directory / SUSPEND_IMAGE
        shutil.rmtree(image, ignore_errors=True)
        await sandbox.wake()  # a parked sandbox's agent answers only once woken
        await self._quiesce(sandbox, "suspending")
        try:
            await self.backend.checkpoint(record.id, image)
        except BackendError as exc:
            await self._recover(sandbox)
            raise Internal(f"the sandbox could not be suspended: {exc}") from exc
        sandbox.processes.paused_reason = "suspended"
        record.state = SandboxState.SUSPENDED
        sandbox.save()
        self.host.state_changed(sandbox)
        self.host.audit.record("sandbox.suspended", record.id, **({"reason": reason} if reason else {}))
        return record

    async def resume(self, ref: str) -> SandboxRecord:
        """Bring a suspended sandbox back as it was; 409 when it is not suspended."""
        sandbox = self.host.resolve(ref)
        async with sandbox.lock:
            return await self.resume_locked(sandbox)

    async def resume_locked(self, sandbox: Sandbox, reason: str | None = None) -> SandboxRecord:
        """:meth:`resume` of ``sandbox`` under its lock (held by the caller); audit ``sandbox.resumed`` with
        ``reason`` when given (``request``: woken by a request that needed it)."""
        record = sandbox.record
        if record.state is not SandboxState.SUSPENDED:
            raise Conflict(f"sandbox {record.id} is {record.state.value}, not suspended")
        refusal = resume_refusal(record.id, record.runsc_version, self.runsc_version)
        if refusal is not None:
            raise refusal
        image = sandbox.directory / SUSPEND_IMAGE
        try:
            await self.backend.restore(record.id, image)
            await self.host.reattach_agent(sandbox)
        except (BackendError, AgentError, OSError) as exc:
            # Still suspended, the checkpoint kept: a retry restores from it again.
            raise Internal(f"the sandbox could not be resumed: {exc}") from exc
        record.state = SandboxState.RUNNING
        record.runsc_version = self.runsc_version
        sandbox.save()
        self.host.state_changed(sandbox)
        sandbox.touch()
        self.host.audit.record("sandbox.resumed", record.id, **({"reason": reason} if reason else {}))
        await asyncio.to_thread(shutil.rmtree, image, True)
        return record

    async def take_back_stopped(self, sandbox: Sandbox) -> bool:
        """At start, for a sandbox the record says runs but the backend does not: if sandboxd was killed
        between a checkpoint and what follows it, finish that (a suspend becomes suspended; a capture
        restores the sandbox from its checkpoint). False when there is no checkpoint to go on from."""
        record = sandbox.record
        image = sandbox.directory / CAPTURE_IMAGE
        if self.backend.has_checkpoint(image) and differs(record.runsc_version, self.runsc_version):
            # Captured by the runsc before an upgrade, which this one cannot restore: kept as a suspended
            # sandbox (its disk reachable through a disk snapshot), never lost.
            shutil.rmtree(sandbox.directory / SUSPEND_IMAGE, ignore_errors=True)
            os.rename(image, sandbox.directory / SUSPEND_IMAGE)
            log.warning(
                "a sandbox checkpointed by another runsc before a restart is kept suspended",
                extra={"sandbox": record.id, "made_by": record.runsc_version, "runsc": self.runsc_version},
            )
        if self.backend.has_checkpoint(sandbox.directory / SUSPEND_IMAGE):
            record.state = SandboxState.SUSPENDED
            sandbox.save()
            sandbox.processes.load()
            sandbox.processes.paused_reason = "suspended"
            self.host.audit.record("sandbox.suspended", record.id)
            log.info("an interrupted suspend was finished", extra={"sandbox": record.id})
            return True
        if self.backend.has_checkpoint(image):
            sandbox.processes.load()
            await self.backend.restore(record.id, image)
            await self.host.reattach_agent(sandbox)
            await asyncio.to_thread(shutil.rmtree, image, True)
            log.info("restored after an interrupted snapshot", extra={"sandbox": record.id})
            return True
        return False

    def discard_suspend_image(self, sandbox: Sandbox) -> None:
        """Remove a terminated sandbox's checkpoint (it may be as large as its memory)."""
        shutil.rmtree(sandbox.directory / SUSPEND_IMAGE, ignore_errors=True)

    # -- snapshots --------------------------------------------------------------------------------------

    def snapshotting(self, sandbox_id: str) -> bool:
        return sandbox_id in self._taking

    async def snapshot(self, ref: str, kind: SnapshotKind, scheduled: bool = False) -> SnapshotRecord:
        """Take a snapshot of a running sandbox (a disk snapshot also of a suspended one); the answer waits for
        it, but a closed connection does not cancel it (it runs in a task of its own)."""
        sandbox = self.host.resolve(ref, touch=not scheduled)
        record = sandbox.record
        if record.state is SandboxState.SUSPENDED and kind == "memory":
            raise Conflict(
                f"sandbox {record.id} is suspended; a memory snapshot is taken of a running sandbox (resume it "
                'first), a disk snapshot ({"kind": "disk"}) of a running or a suspended one'
            )
        if record.state not in (SandboxState.RUNNING, SandboxState.SUSPENDED):
            raise Conflict(
                f"sandbox {record.id} is {record.state.value}; only a running sandbox can be snapshotted"
            )
        if kind == "memory":
            what = "no memory snapshot of it is taken"
            refusal = checkpoint_refusal(record.id, record.runsc_version, self.runsc_version, what)
            if refusal is not None:
                raise refusal
        if record.volumes:
            raise Conflict(
                f"sandbox {record.id} has volumes; a sandbox with volumes cannot be snapshotted "
                "(keep files that must outlive it on the volume instead)"
            )
        under_way = record.snapshotting
        if record.id in self._taking:
            since = f" (since {under_way.started_at})" if under_way else ""
            raise Conflict(f"a snapshot of sandbox {record.id} is being taken{since}; one at a time")
        task = asyncio.get_running_loop().create_task(self._take(sandbox, kind, scheduled))
        self._taking[record.id] = task
        task.add_done_callback(lambda _t: self._taking.pop(record.id, None))
        return await asyncio.shield(task)

    async def _take(self, sandbox: Sandbox, kind: SnapshotKind, scheduled: bool) -> SnapshotRecord:
        # Held for the whole snapshot (a scheduled one is no request): it must not be parked or idled out under
        # the copy or the capture, and a parked one is woken (its agent must quiesce; runsc's checkpoint asks the
        # sentry). An idle timeout that fell due meanwhile is acted on at the release.
        sandbox.hold()
        try:
            await sandbox.wake()
            return await self._take_woken(sandbox, kind, scheduled)
        finally:
            # A scheduled snapshot is no activity: an idle sandbox is parked again right after it.
            sandbox.release(activity=not scheduled)

    async def _take_woken(self, sandbox: Sandbox, kind: SnapshotKind, scheduled: bool) -> SnapshotRecord:
        record = sandbox.record
        snapshot_id = new_snapshot_id(self.host.node_id)
        staging = self.store.staging(snapshot_id)
        estimate = self.backend.disk_used_bytes(record.id)
        if kind == "memory":
            usage = await self.backend.usage(record.id)
            estimate += usage.memory_bytes if usage is not None else 0
        record.snapshotting = SnapshotProgress(
            started_at=utc_now(), phase="capture", bytes=0, scheduled=scheduled, estimated_bytes=estimate
        )
        progress = asyncio.get_running_loop().create_task(self._track_bytes(record, staging))
        try:
            if kind == "memory":
                next_pid = await self._capture_memory(sandbox, staging)
            else:
                await self.backend.copy_disk(record.id, staging / "disk.img")
                next_pid = 1
            if record.snapshotting is not None:
                record.snapshotting.phase = "store"
            snapshot = SnapshotRecord(
                id=snapshot_id, sandbox=record.id, image=record.image, kind=kind,
                bytes=allocated_bytes(staging), created_at=utc_now(), cpus=record.cpus,
                memory_mb=record.memory_mb, disk_mb=record.disk_mb, network=record.network.to_wire(),
                scheduled=scheduled, next_pid=next_pid, runsc_version=record.runsc_version,
            )  # fmt: skip
            await asyncio.to_thread(self.store.commit, staging, snapshot)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(exc, (BackendError, AgentError, OSError)):
                raise Internal(f"the snapshot of sandbox {record.id} failed: {exc}") from exc
            raise
        finally:
            progress.cancel()
            record.snapshotting = None
        self.host.audit.record("snapshot.created", record.id, snapshot=snapshot.id, bytes=snapshot.bytes)
        log.info("snapshot taken", extra={"sandbox": record.id, "snapshot": snapshot.id, "kind": kind})
        return snapshot

    async def _capture_memory(self, sandbox: Sandbox, staging: Path) -> int:
        """Checkpoint, copy process records and disk, then restore the sandbox; returns the next handle."""
        record = sandbox.record
        async with sandbox.lock:  # a DELETE meanwhile waits for the capture, then ends the sandbox
            if record.state is not SandboxState.RUNNING:
                raise Conflict(f"sandbox {record.id} is {record.state.value}; the snapshot was not taken")
            await self._quiesce(sandbox, "being snapshotted")
            # In the sandbox's own directory first: a sandboxd killed before the restore below finds it there
            # and restores the sandbox from it at its next start (take_back_stopped).
            image = sandbox.directory / CAPTURE_IMAGE
            shutil.rmtree(image, ignore_errors=True)
            try:
                await self.backend.checkpoint(record.id, image, restored_at_once=True)
            except BackendError:
                await self._recover(sandbox)
                raise
            try:
                # Complete up to the quiesce: the agent sent everything before it closed the connection.
                await asyncio.to_thread(shutil.copytree, sandbox.processes.directory, staging / "processes")
                await self.backend.copy_disk(record.id, staging / "disk.img", below_checkpoint=True)
            except BaseException:
                await asyncio.shield(self._restart(sandbox, image))
                shutil.rmtree(image, ignore_errors=True)
                raise
            await asyncio.shield(self._restart(sandbox, image))
            os.rename(image, staging / "memory")  # the same file system: the state directory
            return sandbox.processes.next_pid

    async def _restart(self, sandbox: Sandbox, image: Path) -> None:
        """Bring the checkpointed sandbox back from ``image`` after a capture; terminate it if it cannot be."""
        try:
            await self.backend.restore(sandbox.record.id, image)
            await self.host.reattach_agent(sandbox)
        except (BackendError, AgentError, OSError) as exc:
            log.error("sandbox could not be restored after a snapshot",
                      extra={"sandbox": sandbox.record.id, "error": str(exc)})  # fmt: skip
            sandbox.processes.paused_reason = None
            if sandbox.record.live:
                await self.host.lose_locked(sandbox, "crashed")

    async def _track_bytes(self, record: SandboxRecord, staging: Path) -> None:
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_SECS)
            if record.snapshotting is not None:
                record.snapshotting.bytes = await asyncio.to_thread(allocated_bytes, staging)

    def delete_snapshot(self, snapshot_id: str, reason: str | None = None) -> None:
        """Delete a snapshot and its files; audit ``snapshot.deleted`` (with ``reason`` when given)."""
        snapshot = self.store.remove(snapshot_id)
        extra = {"reason": reason} if reason else {}
        self.host.audit.record("snapshot.deleted", snapshot.sandbox, snapshot=snapshot_id, **extra)

    # -- forks ------------------------------------------------------------------------------------------

    def fork_request(self, req: CreateSpec) -> tuple[SnapshotRecord, CreateSpec]:
        """Check a create with ``snapshot_id`` against the fork rules; returns the snapshot and the request
        with the snapshot's image and (for a memory fork) resources, or the original's for omitted ones."""
        assert req.snapshot_id is not None
        snapshot = self.store.get(req.snapshot_id)
        if snapshot.kind == "memory":
            refusal = fork_refusal(snapshot.id, snapshot.runsc_version, self.runsc_version)
            if refusal is not None:
                raise refusal
        given = req.fields_given
        if "image" in given and req.image != snapshot.image:
            raise InvalidRequest(
                f"image: a fork of snapshot {snapshot.id} runs its image {snapshot.image!r}; omit image"
            )
        original = {"cpus": snapshot.cpus, "memory_mb": snapshot.memory_mb, "disk_mb": snapshot.disk_mb}
        asked = {"cpus": req.cpus, "memory_mb": req.memory_mb, "disk_mb": req.disk_mb}
        if snapshot.kind == "memory":
            different = [f"{k} (snapshot {original[k]}, asked {asked[k]})"
                         for k in original if k in given and asked[k] != original[k]]  # fmt: skip
            if different:
                raise InvalidRequest(
                    f"a fork of memory snapshot {snapshot.id} keeps its resources; omit "
                    + ", ".join(different)
                )
            if req.network.mode != "none":
                raise Unsupported(
                    "the gvisor backend cannot fork a memory snapshot into a sandbox with a network "
                    "(rule 3 of forks); ask for network mode none, or fork a disk snapshot"
                )
            if req.persistent:
                # A persistent sandbox starts again from its disk alone, and a memory fork's files may be in its
                # restored kernel's own overlay (backends/root_overlay.py, [gvisor] root_overlay), never on it.
                raise Unsupported(
                    f"a fork of memory snapshot {snapshot.id} cannot be persistent: the files of a memory fork "
                    "may live in its restored memory, not on a disk it could start from again; omit "
                    "persistent, or fork a disk snapshot (which a persistent sandbox can)"
                )

        def pick(key: str) -> int:
            return asked[key] if key in given else original[key]

        forked = replace(
            req, image=snapshot.image, cpus=pick("cpus"), memory_mb=pick("memory_mb"), disk_mb=pick("disk_mb")
        )
        return snapshot, forked

    async def boot_fork(self, snapshot: SnapshotRecord, sandbox: Sandbox, image_root: Path) -> None:
        """Boot the fork ``sandbox`` from ``snapshot``; a memory fork takes over the original's process
        records (its processes run on in the fork) before its agent is connected."""
        record = sandbox.record
        record.runsc_version = self.runsc_version
        memory = snapshot.kind == "memory"
        if memory:
            target = sandbox.processes.directory
            await asyncio.to_thread(shutil.rmtree, target, True)
            await asyncio.to_thread(shutil.copytree, self.store.processes_dir(snapshot.id), target)
            sandbox.processes.load()
        await self.backend.boot_from_snapshot(
            record.boot_spec(image_root),
            self.store.disk_image(snapshot.id),
            self.store.memory_image(snapshot.id) if memory else None,
        )  # fmt: skip

    # -- schedules --------------------------------------------------------------------------------------

    def set_schedule(self, ref: str, every_secs: int, keep: int) -> SandboxRecord:
        """Start, change (``every_secs`` > 0) or stop (0) a running sandbox's snapshot schedule."""
        sandbox = self.host.resolve(ref)
        record = sandbox.record
        if record.state is not SandboxState.RUNNING:
            raise Conflict(
                f"sandbox {record.id} is {record.state.value}; a schedule is set on a running sandbox"
            )
        if record.volumes and every_secs:
            raise Conflict(f"sandbox {record.id} has volumes; a sandbox with volumes cannot be snapshotted")
        if every_secs:
            what = "it cannot have a snapshot schedule (scheduled snapshots are memory snapshots)"
            refusal = checkpoint_refusal(record.id, record.runsc_version, self.runsc_version, what)
            if refusal is not None:
                raise refusal
        record.snapshot_every_secs = every_secs
        record.snapshot_keep = keep if every_secs else 0
        sandbox.save()
        old = self._schedules.pop(record.id, None)
        if old is not None:
            old.cancel()
        if every_secs:
            self._start_schedule(record.id)
        return record

    def _start_schedule(self, sandbox_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._schedule_loop(sandbox_id))
        self._schedules[sandbox_id] = task
        task.add_done_callback(
            lambda t: self._schedules.pop(sandbox_id, None) if self._schedules.get(sandbox_id) is t else None
        )

    def stop_schedule(self, sandbox_id: str) -> None:
        task = self._schedules.pop(sandbox_id, None)
        if task is not None:
            task.cancel()

    async def _schedule_loop(self, sandbox_id: str) -> None:
        """Snapshot every ``snapshot_every_secs``, counted from the end of the previous one (rule 1)."""
        while True:
            sandbox = self.host.resolve_or_none(sandbox_id)
            if sandbox is None or not sandbox.record.live or sandbox.record.snapshot_every_secs <= 0:
                return
            await asyncio.sleep(sandbox.record.snapshot_every_secs)
            if sandbox.record.state is not SandboxState.RUNNING:
                continue  # suspended: nothing changes, nothing to keep
            try:
                await self.snapshot(sandbox_id, "memory", scheduled=True)
            except SandboxError as exc:
                log.warning("scheduled snapshot failed", extra={"sandbox": sandbox_id, "error": exc.message})
                continue
            self._apply_retention(sandbox_id, sandbox.record.snapshot_keep)

    def _apply_retention(self, sandbox_id: str, keep: int) -> None:
        """Remove the oldest scheduled snapshots of the sandbox beyond ``keep`` (never a requested one)."""
        scheduled = [s for s in self.store.of_sandbox(sandbox_id) if s.scheduled]
        for old in scheduled[: max(0, len(scheduled) - keep)]:
            with contextlib.suppress(SandboxError):
                self.delete_snapshot(old.id, reason="retention")
