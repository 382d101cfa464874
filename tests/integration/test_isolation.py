"""Isolation: a sandbox sees nothing of the host or its neighbours, and cannot starve them."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from sandboxd_harness import Sandboxd


def test_cannot_see_host_or_neighbours(sandboxd_factory: Callable[..., Sandboxd], tmp_path: object) -> None:
    server = sandboxd_factory()
    marker = f"/var/tmp/host-marker-{os.getpid()}"
    with open(marker, "w") as f:
        f.write("host secret")
    try:
        a = server.create()
        b = server.create()
        assert server.run(a["id"], ["sh", "-c", "echo mine > /sandbox/home/a-only"])["exit_code"] == 0
        # Host files: the marker and the server's socket and state dir do not exist inside.
        for path in (marker, str(server.socket_path), str(server.state_dir), "/run/sandboxd.sock"):
            assert server.run(a["id"], ["test", "-e", path])["exit_code"] != 0, path
        # Another sandbox's files are not visible.
        assert server.run(b["id"], ["test", "-e", "/sandbox/home/a-only"])["exit_code"] != 0
        # Host processes are invisible: only the agent and our own processes are in /proc.
        ps = server.run(a["id"], ["ps", "-eo", "pid,comm"])["stdout"].decode()
        assert "sandboxd" not in ps and "python" not in ps and "runsc" not in ps
        assert len(ps.strip().splitlines()) <= 4, ps
        # Own hostname, no network interfaces but loopback.
        assert server.run(a["id"], ["hostname"])["stdout"] == b"sandbox\n"
        links = server.run(a["id"], ["cat", "/proc/net/dev"])["stdout"].decode()
        assert [line.split(":")[0].strip() for line in links.splitlines()[2:]] == ["lo"]
        # The agent's control directory is not open to the sandbox user.
        assert server.run(a["id"], ["ls", "/.sbx/ctl"])["exit_code"] != 0
    finally:
        os.unlink(marker)


def test_memory_limit_is_enforced(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory()
    s = server.create(memory_mb=256)
    hog = "a = []\nwhile True:\n    a.append(bytearray(16 * 1024 * 1024))\n"
    result = server.run(s["id"], ["python3", "-c", hog], timeout_secs=60)
    assert result["exit_code"] != 0 or result["timed_out"]


def test_fork_bomb_and_memory_hog_do_not_stop_a_neighbour(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory()
    victim = server.create(cpus=1, memory_mb=256)
    bomber = server.create(cpus=1, memory_mb=256)
    hog = server.create(cpus=1, memory_mb=256)
    attackers: list[threading.Thread] = []
    for s, argv in (
        (bomber, ["sh", "-c", "bomb() { bomb | bomb & }; bomb"]),
        (hog, ["python3", "-c", "a=[]\nwhile 1: a.append(bytearray(8<<20))"]),
    ):
        t = threading.Thread(
            target=lambda s=s, argv=argv: server.request(
                "POST", f"/v1/sandboxes/{s['id']}/run", {"argv": argv, "timeout_secs": 20}, timeout=120
            ),
            daemon=True,
        )
        t.start()
        attackers.append(t)
    time.sleep(3)
    worst = 0.0
    for _ in range(10):
        started = time.monotonic()
        result = server.run(victim["id"], ["echo", "alive"])
        worst = max(worst, time.monotonic() - started)
        assert result["stdout"] == b"alive\n"
        time.sleep(0.3)
    assert worst < 5, worst
    for t in attackers:
        t.join(timeout=60)


def test_cpu_quota_is_enforced(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    """Two busy loops in a 1-vCPU sandbox get about one core of host CPU time, not two."""
    from pathlib import Path

    server = sandboxd_factory()
    s = server.create(cpus=1)
    usage = Path("/sys/fs/cgroup/cpuacct/sandboxd") / s["id"] / "cpuacct.usage"
    if not usage.exists():
        import pytest

        pytest.skip(f"needs the cgroup v1 cpuacct controller ({usage} is missing)")
    burn = "end=$(( $(date +%s) + 4 )); while [ $(date +%s) -lt $end ]; do :; done"
    before_ns, started = int(usage.read_text()), time.monotonic()
    result = server.run(s["id"], ["sh", "-c", f"({burn}) & ({burn}) & wait"], timeout_secs=30)
    used_secs = (int(usage.read_text()) - before_ns) / 1e9
    wall_secs = time.monotonic() - started
    assert result["exit_code"] == 0
    assert used_secs / wall_secs < 1.25, (used_secs, wall_secs)
