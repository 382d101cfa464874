"""How many sandboxes a node holds and why (sbx.node.capacity): the host's live figures read from /proc, when the
host refuses one more (a table of cases, each message naming the figures and what to change), and the limits
GET /v1/node reports with the one that binds."""

from __future__ import annotations

import resource
from dataclasses import replace
from pathlib import Path

import pytest

from sbx.api.node import Resources
from sbx.node.capacity import (
    FILES_PER_SANDBOX,
    INSTALLED_NOFILE,
    INSTALLED_PID_MAX,
    MEMORY_PER_IDLE_SANDBOX_MB,
    TASKS_PER_SANDBOX,
    HostState,
    host_shortage,
    read_host,
    sandbox_capacity,
)

#: A roomy host: 24 GiB with 20 GiB available, pid_max raised, 1M descriptors.
HOST = HostState(
    memory_total_mb=24_000, memory_available_mb=20_000, tasks=5_000, pid_max=4_194_304, threads_max=190_000,
    open_files=2_000, open_files_limit=1_048_576,
)  # fmt: skip


def test_reserves_are_the_larger_of_a_floor_and_a_share() -> None:
    assert HOST.memory_reserve_mb == 1200  # 5 % of 24,000 MiB (above the 512 MiB floor)
    assert replace(HOST, memory_total_mb=4000).memory_reserve_mb == 512
    assert HOST.tasks_limit == 190_000  # threads-max binds below pid_max
    assert HOST.tasks_reserve == 3800  # 2 % of it (above 1024)
    assert replace(HOST, pid_max=32768).tasks_reserve == 1024
    assert HOST.open_files_reserve == 52428
    assert replace(HOST, open_files_limit=1024).open_files_reserve == 256


def test_read_host_reads_proc(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "sys" / "kernel").mkdir(parents=True)
    (proc / "self" / "fd").mkdir(parents=True)
    for fd in range(7):
        (proc / "self" / "fd" / str(fd)).touch()
    (proc / "meminfo").write_text("MemTotal:       24683656 kB\nMemFree: 1 kB\nMemAvailable:   23955172 kB\n")
    (proc / "loadavg").write_text("4.77 3.49 1.86 3/412 5093\n")
    (proc / "sys" / "kernel" / "pid_max").write_text("32768\n")
    (proc / "sys" / "kernel" / "threads-max").write_text("192729\n")
    host = read_host(proc)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert host == HostState(
        memory_total_mb=24105, memory_available_mb=23393, tasks=412, pid_max=32768, threads_max=192729,
        open_files=7, open_files_limit=1 << 20 if soft == resource.RLIM_INFINITY else soft,
    )  # fmt: skip


def test_read_host_on_this_machine_is_plausible() -> None:
    host = read_host()
    assert 0 < host.memory_available_mb <= host.memory_total_mb
    assert 0 < host.tasks < host.tasks_limit
    assert 0 < host.open_files < host.open_files_limit


@pytest.mark.parametrize(
    ("host", "message"),
    [
        (HOST, None),
        # Memory: a create needs 64 MiB beyond the reserve.
        (replace(HOST, memory_available_mb=1200 + 64), None),
        (replace(HOST, memory_available_mb=1200 + 63),
         ("the host has 1263 MiB of memory available and keeps 1200 MiB in reserve, and a new sandbox needs about "
         "64 MiB more: delete sandboxes or retry on another node")),
        # Tasks: a sandbox needs 32 beyond the reserve.
        (replace(HOST, pid_max=32768, tasks=32768 - 1024 - 32), None),
        (replace(HOST, pid_max=32768, tasks=32768 - 1024 - 31),
         ("the host runs 31713 tasks of at most 32768 (kernel.pid_max 32768, kernel.threads-max 190000) and keeps "
         "1024 free; a sandbox needs about 32: raise kernel.pid_max (scripts/install.sh sets 4194304) or delete "
         "sandboxes")),
        # sandboxd's descriptors: a create needs 16 beyond the reserve.
        (replace(HOST, open_files_limit=1024, open_files=1024 - 256 - 16), None),
        (replace(HOST, open_files_limit=1024, open_files=1024 - 256 - 15),
         ("sandboxd holds 753 open files of its limit 1024 (RLIMIT_NOFILE) and keeps 256 for its clients: raise "
         "LimitNOFILE of sandboxd.service (scripts/install.sh sets 1048576) or delete sandboxes")),
        # Memory is named first when several are short.
        (replace(HOST, memory_available_mb=0, open_files=1_048_576), "the host has 0 MiB of memory available"),
    ],
)  # fmt: skip
def test_host_shortage(host: HostState, message: str | None) -> None:
    got = host_shortage(host)
    if message is None:
        assert got is None
    else:
        assert got is not None and got.startswith(message)


DEFAULT = Resources(1, 512, 2048)


def test_capacity_names_every_limit_and_the_one_that_binds() -> None:
    report = sandbox_capacity(Resources(16, 21_695, 64_243), DEFAULT, 0, (8, 1.0, 1.0), 3, HOST)
    by = {limit.resource: limit.sandboxes for limit in report.limits}
    assert by == {
        "cpus": 16,
        "memory": 42,
        "disk": 31,
        "host_memory": 3 + (20_000 - 1200) // MEMORY_PER_IDLE_SANDBOX_MB,
        "tasks": 3 + (190_000 - 3800 - 5000) // TASKS_PER_SANDBOX,
        "open_files": 3 + (1_048_576 - 52428 - 2000) // FILES_PER_SANDBOX,
    }
    assert (report.max_sandboxes, report.limited_by, report.sandboxes) == (16, "cpus", 3)
    why = {limit.resource: limit.why for limit in report.limits}
    assert why["memory"] == "capacity memory_mb 21695 (memory_overcommit 1) / defaults memory_mb 512"
    assert why["cpus"] == "capacity cpus 16 (cpu_overcommit 8 per core when measured) / defaults cpus 1"
    assert report.host.memory_available_mb == 20_000 and report.host.tasks_limit == 190_000


@pytest.mark.parametrize(
    ("capacity", "max_sandboxes", "host", "limited_by", "count"),
    [
        # Overcommitted for density (docs/config.md): the host's own limits bind.
        (Resources(2000, 1_000_000, 10_000_000), 0, HOST, "host_memory", 3 + 18_800 // MEMORY_PER_IDLE_SANDBOX_MB),
        (Resources(2000, 1_000_000, 10_000_000), 0, replace(HOST, pid_max=32768, memory_available_mb=90_000), "tasks", 3 + (32768 - 1024 - 5000) // 32),
        (Resources(2000, 1_000_000, 10_000_000), 500, HOST, "max_sandboxes", 500),
        (Resources(2000, 1_000_000, 10_000_000), 0, replace(HOST, open_files_limit=1024, open_files=20), "open_files", 3 + (1024 - 256 - 20) // 2),
        # A host already past a reserve holds what it holds and no more.
        (Resources(2000, 1_000_000, 10_000_000), 0, replace(HOST, memory_available_mb=100), "host_memory", 3),
    ],
)  # fmt: skip
def test_the_binding_limit(
    capacity: Resources, max_sandboxes: int, host: HostState, limited_by: str, count: int
) -> None:
    report = sandbox_capacity(capacity, DEFAULT, max_sandboxes, (500, 50.0, 200.0), 3, host)
    assert (report.limited_by, report.max_sandboxes) == (limited_by, count)
    assert report.max_sandboxes == min(limit.sandboxes for limit in report.limits)


def test_the_limits_named_in_refusals_are_those_install_sh_sets() -> None:
    script = (Path(__file__).resolve().parents[2] / "scripts" / "install.sh").read_text()
    assert f"\nPID_MAX={INSTALLED_PID_MAX}\n" in script
    assert f"\nNOFILE_LIMIT={INSTALLED_NOFILE}\n" in script
    assert "LimitNOFILE=$NOFILE_LIMIT" in script and 'ulimit -n "$NOFILE_LIMIT"' in script
