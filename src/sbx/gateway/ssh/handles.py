"""Open SFTP files: reads from one streamed ``GET .../files``, writes into one streamed ``PUT .../files``, and
``dd`` for the rest (see ``guestfs.py``).

SFTP reads and writes name an offset each; clients send them in order (OpenSSH's ``sftp`` and ``scp`` keep up
to 64 requests in flight, in increasing offsets, and the server answers them one at a time), so:

- **Reads** are served from a stream of the whole file, opened with the file; a read ahead of the stream (a
  resumed download) skips forward in it. A read behind the stream, or more than :data:`SKIP_AHEAD_BYTES` ahead
  of it, is served on its own by ``dd`` (random access: one command per read).
- **Writes** to a file that is new or opened with truncation, from offset 0 on, stream into one ``PUT``: an
  upload is one request, whatever its size up to the node's 64 MiB body cap. Past the cap, and for any write
  that does not continue the last one (or to a file opened without truncation, or in append mode), a ``dd`` is
  started at that offset and fed through its stdin; it writes in place without truncating. The file is
  complete when the handle is closed (or ``fsync`` is asked): a ``PUT`` replaces the file when its body ends.
  A segment that fails fails every later write and the close (the data did not all get in); a file still open
  when the session ends is abandoned (``Writer.abort``): a ``PUT`` is dropped, a ``dd`` ends with what it has.

A new file gets the permissions the client asked for; an overwritten one keeps its own (as ``open(2)`` with
``O_TRUNC`` would), though a ``PUT`` gives a new inode: its hard links to the old contents are not updated.
"""

from __future__ import annotations

import asyncio
import errno
import posixpath
import stat
from collections.abc import AsyncIterator

import aiohttp

from sbx.gateway.ssh.guestfs import FIND_FORMAT, DdWriter, GuestError, GuestFs, SetAttrs, parse_records
from sbx.web.http import FILE_BODY_CAP

#: A read at most this far ahead of the stream skips forward in it (a resumed download); farther, or behind
#: it, it is a ``dd`` of its own.
SKIP_AHEAD_BYTES = 64 << 20
#: Bytes read from the stream at once.
_CHUNK_BYTES = 1 << 20
#: Bytes a ``PUT`` takes at most (the node's body cap); the rest of a longer upload goes through ``dd``.
PUT_CAP_BYTES = FILE_BODY_CAP
#: Chunks queued for a ``PUT`` before a write waits for the node to take them.
_QUEUED_CHUNKS = 16
#: The mode a ``PUT`` gives a file it makes.
PUT_MODE = 0o644


class Reader:
    """The read side of an open file."""

    def __init__(self, fs: GuestFs, path: str) -> None:
        self.fs = fs
        self.path = path
        self._resp: aiohttp.ClientResponse | None = None
        self._pos = 0  # file offset of self._buf[0]
        self._buf = bytearray()
        self._eof = False

    async def open(self) -> None:
        """Start the stream (so a missing or unreadable file is refused at open)."""
        self._resp = await self.fs.open_read(self.path)

    async def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset``; ``b""`` at or past the end."""
        end = self._pos + len(self._buf)
        if self._resp is None or not self._pos <= offset <= end + SKIP_AHEAD_BYTES:
            return await self.fs.read_range(self.path, offset, size)
        try:
            while self._pos + len(self._buf) < offset and not self._eof:  # skip ahead, keeping nothing
                self._pos += len(self._buf)
                self._buf.clear()
                await self._fill(offset - self._pos)
            skip = min(offset - self._pos, len(self._buf))
            del self._buf[:skip]
            self._pos += skip
            while len(self._buf) < size and not self._eof:
                await self._fill(size - len(self._buf))
        except (aiohttp.ClientError, OSError) as exc:
            raise GuestError(errno.EIO, f"the read of {self.path} stopped: {exc}") from None
        if self._pos < offset:  # past the end
            return b""
        data = bytes(self._buf[:size])
        del self._buf[: len(data)]
        self._pos += len(data)
        return data

    async def _fill(self, wanted: int) -> None:
        """Read one chunk of the stream (at most ``_CHUNK_BYTES``) into the buffer."""
        assert self._resp is not None
        chunk = await self._resp.content.read(min(max(wanted, 64 * 1024), _CHUNK_BYTES))
        if not chunk:
            self._eof = True
        self._buf += chunk

    def close(self) -> None:
        if self._resp is not None:
            self._resp.close()
            self._resp = None


class _Put:
    """A ``PUT`` whose body is fed chunk by chunk."""

    def __init__(self, fs: GuestFs, path: str) -> None:
        self.sent = 0
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(_QUEUED_CHUNKS)
        self._task = asyncio.create_task(fs.put(path, self._chunks()))

    async def _chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self._queue.get()) is not None:
            yield chunk

    async def _offer(self, item: bytes | None) -> None:
        """Queue ``item`` unless the PUT ended (then its error is raised)."""
        if self._task.done():
            await self._task  # raises the node's refusal
            raise GuestError(errno.EIO, "the upload ended early")
        put = asyncio.create_task(self._queue.put(item))
        await asyncio.wait({put, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not put.done():
            put.cancel()
            await self._task  # raises the node's refusal
            raise GuestError(errno.EIO, "the upload ended early")

    async def write(self, data: bytes) -> None:
        await self._offer(data)
        self.sent += len(data)

    async def close(self) -> None:
        await self._offer(None)
        await self._task

    def abort(self) -> None:
        self._task.cancel()


class Writer:
    """The write side of an open file (see the module's docstring)."""

    def __init__(
        self, fs: GuestFs, path: str, *, fresh: bool, append: bool, restore_mode: int | None = None
    ) -> None:
        self.fs = fs
        self.path = path
        #: The file is to be empty (new, or truncated at open) and nothing is written yet.
        self.fresh = fresh
        self.append = append
        #: Permissions to set once the data is in (a new file's requested mode, an overwritten file's own).
        self.restore_mode = restore_mode
        self._segment: _Put | DdWriter | None = None
        self._end = 0  # file offset after the segment's last byte
        self._failure: GuestError | None = None

    async def write(self, offset: int, data: bytes) -> None:
        if self._failure is not None:
            raise self._failure
        view = memoryview(data)
        while view:
            segment = self._segment
            if segment is not None and (self.append or offset == self._end):
                room = PUT_CAP_BYTES - segment.sent if isinstance(segment, _Put) else len(view)
                if room > 0:
                    part = bytes(view[:room])
                    await segment.write(part)
                    self._end += len(part)
                    offset += len(part)
                    view = view[len(part) :]
                    continue
            await self._start(offset)

    async def _start(self, offset: int) -> None:
        """End the current segment and start one at ``offset``."""
        await self.flush()
        if self.fresh and offset == 0 and not self.append:
            self._segment = _Put(self.fs, self.path)
        else:
            if self.fresh:  # truncation was asked at open: do it before writing in place
                await self.fs.put(self.path, _nothing())
            self._segment = await self.fs.open_writer(self.path, None if self.append else offset)
        self.fresh = False
        self._end = offset

    async def flush(self) -> None:
        """Make what was written so far the file's (``fsync``, ``fstat``, and before a new segment). A failure
        is kept: every later write, flush and the close fail with it too (the data did not all get in)."""
        if self._failure is not None:
            raise self._failure
        segment, self._segment = self._segment, None
        if segment is not None:
            try:
                await segment.close()
            except GuestError as exc:
                self._failure = exc
                raise

    async def close(self) -> None:
        """Finish the file: end the last segment, create or truncate a file nothing was written to, then set
        its permissions."""
        try:
            await self.flush()
            if self.fresh:
                await self.fs.put(self.path, _nothing())
                self.fresh = False
            if self.restore_mode is not None and self.restore_mode != PUT_MODE:
                await self.fs.setstat(self.path, SetAttrs(permissions=self.restore_mode))
        finally:
            self.abort()

    def abort(self) -> None:
        segment, self._segment = self._segment, None
        if segment is not None:
            segment.abort()


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield  # pragma: no cover - an empty async generator


async def open_for_write(
    fs: GuestFs, path: str, *, create: bool, truncate: bool, exclusive: bool, append: bool,
    permissions: int | None,
) -> Writer:  # fmt: skip
    """A writer of ``path`` after the checks ``open(2)`` makes: the parent is a directory, a file that must not
    exist does not, one that must does, and it is not a directory. A symlink is written through."""
    parent = posixpath.dirname(path) or "/"
    # The parent's and the file's attributes, then whether each is writable (w or r).
    script = (
        'find -L "$1" -maxdepth 0 -printf "$3" || exit 1; find "$2" -maxdepth 0 -printf "$3" 2>/dev/null; '
        '[ -w "$1" ] && printf w || printf r; [ -w "$2" ] && printf w || printf r'
    )
    out = await fs.command(["sh", "-c", script, "sh", parent, path, FIND_FORMAT])
    records, _, flags = out.rpartition(b"\0")
    found = parse_records(records)
    if not found or not stat.S_ISDIR(found[0].mode):
        raise GuestError(errno.ENOTDIR, f"{parent}: Not a directory")
    parent_writable, file_writable = flags[:1] == b"w", flags[1:2] == b"w"
    if len(found) < 2:
        if not create:
            raise GuestError(errno.ENOENT, f"{path}: No such file or directory")
        if not parent_writable:
            raise GuestError(errno.EACCES, f"{path}: Permission denied")
        return Writer(fs, path, fresh=True, append=append, restore_mode=permissions)
    attrs = found[1]
    if exclusive:
        raise GuestError(errno.EEXIST, f"{path}: File exists")
    if stat.S_ISDIR(attrs.mode):
        raise GuestError(errno.EISDIR, f"{path}: Is a directory")
    if not file_writable:
        raise GuestError(errno.EACCES, f"{path}: Permission denied")
    if truncate and (stat.S_ISLNK(attrs.mode) or not parent_writable):
        # A PUT replaces the file through a new one beside it: a link would be replaced, not written through,
        # and an unwritable directory takes no new file. Truncate in place instead, then write in place.
        await fs.command(["truncate", "-s", "0", "--", path])
        truncate = False
    mode = attrs.mode & 0o7777 if truncate else None
    return Writer(fs, path, fresh=truncate, append=append, restore_mode=mode)
