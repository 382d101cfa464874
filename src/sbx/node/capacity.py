"""How many sandboxes this node can hold and why, and whether the host can take one more right now.

Two kinds of limit (docs/config.md, "How many sandboxes a node holds"):

- **Accounting**, what sandboxes are given: CPUs, memory and disk against ``[capacity]`` (with its overcommit
  factors), and ``[capacity] max_sandboxes``. Exact and stable; checked by :class:`~sbx.node.reservations.Reservations`.
- **The host**, read live at every create and pool boot (a few small files, no subprocess): memory the kernel
  says is available (``MemAvailable``), tasks (every host thread takes a pid: ``kernel.pid_max`` and
  ``kernel.threads-max``) and sandboxd's own open files (``RLIMIT_NOFILE``). A create is refused (503) while one
  is below its reserve, before the host suffers, whatever the accounting says.

``GET /v1/node`` reports both under ``sandbox_capacity`` (:func:`sandbox_capacity`): how many sandboxes of the
default size each limit allows, the smallest of them, and the host's live figures. What one idle sandbox costs
the host was measured on this project's gVisor sandboxes (docs/benchmarks.md, "Density"): the constants below.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from sbx.api.node import HostHeadroom, Resources, SandboxCapacity, SandboxLimit

#: Host tasks (threads, each with a pid) one idle gVisor sandbox holds: measured 21-28 (sentry, gofer and
#: systrap stubs), with room for a few guest processes (each adds a stub thread or two).
TASKS_PER_SANDBOX: Final = 32
#: Host memory one idle sandbox takes, MiB: measured 12.9-16.4 (MemAvailable drop per sandbox with 100 to 1,000
#: idle ones, bench/bench_density.py); rounded up. Used only to say how many more the available memory holds.
MEMORY_PER_IDLE_SANDBOX_MB: Final = 16
#: Memory a sandbox being created takes before its first command, MiB (sentry, gofer, page cache of the boot):
#: what must be available beyond the reserve for a create to go ahead.
MEMORY_PER_BOOT_MB: Final = 64
#: sandboxd's own descriptors per sandbox: the agent connection, and the output log of a running process.
FILES_PER_SANDBOX: Final = 2
#: Descriptors a create needs while it runs (runsc's pipes, the layer's files, the agent's socket).
FILES_PER_BOOT: Final = 16

#: Memory the host keeps available whatever the sandboxes do: the larger of these (MiB, share of MemTotal).
MEMORY_RESERVE_MIN_MB: Final = 512
MEMORY_RESERVE_FRACTION: Final = 0.05
#: Tasks kept free for the host: the larger of these (count, share of the kernel's limit).
TASKS_RESERVE_MIN: Final = 1024
TASKS_RESERVE_FRACTION: Final = 0.02
#: sandboxd's descriptors kept free for its clients (requests, streams, egress): the larger of these.
FILES_RESERVE_MIN: Final = 256
FILES_RESERVE_FRACTION: Final = 0.05
#: What scripts/install.sh sets: kernel.pid_max (its 64-bit maximum) and sandboxd's LimitNOFILE.
INSTALLED_PID_MAX: Final = 4_194_304
INSTALLED_NOFILE: Final = 1_048_576


@dataclass(frozen=True)
class HostState:
    """The host's live figures: memory (MiB), tasks (threads now, and the most the kernel allows: the smaller
    of ``kernel.pid_max`` and ``kernel.threads-max``), and sandboxd's open files and its soft limit."""

    memory_total_mb: int
    memory_available_mb: int
    tasks: int
    pid_max: int
    threads_max: int
    open_files: int
    open_files_limit: int

    @property
    def tasks_limit(self) -> int:
        return min(self.pid_max, self.threads_max)

    @property
    def memory_reserve_mb(self) -> int:
        return max(MEMORY_RESERVE_MIN_MB, int(self.memory_total_mb * MEMORY_RESERVE_FRACTION))

    @property
    def tasks_reserve(self) -> int:
        return max(TASKS_RESERVE_MIN, int(self.tasks_limit * TASKS_RESERVE_FRACTION))

    @property
    def open_files_reserve(self) -> int:
        return max(FILES_RESERVE_MIN, int(self.open_files_limit * FILES_RESERVE_FRACTION))

    def headroom(self) -> HostHeadroom:
        """The wire form (``sandbox_capacity.host`` in NodeStatus)."""
        return HostHeadroom(
            memory_available_mb=self.memory_available_mb, memory_reserve_mb=self.memory_reserve_mb,
            tasks=self.tasks, tasks_limit=self.tasks_limit, tasks_reserve=self.tasks_reserve,
            open_files=self.open_files, open_files_limit=self.open_files_limit,
            open_files_reserve=self.open_files_reserve,
        )  # fmt: skip


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return ""


def _meminfo_mb(text: str, key: str) -> int:
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) // 1024
    return 0


def _int(text: str, default: int) -> int:
    try:
        return int(text.strip())
    except ValueError:
        return default


def read_host(proc: Path = Path("/proc")) -> HostState:
    """The host's figures now, from /proc (about 0.1 ms; no subprocess). Tasks come from ``/proc/loadavg``
    (its running/total field: every thread the kernel schedules), open files from sandboxd's ``/proc/self/fd``."""
    meminfo = _read(proc / "meminfo")
    loadavg = _read(proc / "loadavg").split()
    tasks = _int(loadavg[3].partition("/")[2], 0) if len(loadavg) > 3 else 0
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        open_files = len(os.listdir(proc / "self" / "fd"))
    except OSError:
        open_files = 0
    return HostState(
        memory_total_mb=_meminfo_mb(meminfo, "MemTotal"),
        memory_available_mb=_meminfo_mb(meminfo, "MemAvailable"),
        tasks=tasks,
        pid_max=_int(_read(proc / "sys" / "kernel" / "pid_max"), 32768),
        threads_max=_int(_read(proc / "sys" / "kernel" / "threads-max"), 1 << 22),
        open_files=open_files,
        open_files_limit=1 << 20 if soft == resource.RLIM_INFINITY else soft,
    )


def host_shortage(host: HostState) -> str | None:
    """Why the host cannot take one more sandbox now (a sentence naming the figures and what to change), None
    when it can."""
    if host.memory_available_mb - MEMORY_PER_BOOT_MB < host.memory_reserve_mb:
        return (
            f"the host has {host.memory_available_mb} MiB of memory available and keeps {host.memory_reserve_mb} "
            f"MiB in reserve, and a new sandbox needs about {MEMORY_PER_BOOT_MB} MiB more: delete sandboxes or "
            "retry on another node"
        )
    if host.tasks_limit - host.tasks - TASKS_PER_SANDBOX < host.tasks_reserve:
        return (
            f"the host runs {host.tasks} tasks of at most {host.tasks_limit} (kernel.pid_max {host.pid_max}, "
            f"kernel.threads-max {host.threads_max}) and keeps {host.tasks_reserve} free; a sandbox needs about "
            f"{TASKS_PER_SANDBOX}: raise kernel.pid_max (scripts/install.sh sets {INSTALLED_PID_MAX}) or delete "
            "sandboxes"
        )
    if host.open_files_limit - host.open_files - FILES_PER_BOOT < host.open_files_reserve:
        return (
            f"sandboxd holds {host.open_files} open files of its limit {host.open_files_limit} (RLIMIT_NOFILE) "
            f"and keeps {host.open_files_reserve} for its clients: raise LimitNOFILE of sandboxd.service "
            f"(scripts/install.sh sets {INSTALLED_NOFILE}) or delete sandboxes"
        )
    return None


def sandbox_capacity(
    capacity: Resources, default: Resources, max_sandboxes: int, overcommit: tuple[float, float, float],
    sandboxes: int, host: HostState,
) -> SandboxCapacity:  # fmt: skip
    """How many sandboxes of the ``default`` size the node holds, by each limit, and which binds.

    ``capacity``: what the node offers (overcommit included); ``overcommit``: the factors (cpu, memory,
    disk) it includes, named in the reasons; ``max_sandboxes``: the configured cap (0: none); ``sandboxes``:
    how many it holds now, pooled ones included. Limits read from the host are what it holds now plus what
    its free room takes.
    """
    cpu, memory, disk = overcommit

    def per(total: int, each: int) -> int:
        return total // each if each > 0 else 0

    def factor(value: float) -> str:
        return f"{value:g}"

    limits = [
        SandboxLimit(
            resource="cpus", sandboxes=per(capacity.cpus, default.cpus),
            why=f"capacity cpus {capacity.cpus} (cpu_overcommit {factor(cpu)} per core when measured) / "
            f"defaults cpus {default.cpus}",
        ),
        SandboxLimit(
            resource="memory", sandboxes=per(capacity.memory_mb, default.memory_mb),
            why=f"capacity memory_mb {capacity.memory_mb} (memory_overcommit {factor(memory)}) / "
            f"defaults memory_mb {default.memory_mb}",
        ),
        SandboxLimit(
            resource="disk", sandboxes=per(capacity.disk_mb, default.disk_mb),
            why=f"capacity disk_mb {capacity.disk_mb} (disk_overcommit {factor(disk)}; a sandbox's disk is a "
            f"sparse file, disk_mb its most) / defaults disk_mb {default.disk_mb}",
        ),
    ]  # fmt: skip
    if max_sandboxes > 0:
        limits.append(SandboxLimit(resource="max_sandboxes", sandboxes=max_sandboxes,
                                   why=f"[capacity] max_sandboxes {max_sandboxes}"))  # fmt: skip
    memory_room = host.memory_available_mb - host.memory_reserve_mb
    tasks_room = host.tasks_limit - host.tasks_reserve - host.tasks
    files_room = host.open_files_limit - host.open_files_reserve - host.open_files
    limits += [
        SandboxLimit(
            resource="host_memory", sandboxes=sandboxes + max(0, memory_room) // MEMORY_PER_IDLE_SANDBOX_MB,
            why=f"{sandboxes} now + ({host.memory_available_mb} MiB available - {host.memory_reserve_mb} MiB "
            f"reserve) / {MEMORY_PER_IDLE_SANDBOX_MB} MiB per idle sandbox",
        ),
        SandboxLimit(
            resource="tasks", sandboxes=sandboxes + max(0, tasks_room) // TASKS_PER_SANDBOX,
            why=f"{sandboxes} now + ({host.tasks_limit} tasks at most (kernel.pid_max {host.pid_max}, "
            f"threads-max {host.threads_max}) - {host.tasks_reserve} reserve - {host.tasks} running) / "
            f"{TASKS_PER_SANDBOX} per sandbox",
        ),
        SandboxLimit(
            resource="open_files", sandboxes=sandboxes + max(0, files_room) // FILES_PER_SANDBOX,
            why=f"{sandboxes} now + (sandboxd's RLIMIT_NOFILE {host.open_files_limit} - "
            f"{host.open_files_reserve} reserve - {host.open_files} open) / {FILES_PER_SANDBOX} per sandbox",
        ),
    ]  # fmt: skip
    binding = min(limits, key=lambda limit: limit.sandboxes)
    return SandboxCapacity(
        max_sandboxes=binding.sandboxes, limited_by=binding.resource, sandboxes=sandboxes, limits=limits,
        host=host.headroom(),
    )  # fmt: skip
