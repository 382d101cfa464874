"""Which runsc made what, and what cannot work across two of them.

A checkpoint (a suspended sandbox's image, a memory snapshot) is gVisor's saved kernel state: only the runsc
release that made it restores it ("container specs not found in metadata during restore", measured from
20240729 to the pinned build). A running sandbox is checkpointed by its own sentry, the runsc that booted or last
restored it, whatever runsc sandboxd runs now. So the node records that runsc's version (``RunscInfo.version``)
in every sandbox record and every snapshot record, and refuses (409, before touching anything) what would need
one runsc to restore another's image: suspending or memory-snapshotting a sandbox another runsc started (the
restore would fail and the sandbox would be lost), resuming a sandbox another runsc suspended, and forking a
memory snapshot another runsc made. Disk snapshots, disk forks and DELETE work across versions
(docs/backends.md, "Upgrading the runtime under existing state").

State from before the records named a runsc is stamped once, at the first start that finds it
(:class:`RuntimeLedger`): with the runsc that last served the state directory (``<state>/runtime.json``), or,
when there is no such file (the sandboxd before ``[paths] runsc`` always ran ``runsc`` from ``PATH``), with the
version of the ``runsc`` on ``PATH``, else :data:`UNKNOWN`, which differs from every runsc (refused rather
than risked).

A backend without runsc (``runtime_report().runsc_version`` unset) records nothing and refuses nothing.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Final

from sbx.api.errors import Conflict
from sbx.backends.base import Backend, BackendError
from sbx.backends.runsc import read_version
from sbx.statefile import read_json, write_json_atomic

log = logging.getLogger(__name__)

#: The state-level file naming the runsc that last served the state directory.
MARKER_NAME: Final = "runtime.json"
#: The stamp of state whose runsc could not be found out: never the same as a runsc's version.
UNKNOWN: Final = "unknown"


def current_runsc(backend: Backend) -> str | None:
    """The version of the runsc ``backend`` runs sandboxes on (valid after its ``check``); None for a backend
    without one."""
    version = backend.runtime_report().runsc_version
    return version if isinstance(version, str) and version else None


def runsc_on_path() -> str | None:
    """The version of the ``runsc`` on ``PATH`` (what sandboxd ran before ``[paths] runsc``), None without one."""
    path = shutil.which("runsc")
    if path is None:
        return None
    try:
        return read_version(path) or None
    except BackendError:
        return None


def differs(made_by: str | None, current: str | None) -> bool:
    """Whether what ``made_by`` made (None: not recorded) cannot be restored by ``current`` (None: a backend
    without runsc, which compares nothing). Unknown differs from every version."""
    return current is not None and (made_by == UNKNOWN or made_by != current)


def describe(version: str | None) -> str:
    """``runsc 0.0~20240729.0``, or what an unknown one is called in a message."""
    if version is None or version == UNKNOWN:
        return "a runsc whose version was not recorded (from before sandboxd recorded it)"
    return f"runsc {version}"


def _disk_route(sandbox_id: str) -> str:
    """What gives the user a sandbox's files whatever runsc made it."""
    request = f'POST /v1/sandboxes/{sandbox_id}/snapshots with {{"kind": "disk"}}'
    return f"take a disk snapshot ({request}) and create from it"


def checkpoint_refusal(
    sandbox_id: str, made_by: str | None, current: str | None, what: str
) -> Conflict | None:
    """The 409 for saving the memory of a running sandbox ``made_by`` started while this node runs ``current``
    (``what``: what is therefore not done), or None when it may be saved. The sandbox's own sentry would make
    the checkpoint and ``current`` could not restore it: the sandbox would be lost."""
    if not differs(made_by, current):
        return None
    return Conflict(
        f"sandbox {sandbox_id} was started by {describe(made_by)} and this node now runs runsc {current}, "
        f"which cannot restore a memory checkpoint of it, so {what} (it runs on, unchanged); "
        f"{_disk_route(sandbox_id)}, or recreate the sandbox"
    )


def resume_refusal(sandbox_id: str, made_by: str | None, current: str | None) -> Conflict | None:
    """The 409 for resuming a sandbox ``made_by`` suspended while this node runs ``current``, or None."""
    if not differs(made_by, current):
        return None
    again = (
        f"; a node serving this state with runsc {made_by} again ([paths] runsc) could resume it"
        if made_by is not None and made_by != UNKNOWN
        else ""
    )
    return Conflict(
        f"sandbox {sandbox_id} was suspended by {describe(made_by)} and this node now runs runsc {current}, "
        f"which cannot restore its checkpoint; it stays suspended with its disk: {_disk_route(sandbox_id)}, "
        f"or delete it{again}"
    )


def fork_refusal(snapshot_id: str, made_by: str | None, current: str | None) -> Conflict | None:
    """The 409 for forking a memory snapshot ``made_by`` made while this node runs ``current``, or None."""
    if not differs(made_by, current):
        return None
    where = describe(made_by) if made_by is not None and made_by != UNKNOWN else "the runsc that made it"
    return Conflict(
        f"snapshot {snapshot_id} is a memory snapshot made by {describe(made_by)} and this node now runs runsc "
        f"{current}, which cannot restore it; the snapshot is kept: fork it on a node running {where}, fork a "
        f"disk snapshot instead, or delete it (DELETE /v1/snapshots/{snapshot_id})"
    )


class RuntimeLedger:
    """The runsc that last served a state directory (``<state>/runtime.json``) and the stamp of state whose
    records name no runsc. Used once per start: :meth:`stamp` each record read, then :meth:`save`."""

    def __init__(
        self, state_dir: Path, current: str | None, find_previous: Callable[[], str | None] | None = None
    ) -> None:
        """``current``: the runsc this start runs (None: a backend without runsc, nothing is stamped);
        ``find_previous``: what ran before when no marker says (default :func:`runsc_on_path`), asked at most
        once and only when some record names no runsc."""
        self.path = state_dir / MARKER_NAME
        self.current = current
        data = read_json(self.path)
        found = data.get("runsc_version") if isinstance(data, dict) else None
        #: The runsc the marker names, None when there is none (a fresh state dir, or one from before it).
        self.last: str | None = found if isinstance(found, str) and found else None
        self._find_previous = find_previous if find_previous is not None else runsc_on_path
        self._unrecorded: str | None = None

    def unrecorded(self) -> str:
        """What made state whose record names no runsc: the marker's runsc, else the one on ``PATH``, else
        :data:`UNKNOWN` (found out on first use, then kept)."""
        if self._unrecorded is None:
            from_path = None if self.last is not None else self._find_previous()
            self._unrecorded = self.last or from_path or UNKNOWN
            log.info(
                "state from before runsc versions were recorded is taken as made by the runsc that served it",
                extra={"runsc": self._unrecorded, "from": MARKER_NAME if self.last is not None else "PATH"},
            )
        return self._unrecorded

    def stamp(self, recorded: str | None) -> str | None:
        """The version to record for state that records ``recorded``: itself when set (or when this start has
        no runsc), else :meth:`unrecorded`."""
        if recorded is not None or self.current is None:
            return recorded
        return self.unrecorded()

    def save(self) -> None:
        """Name the current runsc as the one that last served the state dir (written only when it changed)."""
        if self.current is not None and self.current != self.last:
            write_json_atomic(self.path, {"runsc_version": self.current})
