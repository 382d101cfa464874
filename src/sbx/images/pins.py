"""Blob pins shared between processes: what a pull under way in any process keeps from garbage collection.

Several processes may use one images directory (two sandboxd on a host, a test suite's servers, an image
builder beside the node). A pull pins the blobs it is about to install; a collection in another process must
not delete them. Layout under ``blobs/`` (beside ``sha256/``, which holds only blobs)::

    .gc.lock           flock: shared while a process rewrites its pin file, exclusive while a collection runs
    .pins-<pid>-<rand> the digests one process has pinned, one per line; flock-ed exclusively by that process
                       for as long as it exists

A collection takes ``.gc.lock`` exclusively, then reads every pin file another process still holds (its lock
cannot be taken) and removes those whose owner is gone (a killed process's lock went with it). Since a process
rewrites its pin file only under the shared lock, a collection never reads half a file, and a pin written
before the collection started is always seen.

Locks are ``flock``s: per open file, released by the kernel when the process dies, never inherited across
``exec``. Blocking: ``update`` waits for a running collection (a directory listing and some unlinks).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
from collections.abc import Collection, Iterator
from pathlib import Path

GC_LOCK = ".gc.lock"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
PIN_PREFIX = ".pins-"


@contextlib.contextmanager
def _flock(path: Path, mode: int) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, mode)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases its lock


class PinFile:
    """This process's pins in ``root`` (``blobs/``): :meth:`update` publishes them, :meth:`close` removes
    them. Not thread-safe: one owner (a :class:`~sbx.images.blobs.BlobStore`) calls it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._fd: int | None = None
        self._path: Path | None = None

    def update(self, digests: Collection[str]) -> None:
        """Publish ``digests`` as this process's pins (replacing the previous set; empty removes the file)."""
        if not digests:
            self.close()
            return
        with _flock(self.root / GC_LOCK, fcntl.LOCK_SH):
            if self._fd is None:
                self._path = self.root / f"{PIN_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
                self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            data = "".join(f"{d}\n" for d in sorted(digests)).encode()
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)

    def close(self) -> None:
        """Remove the pin file (nothing pinned by this process any more)."""
        if self._fd is None or self._path is None:
            return
        with _flock(self.root / GC_LOCK, fcntl.LOCK_SH):
            self._path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = self._path = None

    def owns(self, name: str) -> bool:
        """Whether ``name`` (an entry of the root) is this process's own pin file."""
        return self._path is not None and name == self._path.name


@contextlib.contextmanager
def collecting(root: Path, own: PinFile) -> Iterator[set[str]]:
    """Hold off every other process's pin changes while the block runs (a collection), and give the digests
    they have pinned; removes the pin files of processes that are gone. ``own``'s file is skipped: the caller
    knows its own pins."""
    with _flock(root / GC_LOCK, fcntl.LOCK_EX):
        pinned: set[str] = set()
        for entry in os.scandir(root):
            if not entry.name.startswith(PIN_PREFIX) or own.owns(entry.name):
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:  # its owner lives: its pins hold
                    with os.fdopen(os.dup(fd), encoding="ascii", errors="replace") as pins:
                        pinned.update(line.strip() for line in pins if _DIGEST.fullmatch(line.strip()))
                else:  # its owner died with its pins: stale
                    os.unlink(entry.path)
            finally:
                os.close(fd)
        yield pinned
