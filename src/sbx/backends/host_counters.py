"""Host-side usage counters of one sandbox, read from its cgroup, its processes' I/O accounting and its host
network interface: file reads only, never a subprocess, never a question to the guest.

Both cgroup layouts are read: v1 (one hierarchy per controller, ``<root>/cpuacct/<path>``,
``<root>/memory/<path>``, ...) and v2 (one unified hierarchy, ``<root>/<path>`` holding every controller's
files). A hybrid host (v1 controllers plus ``<root>/unified``) is read as v1, where runtimes put the limits.

What each figure is, and why (measured on this project's gVisor sandboxes):

- CPU time: ``cpuacct.usage`` (v1, ns) or ``usage_usec`` of ``cpu.stat`` (v2): every host process of the
  sandbox (sentry, gofer, the ptrace stubs running guest code), so guest work and its emulation both count.
- Memory: the cgroup's usage less its file page cache, shared memory kept. gVisor keeps all guest memory in one
  memfd, which the kernel accounts as *shmem page cache*, so "usage less cache" would report a guest that
  allocated 200 MiB as using 10 MiB; and summing the processes' RSS counts guest pages twice (the sentry and the
  ptrace stub of the guest process both map them) plus the runsc binary shared by every sandbox. What is left is
  the resident set of the sandbox's VMM processes, guest memory included, each page once.
- Disk: ``read_bytes``/``write_bytes`` of ``/proc/<pid>/io`` summed over the cgroup's processes (bytes the
  sandbox made the host read from or dirty for storage). The blkio/io controller's counters stay at 0 here:
  the sandbox's disk is a loop device, and buffered writeback is charged to the root cgroup on cgroup v1. These
  sums go back when a process of the sandbox exits; the sampler keeps its totals monotonic.
- Network: the statistics of the sandbox's host-side interface (one end of a veth pair) turned round: what the
  host end transmitted the sandbox received. No interface (network mode ``none``): 0.
"""

from __future__ import annotations

import os
from pathlib import Path

from sbx.backends.base import BackendUsage

#: Where cgroup file systems are mounted.
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Limits at or above this are "no limit" in cgroup v1 (the kernel reports PAGE_COUNTER_MAX pages in bytes).
_V1_NO_LIMIT = 1 << 62


def is_unified(root: Path = CGROUP_ROOT) -> bool:
    """Whether ``root`` is a cgroup v2 unified hierarchy (rather than v1 or hybrid)."""
    return (root / "cgroup.controllers").is_file()


def read_usage(
    cgroup_path: str,
    host_interface: str | None = None,
    root: Path = CGROUP_ROOT,
    proc: Path = Path("/proc"),
    sys_net: Path = Path("/sys/class/net"),
) -> BackendUsage | None:
    """The counters of the sandbox in cgroup ``cgroup_path`` (e.g. ``/sandboxd/<id>``), or None when that
    cgroup does not exist (the sandbox is not running). ``host_interface`` names the host end of its network
    interface, None when it has none. ``processes`` is 0: a cgroup shows host processes, not the guest's."""
    # Plain strings rather than Path objects: building paths cost more than reading the files (measured).
    rel = cgroup_path.strip("/")
    base = str(root)
    if is_unified(root):
        group = f"{base}/{rel}"
        if not os.path.isdir(group):
            return None
        cpu_ns = _field(_read(f"{group}/cpu.stat"), "usage_usec") * 1000
        memory_dir = procs_dir = group
        usage_file, limit_file = "memory.current", "memory.max"
        cache_key, shmem_key = "file", "shmem"
    else:
        memory_dir = f"{base}/memory/{rel}"
        if not os.path.isdir(memory_dir):
            return None
        cpu_ns = _int(f"{base}/cpuacct/{rel}/cpuacct.usage")
        procs_dir = f"{base}/pids/{rel}"
        if not os.path.isdir(procs_dir):
            procs_dir = memory_dir
        usage_file, limit_file = "memory.usage_in_bytes", "memory.limit_in_bytes"
        # total_*: this group and its children, as the usage figure is.
        cache_key, shmem_key = "total_cache", "total_shmem"
    stat = _read(f"{memory_dir}/memory.stat")
    used = _int(f"{memory_dir}/{usage_file}")
    memory = max(0, used - max(0, _field(stat, cache_key) - _field(stat, shmem_key)))
    limit = _int(f"{memory_dir}/{limit_file}")
    disk_read, disk_write = _process_io(f"{procs_dir}/cgroup.procs", str(proc))
    net_rx = net_tx = 0
    if host_interface is not None:
        stats = f"{sys_net}/{host_interface}/statistics"
        net_rx, net_tx = _int(f"{stats}/tx_bytes"), _int(f"{stats}/rx_bytes")
    return BackendUsage(
        cpu_ns=cpu_ns,
        memory_bytes=memory,
        memory_limit_bytes=limit if 0 < limit < _V1_NO_LIMIT else 0,
        net_rx_bytes=net_rx,
        net_tx_bytes=net_tx,
        disk_read_bytes=disk_read,
        disk_write_bytes=disk_write,
        processes=0,
    )


def _process_io(procs_file: str, proc: str) -> tuple[int, int]:
    """Summed ``read_bytes`` and ``write_bytes`` of the processes listed in ``procs_file``."""
    read = write = 0
    for pid in _read(procs_file).split():
        # A process that exited since the listing reads as "": it adds 0.
        io = _read(f"{proc}/{pid}/io")
        read += _field(io, "read_bytes", ": ")
        write += _field(io, "write_bytes", ": ")
    return read, write


def _read(path: str) -> str:
    """A small kernel file's text; "" when it cannot be read (gone with its process or cgroup)."""
    # os.open/os.read rather than open(): no buffered file object, one read for the whole file.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return os.read(fd, 65536).decode("ascii", errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _int(path: str) -> int:
    """An integer file's value; 0 when missing or not a number (``max`` in cgroup v2 among them)."""
    try:
        return int(_read(path).strip() or "0")
    except ValueError:
        return 0


def _field(text: str, key: str, sep: str = " ") -> int:
    """The value of ``key`` in a flat-keyed file's text (``key value`` lines, or ``key: value`` with
    ``sep=": "``); 0 when absent. Finds the one key rather than parsing every line."""
    prefix = key + sep
    if text.startswith(prefix):
        start = len(prefix)
    else:
        at = text.find("\n" + prefix)
        if at < 0:
            return 0
        start = at + 1 + len(prefix)
    end = text.find("\n", start)
    try:
        return int(text[start : end if end >= 0 else len(text)])
    except ValueError:
        return 0
