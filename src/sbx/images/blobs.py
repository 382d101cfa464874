"""The content-addressed blob store: image layers, each stored once whatever number of images use it.

Layout under ``images_dir``::

    blobs/sha256/<64 hex>            a complete blob whose SHA-256 was verified before it got this name
    blobs/sha256/.tmp-<hex>-<rand>   a download in progress (or left by a killed one)

A blob only appears under its digest through one ``rename`` of a file that was written, verified (size and
SHA-256) and flushed, so a reader never sees a half or wrong blob. Concurrent fetches of one digest in this
process are joined into one download (:class:`SingleFlight`); two processes fetching the same blob both
download it and the second rename harmlessly replaces an identical file.

Blobs are kept while an installed image records them (the ``layers`` of its image.json) or while a pull in
any process uses them (:meth:`BlobStore.pinned`, published to other processes by :mod:`sbx.images.pins`);
:func:`collect_unused_blobs` deletes the rest.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Awaitable, Callable, Collection, Hashable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Generic, TypeVar

from sbx.api.errors import InvalidRequest
from sbx.images.pins import PinFile, collecting
from sbx.images.store import ImageStore

log = logging.getLogger(__name__)

#: Temporary files older than this (seconds since last write) belong to a dead download and are deleted by GC.
STALE_TMP_SECS = 3600.0

_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")
_TMP_PREFIX = ".tmp-"

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class DigestMismatch(InvalidRequest):
    """A blob's content does not match its digest or declared size (400 invalid_request)."""


def digest_hex(digest: str) -> str:
    """The hex part of ``sha256:<hex>``; raises InvalidRequest for anything else."""
    match = _DIGEST.match(digest)
    if not match:
        raise InvalidRequest(f"unsupported digest {digest!r}: only sha256:<64 lowercase hex> is supported")
    return match.group(1)


class SingleFlight(Generic[K, T]):
    """Join concurrent calls with one key into one running coroutine.

    The first caller of :meth:`run` with a key starts ``make()`` as a task; callers arriving while it runs
    await the same task and get its result or exception. The task is cancelled only once every caller
    waiting on it has been cancelled, so one impatient caller does not fail the others.
    """

    def __init__(self) -> None:
        self._tasks: dict[K, tuple[asyncio.Task[T], list[int]]] = {}

    def running(self, key: K) -> bool:
        """Whether a call with ``key`` is in flight."""
        return key in self._tasks

    async def run(self, key: K, make: Callable[[], Awaitable[T]]) -> T:
        """The result of the in-flight call with ``key``, starting ``make()`` when there is none."""
        entry = self._tasks.get(key)
        if entry is None:

            async def call() -> T:
                return await make()

            task = asyncio.get_running_loop().create_task(call())
            entry = (task, [0])
            self._tasks[key] = entry
            task.add_done_callback(lambda _t: self._forget(key, entry))
        task, waiters = entry
        waiters[0] += 1
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done() and waiters[0] == 1:
                task.cancel()
            raise
        finally:
            waiters[0] -= 1

    def _forget(self, key: K, entry: tuple[asyncio.Task[T], list[int]]) -> None:
        if self._tasks.get(key) is entry:
            del self._tasks[key]
        task = entry[0]
        # Retrieve the exception so asyncio does not log "never retrieved" when every caller was cancelled.
        if not task.cancelled():
            task.exception()


class BlobWriter:
    """A blob being written: bytes go to a temporary file while their SHA-256 is computed.

    ``expected_size`` (bytes) is enforced as data arrives, so a registry cannot fill the disk past what the
    manifest declared. :meth:`commit` verifies and renames; :meth:`discard` deletes. Not thread-safe.
    """

    def __init__(self, final: Path, digest: str, expected_size: int | None) -> None:
        self.digest = digest
        self.expected_size = expected_size
        self._final = final
        fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{final.name}-", dir=final.parent)
        self._fd: int | None = fd
        self.tmp_path = Path(tmp)
        self._hash = hashlib.sha256()
        self.offset = 0

    def write(self, data: bytes) -> None:
        """Append ``data``; raises DigestMismatch when the blob grows past its declared size."""
        if self.expected_size is not None and self.offset + len(data) > self.expected_size:
            raise DigestMismatch(
                f"blob {self.digest} is larger than the {self.expected_size} bytes its manifest declares"
            )
        assert self._fd is not None, "write after commit or discard"
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        self._hash.update(data)
        self.offset += len(data)

    def restart(self) -> None:
        """Drop everything written so far (a server ignored a range request and sends the whole blob)."""
        assert self._fd is not None
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        self._hash = hashlib.sha256()
        self.offset = 0

    def commit(self) -> Path:
        """Verify size and digest, flush, and give the blob its final name; returns that path.

        Raises DigestMismatch (and deletes the temporary file) when the content is not the blob asked for.
        """
        try:
            if self.expected_size is not None and self.offset != self.expected_size:
                raise DigestMismatch(
                    f"blob {self.digest} ended after {self.offset} bytes; its manifest declares "
                    f"{self.expected_size}"
                )
            actual = f"sha256:{self._hash.hexdigest()}"
            if actual != self.digest:
                raise DigestMismatch(
                    f"blob {self.digest} has content with digest {actual}: the registry served corrupt or "
                    "different data"
                )
            assert self._fd is not None
            os.fchmod(self._fd, 0o444)
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.rename(self.tmp_path, self._final)
            return self._final
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Delete the temporary file (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        with suppress(FileNotFoundError):
            os.unlink(self.tmp_path)


class BlobStore:
    """Verified blobs under ``<images_dir>/blobs/sha256``; one instance per images directory per process.

    Its async methods must run on one event loop; file writes are small appends done inline.
    """

    def __init__(self, images_dir: Path) -> None:
        self.root = Path(images_dir) / "blobs" / "sha256"
        self._flights: SingleFlight[str, Path] = SingleFlight()
        self._pins: dict[str, int] = {}
        # Beside sha256/, not in it: that directory holds only blobs and their downloads.
        self._pin_file = PinFile(self.root.parent)

    def path(self, digest: str) -> Path:
        """Where the blob ``digest`` lives (whether or not it is there)."""
        return self.root / digest_hex(digest)

    def has(self, digest: str) -> bool:
        """Whether the complete blob ``digest`` is stored."""
        return self.path(digest).is_file()

    def size(self, digest: str) -> int:
        """The size in bytes of the stored blob ``digest`` (FileNotFoundError when absent)."""
        return self.path(digest).stat().st_size

    def digests(self) -> set[str]:
        """Every stored blob."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return set()
        return {f"sha256:{n}" for n in names if re.fullmatch(r"[0-9a-f]{64}", n)}

    def open_writer(self, digest: str, expected_size: int | None) -> BlobWriter:
        """A :class:`BlobWriter` for ``digest``; commit it to store the blob."""
        final = self.path(digest)
        self._make_root()
        return BlobWriter(final, digest, expected_size)

    async def ensure(
        self, digest: str, expected_size: int | None, fill: Callable[[BlobWriter], Awaitable[None]]
    ) -> Path:
        """The path of blob ``digest``, fetching it with ``fill(writer)`` when it is not stored yet.

        ``fill`` writes the content into the writer (it may call ``writer.restart()``); the store then
        verifies and commits it. Concurrent calls for one digest share one ``fill``; on any error nothing
        is left behind and the error propagates to every caller waiting on it.
        """
        path = self.path(digest)
        if path.is_file() and (expected_size is None or path.stat().st_size == expected_size):
            return path

        async def fetch() -> Path:
            writer = self.open_writer(digest, expected_size)
            try:
                await fill(writer)
                # commit fsyncs a possibly large file: keep that off the event loop.
                return await asyncio.to_thread(writer.commit)
            finally:
                writer.discard()

        return await self._flights.run(digest, fetch)

    @contextmanager
    def pinned(self, digests: Collection[str]) -> Iterator[None]:
        """Keep ``digests`` from :meth:`collect_garbage` while the block runs (a pull not yet installed), in this
        process and in every other that collects this store (the pins are published to a file of the store:
        :mod:`sbx.images.pins`). Entering and leaving wait for another process's collection under way."""
        for d in digests:
            self._pins[d] = self._pins.get(d, 0) + 1
        try:
            self._make_root()
            self._pin_file.update(self._pins.keys())
            yield
        finally:
            for d in digests:
                self._pins[d] -= 1
                if not self._pins[d]:
                    del self._pins[d]
            self._pin_file.update(self._pins.keys())

    def collect_garbage(self, keep: Collection[str]) -> int:
        """Delete every blob not in ``keep`` and not pinned, and stale temporary files; returns bytes freed."""
        if not self.root.is_dir():
            return 0
        # Other processes' pins hold still (and are read) while this runs.
        with collecting(self.root.parent, self._pin_file) as pinned_elsewhere:
            keep_hex = {digest_hex(d) for d in (*keep, *self._pins, *pinned_elsewhere)}
            return self._delete_unkept(keep_hex)

    def _delete_unkept(self, keep_hex: set[str]) -> int:
        freed = 0
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return 0
        now = time.time()
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
                if entry.name.startswith(_TMP_PREFIX):
                    if now - st.st_mtime < STALE_TMP_SECS:
                        continue
                elif entry.name in keep_hex or not re.fullmatch(r"[0-9a-f]{64}", entry.name):
                    continue
                os.unlink(entry.path)
                freed += st.st_size
                log.info("deleted unused blob %s (%d bytes)", entry.name, st.st_size)
            except FileNotFoundError:
                continue
        return freed

    def _make_root(self) -> None:
        # 0700 like the images directory: layers may hold files the host's other users must not read.
        self.root.parent.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.root.parent.mkdir(mode=0o700, exist_ok=True)
        self.root.mkdir(mode=0o700, exist_ok=True)


def recorded_layers(store: ImageStore) -> set[str]:
    """The layer digests recorded by every installed image of ``store``."""
    return {layer for image in store.list() for layer in image.layers}


def collect_unused_blobs(store: ImageStore, blobs: BlobStore) -> int:
    """Delete the blobs no installed image records (nor a running pull uses); returns bytes freed.

    Blocking (lists images, unlinks files): call it through ``asyncio.to_thread`` from async code, after
    removing images (``DELETE /v1/images``). A pull under way in another process keeps its blobs (its pins).
    """
    return blobs.collect_garbage(recorded_layers(store))
