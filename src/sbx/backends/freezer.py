"""Freezing a sandbox's cgroup: the kernel stops every process in it where it stands, so an idle sandbox costs no
CPU at all, and lets them go on where they were when it is thawed (docs/backends.md, "Parking").

Why a backend needs it: an idle gVisor sandbox on systrap is not idle on the host. Its sentry starts one
goroutine per sandbox (``controlFastPath``, pkg/sentry/platform/systrap/metrics.go of release 20240729) that
sleeps ``recordingPeriod`` = 400 us in a loop for ever, 2,500 wake-ups a second, with nothing running inside:
2-4 % of a core per sandbox here, measured, and no runsc flag turns it off. A frozen cgroup uses none.

Both cgroup layouts are handled, as host_counters.py reads them:

- v1 (one hierarchy per controller, a hybrid host included): ``<root>/freezer/<path>/freezer.state``, written
  ``FROZEN`` or ``THAWED``, read as ``THAWED``, ``FREEZING`` (not every task stopped yet) or ``FROZEN``;
- v2 (unified): ``<root>/<path>/cgroup.freeze`` written ``1`` or ``0``; ``cgroup.events`` says ``frozen 1``
  once every task is stopped.

Freezing takes well under a millisecond for an idle sandbox here, thawing is immediate (the write returns when
the tasks may run). Two things a frozen group does not do, which callers must know: a v1 frozen task does not
act on SIGKILL until it is thawed, and anything that asks the sandbox a question (runsc's control socket, the
agent) waits until the thaw. So the group is thawed before a sandbox is destroyed.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Literal

from sbx.backends.base import BackendError
from sbx.backends.host_counters import CGROUP_ROOT, is_unified

#: How long a freeze may take to stop every task, in seconds, before it is undone and reported as failed (a task
#: in an uninterruptible sleep, e.g. waiting on a stuck disk, keeps a v1 group FREEZING).
FREEZE_TIMEOUT_SECS = 5.0
#: Polling while FREEZING: the first checks come quickly (an idle sandbox freezes in well under a ms).
_POLL_SECS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02)

FreezerState = Literal["thawed", "freezing", "frozen"]


class CgroupFreezer:
    """Freezes and thaws the cgroups at ``<parent>/<name>`` under ``root`` (both layouts, see the module)."""

    def __init__(self, parent: str, root: Path = CGROUP_ROOT) -> None:
        """``parent``: the cgroup path the sandboxes' groups are children of (``/sandboxd``)."""
        self.parent = parent.strip("/")
        self.root = root
        self._unified: bool | None = None

    @property
    def unified(self) -> bool:
        if self._unified is None:
            self._unified = is_unified(self.root)
        return self._unified

    def group_dir(self, name: str) -> Path:
        """The directory holding the freezer files of the group ``name``."""
        if self.unified:
            return self.root / self.parent / name
        return self.root / "freezer" / self.parent / name

    def usable(self) -> bool:
        """Whether this host has a freezer where sandboxes' groups are made (v2 always has one)."""
        return self.unified or (self.root / "freezer").is_dir()

    def state(self, name: str) -> FreezerState | None:
        """The group's state, None when it does not exist (the sandbox is not running)."""
        group = self.group_dir(name)
        try:
            if self.unified:
                events = (group / "cgroup.events").read_text()
                if (group / "cgroup.freeze").read_text().strip() != "1":
                    return "thawed"
                return "frozen" if "\nfrozen 1" in "\n" + events else "freezing"
            text = (group / "freezer.state").read_text().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise BackendError(f"cannot read the freezer state of cgroup {group}: {exc.strerror}") from exc
        return {"FROZEN": "frozen", "FREEZING": "freezing"}.get(text, "thawed")  # type: ignore[return-value]

    def has_tasks(self, name: str) -> bool:
        """Whether any process is in the group (a frozen group's processes exist, stopped)."""
        group = self.group_dir(name)
        try:
            return bool((group / "cgroup.procs").read_text().strip())
        except OSError:
            return False

    def _write(self, name: str, frozen: bool) -> bool:
        """Ask for the state; False when the group does not exist."""
        group = self.group_dir(name)
        path, value = (
            (group / "cgroup.freeze", "1" if frozen else "0")
            if self.unified
            else (group / "freezer.state", "FROZEN" if frozen else "THAWED")
        )
        try:
            fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise BackendError(f"cannot open the freezer of cgroup {group}: {exc.strerror}") from exc
        try:
            os.write(fd, value.encode())
        except OSError as exc:
            raise BackendError(
                f"cannot {'freeze' if frozen else 'thaw'} cgroup {group}: {exc.strerror}"
            ) from exc
        finally:
            os.close(fd)
        return True

    async def freeze(self, name: str, timeout_secs: float = FREEZE_TIMEOUT_SECS) -> None:
        """Freeze the group and wait until every task in it is stopped; idempotent.

        BackendError when the group does not exist, or when it is not frozen within ``timeout_secs`` (it is
        thawed again first: a failed freeze leaves the sandbox running).
        """
        if not self._write(name, True):
            raise BackendError(f"the sandbox's cgroup {self.group_dir(name)} does not exist; is it running?")
        deadline = time.monotonic() + timeout_secs
        polls = iter(_POLL_SECS)
        while (state := self.state(name)) != "frozen":
            if state is None:
                raise BackendError("the sandbox stopped while it was being frozen")
            if time.monotonic() > deadline:
                self.thaw(name)
                raise BackendError(
                    f"the sandbox's processes were not all stopped within {timeout_secs:g} s (one is in an "
                    "uninterruptible wait); it was left running"
                )
            await asyncio.sleep(next(polls, _POLL_SECS[-1]))

    def thaw(self, name: str) -> None:
        """Let every task of the group run again; idempotent, and nothing when the group does not exist. The
        write returns once the tasks may run (no waiting is needed)."""
        self._write(name, False)
