"""The gateway's audit log: one JSON line per authenticated API request and per revocation, drain or org event.

File ``--audit-log FILE`` (default ``audit/gateway.jsonl`` beside the state file), mode 0600, rotated at 8 MiB
keeping five old generations (``FILE.1`` newest .. ``FILE.5`` oldest). Entries::

    {"time", "kind", "type", "key_id"?, "user"?, "tenant"?, "org"?, "method"?, "route"?, "status"?,
     "target"?, "node"?, "result"?}

``kind`` is ``api``, ``revocation``, ``drain`` or ``org``; ``type`` is ``api.request``, ``api.revoked``,
``drain.terminate``, ``drain.suspend`` (a persistent sandbox a drain suspended), ``org.created``,
``org.member_added``, ``org.member_role``, ``org.member_removed``.
``route`` is the path's shape (``/v1/sandboxes/{ref}/run``), never the query string; a credential is named by
its key id only. Best-effort: a failed write is logged, never raised.

On PostgreSQL (several replicas): :class:`StoreAudit`, the same entries as rows of the database's ``audit`` table,
written by every replica and read alike by any (docs/ha.md, "Shared by the replicas").

Off the answer's path: inside an event loop an entry is queued and written in the loop's next turn, after
the answer was sent, with every other entry queued meanwhile in one write (a request costs a dict, not a JSON
encoding and a system call, before its answer). Reading or closing the log writes what is queued first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sbx import logfiles
from sbx.gateway.store import Store

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


def _entry(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` without the ones not allowed (logged) and the None values."""
    entry: dict[str, Any] = {}
    for name, value in fields.items():
        if name not in ALLOWED_FIELDS:
            log.error("gateway audit field %r dropped", name)
        elif value is not None:
            entry[name] = value
    return entry


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
        entry = _entry(fields)
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


#: Entries a replica holds while its writer cannot reach the database; more are dropped (and counted in the log).
STORE_QUEUE_MAX = 10_000
#: The writer takes at most this many entries into one transaction.
STORE_BATCH_MAX = 2_000
#: The writer trims the table to its budget after writing this many bytes since its last trim.
STORE_TRIM_EVERY_BYTES = 1024 * 1024
#: The writer, woken by an entry, waits this long for more before it writes (fewer, larger transactions: a
#: transaction costs the replica about 0.3 ms CPU whatever it holds, so at 0.02 s a create cycle's entries went in
#: two or three of them; measured in docs/benchmarks.md). Also the longest a SIGKILL can lose.
STORE_LINGER_SECS = 0.1
#: After a failed write the writer tries again this often (the entries stay queued meanwhile).
STORE_RETRY_SECS = 1.0
#: A read or a close waits at most this long for the entries queued before it to be written.
STORE_FLUSH_WAIT_SECS = 10.0


class StoreAudit:
    """The audit log in the store's ``audit`` table (PostgreSQL: shared by the replicas), with the same entries,
    ``read`` and budget as :class:`GatewayAudit`.

    Budget: the file keeps ``keep + 1`` generations of ``max_bytes`` (48 MiB of lines by default); the table keeps
    the newest ``(keep + 1) * max_bytes`` bytes of lines, trimmed by whichever replica wrote
    ``STORE_TRIM_EVERY_BYTES`` since its last trim (so it may exceed the budget by that much per replica).

    Off the answer's path: ``record`` puts the entry on a bounded queue (``STORE_QUEUE_MAX``) and a writer thread
    encodes and writes everything queued in one transaction (``synchronous_commit`` off; it waits
    ``STORE_LINGER_SECS`` after the first entry for more), so a request waits for no round trip.
    What a crash can lose: a SIGKILL of the replica loses the entries still queued or being written (those of
    about the last ``STORE_LINGER_SECS``: the file writer loses those of the loop's last turn); a PostgreSQL crash
    may lose the last fraction of a second of committed ones. While the database cannot be reached the entries
    wait in the queue (the writer tries again every second); beyond ``STORE_QUEUE_MAX`` new ones are dropped,
    counted in the log."""

    def __init__(self, store: Store, max_bytes: int = DEFAULT_MAX_BYTES, keep: int = DEFAULT_KEEP) -> None:
        self.store = store
        self.budget_bytes = max_bytes * (keep + 1)
        self._cond = threading.Condition()
        self._queued: deque[tuple[float, dict[str, Any]]] = deque()
        self._writing = 0
        self._dropped = 0
        self._closed = False
        self._failing = False
        self._since_trim = 0
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()

    def record(self, **fields: Any) -> None:
        """Queue ``{time, **fields}`` (only ``ALLOWED_FIELDS``, None values left out); never raises or waits."""
        entry = (time.time(), _entry(fields))  # encoded by the writer, off the request's loop
        with self._cond:
            if len(self._queued) >= STORE_QUEUE_MAX:
                self._dropped += 1
                return
            self._queued.append(entry)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._closed:
                    self._cond.wait()
                if not self._queued:
                    return
            if not self._closed:
                time.sleep(STORE_LINGER_SECS)  # the entries of a busy moment go in one transaction
            with self._cond:
                batch = [self._queued.popleft() for _ in range(min(len(self._queued), STORE_BATCH_MAX))]
                self._writing = len(batch)
                dropped, self._dropped = self._dropped, 0
            if dropped:
                log.error("gateway audit entries dropped: the database could not take them in time",
                          extra={"count": dropped})  # fmt: skip
            try:
                rows = _encoded(batch)
                self.store.audit_append(rows)
                written = sum(len(line) for _, line in rows)
                self._since_trim += written
                if self._since_trim >= STORE_TRIM_EVERY_BYTES:
                    self._since_trim = 0
                    self.store.audit_trim(self.budget_bytes)
                if self._failing:
                    log.info("gateway audit entries written again")
                self._failing = False
            except Exception as exc:  # noqa: BLE001 - whatever failed, the entries are kept and tried again
                if not self._failing:
                    log.warning(
                        "gateway audit log: could not record; trying again", extra={"error": str(exc)}
                    )
                self._failing = True
                with self._cond:
                    self._queued.extendleft(reversed(batch))
                    self._writing = 0
                    self._cond.notify_all()
                    if self._closed:
                        return
                    self._cond.wait(STORE_RETRY_SECS)
                continue
            with self._cond:
                self._writing = 0
                self._cond.notify_all()

    def flush(self, timeout_secs: float = STORE_FLUSH_WAIT_SECS) -> bool:
        """Wait until every entry queued before the call is in the database (False after ``timeout_secs``)."""
        deadline = time.monotonic() + timeout_secs
        with self._cond:
            while self._queued or self._writing:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(left, 0.5))
        return True

    def close(self) -> None:
        """Write what is queued (waiting at most ``STORE_FLUSH_WAIT_SECS``), then stop the writer."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(STORE_FLUSH_WAIT_SECS)

    def read(self, since: datetime | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        """As :meth:`GatewayAudit.read`, from the table: this replica's queued entries are written first; another
        replica's show once its writer committed them (milliseconds). Call it through ``asyncio.to_thread``."""
        self.flush()
        since_ms = None if since is None else math.ceil(since.timestamp() * 1000 - 1e-6)
        lines = self.store.audit_read(since_ms, limit + 1)
        entries = [json.loads(line) for line in lines]
        return (entries[:limit], True) if len(entries) > limit else (entries, False)


def _encoded(batch: list[tuple[float, dict[str, Any]]]) -> list[tuple[int, str]]:
    """``(epoch milliseconds, JSON line)`` of each entry; one that cannot be encoded is dropped (logged)."""
    rows = []
    for when, entry in batch:
        try:
            rows.append((int(when * 1000), _line(when, entry)[:-1].decode()))
        except (TypeError, ValueError):
            log.error("gateway audit entry dropped: a field is not JSON", extra={"fields": sorted(entry)})
    return rows


#: What a serving gateway records into: a file, or the store's table.
AuditLog = GatewayAudit | StoreAudit

#: One encoder for every line (``json.dumps`` with options builds a new one per call).
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def _line(when: float, entry: dict[str, Any]) -> bytes:
    """One JSON line, ``time`` first: RFC 3339 UTC with milliseconds and a ``Z``."""
    stamp = datetime.fromtimestamp(when, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return (_ENCODER.encode({"time": stamp, **entry}) + "\n").encode()
