"""A process's output on the host: an append-only record file that followers read from the start.

Record layout: one byte (1 stdout, 2 stderr; with the high bit set the record is a *drop marker*: it stands
for bytes that were dropped and carries no data), a big-endian uint32 length, then the data. The sum of
lengths per stream, kept and dropped, is the offset the agent has been acknowledged up to, so it can be
rebuilt after a restart. The last record of an exited process is kind 3, the exit: a big-endian int32 exit
code and a float64 Unix time. The file is created by the first record: a process that never printed has none.

Data records are only ever appended. A stream has one drop marker, whose length is updated in place as more
bytes are dropped (a new one is appended only after 4 GiB), so a process printing forever past the bound
never makes the file grow. Readers skip markers, so an update never disturbs them.

The output of a sandbox's processes shares one :class:`OutputBudget`: the bytes of data records (headers
included) its logs may hold together. Past it, output is dropped and counted (followers then see
``truncated``); :meth:`OutputLog.drop_output` replaces an exited process's log by its summary (a marker per
stream and the exit record), which is how the budget is given back.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from sbx.statefile import write_bytes_atomic

STREAMS = {"stdout": 1, "stderr": 2}
_NAMES = {v: k for k, v in STREAMS.items()}
_DROPPED = 0x80
_EXIT = 3
_HEADER = struct.Struct(">BI")
_EXIT_BODY = struct.Struct(">id")
_MAX_RECORD = 0xFFFFFFFF

#: Output kept on the host per sandbox, in bytes (64 MiB): the data records of all its processes' logs
#: together. Beyond it output is counted and dropped, so a sandbox printing forever cannot fill the host disk.
DEFAULT_BUDGET_BYTES = 64 * 1024 * 1024
#: Bytes of a log that are bookkeeping, outside the budget: a drop marker per stream and the exit record.
SUMMARY_BYTES = 2 * _HEADER.size + _HEADER.size + _EXIT_BODY.size


class OutputBudget:
    """The bytes of output one sandbox keeps on the host, shared by its processes' logs.

    ``limit_bytes`` bounds the data records of all the logs together (headers included; the few bytes of
    :data:`SUMMARY_BYTES` per log are outside it). When a log needs more than is left, ``reclaim(needed)``
    may free room (by dropping the output of exited processes) and returns how many bytes it gave back.
    """

    def __init__(self, limit_bytes: int = DEFAULT_BUDGET_BYTES, reclaim: Callable[[int], int] | None = None):
        self.limit_bytes = limit_bytes
        self.reclaim = reclaim
        #: Bytes the logs hold now.
        self.used_bytes = 0

    def grant(self, wanted: int) -> int:
        """Take up to ``wanted`` bytes (reclaiming when short); returns how many were taken."""
        short = wanted - (self.limit_bytes - self.used_bytes)
        if short > 0 and self.reclaim is not None:
            self.reclaim(short)
        granted = max(0, min(wanted, self.limit_bytes - self.used_bytes))
        self.used_bytes += granted
        return granted

    def charge(self, size: int) -> None:
        """Count ``size`` bytes a log already holds (one read back after a restart)."""
        self.used_bytes += size

    def refund(self, size: int) -> None:
        """Give back ``size`` bytes a log no longer holds."""
        self.used_bytes = max(0, self.used_bytes - size)


class OutputLog:
    """Writer side plus change notification for followers. Single writer, many readers.

    ``budget`` is the sandbox's (a budget of its own, of the default size, when None). ``new``: the caller
    knows there is no file yet (a process just started), so none is looked for.
    """

    def __init__(self, path: Path, budget: OutputBudget | None = None, *, new: bool = False) -> None:
        self.path = path
        self.budget = budget or OutputBudget()
        self.offsets = {"stdout": 0, "stderr": 0}
        self.kept = {"stdout": 0, "stderr": 0}
        #: Bytes of data records in the file (what the budget was charged for).
        self.charged = 0
        self.truncated = False
        self.closed = False
        #: Set once the process has exited: its code and the Unix time it was recorded.
        self.exit_code: int | None = None
        self.exited_at: float | None = None
        #: What followers wait on; made by the first (most processes are never followed).
        self._changed: asyncio.Condition | None = None
        self._fd: int | None = None
        self._size = 0
        #: Per stream: (file offset, length) of its drop marker, when it has one.
        self._markers: dict[str, tuple[int, int]] = {}
        #: Changes when the output is dropped: followers then stop reading the file.
        self._generation = 0
        #: Whether the file may exist (it does once written; a log made ``new`` has none until then).
        self._on_disk = not new
        if not new and path.exists():
            self._scan()
            self.budget.charge(self.charged)

    def _scan(self) -> None:
        """Rebuild the per-stream offsets from an existing file (after a sandboxd restart)."""
        with open(self.path, "rb") as f:
            data = f.read()
        pos = 0
        while pos + _HEADER.size <= len(data):
            kind, length = _HEADER.unpack_from(data, pos)
            if kind == _EXIT and length == _EXIT_BODY.size and pos + _HEADER.size + length <= len(data):
                self.exit_code, self.exited_at = _EXIT_BODY.unpack_from(data, pos + _HEADER.size)
                self.closed = True
                pos += _HEADER.size + length
                continue
            dropped = bool(kind & _DROPPED)
            name = _NAMES.get(kind & ~_DROPPED)
            end = pos + _HEADER.size + (0 if dropped else length)
            if name is None or end > len(data):
                # A record cut by a kill mid-write: drop the tail so the file is whole again.
                os.truncate(self.path, pos)
                break
            self.offsets[name] += length
            if dropped:
                self.truncated = True
                self._markers[name] = (pos, length)
            else:
                self.kept[name] += length
                self.charged += end - pos
            pos = end
        self._size = pos

    def _open(self) -> int:
        if self._fd is None:
            self._on_disk = True
            # Not O_APPEND: drop markers are updated in place (pwrite ignores offsets under O_APPEND).
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return self._fd

    def _write(self, record: bytes) -> int:
        """Append ``record`` with one write (a reader never sees half a header once a kill cut nothing);
        returns the file offset it was written at."""
        at = self._size
        os.pwrite(self._open(), record, at)
        self._size += len(record)
        return at

    async def append(self, stream: str, data: bytes) -> None:
        """Record ``data`` of ``stream`` (``stdout`` or ``stderr``) and wake followers; what the budget has no
        room for is dropped and counted."""
        granted = self.budget.grant(_HEADER.size + len(data)) if data else 0
        kept = data[: max(0, granted - _HEADER.size)]
        if kept:
            self._write(_HEADER.pack(STREAMS[stream], len(kept)) + kept)
            self.kept[stream] += len(kept)
            self.charged += granted
        elif granted:
            self.budget.refund(granted)  # room for a header alone: keep nothing
        if len(kept) < len(data):
            self._drop(stream, len(data) - len(kept))
        self.offsets[stream] += len(data)
        await self._notify()

    async def _notify(self) -> None:
        """Wake the followers, if any."""
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    def _drop(self, stream: str, count: int) -> None:
        """Count ``count`` bytes of ``stream`` as dropped in its drop marker."""
        self.truncated = True
        marker = self._markers.get(stream)
        if marker is not None and marker[1] + count <= _MAX_RECORD:
            at, length = marker
            os.pwrite(self._open(), struct.pack(">I", length + count), at + 1)
            self._markers[stream] = (at, length + count)
        else:
            at = self._write(_HEADER.pack(STREAMS[stream] | _DROPPED, count))
            self._markers[stream] = (at, count)

    async def finish(self, exit_code: int, exited_at: float) -> None:
        """Record the exit (``exited_at``: Unix time) as the last record, then close. A process that printed
        nothing has no file, and gets none: its exit is in its record (sbx.node.process_journal), and creating
        a file is most of what a run of such a process would cost the host."""
        if self._size:
            self._write(_HEADER.pack(_EXIT, _EXIT_BODY.size) + _EXIT_BODY.pack(exit_code, exited_at))
        self.exit_code, self.exited_at = exit_code, exited_at
        await self.close()

    def ended(self) -> None:
        """The process is known to have exited (its record says so, read back after a restart): no output
        will come, even when the file holds no exit record (a process that printed nothing has no file)."""
        self.closed = True

    async def close(self) -> None:
        """No more output will come (the process exited); wakes followers so they finish."""
        self.closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        await self._notify()

    def drop_output(self) -> int:
        """Replace the log of an exited process by its summary: a drop marker per stream with its whole
        offset, then the exit record, so offsets, exit code and ``truncated`` survive. Followers stop where
        they are. Returns the budget bytes given back (0 when nothing was kept, or the process runs)."""
        if not self.closed or self._fd is not None or self.charged == 0:
            return 0
        summary = b""
        for stream, kind in STREAMS.items():
            left = self.offsets[stream]
            while left > 0:
                summary += _HEADER.pack(kind | _DROPPED, min(left, _MAX_RECORD))
                left -= min(left, _MAX_RECORD)
        if self.exit_code is not None and self.exited_at is not None:
            summary += _HEADER.pack(_EXIT, _EXIT_BODY.size) + _EXIT_BODY.pack(self.exit_code, self.exited_at)
        write_bytes_atomic(self.path, summary, durable=False)
        freed, self.charged = self.charged, 0
        self.budget.refund(freed)
        self.kept = {"stdout": 0, "stderr": 0}
        self.truncated = True
        self._size = len(summary)
        self._markers = {}
        self._generation += 1
        return freed

    def remove(self) -> None:
        """Delete the log and give its budget back (the process is forgotten)."""
        if self._on_disk:
            self.path.unlink(missing_ok=True)
        self.budget.refund(self.charged)
        self.charged = 0
        self._generation += 1

    async def follow(self, chunk_bytes: int = 256 * 1024) -> AsyncIterator[tuple[str, bytes]]:
        """Yield ``(stream, data)`` from the beginning, waiting for more until the log is closed. Ends early
        when the output is dropped meanwhile (:meth:`drop_output`)."""
        pos = 0
        generation = self._generation
        if self._changed is None:
            self._changed = asyncio.Condition()
        changed = self._changed
        while True:
            async with changed:
                while not self.closed and _file_size(self.path) <= pos:
                    await changed.wait()
            if self._generation != generation:
                return
            size = _file_size(self.path)
            if size <= pos and self.closed:
                return
            # Page-cache reads of at most chunk_bytes: far below a millisecond, not worth a thread hop.
            with open(self.path, "rb") as f:  # noqa: ASYNC230
                f.seek(pos)
                data = f.read(min(size - pos, max(chunk_bytes, _HEADER.size)))
            consumed = 0
            while consumed + _HEADER.size <= len(data):
                if self._generation != generation:
                    return  # dropped while the caller held the last record
                kind, length = _HEADER.unpack_from(data, consumed)
                if kind & _DROPPED:
                    consumed += _HEADER.size
                    continue
                if kind == _EXIT:
                    if consumed + _HEADER.size + length > len(data):
                        break
                    consumed += _HEADER.size + length
                    continue
                end = consumed + _HEADER.size + length
                if end > len(data):
                    if consumed == 0:
                        # A record larger than the chunk: read it whole.
                        with open(self.path, "rb") as f:  # noqa: ASYNC230
                            f.seek(pos + _HEADER.size)
                            payload = f.read(length)
                        yield _NAMES[kind], payload
                        consumed = _HEADER.size + length
                    break
                yield _NAMES[kind], data[consumed + _HEADER.size : end]
                consumed = end
            pos += consumed


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
