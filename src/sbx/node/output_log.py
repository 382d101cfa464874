"""A process's output on the host: an append-only record file that followers read from the start.

Record layout: one byte (1 stdout, 2 stderr; with the high bit set the record stands for bytes that were
dropped past the cap and carries no data), a big-endian uint32 length, then the data. The sum of lengths per
stream is the offset the agent has been acknowledged up to, so it can be rebuilt after a restart. The last
record of an exited process is kind 3, the exit: a big-endian int32 exit code and a float64 Unix time. The
log is append-only, so recording an exit never rewrites anything.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path

STREAMS = {"stdout": 1, "stderr": 2}
_NAMES = {v: k for k, v in STREAMS.items()}
_DROPPED = 0x80
_EXIT = 3
_HEADER = struct.Struct(">BI")
_EXIT_BODY = struct.Struct(">id")

#: Output kept per stream of a process on the host, in bytes (64 MiB); beyond it, output is counted and
#: dropped so a process printing forever cannot fill the host disk. Followers then see ``truncated``.
DEFAULT_CAP_BYTES = 64 * 1024 * 1024


class OutputLog:
    """Writer side plus change notification for followers. Single writer, many readers."""

    def __init__(self, path: Path, cap_bytes: int = DEFAULT_CAP_BYTES) -> None:
        self.path = path
        self.cap_bytes = cap_bytes
        self.offsets = {"stdout": 0, "stderr": 0}
        self.kept = {"stdout": 0, "stderr": 0}
        self.truncated = False
        self.closed = False
        #: Set once the process has exited: its code and the Unix time it was recorded.
        self.exit_code: int | None = None
        self.exited_at: float | None = None
        self._changed = asyncio.Condition()
        self._fd: int | None = None
        if path.exists():
            self._scan()

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
            else:
                self.kept[name] += length
            pos = end

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        return self._fd

    async def append(self, stream: str, data: bytes) -> None:
        """Record ``data`` of ``stream`` (``stdout`` or ``stderr``) and wake followers."""
        room = max(0, self.cap_bytes - self.kept[stream])
        kept, dropped = data[:room], len(data) - min(room, len(data))
        chunks = []
        if kept:
            chunks.append(_HEADER.pack(STREAMS[stream], len(kept)) + kept)
            self.kept[stream] += len(kept)
        if dropped:
            chunks.append(_HEADER.pack(STREAMS[stream] | _DROPPED, dropped))
            self.truncated = True
        if chunks:
            # One write per record with O_APPEND: a reader never sees half a header once a kill cut nothing.
            os.write(self._open(), b"".join(chunks))
        self.offsets[stream] += len(data)
        async with self._changed:
            self._changed.notify_all()

    async def finish(self, exit_code: int, exited_at: float) -> None:
        """Record the exit (``exited_at``: Unix time) as the last record, then close."""
        os.write(self._open(), _HEADER.pack(_EXIT, _EXIT_BODY.size) + _EXIT_BODY.pack(exit_code, exited_at))
        self.exit_code, self.exited_at = exit_code, exited_at
        await self.close()

    async def close(self) -> None:
        """No more output will come (the process exited); wakes followers so they finish."""
        self.closed = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        async with self._changed:
            self._changed.notify_all()

    async def follow(self, chunk_bytes: int = 256 * 1024) -> AsyncIterator[tuple[str, bytes]]:
        """Yield ``(stream, data)`` from the beginning, waiting for more until the log is closed."""
        pos = 0
        while True:
            async with self._changed:
                while not self.closed and _file_size(self.path) <= pos:
                    await self._changed.wait()
            size = _file_size(self.path)
            if size <= pos and self.closed:
                return
            # Page-cache reads of at most chunk_bytes: far below a millisecond, not worth a thread hop.
            with open(self.path, "rb") as f:  # noqa: ASYNC230
                f.seek(pos)
                data = f.read(min(size - pos, max(chunk_bytes, _HEADER.size)))
            consumed = 0
            while consumed + _HEADER.size <= len(data):
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
