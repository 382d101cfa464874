"""The host counter reader on fake cgroup v1 and v2 trees, /proc and /sys/class/net."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.backends.base import BackendUsage
from sbx.backends.host_counters import is_unified, read_usage

MIB = 1024 * 1024


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _proc(root: Path, io: dict[str, tuple[int, int]]) -> Path:
    proc = root / "proc"
    for pid, (read, write) in io.items():
        _write(
            proc / pid / "io",
            f"rchar: 999\nwchar: 999\nsyscr: 1\nsyscw: 1\nread_bytes: {read}\nwrite_bytes: {write}\n"
            "cancelled_write_bytes: 0\n",
        )
    return proc


def _v1(root: Path, limit: int) -> Path:
    cg = root / "cgroup"
    _write(cg / "cpuacct/sandboxd/sbx_a/cpuacct.usage", "7500000000\n")
    memory = cg / "memory/sandboxd/sbx_a"
    _write(memory / "memory.usage_in_bytes", f"{229 * MIB}\n")
    _write(memory / "memory.limit_in_bytes", f"{limit}\n")
    # Shaped like a gVisor sandbox whose guest allocated 200 MiB: guest memory is shmem inside the cache.
    _write(
        memory / "memory.stat",
        f"cache 1\nrss 2\nshmem 3\ntotal_cache {213 * MIB}\ntotal_rss {11 * MIB}\ntotal_shmem {204 * MIB}\n",
    )
    _write(cg / "pids/sandboxd/sbx_a/cgroup.procs", "10\n11\n12\n")
    return cg


def _v2(root: Path, memory_max: str) -> Path:
    cg = root / "cgroup"
    _write(cg / "cgroup.controllers", "cpu io memory pids\n")
    group = cg / "sandboxd/sbx_a"
    _write(group / "cpu.stat", "usage_usec 7500000\nuser_usec 7000000\nsystem_usec 500000\n")
    _write(group / "memory.current", f"{229 * MIB}\n")
    _write(group / "memory.max", memory_max + "\n")
    # Keys that begin with the ones read come first: only whole keys may match.
    _write(
        group / "memory.stat",
        f"file_mapped 1\nshmem_thp 2\nanon {11 * MIB}\nfile {213 * MIB}\nshmem {204 * MIB}\nfile_dirty 3",
    )
    _write(group / "cgroup.procs", "10\n11\n12\n")
    return cg


EXPECTED = BackendUsage(
    cpu_ns=7_500_000_000,
    memory_bytes=220 * MIB,  # usage less the 9 MiB of file cache; the guest's 204 MiB of shmem stays
    memory_limit_bytes=256 * MIB,
    disk_read_bytes=100 + 300,  # pid 12 exited between listing and reading: skipped
    disk_write_bytes=1000 + 3000,
)


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_reads_both_layouts(tmp_path: Path, layout: str) -> None:
    cg = _v1(tmp_path, 256 * MIB) if layout == "v1" else _v2(tmp_path, str(256 * MIB))
    proc = _proc(tmp_path, {"10": (100, 1000), "11": (300, 3000)})
    assert is_unified(cg) == (layout == "v2")
    assert read_usage("/sandboxd/sbx_a", root=cg, proc=proc) == EXPECTED


@pytest.mark.parametrize(
    ("layout", "limit", "expected"),
    [
        ("v1", str(9223372036854771712), 0),  # v1's "unlimited"
        ("v2", "max", 0),
        ("v1", str(512 * MIB), 512 * MIB),
    ],
)
def test_no_limit_reads_as_zero(tmp_path: Path, layout: str, limit: str, expected: int) -> None:
    cg = _v1(tmp_path, int(limit)) if layout == "v1" else _v2(tmp_path, limit)
    usage = read_usage("/sandboxd/sbx_a", root=cg, proc=_proc(tmp_path, {}))
    assert usage is not None and usage.memory_limit_bytes == expected


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_missing_cgroup_is_not_running(tmp_path: Path, layout: str) -> None:
    cg = _v1(tmp_path, MIB) if layout == "v1" else _v2(tmp_path, "max")
    assert read_usage("/sandboxd/sbx_gone", root=cg, proc=tmp_path / "proc") is None


def test_network_from_the_host_end_turned_round(tmp_path: Path) -> None:
    cg = _v1(tmp_path, MIB)
    net = tmp_path / "net"
    _write(net / "veth-a/statistics/rx_bytes", "111\n")  # the host end received: the sandbox sent
    _write(net / "veth-a/statistics/tx_bytes", "222\n")
    usage = read_usage("/sandboxd/sbx_a", "veth-a", root=cg, proc=_proc(tmp_path, {}), sys_net=net)
    assert usage is not None and (usage.net_rx_bytes, usage.net_tx_bytes) == (222, 111)
    # No interface (network mode none): 0, and an interface that vanished reads as 0 too.
    for interface in (None, "veth-gone"):
        usage = read_usage("/sandboxd/sbx_a", interface, root=cg, proc=_proc(tmp_path, {}), sys_net=net)
        assert usage is not None and (usage.net_rx_bytes, usage.net_tx_bytes) == (0, 0)


def test_this_host_reads_without_error() -> None:
    # The real /sys/fs/cgroup: a cgroup that does not exist is None, whatever the layout here.
    assert read_usage("/sandboxd/sbx_does_not_exist") is None
