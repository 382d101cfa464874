"""One sandbox as this node holds it: its record, processes, agent connection, lock, what its image says about
how processes run (Env, WorkingDir), and what its idle timeout and parking go by (activity, holds, parked)."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from sbx.backends.base import GuestUser
from sbx.images.store import ImageConfig
from sbx.node.audit import AuditLog
from sbx.node.processes import ProcessTable
from sbx.node.records import SandboxRecord
from sbx.statefile import read_json, write_json_atomic

log = logging.getLogger(__name__)


class Sandbox:
    """A sandbox known to this node: its record, its processes and its agent connection."""

    def __init__(self, record: SandboxRecord, directory: Path, audit: AuditLog, guest: GuestUser) -> None:
        """``guest``: who its processes and file transfers run as (the backend's)."""
        self.record = record
        self.directory = directory
        #: When a request last named it or a process last started or exited (time.monotonic seconds).
        self.last_activity = time.monotonic()
        self.processes = ProcessTable(
            record.id, directory / "processes", audit, guest, on_change=self.touch, wake=self.wake
        )
        self.lock = asyncio.Lock()
        #: Requests in progress naming it and operations under way that need it awake (see :meth:`hold`): it
        #: is neither parked nor idled out under them.
        self.holds = 0
        #: Parked: its processes are stopped on the host (sbx.node.parking); the API still says running.
        self.parked = False
        #: A dormant persistent sandbox being woken (sbx.node.persistent): its cpus and memory count as held.
        self.waking = False
        #: Held while it is being parked or woken (one at a time).
        self.park_lock = asyncio.Lock()
        #: No park is tried before this (time.monotonic seconds) after one found the guest busy or failed,
        #: and how many did in a row (the delay doubles; sbx.node.idle.park_retry_delay).
        self.park_retry_at = 0.0
        self.park_refusals = 0
        #: Its idle timer (sbx.node.idle.IdleTimers): the handle and the monotonic time it fires at.
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        #: Called when its activity, holds or processes change (the node re-arms its timer), and what wakes
        #: it when parked (sbx.node.parking.Parking.wake); set by the manager.
        self.on_change: Callable[[Sandbox], None] | None = None
        self.waker: Callable[[Sandbox], Awaitable[None]] | None = None
        #: Environment from the image, below the sandbox's own env (see routes/processes.py).
        self.image_env: dict[str, str] = {}
        #: Default cwd of processes: the image's WorkingDir when it names a directory, else None (home).
        self.working_dir: str | None = None

    def set_image_config(self, config: ImageConfig, rootfs: Path | None) -> None:
        """Take Env and WorkingDir from the image config (User, Entrypoint and Cmd are not used)."""
        self.image_env = dict(config.env)
        self.working_dir = None
        wd = (config.working_dir or "").strip("/")
        if config.working_dir and config.working_dir.startswith("/") and rootfs is not None:
            try:
                # lstat, not is_dir: a symlink in an image must never lead the host's check outside it.
                is_dir = stat.S_ISDIR(os.lstat(rootfs / wd).st_mode) if wd else True
            except OSError:
                is_dir = False
            if is_dir:
                self.working_dir = "/" + wd
            else:
                log.info("image WorkingDir is not a directory; processes start in the home",
                         extra={"sandbox": self.record.id, "working_dir": config.working_dir})  # fmt: skip

    def save_image_config(self) -> None:
        write_json_atomic(
            self.directory / "image-config.json",
            {"env": self.image_env, "working_dir": self.working_dir},
            durable=False,
        )

    def load_image_config(self) -> bool:
        """Read image-config.json; False when there is none (a sandbox created before it existed)."""
        data = read_json(self.directory / "image-config.json")
        if not isinstance(data, dict):
            return False
        self.image_env = {str(k): str(v) for k, v in (data.get("env") or {}).items()}
        wd = data.get("working_dir")
        self.working_dir = wd if isinstance(wd, str) else None
        return True

    def touch(self) -> None:
        """Note activity: a request naming the sandbox, or a process starting or exiting. Under a hold the
        timer is not told: nothing can be due while a request is in progress, and the release tells it."""
        self.last_activity = time.monotonic()
        if self.holds == 0:
            self.changed()

    def changed(self) -> None:
        """Tell the node that what its idle timer goes by changed (activity, holds, processes)."""
        if self.on_change is not None:
            self.on_change(self)

    def hold(self) -> None:
        """Keep the sandbox from being parked or idled out until :meth:`release` (a request or operation under
        way)."""
        self.holds += 1

    def release(self, activity: bool = True) -> None:
        """End a :meth:`hold`; with ``activity`` (a request ending) the idle time counts from now."""
        self.holds -= 1
        if activity:
            self.touch()
        else:
            self.changed()

    async def wake(self) -> None:
        """Make sure the sandbox is not parked (a few milliseconds when it is; nothing otherwise). Call before
        anything that reaches its agent or the backend's commands about it, under a :meth:`hold` or a
        request (which holds it) so that it cannot be parked again meanwhile."""
        if self.parked and self.waker is not None:
            await self.waker(self)

    def save(self, durable: bool = True) -> None:
        """Persist the record atomically (``durable``: fsynced, surviving a power loss too)."""
        write_json_atomic(self.directory / "sandbox.json", self.record.to_disk(), durable=durable)
