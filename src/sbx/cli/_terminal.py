"""The local terminal: its size, and raw mode that is always put back."""

from __future__ import annotations

import contextlib
import os
import termios
import tty
from collections.abc import Iterator

#: Used when the size cannot be read (not a terminal): the classic 24 x 80.
DEFAULT_SIZE = (24, 80)


def terminal_size(fd: int) -> tuple[int, int]:
    """``(rows, cols)`` of the terminal on ``fd``, or ``DEFAULT_SIZE``; never 0."""
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return DEFAULT_SIZE
    return (size.lines or DEFAULT_SIZE[0], size.columns or DEFAULT_SIZE[1])


@contextlib.contextmanager
def raw_mode(fd: int) -> Iterator[None]:
    """Put the terminal on ``fd`` in raw mode (keys, Ctrl-C included, go to the remote side
    unchanged) and restore its settings on the way out, whatever happens."""
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
