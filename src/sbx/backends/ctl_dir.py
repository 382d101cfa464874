"""The sandbox's control directory as the host touches it: ``<state>/gvisor/<id>/ctl``, which the guest sees
(read-write) as ``/.sbx/ctl``, where the agent makes its socket and waits for its wake file.

Root in the guest can put anything at any name in there: a symlink to a host path, a FIFO, a directory. So
the host never follows a name it finds there, and never opens anything there it did not create itself:

- :func:`touch_regular` makes a file exist through a descriptor of the directory, with
  ``O_CREAT | O_EXCL | O_NOFOLLOW`` (which creates a new file or fails, never following a link), and removes
  whatever else the guest put at the name first (the entry itself, never what a link points to);
- the agent's socket is connected to through the socket file itself, opened with ``O_PATH | O_NOFOLLOW``
  (:meth:`sbx.agent.client.AgentClient.connect`): a symlink planted there never makes sandboxd connect to a
  host socket.

The directory itself (``ctl``) is a mount point in the guest, which cannot replace it; it is opened with
``O_NOFOLLOW`` all the same.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from sbx.backends.base import BackendError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def touch_regular(directory: Path, name: str) -> None:
    """Make ``directory/name`` exist as a regular file (created empty, mode 0600, when missing), without
    following or opening anything the guest put there; whatever is there and is not a regular file is
    removed first. BackendError when the guest replaces it again while this runs, or the directory is not
    a directory."""
    try:
        dir_fd = os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        raise BackendError(f"the control directory {directory} cannot be opened: {exc.strerror}") from None
    try:
        for _ in range(3):
            try:
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 0o600, dir_fd=dir_fd))  # fmt: skip
                return
            except FileExistsError:
                pass
            try:
                found = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile: create it again
            if stat.S_ISREG(found.st_mode):
                return
            _remove(dir_fd, name, found)
        raise BackendError(f"{directory / name} keeps being replaced from inside the sandbox")
    finally:
        os.close(dir_fd)


def _remove(dir_fd: int, name: str, found: os.stat_result) -> None:
    """Remove the entry ``name`` (a directory with its contents; a link itself, not its target)."""
    try:
        if stat.S_ISDIR(found.st_mode):
            shutil.rmtree(name, dir_fd=dir_fd)  # fd-based: never leaves the directory through a link
        else:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
