"""Append-only log files that rotate: the node's and the gateway's audit logs share these rules.

A log ``FILE`` rotates to ``FILE.1`` (newest old generation) .. ``FILE.<keep>`` (oldest); files are mode 0600.
"""

from __future__ import annotations

import os
from pathlib import Path


def generation(path: Path, n: int) -> Path:
    """The log itself for ``n`` 0, else its ``n``-th old generation (``FILE.n``)."""
    return path if n == 0 else path.with_name(f"{path.name}.{n}")


def open_append(path: Path) -> tuple[int, int, int]:
    """Open (creating, mode 0600) ``path`` for appending: ``(fd, size in bytes, inode)``.

    A file a crash left ending mid-line gets a newline first, so the next record starts a line of its own.
    """
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        size = st.st_size
        if size > 0 and not _ends_with_newline(path, size):
            size += os.write(fd, b"\n")
    except BaseException:
        os.close(fd)
        raise
    return fd, size, st.st_ino


def rotate(path: Path, keep: int) -> None:
    """Shift the generations: ``FILE.(keep-1)`` over ``FILE.keep`` (the oldest is dropped) .. ``FILE`` to
    ``FILE.1``; with ``keep`` 0 the log is simply removed. The caller has closed ``path``."""
    if keep == 0:
        path.unlink(missing_ok=True)
        return
    for n in range(keep - 1, 0, -1):
        older = generation(path, n)
        if older.exists():
            os.replace(older, generation(path, n + 1))
    os.replace(path, generation(path, 1))


def _ends_with_newline(path: Path, size: int) -> bool:
    with open(path, "rb") as f:
        f.seek(size - 1)
        return f.read(1) == b"\n"
