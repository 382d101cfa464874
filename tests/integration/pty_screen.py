"""Driving a real client (``sandbox-cli shell``, OpenSSH's ``ssh``) on a pseudo-terminal in tests: set its
window size and read its screen until some bytes appear."""

from __future__ import annotations

import fcntl
import os
import select
import struct
import termios
import time


def set_size(fd: int, rows: int, cols: int) -> None:
    """Set the terminal ``fd``'s window size (the client sees SIGWINCH)."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def read_until(fd: int, needle: bytes, timeout_secs: float = 30) -> bytes:
    """Everything read from ``fd`` until ``needle`` is in it (or the terminal closed); fails the test when
    ``needle`` is not seen within ``timeout_secs``, naming the screen's last 500 bytes."""
    seen = b""
    deadline = time.monotonic() + timeout_secs
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} on the screen; saw {seen[-500:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    return seen
