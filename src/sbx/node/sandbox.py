"""One sandbox as this node holds it: its record, processes, agent connection, lock, and what its image says
about how processes run (Env, WorkingDir)."""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
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
        self.last_activity = time.monotonic()
        self.processes = ProcessTable(record.id, directory / "processes", audit, guest, on_change=self.touch)
        self.lock = asyncio.Lock()
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
        """Note activity: a request naming the sandbox, or a process starting or exiting."""
        self.last_activity = time.monotonic()

    def save(self, durable: bool = True) -> None:
        """Persist the record atomically (``durable``: fsynced, surviving a power loss too)."""
        write_json_atomic(self.directory / "sandbox.json", self.record.to_disk(), durable=durable)
