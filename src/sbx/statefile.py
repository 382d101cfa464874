"""Crash-safe JSON state files (the node's state directory, the image store).

A state file is replaced, never edited: the new contents go to a temporary file in the same
directory, which is flushed to disk and then renamed over the old one. ``rename`` is atomic on
POSIX file systems, so a reader (or a restarted ``sandboxd`` after a SIGKILL or power loss) sees
either the complete old version or the complete new one. A temporary file left behind by a kill
is ignored by :func:`read_json`; :func:`remove_stale_tmp_files` clears them at startup.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any

# Temporary files are ``.<name>.<random>.sbx-tmp`` so they never match the real name or a glob on it.
_TMP_SUFFIX = ".sbx-tmp"


def _tmp_prefix(path: Path) -> str:
    return f".{path.name}."


def write_json_atomic(path: Path, obj: Any, durable: bool = True) -> None:
    """Replace ``path`` with ``obj`` as JSON, atomically and durably.

    Writes to a temporary file in the same directory (so the rename never crosses file systems),
    fsyncs it, renames it over ``path`` and fsyncs the directory so the rename itself survives a
    power loss. With ``durable=False`` both fsyncs are skipped: the replacement is still atomic
    against a killed process (the page cache outlives it), just not against a power loss; for
    records on a hot path that a host crash makes moot anyway. The file gets mode 0600: state files may name sandboxes and labels.

    Raises ``TypeError``/``ValueError`` if ``obj`` is not JSON-serialisable (``path`` untouched)
    and ``OSError`` if the disk write fails (``path`` untouched as well).
    """
    # Serialise first: a bad object must not leave even a temporary file behind.
    write_bytes_atomic(path, json.dumps(obj, separators=(",", ":")).encode("utf-8"), durable)


def write_bytes_atomic(path: Path, data: bytes, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` the way :func:`write_json_atomic` does (same guarantees, mode 0600)."""
    path = Path(path)
    directory = path.parent
    fd, tmp_name = tempfile.mkstemp(prefix=_tmp_prefix(path), suffix=_TMP_SUFFIX, dir=directory)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp_name, path)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise
    if durable:
        fsync_dir(directory)


def write_json_new(path: Path, obj: Any) -> None:
    """Create ``path`` (which must not exist) holding ``obj`` as JSON, with one write and no rename.

    Cheaper than :func:`write_json_atomic` for records written once: a kill can only leave an empty
    or cut file, which :func:`read_json` reports as invalid, never a mix of two versions.
    """
    data = json.dumps(obj, separators=(",", ":")).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def read_json(path: Path) -> Any | None:
    """The decoded JSON in ``path``, or ``None`` if the file does not exist.

    Leftover temporary files from an interrupted write are never read. A file that exists but
    does not hold valid JSON raises ``ValueError`` naming the file: with :func:`write_json_atomic`
    that only happens when something else wrote it, and guessing would hide the damage.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise ValueError(
            f"state file {path} is not valid JSON ({exc}); move it aside to start afresh"
        ) from exc


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_tmp_files(directory: Path) -> int:
    """Delete temporary files that killed writers left in ``directory``; returns how many.

    Call it once at startup, before anything writes state: a temporary file is only stale when
    no writer is running, and this cannot tell a stale one from one being written right now.
    """
    removed = 0
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    for name in names:
        if name.startswith(".") and name.endswith(_TMP_SUFFIX):
            try:
                os.unlink(Path(directory) / name)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def try_lock(path: Path) -> int | None:
    """Take an exclusive lock on the file ``path`` (created mode 0600, its directory 0700) without waiting:
    the open descriptor, which holds the lock until it is closed (or the process ends), or None when another
    process holds it. Used so that two servers never share one state."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd
