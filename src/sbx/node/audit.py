"""The node's audit log: one JSON line per sandbox event, kept across restarts.

File layout in the log directory::

    events.jsonl      the file being appended to
    events.jsonl.1    the previous generation (newest of the old ones)
    ...
    events.jsonl.5    the oldest kept; the generation before it is dropped at rotation

Each line is ``{"time": <RFC 3339 UTC, milliseconds, "Z">, "type": ..., "sandbox": <id>, ...fields}``.
Rules from the spec: environment values, file contents and process arguments are never recorded.
:func:`process_started_fields` is the only way to describe a started process (program, argument
count and a hash of the arguments), and :meth:`AuditLog.record` drops fields whose names suggest
values or arguments (see ``FORBIDDEN_FIELDS``) instead of writing them.

The log is best-effort: a failed write is logged and never raised, so it cannot refuse a request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from sbx import logfiles
from sbx.node.records import utc_now

log = logging.getLogger(__name__)

LOG_NAME = "events.jsonl"
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_KEEP = 5
DEFAULT_EVENTS_LIMIT = 5000

EVENT_TYPES = frozenset(
    {
        "sandbox.created",
        "sandbox.network_updated",
        "sandbox.updated",
        "sandbox.suspended",
        "sandbox.resumed",
        "sandbox.terminated",
        "snapshot.created",
        "snapshot.deleted",
        "process.started",
        "process.exited",
        "file.read",
        "file.written",
        "file.removed",
        "tunnel.opened",
    }
)
"""The node audit event types the spec names (Events, Node audit events)."""

FORBIDDEN_FIELDS = frozenset(
    {"env", "secret_env", "argv", "args", "stdin", "stdout", "stderr", "data", "content", "contents"}
)
"""Field names that would carry environment values, process arguments or file contents."""

_RESERVED = ("time", "type", "sandbox")
#: Compact separators are relied on by the search pre-filter in events_for. Made once: ``json.dumps`` with
#: options builds an encoder per call, a good part of what recording an event cost.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), default=str)


def rfc3339_now() -> str:
    """The current UTC time as RFC 3339 with milliseconds and a ``Z``, e.g. ``2024-05-01T12:00:00.123Z``."""
    return utc_now()


def args_sha256(argv: Sequence[str]) -> str:
    """SHA-256 (hex) over the arguments after ``argv[0]``, each followed by a NUL byte.

    This is the spec's rule, so a known command line can be matched without being stored.
    A command with no arguments hashes the empty string.
    """
    digest = hashlib.sha256()
    for arg in argv[1:]:
        digest.update(arg.encode("utf-8", "surrogateescape"))
        digest.update(b"\0")
    return digest.hexdigest()


def process_started_fields(
    pid: int, argv: Sequence[str], cwd: str, env_names: Iterable[str]
) -> dict[str, Any]:
    """The fields of a ``process.started`` event: never the arguments nor environment values.

    ``env_names`` may be the request's env mapping itself: iterating a mapping yields its keys,
    so only names are kept (sorted, so the event does not depend on dict order).
    """
    if not argv:
        raise ValueError("argv must name a program")
    return {
        "pid": pid,
        "program": argv[0],
        "arg_count": len(argv) - 1,
        "args_sha256": args_sha256(argv),
        "cwd": cwd,
        "env_names": sorted(env_names),
    }


def process_exited_fields(pid: int, exit_code: int, duration_ms: int) -> dict[str, Any]:
    """The fields of a ``process.exited`` event; ``duration_ms`` in milliseconds."""
    return {"pid": pid, "exit_code": exit_code, "duration_ms": duration_ms}


class AuditLog:
    """Append-only JSONL event log in ``dir`` rotating at ``max_bytes`` with ``keep`` old generations.

    ``max_bytes`` defaults to 8 MiB and ``keep`` to 5 (the spec's values). A file is rotated
    before a line that would take it past ``max_bytes``; a single line larger than that still
    goes into a fresh file on its own. The log file and the files it rotates to have mode 0600.

    :meth:`record` is one ``write()`` of one line on an ``O_APPEND`` descriptor under a lock, so
    it is safe from the event loop and from worker threads. :meth:`events_for` reads up to
    ``(keep + 1) * max_bytes`` from disk (48 MiB at the defaults, tens of milliseconds from the
    page cache): call it through ``asyncio.to_thread`` from a server.
    """

    def __init__(self, dir: Path, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        if keep < 0:
            raise ValueError("keep must be 0 or more")
        self.dir = Path(dir)
        self.path = self.dir / LOG_NAME
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self._failing = False
        # The index: which sandboxes (JSON-encoded ids) have events in which file, so
        # events_for skips files without any. Collected while writing, so it costs a set.add per
        # event and no reading. Keyed by inode, which a file keeps through rotation renames.
        # Files written before a restart are not indexed and are always read.
        self._ino: int | None = None
        self._current_ids: set[bytes] | None = None  # None: the current file predates us
        self._ids_by_inode: dict[int, frozenset[bytes]] = {}

    # -- writing ---------------------------------------------------------------------------

    def record(self, type: str, sandbox: str, **fields: Any) -> None:
        """Append one event ``{time, type, sandbox, **fields}``; never raises.

        ``fields`` named ``time``, ``type`` or ``sandbox`` or listed in ``FORBIDDEN_FIELDS`` are
        dropped with an error in the server log: they are a caller's bug, not a reason to fail.
        """
        with self._lock:
            try:
                self._append(self._encode(type, sandbox, fields), _encode_id(sandbox))
            except Exception as exc:  # noqa: BLE001 - best-effort by contract: the request goes on
                if not self._failing:
                    log.warning("audit log %s: could not record %s for %s: %s", self.path, type, sandbox, exc)
                self._failing = True
                self._close_fd()
            else:
                if self._failing:
                    log.warning("audit log %s: writable again", self.path)
                self._failing = False

    def close(self) -> None:
        """Close the log file; a later :meth:`record` reopens it."""
        with self._lock:
            self._close_fd()

    def _encode(self, type: str, sandbox: str, fields: dict[str, Any]) -> bytes:
        if type not in EVENT_TYPES:
            log.warning("audit event type %r is not one the spec names", type)
        event: dict[str, Any] = {"time": rfc3339_now(), "type": type, "sandbox": sandbox}
        for name, value in fields.items():
            if name in _RESERVED or name in FORBIDDEN_FIELDS:
                log.error("audit event %s: field %r dropped (reserved or may carry a value)", type, name)
                continue
            event[name] = value
        text = _ENCODER.encode(event)
        return text.encode("utf-8", "surrogateescape") + b"\n"

    def _append(self, line: bytes, encoded_id: bytes) -> None:
        if self._fd is None:
            self._open()
        if self._size > 0 and self._size + len(line) > self.max_bytes:
            self._rotate()
            self._open()
        assert self._fd is not None
        if self._current_ids is not None:
            # Added before the write: a failed write leaves a superset, which costs a read, not an event.
            self._current_ids.add(encoded_id)
        written = os.write(self._fd, line)
        self._size += written
        if written != len(line):
            # A short write (disk full) leaves a partial line; the next open repairs the newline.
            self._close_fd()
            raise OSError(f"short write ({written} of {len(line)} bytes)")

    def _open(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, size, inode = logfiles.open_append(self.path)
        if inode != self._ino:
            # A file we have not been indexing: only an empty one can be indexed from now on.
            self._ino = inode
            self._current_ids = set() if size == 0 else None
        self._fd = fd
        self._size = size

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _rotate(self) -> None:
        self._close_fd()
        if self._ino is not None and self._current_ids is not None:
            self._ids_by_inode[self._ino] = frozenset(self._current_ids)
        self._ino = None
        self._current_ids = None
        logfiles.rotate(self.path, self.keep)

    def _generation(self, n: int) -> Path:
        return logfiles.generation(self.path, n)

    # -- reading ---------------------------------------------------------------------------

    def events_for(
        self, sandbox_id: str, limit: int = DEFAULT_EVENTS_LIMIT
    ) -> tuple[list[dict[str, Any]], bool]:
        """The events of ``sandbox_id``, oldest first: the newest ``limit`` and whether more existed.

        Reads the current file and every kept generation, newest first, and stops as soon as
        more than ``limit`` events were found. Lines that do not parse (a fragment left by a
        crash) are skipped. Raises ``OSError`` when the log directory cannot be read: unlike
        writing, reading is not best-effort.
        """
        if limit < 0:
            raise ValueError("limit must be 0 or more")
        encoded_id = _encode_id(sandbox_id)
        needle = b'"sandbox":' + encoded_id
        newest_first: list[list[dict[str, Any]]] = []
        found = 0
        opened = self._open_generations()
        try:
            for f, known, size in opened:
                if known is not None and encoded_id not in known:
                    continue
                events = _matching(f.read() if size is None else f.read(size), needle, sandbox_id)
                newest_first.append(events)
                found += len(events)
                if found > limit:
                    break
        finally:
            for f, _, _ in opened:
                f.close()
        ordered = [event for events in reversed(newest_first) for event in events]
        truncated = len(ordered) > limit
        if truncated:
            ordered = ordered[len(ordered) - limit :]
        return ordered, truncated

    def _open_generations(self) -> list[tuple[BinaryIO, frozenset[bytes] | None, int | None]]:
        """Every generation opened, newest first: ``(file, sandbox ids in it or None, length)``.

        Opened under the write lock: an open file keeps its contents through a later rotation,
        and reading the current file only up to the noted length never sees a half-appended line.
        Rotated generations never change, so they are read whole (length ``None``). The ids are
        ``None`` for a file not indexed (written before this process).
        """
        opened: list[tuple[BinaryIO, frozenset[bytes] | None, int | None]] = []
        inodes_seen: set[int] = set()
        with self._lock:
            try:
                for n in range(self.keep + 1):
                    try:
                        f: BinaryIO = open(self._generation(n), "rb")  # noqa: SIM115 - the caller closes it
                    except FileNotFoundError:
                        continue
                    st = os.fstat(f.fileno())
                    if n == 0:
                        current = self._current_ids if st.st_ino == self._ino else None
                        known = None if current is None else frozenset(current)
                        opened.append((f, known, st.st_size))
                    else:
                        opened.append((f, self._ids_by_inode.get(st.st_ino), None))
                    inodes_seen.add(st.st_ino)
            except BaseException:
                for f, _, _ in opened:
                    f.close()
                raise
            # Forget dropped generations, so the index holds at most keep files.
            for inode in list(self._ids_by_inode):
                if inode not in inodes_seen:
                    del self._ids_by_inode[inode]
        return opened


def _matching(data: bytes, needle: bytes, sandbox_id: str) -> list[dict[str, Any]]:
    """Events of ``sandbox_id`` in ``data`` (JSON lines), in file order.

    Searches for the serialised ``"sandbox":"<id>"`` first so only candidate lines are parsed;
    the parsed top-level ``sandbox`` is then checked, since a nested object may carry the key too.
    """
    events: list[dict[str, Any]] = []
    pos = data.find(needle)
    while pos != -1:
        start = data.rfind(b"\n", 0, pos) + 1
        end = data.find(b"\n", pos)
        if end == -1:
            end = len(data)
        try:
            event = json.loads(data[start:end])
        except ValueError:
            event = None
        if isinstance(event, dict) and event.get("sandbox") == sandbox_id:
            events.append(event)
        pos = data.find(needle, end)
    return events


def _encode_id(sandbox_id: str) -> bytes:
    """The id as it appears in a line after ``"sandbox":`` (same encoding as the events)."""
    return json.dumps(sandbox_id, ensure_ascii=False).encode("utf-8", "surrogateescape")
