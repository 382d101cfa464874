"""A copy of one mount held outside this mount namespace, as another program's mount namespace holds one.

Where the host's mounts are private (no systemd: this machine's), a program that makes a mount namespace
(``unshare -m``, ``ip netns exec``) keeps its own copy of every mount there was, which an unmount on the host
does not reach: the file system, and the loop device under it, stay until that program exits. A test makes
the same state for one mount alone with ``open_tree(OPEN_TREE_CLONE)``: a detached copy of that mount, held
by a descriptor. A whole namespace would also hold the mounts of every test running beside it, whose loop
devices would then outlive their unmounts.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

_SYS_OPEN_TREE = 428  # x86_64 and aarch64 alike (the unified syscall table)
_OPEN_TREE_CLONE = 1
_AT_FDCWD = -100

_libc = ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def holding_mount(mount_point: Path) -> Iterator[None]:
    """Hold a detached copy of the mount at ``mount_point`` until the block ends (its file system stays in
    use, whatever is unmounted here meanwhile)."""
    fd = _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, str(mount_point).encode(), _OPEN_TREE_CLONE | os.O_CLOEXEC)
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"open_tree of {mount_point}: {os.strerror(err)}")
    try:
        yield
    finally:
        os.close(fd)  # the detached copy is unmounted with its last descriptor
