"""Persistent sandboxes on one node (capability ``persistent``), against real gVisor sandboxes: idle suspend,
wake on request, stop and start from the disk, restarts and crashes, capacity, races and bad input."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from guest_counter import COUNTER, expect_error, text, wait_count_above
from sandboxd_harness import Response, Sandboxd

CONFIG = """
[network]
ceiling = "open"
may_allow = ["*.test"]
"""


@pytest.fixture(scope="module")
def server() -> Iterator[Sandboxd]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxd-", dir="/var/tmp"))
    s = Sandboxd(workdir, CONFIG).start()
    yield s
    s.teardown()
    shutil.rmtree(workdir, ignore_errors=True)


def get(server: Sandboxd, ref: str) -> dict[str, Any]:
    resp = server.request("GET", f"/v1/sandboxes/{ref}")
    assert resp.status == 200, resp.body
    return dict(resp.json())


def events(server: Sandboxd, ref: str) -> list[dict[str, Any]]:
    return list(server.request("GET", f"/v1/sandboxes/{ref}/events").json()["events"])


def lifecycle(server: Sandboxd, ref: str) -> list[tuple[str, str | None]]:
    """The sandbox's state events, each with its reason."""
    wanted = ("sandbox.suspended", "sandbox.resumed", "sandbox.stopped", "sandbox.started")
    return [(e["type"], e.get("reason")) for e in events(server, ref) if e["type"] in wanted]


def listed(server: Sandboxd, ref: str) -> dict[str, Any]:
    """The sandbox as the listing shows it: a request that does not name it, so no activity of its own."""
    return next(s for s in server.request("GET", "/v1/sandboxes").json()["sandboxes"] if s["id"] == ref)


def wait_state(server: Sandboxd, ref: str, state: str, timeout_secs: float = 20) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_secs
    while (sandbox := listed(server, ref))["state"] != state:
        assert time.monotonic() < deadline, f"{ref} stayed {sandbox['state']}, never {state}"
        time.sleep(0.1)
    return sandbox


def persistent(server: Sandboxd, name: str, **fields: Any) -> dict[str, Any]:
    return server.create(name=name, persistent=True, **fields)


def test_capability_and_the_persistent_field(server: Sandboxd) -> None:
    caps = server.request("GET", "/v1/capabilities").json()["capabilities"]
    assert caps["persistent"] is True
    plain = server.create()
    kept = persistent(server, "field-shown")
    assert plain["persistent"] is False and kept["persistent"] is True
    assert "stopped_reason" not in kept
    listed = {s["id"]: s for s in server.request("GET", "/v1/sandboxes").json()["sandboxes"]}
    assert listed[plain["id"]]["persistent"] is False and listed[kept["id"]]["persistent"] is True
    for ref in (plain["id"], kept["id"]):
        server.request("DELETE", f"/v1/sandboxes/{ref}")


@pytest.mark.parametrize(
    ("body", "status", "code", "words"),
    [
        ({"persistent": True}, 400, "invalid_request", "persistent: a persistent sandbox needs a name"),
        ({"persistent": "yes", "name": "x1"}, 400, "invalid_request", "persistent"),
        ({"persistent": True, "name": "x2", "colour": "red"}, 400, "invalid_request", "colour"),
    ],
    ids=["no-name", "not-a-boolean", "unknown-field"],
)
def test_bad_creates_make_nothing(
    server: Sandboxd, body: dict[str, Any], status: int, code: str, words: str
) -> None:
    before = server.request("GET", "/v1/sandboxes").json()["sandboxes"]
    expect_error(server.request("POST", "/v1/sandboxes", body), status, code, words)
    assert server.request("GET", "/v1/sandboxes").json()["sandboxes"] == before


def test_stop_of_a_sandbox_that_is_not_persistent_is_409_and_changes_nothing(server: Sandboxd) -> None:
    ref = server.create()["id"]
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/stop"), 409, "conflict", "is not persistent")
    assert get(server, ref)["state"] == "running"
    assert text(server, ref, "echo", "fine") == "fine\n"
    assert "sandbox.stopped" not in [e["type"] for e in events(server, ref)]
    server.request("DELETE", f"/v1/sandboxes/{ref}")
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/stop"), 409, "conflict", "is not persistent")


def test_stop_of_a_terminated_persistent_sandbox_is_409(server: Sandboxd) -> None:
    ref = persistent(server, "gone-soon")["id"]
    server.request("DELETE", f"/v1/sandboxes/{ref}")
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/stop"), 409, "conflict", "terminated")


def test_a_persistent_sandbox_keeps_its_name(server: Sandboxd) -> None:
    ref = persistent(server, "named-for-good")["id"]
    resp = server.request("PATCH", f"/v1/sandboxes/{ref}", {"name": ""})
    expect_error(resp, 400, "invalid_request", "persistent and keeps a name")
    assert get(server, ref)["name"] == "named-for-good"
    assert server.request("PATCH", f"/v1/sandboxes/{ref}", {"name": "renamed"}).status == 200
    server.request("DELETE", f"/v1/sandboxes/{ref}")


# ---- idle suspend and wake --------------------------------------------------------------------------------


def test_five_idle_suspend_and_wake_cycles_keep_files_daemon_and_identity(server: Sandboxd) -> None:
    created = persistent(server, "cycles", idle_timeout_secs=2, labels={"team": "a"})
    ref = created["id"]
    text(server, ref, "sh", "-c", COUNTER)
    last = wait_count_above(server, ref, 0)
    for cycle in range(5):
        # Appended right before the idle suspend: acknowledged, so it is there after it.
        text(server, ref, "sh", "-c", f"echo cycle{cycle} >> /sandbox/home/notes")
        asleep = wait_state(server, ref, "suspended")
        assert (asleep["id"], asleep["name"], asleep["labels"], asleep["idle_timeout_secs"]) == (
            ref, "cycles", {"team": "a"}, 2,
        )  # fmt: skip
        # Woken by the run: the daemon's counter goes on from where it was (memory kept), the notes are whole.
        notes = text(server, ref, "cat", "/sandbox/home/notes")
        assert notes == "".join(f"cycle{i}\n" for i in range(cycle + 1))
        last = wait_count_above(server, ref, last)
        assert get(server, ref)["state"] == "running"
    kinds = lifecycle(server, ref)
    assert kinds == [("sandbox.suspended", "idle"), ("sandbox.resumed", "request")] * 5
    assert get(server, ref)["idle_timeout_secs"] == 2
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_reads_of_the_sandbox_never_wake_it(server: Sandboxd) -> None:
    ref = persistent(server, "sleepy")["id"]
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    for path in (f"/v1/sandboxes/{ref}", "/v1/sandboxes", f"/v1/sandboxes/{ref}/events",
                 f"/v1/sandboxes/{ref}/metrics", f"/v1/sandboxes/{ref}/processes"):  # fmt: skip
        assert server.request("GET", path).status == 200, path
    assert get(server, ref)["state"] == "suspended"
    assert ("sandbox.resumed", "request") not in lifecycle(server, ref)
    server.request("DELETE", f"/v1/sandboxes/{ref}")


@pytest.mark.parametrize(
    ("what", "call"),
    [
        ("run", lambda s, ref: s.run(ref, ["true"])["exit_code"] == 0),
        (
            "process",
            lambda s, ref: (
                s.request("POST", f"/v1/sandboxes/{ref}/processes", {"argv": ["true"]}).status == 201
            ),
        ),
        (
            "file-write",
            lambda s, ref: (
                s.request("PUT", f"/v1/sandboxes/{ref}/files?path=/tmp/w", body=b"x").status == 204
            ),
        ),
        (
            "file-read",
            lambda s, ref: s.request("GET", f"/v1/sandboxes/{ref}/files?path=/etc/hostname").status == 200,
        ),
        ("directory", lambda s, ref: s.request("GET", f"/v1/sandboxes/{ref}/dirs?path=/tmp").status == 200),
        (
            "network",
            lambda s, ref: (
                s.request("PATCH", f"/v1/sandboxes/{ref}", {"network": {"mode": "open"}}).status == 200
            ),
        ),
        (
            "disk-snapshot",
            lambda s, ref: (
                s.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "disk"}).status == 201
            ),
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
@pytest.mark.parametrize("asleep", ["suspended", "stopped"])
def test_each_guest_request_wakes_a_dormant_sandbox(
    server: Sandboxd, what: str, call: Callable[[Sandboxd, str], bool], asleep: str
) -> None:
    network = {"network": {"mode": "allowlist", "allow": ["example.test"]}} if what == "network" else {}
    ref = persistent(server, f"wake-{what}-{asleep}", **network)["id"]
    action = "suspend" if asleep == "suspended" else "stop"
    assert server.request("POST", f"/v1/sandboxes/{ref}/{action}").status == 200
    assert get(server, ref)["state"] == asleep
    assert call(server, ref), what
    assert get(server, ref)["state"] == "running"
    expected = ("sandbox.resumed", "request") if asleep == "suspended" else ("sandbox.started", "request")
    assert lifecycle(server, ref)[-1] == expected
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_a_bad_request_does_not_wake_it(server: Sandboxd) -> None:
    ref = persistent(server, "not-for-typos")["id"]
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    expect_error(
        server.request("POST", f"/v1/sandboxes/{ref}/run", {"argv": []}), 400, "invalid_request", "argv"
    )
    assert get(server, ref)["state"] == "suspended"
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_a_suspended_sandbox_that_is_not_persistent_still_answers_409(server: Sandboxd) -> None:
    ref = server.create()["id"]
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["true"]}), 409, "conflict",
                 "suspended")  # fmt: skip
    assert get(server, ref)["state"] == "suspended"
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_a_tunnel_wakes_it(server: Sandboxd) -> None:
    ref = persistent(server, "tunnelled")["id"]
    server_py = (
        "import socket; s = socket.create_server(('127.0.0.1', 8123)); "
        "[c.sendall(b'hi\\n') or c.close() for c in iter(lambda: s.accept()[0], None)]"
    )
    text(server, ref, "sh", "-c", f'nohup python3 -c "{server_py}" >/dev/null 2>&1 &')
    # Listening (port 8123 is 1FBB in /proc/net/tcp) before it is suspended.
    deadline = time.monotonic() + 10
    while ":1FBB" not in text(server, ref, "cat", "/proc/net/tcp"):
        assert time.monotonic() < deadline, "the guest server never listened"
        time.sleep(0.1)
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(60)
    sock.connect(str(server.socket_path))
    sock.sendall(
        f"GET /v1/sandboxes/{ref}/tunnel?port=8123 HTTP/1.1\r\nHost: localhost\r\n"
        "Connection: Upgrade\r\nUpgrade: sbx-tunnel/1\r\n\r\n".encode()
    )
    got = b""
    with sock:
        while b"hi\n" not in got:
            chunk = sock.recv(4096)
            assert chunk, got
            got += chunk
    assert got.startswith(b"HTTP/1.1 101"), got
    assert get(server, ref)["state"] == "running"
    server.request("DELETE", f"/v1/sandboxes/{ref}")


# ---- stop and start ---------------------------------------------------------------------------------------


def test_stop_keeps_the_disk_and_a_wake_boots_it_with_new_processes(server: Sandboxd) -> None:
    ref = persistent(server, "stopper", labels={"k": "v"})["id"]
    text(server, ref, "sh", "-c", "echo kept > /sandbox/home/file; " + COUNTER)
    wait_count_above(server, ref, 0)
    proc = server.request("POST", f"/v1/sandboxes/{ref}/processes", {"argv": ["sleep", "600"]}).json()
    resp = server.request("POST", f"/v1/sandboxes/{ref}/stop")
    assert resp.status == 200, resp.body
    stopped = resp.json()
    assert (stopped["state"], stopped["stopped_reason"], stopped["name"], stopped["labels"]) == (
        "stopped", "request", "stopper", {"k": "v"},
    )  # fmt: skip
    # Idempotent: stopped again, answered as it is.
    assert server.request("POST", f"/v1/sandboxes/{ref}/stop").json()["state"] == "stopped"
    ended = server.request("GET", f"/v1/sandboxes/{ref}/processes/{proc['pid']}").json()
    assert (ended["state"], ended["exit_code"]) == ("exited", -1)  # ended by the stop
    # Booted from its disk: the file is there, the daemon is not (new processes).
    resp = server.request("POST", f"/v1/sandboxes/{ref}/resume")
    assert resp.status == 200 and resp.json()["state"] == "running", resp.body
    assert "stopped_reason" not in resp.json()
    assert text(server, ref, "cat", "/sandbox/home/file") == "kept\n"
    ps = text(server, ref, "sh", "-c", "ps -eo args || ls /proc")
    assert "while :" not in ps
    assert lifecycle(server, ref)[-2:] == [("sandbox.stopped", "request"), ("sandbox.started", "request")]
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_stop_of_a_suspended_sandbox_discards_its_memory(server: Sandboxd) -> None:
    ref = persistent(server, "suspended-then-stopped")["id"]
    text(server, ref, "sh", "-c", "echo on-disk > /sandbox/home/f")
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    image = server.state_dir / "sandboxes" / ref / "suspend-image"
    assert image.exists()
    assert server.request("POST", f"/v1/sandboxes/{ref}/stop").json()["state"] == "stopped"
    assert not image.exists()
    assert text(server, ref, "cat", "/sandbox/home/f") == "on-disk\n"
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_a_memory_image_that_cannot_be_restored_becomes_a_start(server: Sandboxd) -> None:
    ref = persistent(server, "damaged-image")["id"]
    text(server, ref, "sh", "-c", "echo survives > /sandbox/home/f")
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    image = server.state_dir / "sandboxes" / ref / "suspend-image"
    for path in image.rglob("*"):
        if path.is_file():
            path.write_bytes(b"not a checkpoint")
    assert text(server, ref, "cat", "/sandbox/home/f") == "survives\n"
    assert lifecycle(server, ref)[-2:] == [
        ("sandbox.stopped", "restore_failed"),
        ("sandbox.started", "request"),
    ]
    server.request("DELETE", f"/v1/sandboxes/{ref}")


# ---- races -------------------------------------------------------------------------------------------------


def test_two_wakes_racing_wake_it_once(server: Sandboxd) -> None:
    ref = persistent(server, "two-wakes")["id"]
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    results: list[int] = []

    def wake() -> None:
        results.append(server.run(ref, ["true"])["exit_code"])

    threads = [threading.Thread(target=wake) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [0, 0]
    assert [k for k in lifecycle(server, ref) if k[0] == "sandbox.resumed"] == [
        ("sandbox.resumed", "request")
    ]
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_a_wake_racing_a_delete_leaves_it_terminated(server: Sandboxd) -> None:
    ref = persistent(server, "wake-vs-delete")["id"]
    assert server.request("POST", f"/v1/sandboxes/{ref}/stop").status == 200
    answers: list[Response] = []
    waker = threading.Thread(target=lambda: answers.append(server.request("POST", f"/v1/sandboxes/{ref}/run",
                                                                          {"argv": ["true"]})))  # fmt: skip
    waker.start()
    time.sleep(0.05)
    assert server.request("DELETE", f"/v1/sandboxes/{ref}").status == 204
    waker.join()
    # Answered before the DELETE (200), or refused by it: terminated before or while the command ran (409).
    assert answers[0].status in (200, 409), answers[0].body
    assert get(server, ref)["state"] == "terminated"
    deadline = time.monotonic() + 20
    while subprocess.run(["pgrep", "-f", ref], capture_output=True, check=False).returncode == 0:
        assert time.monotonic() < deadline, "runsc processes of the deleted sandbox are left"
        time.sleep(0.2)


# ---- capacity -------------------------------------------------------------------------------------------------


def test_a_dormant_sandbox_holds_only_its_disk_and_a_wake_that_does_not_fit_is_503(
    sandboxd_factory: Callable[..., Sandboxd],
) -> None:
    server = sandboxd_factory("[capacity]\ncpus = 2\nmemory_mb = 1024\ndisk_mb = 20000\n")
    ref = persistent(server, "big", cpus=2, memory_mb=1024, disk_mb=1024)["id"]
    free = server.request("GET", "/v1/node").json()["free"]
    assert (free["cpus"], free["memory_mb"]) == (0, 0)
    assert server.request("POST", f"/v1/sandboxes/{ref}/stop").status == 200
    free = server.request("GET", "/v1/node").json()["free"]
    assert (free["cpus"], free["memory_mb"], free["disk_mb"]) == (2, 1024, 20000 - 1024)
    # Its cpus and memory taken by another: the wake is 503 naming what is short, and it stays stopped.
    other = server.create(cpus=2, memory_mb=1024, disk_mb=512)["id"]
    resp = server.request("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["true"]})
    expect_error(resp, 503, "unavailable", "cpus")
    assert get(server, ref)["state"] == "stopped"
    server.request("DELETE", f"/v1/sandboxes/{other}")
    assert text(server, ref, "echo", "room") == "room\n"
    server.request("DELETE", f"/v1/sandboxes/{ref}")


# ---- restarts and crashes -------------------------------------------------------------------------------------


def test_a_sandboxd_restart_changes_nothing(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory(CONFIG)
    running = persistent(server, "r-running")["id"]
    suspended = persistent(server, "r-suspended")["id"]
    stopped = persistent(server, "r-stopped")["id"]
    for ref in (running, suspended, stopped):
        text(server, ref, "sh", "-c", f"echo {ref} > /sandbox/home/me")
    text(server, suspended, "sh", "-c", COUNTER)
    before = wait_count_above(server, suspended, 0)
    assert server.request("POST", f"/v1/sandboxes/{suspended}/suspend").status == 200
    assert server.request("POST", f"/v1/sandboxes/{stopped}/stop").status == 200
    server.signal(signal.SIGTERM)
    server.start()
    assert [get(server, r)["state"] for r in (running, suspended, stopped)] == [
        "running",
        "suspended",
        "stopped",
    ]
    assert get(server, stopped)["stopped_reason"] == "request"
    for ref in (running, suspended, stopped):
        assert text(server, ref, "cat", "/sandbox/home/me") == f"{ref}\n"
    wait_count_above(server, suspended, before)


@pytest.mark.parametrize("reboot", [False, True], ids=["crash", "reboot"])
def test_a_host_crash_leaves_a_running_one_stopped_and_a_suspended_one_suspended(
    sandboxd_factory: Callable[..., Sandboxd], reboot: bool
) -> None:
    """SIGKILL of sandboxd and of every runsc process of the sandboxes: what a host crash leaves. With
    ``reboot``, their mounts (the overlay root, the layer's loop mount) are taken away too, as a reboot does."""
    server = sandboxd_factory(CONFIG)
    running = persistent(server, "c-running")["id"]
    suspended = persistent(server, "c-suspended")["id"]
    text(server, running, "sh", "-c", "echo synced > /sandbox/home/f; sync")
    text(server, suspended, "sh", "-c", COUNTER)
    before = wait_count_above(server, suspended, 0)
    assert server.request("POST", f"/v1/sandboxes/{suspended}/suspend").status == 200
    server.signal(signal.SIGKILL)
    for ref in (running, suspended):
        subprocess.run(["pkill", "-KILL", "-f", ref], check=False)
    deadline = time.monotonic() + 10
    while subprocess.run(["pgrep", "-f", running], capture_output=True, check=False).returncode == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    if reboot:
        for ref in (running, suspended):
            layer = server.state_dir / "gvisor" / ref / "layer"
            for mount_point in (layer / "rootfs", layer / "disk"):
                subprocess.run(["umount", "-l", str(mount_point)], check=True)
            assert not os.path.ismount(layer / "disk")
    server.start()
    after = get(server, running)
    assert (after["state"], after["stopped_reason"]) == ("stopped", "crash")
    assert get(server, suspended)["state"] == "suspended"
    assert text(server, running, "cat", "/sandbox/home/f") == "synced\n"
    wait_count_above(server, suspended, before)
    assert lifecycle(server, running)[-2:] == [("sandbox.stopped", "crash"), ("sandbox.started", "request")]


def test_a_crashed_guest_of_a_persistent_sandbox_is_stopped_not_terminated(server: Sandboxd) -> None:
    ref = persistent(server, "crashy")["id"]
    text(server, ref, "sh", "-c", "echo still-here > /sandbox/home/f")
    subprocess.run(["pkill", "-KILL", "-f", f"runsc.*{ref}"], check=False)
    sandbox = wait_state(server, ref, "stopped")
    assert sandbox["stopped_reason"] == "crash"
    assert text(server, ref, "cat", "/sandbox/home/f") == "still-here\n"
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_volumes_and_their_files_survive_stop_and_start(server: Sandboxd) -> None:
    assert server.request("POST", "/v1/volumes", {"name": "pvol", "size_mb": 64}).status == 201
    ref = persistent(server, "with-volume", volumes=[{"name": "pvol", "path": "/data"}])["id"]
    text(server, ref, "sh", "-c", "echo on-volume > /data/f")
    assert server.request("POST", f"/v1/sandboxes/{ref}/stop").status == 200
    expect_error(server.request("DELETE", "/v1/volumes/pvol"), 409, "conflict", "")
    assert text(server, ref, "cat", "/data/f") == "on-volume\n"
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_the_disk_is_journaled_and_not_from_the_layer_pool(server: Sandboxd) -> None:
    ref = persistent(server, "journaled")["id"]
    image = server.state_dir / "gvisor" / ref / "layer" / "disk.img"
    out = subprocess.run(["dumpe2fs", "-h", str(image)], capture_output=True, text=True, check=False).stdout
    assert "has_journal" in out
    server.request("DELETE", f"/v1/sandboxes/{ref}")


# ---- the listening ports a gateway builds port URLs from ------------------------------------------------------


def test_listening_ports_on_any_address_and_none_of_a_sleeping_one(server: Sandboxd) -> None:
    assert server.request("GET", "/v1/capabilities").json()["capabilities"]["listening_ports"] is True
    ref = persistent(server, "listener")["id"]
    script = (
        "import socket, time\n"
        "a = socket.create_server(('0.0.0.0', 8000)); b = socket.create_server(('127.0.0.1', 8002))\n"
        "c = socket.socket(socket.AF_INET6); c.bind(('::', 8001)); c.listen()\n"
        "time.sleep(3600)\n"
    )
    text(server, ref, "sh", "-c", f'nohup python3 -c "{script}" >/dev/null 2>&1 &')
    deadline = time.monotonic() + 10
    while (got := server.request("GET", f"/v1/sandboxes/{ref}/listening").json())["ports"] != [
        8000,
        8001,
        8002,
    ]:
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
    assert got["awake"] is True
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    assert server.request("GET", f"/v1/sandboxes/{ref}/listening").json() == {"ports": [], "awake": False}
    assert get(server, ref)["state"] == "suspended"
    expect_error(
        server.request("GET", "/v1/sandboxes/sbx_0000000000000000/listening"), 404, "not_found", "no sandbox"
    )
    server.request("DELETE", f"/v1/sandboxes/{ref}")
