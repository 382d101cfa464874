"""Persistent sandboxes (capability ``persistent``, docs/node-api.md "Persistent sandboxes"): a workspace that
sleeps when idle and wakes on the next request that needs it.

States of a persistent sandbox and what moves it (``dormant`` = suspended or stopped)::

    running --idle timeout--> suspended --wake / resume--> running
    running --POST stop-----> stopped   --wake / resume--> running (booted from its disk)
    suspended --POST stop / a memory image that cannot be restored--> stopped
    running --crash (sandboxd and runsc killed, a host reboot)--> stopped (reason crash)
    any --DELETE--> terminated

A dormant sandbox holds its disk only (the node's accounting counts its ``disk_mb``, not its cpus, memory or
place among ``max_sandboxes``), so a wake first checks that its cpus and memory fit (503 naming what is short,
nothing changed). Every transition happens under the sandbox's lock, so a wake racing a DELETE, a stop or another
wake finds the state the other left: a second wake does nothing, a wake after a DELETE finds it terminated.

What is kept where: a suspended sandbox's memory in its checkpoint (checkpoints.py); a stopped one's disk in its
backend's writable layer (journaled, synced at the stop), its process records and their output in its
directory, its volumes held and attached.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from sbx.agent.client import AgentError
from sbx.api.errors import Conflict, Internal, SandboxError, Unavailable
from sbx.api.node import Resources
from sbx.backends.base import BackendError, PersistentBackend
from sbx.node.records import SandboxRecord, SandboxState

if TYPE_CHECKING:
    from sbx.images.store import ImageStore
    from sbx.node.checkpoints import Checkpoints
    from sbx.node.host import SandboxHost
    from sbx.node.reservations import Reservations
    from sbx.node.sandbox import Sandbox
    from sbx.node.volumes import VolumeStore

log = logging.getLogger(__name__)


class PersistentSandboxes:
    """Stop, start and wake of the node's persistent sandboxes (the idle suspend is the manager's timer calling
    :meth:`idle_out`)."""

    def __init__(
        self,
        host: SandboxHost,
        backend: PersistentBackend,
        checkpoints: Checkpoints,
        reservations: Reservations,
        volumes: VolumeStore,
        images: ImageStore,
    ) -> None:
        self.host = host
        self.backend = backend
        self.checkpoints = checkpoints
        self.reservations = reservations
        self.volumes = volumes
        self.images = images

    # -- stop ---------------------------------------------------------------------------------------------

    async def stop(self, ref: str) -> SandboxRecord:
        """``POST .../stop``: end a persistent sandbox's processes and free its memory, keeping its disk; 409 for
        a sandbox that is not persistent, or is pending or terminated. A stopped one is answered as it is."""
        sandbox = self.host.resolve(ref)
        async with sandbox.lock:
            record = sandbox.record
            if not record.persistent:
                raise Conflict(
                    f"sandbox {record.id} is not persistent; only a persistent sandbox can be stopped (suspend "
                    "it to keep its memory, or delete it)"
                )
            if record.state is SandboxState.STOPPED:
                return record
            if record.state not in (SandboxState.RUNNING, SandboxState.SUSPENDED):
                raise Conflict(f"sandbox {record.id} is {record.state.value}; it cannot be stopped")
            if self.checkpoints.snapshotting(record.id):
                raise Conflict(f"a snapshot of sandbox {record.id} is being taken; stop it when that is done")
            await self.stop_locked(sandbox, "request")
            return record

    async def stop_locked(self, sandbox: Sandbox, reason: str) -> None:
        """Stop the live persistent ``sandbox`` for ``reason`` (``request``, ``restore_failed``, ``crash``,
        ``suspend_failed``); the caller holds its lock. Its processes end (exit code -1, their output kept), a
        suspended one's memory image is discarded, its disk and volumes are written out; audit
        ``sandbox.stopped``. A backend that fails to stop it is logged: the sandbox is stopped all the same
        (its next start stops whatever is left first)."""
        record = sandbox.record
        self.host.forget_parked(sandbox)
        agent = sandbox.processes.agent
        sandbox.processes.agent = None  # the watcher must not take the close for a crash
        if agent is not None:
            await agent.close()
        await sandbox.processes.kill_all(drop_output=False)
        sandbox.processes.paused_reason = "stopped"
        try:
            await self.backend.stop(record.id)
        except BackendError as exc:
            log.error(
                "persistent sandbox did not stop cleanly", extra={"sandbox": record.id, "error": str(exc)}
            )
        await self.volumes.flush_of(record.id)
        self.checkpoints.discard_suspend_image(sandbox)
        record.state = SandboxState.STOPPED
        record.stopped_reason = reason
        sandbox.save()
        self.host.state_changed(sandbox)
        self.host.audit.record("sandbox.stopped", record.id, reason=reason)
        log.info("persistent sandbox stopped", extra={"sandbox": record.id, "reason": reason})

    # -- wake -----------------------------------------------------------------------------------------------

    async def wake(self, sandbox: Sandbox, reason: str | None = "request") -> None:
        """Bring a dormant persistent ``sandbox`` back (called under the request's hold, so it cannot fall
        asleep again before the request is served): a suspended one is resumed, a stopped one booted from its
        disk; a suspended one whose memory image cannot be restored is stopped (``restore_failed``) and booted.
        Nothing for a sandbox that is not dormant (another wake got there first, or it was deleted).
        ``reason``: of the ``sandbox.resumed`` event.

        503 ``unavailable`` when the node has no room for its cpus and memory now, and 500 when its disk cannot
        be booted: either way it stays as it was, and a retry may succeed."""
        if not sandbox.record.dormant:
            return
        async with sandbox.lock:
            record = sandbox.record
            if not record.dormant:
                return
            try:
                self.reservations.check(Resources(record.cpus, record.memory_mb, 0))
            except Unavailable as exc:
                raise Unavailable(
                    f"sandbox {record.id} sleeps ({record.state.value}) and cannot be woken now: {exc.message}"
                ) from None
            sandbox.waking = True  # its cpus and memory count from here: a create meanwhile cannot take them
            try:
                if record.state is SandboxState.SUSPENDED:
                    try:
                        await self.checkpoints.resume_locked(sandbox, reason)
                    except SandboxError as exc:
                        log.warning(
                            "persistent sandbox's memory image could not be restored; booting it from its disk",
                            extra={"sandbox": record.id, "error": exc.message},
                        )
                        await self.stop_locked(sandbox, "restore_failed")
                if record.state is SandboxState.STOPPED:
                    await self._start_locked(sandbox)
            finally:
                sandbox.waking = False
                self.host.state_changed(sandbox)

    async def _start_locked(self, sandbox: Sandbox) -> None:
        """Boot a stopped sandbox from its disk: new processes, every file kept; audit ``sandbox.started``."""
        record = sandbox.record
        image = self.images.get(record.image)
        if image is None:  # an image is not removed while a live sandbox uses it: a damaged image store
            raise Internal(f"the image {record.image!r} of sandbox {record.id} is missing; it stays stopped")
        try:
            binds = await self.volumes.mount(record.id, record.volumes)
            await self.backend.restart(record.boot_spec(image.rootfs, binds))
            agent = await self.host.connect_agent(record.id)
        except (BackendError, AgentError, OSError) as exc:
            with contextlib.suppress(BackendError):
                await self.backend.stop(record.id)
            raise Internal(
                f"sandbox {record.id} could not be started from its disk: {exc}; it is still stopped, retry"
            ) from exc
        record.runsc_version = self.checkpoints.runsc_version
        sandbox.processes.paused_reason = None
        await sandbox.processes.attach_agent(agent)
        self.host.watch_agent(sandbox, agent)
        record.state = SandboxState.RUNNING
        record.stopped_reason = None
        sandbox.save()
        sandbox.touch()
        self.host.audit.record("sandbox.started", record.id, reason="request")
        log.info("persistent sandbox started from its disk", extra={"sandbox": record.id})

    # -- idle -----------------------------------------------------------------------------------------------

    async def idle_out(self, sandbox: Sandbox) -> None:
        """Its idle timeout: suspend it (audit reason ``idle``); when it cannot be suspended (the runsc that
        started it is not this one, a checkpoint failed), stop it instead (``suspend_failed``): asleep either
        way, its disk kept. The caller holds its lock and has checked that it is idle."""
        try:
            await self.checkpoints.suspend_locked(sandbox, reason="idle")
        except SandboxError as exc:
            if not sandbox.record.live or sandbox.record.state is not SandboxState.RUNNING:
                return  # the failed checkpoint already stopped it (a crash, see lose_locked)
            log.warning(
                "idle persistent sandbox could not be suspended; stopping it, its disk kept",
                extra={"sandbox": sandbox.record.id, "error": exc.message},
            )
            await self.stop_locked(sandbox, "suspend_failed")
