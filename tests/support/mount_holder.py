"""A process on the host holding a copy of the host's mounts in a mount namespace of its own.

Where the host's mounts are private (no systemd: this machine's), a program that makes a mount namespace
(``unshare -m``, ``ip netns exec``) keeps its own copy of every mount there was, which an unmount on the host
does not reach: the file system, and the loop device under it, stay until that program exits.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def holding_mounts(timeout_secs: float = 30.0) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``unshare -m sleep`` until the block ends, entered once it sleeps in its own mount namespace
    (which then holds a copy of every mount of this moment)."""
    holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "120"])
    try:
        deadline = time.monotonic() + timeout_secs
        while not _in_own_mount_namespace(holder.pid, "sleep"):
            assert time.monotonic() < deadline, "unshare made no mount namespace"
            time.sleep(0.02)
        yield holder
    finally:
        holder.kill()
        holder.wait()


def _in_own_mount_namespace(pid: int, comm: str) -> bool:
    """Whether process ``pid`` runs ``comm`` in another mount namespace than this process's."""
    try:
        named = Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip() == comm
        return named and os.readlink(f"/proc/{pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    except OSError:
        return False
