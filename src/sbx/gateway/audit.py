"""The gateway's audit log: one JSON line per authenticated API request and per revocation, drain or org event.

File ``--audit-log FILE`` (default ``audit/gateway.jsonl`` beside the state file), mode 0600, rotated at 8 MiB
keeping five old generations (``FILE.1`` newest .. ``FILE.5`` oldest). Entries::

    {"time", "kind", "type", "key_id"?, "user"?, "tenant"?, "org"?, "method"?, "route"?, "status"?,
     "target"?, "node"?, "result"?}

``kind`` is ``api``, ``revocation``, ``drain`` or ``org``; ``type`` is ``api.request``, ``api.revoked``,
``drain.terminate``, ``org.created``, ``org.member_added``, ``org.member_role``, ``org.member_removed``.
``route`` is the path's shape (``/v1/sandboxes/{ref}/run``), never the query string; a credential is named by
its key id only. Best-effort: a failed write is logged, never raised.

Off the answer's path: inside an event loop an entry is queued and written in the loop's next turn, after
the answer was sent, with every other entry queued meanwhile in one write (a request costs a dict, not a JSON
encoding and a system call, before its answer). Reading or closing the log writes what is queued first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sbx import logfiles

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
DEFAULT_KEEP = 5
#: Fields an entry may carry; anything else is dropped (so no body, header or query can slip in).
ALLOWED_FIELDS = frozenset(
    {
        "kind",
        "type",
        "key_id",
        "user",
        "tenant",
        "org",
        "method",
        "route",
        "status",
        "target",
        "node",
        "result",
        # SSH (docs/ssh.md): a login's key fingerprint, a session's kind and forwarded port, a refusal's reason.
        "fingerprint",
        "session",
        "port",
        "reason",
    }
)


class GatewayAudit:
    """Append-only JSONL log rotating at ``max_bytes`` (8 MiB) with ``keep`` (5) old generations."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._size = 0
        self._failing = False
        #: Entries not written yet: (wall time in seconds, fields), oldest first.
        self._queued: list[tuple[float, dict[str, Any]]] = []

    def record(self, **fields: Any) -> None:
        """Append ``{time, **fields}`` (only ``ALLOWED_FIELDS``, None values left out); never raises.

        In an event loop the entry is written in the loop's next turn (see the module's docstring), else now."""
        entry: dict[str, Any] = {}
        for name, value in fields.items():
            if name not in ALLOWED_FIELDS:
                log.error("gateway audit field %r dropped", name)
            elif value is not None:
                entry[name] = value
        with self._lock:
            self._queued.append((time.time(), entry))
            first = len(self._queued) == 1
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.flush()
            return
        if first:
            loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write every queued entry, in one write unless the file must rotate on the way (at ``max_bytes``)."""
        with self._lock:
            queued, self._queued = self._queued, []
            if not queued:
                return
            try:
                if self._fd is None:
                    self._open()
                chunk = bytearray()
                for when, entry in queued:
                    line = _line(when, entry)
                    if self._size + len(chunk) > 0 and self._size + len(chunk) + len(line) > self.max_bytes:
                        self._write(bytes(chunk))
                        chunk.clear()
                        self._rotate()
                        self._open()
                    chunk += line
                self._write(bytes(chunk))
                self._failing = False
            except OSError as exc:
                if not self._failing:
                    log.warning("gateway audit log %s: could not record: %s", self.path, exc)
                self._failing = True
                self._close()

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        if data:
            self._size += os.write(self._fd, data)

    def close(self) -> None:
        self.flush()
        with self._lock:
            self._close()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._fd, self._size, _ = logfiles.open_append(self.path)

    def _close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _generation(self, n: int) -> Path:
        return logfiles.generation(self.path, n)

    def _rotate(self) -> None:
        self._close()
        logfiles.rotate(self.path, self.keep)

    def read(self, since: datetime | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """Entries at or after ``since``, oldest first: the first ``limit`` and whether more followed.

        Reads the kept generations oldest first (at most 48 MiB): call it through ``asyncio.to_thread``.
        """
        entries: list[dict[str, Any]] = []
        self.flush()
        with self._lock:
            generations = [self._generation(n) for n in range(self.keep, -1, -1)]
            blobs = []
            for path in generations:
                try:
                    blobs.append(path.read_bytes())
                except FileNotFoundError:
                    continue
        for blob in blobs:
            for raw in blob.splitlines():
                try:
                    entry = json.loads(raw)
                    when = datetime.fromisoformat(entry["time"])
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue  # a fragment left by a crash
                if since is not None and when < since:
                    continue
                entries.append(entry)
                if len(entries) > limit:
                    return entries[:limit], True
        return entries, False


#: One encoder for every line (``json.dumps`` with options builds a new one per call).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _line(when: float, entry: dict[str, Any]) -> bytes:
    """One JSON line, ``time`` first: RFC 3339 UTC with milliseconds and a ``Z``."""
    stamp = datetime.fromtimestamp(when, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return (_ENCODER.encode({"time": stamp, **entry}) + "\n").encode()
