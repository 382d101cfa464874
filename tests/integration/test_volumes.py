"""Volumes against the real gVisor backend: the API, every mount rule, sizes, read-only drives and restarts."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from mount_holder import holding_mount
from sandboxd_harness import RUNSC, Sandboxd

MiB = 1024 * 1024


@pytest.fixture
def volume(sandboxd: Sandboxd, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh 16 MiB volume named after the test; deleted (with what mounts it) afterwards."""
    name = request.node.name.replace("test_", "").replace("_", "-")[:40].strip("-")
    assert sandboxd.request("POST", "/v1/volumes", {"name": name, "size_mb": 16}).status == 201
    yield name
    _cleanup(sandboxd, name)


def _cleanup(server: Sandboxd, *names: str) -> None:
    for sandbox in server.request("GET", "/v1/sandboxes").json()["sandboxes"]:
        if sandbox["state"] != "terminated":
            server.request("DELETE", f"/v1/sandboxes/{sandbox['id']}")
    for name in names:
        server.request("DELETE", f"/v1/volumes/{name}")


def volumes(server: Sandboxd) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in server.request("GET", "/v1/volumes").json()["volumes"]}


def live(server: Sandboxd) -> list[str]:
    return [
        s["id"]
        for s in server.request("GET", "/v1/sandboxes").json()["sandboxes"]
        if s["state"] != "terminated"
    ]


def sh(server: Sandboxd, ref: str, script: str) -> dict[str, Any]:
    return server.run(ref, ["sh", "-c", script])


def host_mounted(server: Sandboxd, name: str) -> bool:
    target = str(server.state_dir / "volumes" / name / "mnt")
    return any(line.split()[4] == target for line in open("/proc/self/mountinfo", encoding="utf-8"))


def refused(
    server: Sandboxd, method: str, path: str, body: Any, status: int, code: str, message: str
) -> None:
    """The request fails with ``status``/``code`` and a message containing ``message``; nothing changes."""
    before = (volumes(server), live(server))
    resp = server.request(method, path, body)
    assert resp.status == status, (resp.status, resp.body)
    assert resp.error[0] == code and message in resp.error[1], resp.error
    assert (volumes(server), live(server)) == before


# --- the volume API ----------------------------------------------------------------------------------------


def test_create_list_delete_and_their_errors(sandboxd: Sandboxd) -> None:
    resp = sandboxd.request("POST", "/v1/volumes", {"name": "api-vol", "size_mb": 8})
    assert resp.status == 201
    made = resp.json()
    assert set(made) == {"name", "size_mb", "created_at", "attached_to"}
    assert (made["name"], made["size_mb"], made["attached_to"]) == ("api-vol", 8, None)
    assert made["created_at"].endswith("Z")
    default = sandboxd.request("POST", "/v1/volumes", {"name": "api-default"}).json()
    caps = sandboxd.request("GET", "/v1/capabilities").json()
    assert default["size_mb"] == 2048  # the server's default disk size
    assert volumes(sandboxd)["api-vol"] == made
    assert (sandboxd.state_dir / "volumes" / "api-vol" / "disk.img").stat().st_size == 8 * MiB
    assert not host_mounted(sandboxd, "api-vol")  # mounted only while a sandbox uses it

    max_disk = caps["limits"]["max_disk_mb"]
    for body, status, code, message in [
        ({"name": "api-vol"}, 409, "conflict", "a volume named 'api-vol' exists"),
        ({"name": "api-big", "size_mb": max_disk + 1}, 400, "invalid_request", "max_disk_mb"),
        ({"name": "api-zero", "size_mb": 0}, 400, "invalid_request", "size_mb"),
        ({"name": "Api"}, 400, "invalid_request", "not a valid volume name"),
        ({"name": "api-x", "size": 8}, 400, "invalid_request", "unknown field 'size'"),
        ({"size_mb": 8}, 400, "invalid_request", "name is required"),
    ]:
        refused(sandboxd, "POST", "/v1/volumes", body, status, code, message)
    refused(sandboxd, "DELETE", "/v1/volumes/nope", None, 404, "not_found", "no volume 'nope'")

    for name in ("api-vol", "api-default"):
        assert sandboxd.request("DELETE", f"/v1/volumes/{name}").status == 204
    assert "api-vol" not in volumes(sandboxd)
    assert not (sandboxd.state_dir / "volumes" / "api-vol").exists()
    # The name is free again, and the new volume is empty.
    assert sandboxd.request("POST", "/v1/volumes", {"name": "api-vol", "size_mb": 8}).status == 201
    _cleanup(sandboxd, "api-vol")


# --- contents, size, delete while mounted ----------------------------------------------------------------


def test_contents_are_shared_with_the_host_mount_and_survive_the_sandbox(
    sandboxd: Sandboxd, volume: str
) -> None:
    first = sandboxd.create(volumes=[{"name": volume, "path": "/data"}])
    assert volumes(sandboxd)[volume]["attached_to"] == first["id"]
    assert host_mounted(sandboxd, volume)
    out = sh(
        sandboxd,
        first["id"],
        "id -u; echo hello > /data/greeting; mkdir /data/sub; echo deep > /data/sub/f; cat /data/greeting",
    )
    assert out["exit_code"] == 0 and out["stdout"] == b"1000\nhello\n", out
    put = sandboxd.request(
        "PUT", f"/v1/sandboxes/{first['id']}/files?path=/data/api.bin", body=b"\x00\x01" * 1000
    )
    assert put.status in (200, 204), put.body
    # Writes reach the host's mount while the sandbox runs (gVisor's file server writes through).
    assert (sandboxd.state_dir / "volumes" / volume / "mnt" / "greeting").read_bytes() == b"hello\n"

    refused(sandboxd, "DELETE", f"/v1/volumes/{volume}", None, 409, "conflict",
            f"volume {volume!r} is mounted by sandbox {first['id']}")  # fmt: skip
    assert sandboxd.request("DELETE", f"/v1/sandboxes/{first['id']}").status == 204
    assert volumes(sandboxd)[volume]["attached_to"] is None

    second = sandboxd.create(volumes=[{"name": volume, "path": "/sandbox/home/work", "read_only": True}])
    out = sh(sandboxd, second["id"], "cat /sandbox/home/work/greeting /sandbox/home/work/sub/f")
    assert out["stdout"] == b"hello\ndeep\n", out
    got = sandboxd.request("GET", f"/v1/sandboxes/{second['id']}/files?path=/sandbox/home/work/api.bin")
    assert got.status == 200 and got.body == b"\x00\x01" * 1000
    listing = sandboxd.request("GET", f"/v1/sandboxes/{second['id']}/dirs?path=/sandbox/home/work").json()
    assert sorted(e["name"] for e in listing["entries"]) == ["api.bin", "greeting", "sub"]  # no lost+found

    # DELETE right after the sandbox's DELETE: waits for its teardown, then unmounts and deletes.
    sandboxd.request("DELETE", f"/v1/sandboxes/{second['id']}")
    start = time.monotonic()
    assert sandboxd.request("DELETE", f"/v1/volumes/{volume}").status == 204
    assert time.monotonic() - start < 15
    assert not host_mounted(sandboxd, volume)
    assert volume not in volumes(sandboxd)


def test_size_is_enforced_inside_the_sandbox(sandboxd: Sandboxd, volume: str) -> None:
    box = sandboxd.create(volumes=[{"name": volume, "path": "/data"}])
    out = sh(sandboxd, box["id"], "dd if=/dev/zero of=/data/fill bs=1M count=64 2>&1; echo rc=$?")
    assert b"No space left on device" in out["stdout"] and out["stdout"].endswith(b"rc=1\n"), out
    written = int(sh(sandboxd, box["id"], "wc -c < /data/fill")["stdout"])
    assert 8 * MiB < written <= 16 * MiB  # the 16 MiB volume less ext4's own blocks
    # The sandbox's own disk is untouched by the volume filling up.
    assert sh(sandboxd, box["id"], "echo ok > /sandbox/home/f && cat /sandbox/home/f")["stdout"] == b"ok\n"
    resp = sandboxd.request("PUT", f"/v1/sandboxes/{box['id']}/files?path=/data/more", body=b"x" * (2 * MiB))
    assert resp.status == 409 and "no space left on device" in resp.error[1], resp.body
    # Freeing space makes room again.
    assert sh(sandboxd, box["id"], "rm /data/fill && echo y > /data/y && cat /data/y")["stdout"] == b"y\n"


# --- mount rule 1 and read-only drives -------------------------------------------------------------------


def test_three_readers_share_it_and_a_fourth_writable_mount_is_refused(
    sandboxd: Sandboxd, volume: str
) -> None:
    writer = sandboxd.create(volumes=[{"name": volume, "path": "/data"}])
    sh(sandboxd, writer["id"], "echo shared > /data/f")
    # A reader while the writer holds it: 409 naming the writer; nothing is created.
    refused(sandboxd, "POST", "/v1/sandboxes", {"volumes": [{"name": volume, "path": "/d", "read_only": True}]},
            409, "conflict", f"volume {volume!r} is mounted writable by sandbox {writer['id']}")  # fmt: skip
    refused(sandboxd, "POST", "/v1/sandboxes", {"volumes": [{"name": volume, "path": "/d"}]},
            409, "conflict", f"mounted writable by sandbox {writer['id']}")  # fmt: skip
    sandboxd.request("DELETE", f"/v1/sandboxes/{writer['id']}")

    readers = [
        sandboxd.create(volumes=[{"name": volume, "path": f"/r{i}", "read_only": True}]) for i in range(3)
    ]
    assert volumes(sandboxd)[volume]["attached_to"] == min(r["id"] for r in readers)
    for i, reader in enumerate(readers):
        assert sh(sandboxd, reader["id"], f"cat /r{i}/f")["stdout"] == b"shared\n"
    refused(sandboxd, "POST", "/v1/sandboxes", {"volumes": [{"name": volume, "path": "/w"}]},
            409, "conflict", f"volume {volume!r} is mounted read-only by 3 sandbox(es)")  # fmt: skip

    reader = readers[0]["id"]
    # The sandbox user: the shell's write fails with EROFS.
    out = sh(sandboxd, reader, "echo x > /r0/f; echo rc=$?; echo y > /r0/new; touch /r0/t")
    assert out["stderr"].count(b"Read-only file system") == 3 and b"rc=2" in out["stdout"], out
    # ... and truncated nothing on the way (runsc 20240729 truncates before it refuses; docs/backends.md).
    assert (sandboxd.state_dir / "volumes" / volume / "mnt" / "f").read_bytes() == b"shared\n"
    # The files API: 409 read-only file system for a write and a removal; the file is unchanged.
    for method, path, body in [
        ("PUT", "/r0/f", b"changed"),
        ("PUT", "/r0/new", b"n"),
        ("DELETE", "/r0/f", None),
    ]:
        resp = sandboxd.request(method, f"/v1/sandboxes/{reader}/files?path={path}", body=body)
        assert resp.status == 409 and resp.error == ("conflict", "read-only file system"), (method, resp.body)
    # Root inside the sandbox (runsc exec as uid 0; the API runs nothing as root): also EROFS.
    root = subprocess.run(
        [RUNSC, "--root", str(sandboxd.state_dir / "gvisor" / "runsc"), "exec", "--user", "0:0", reader,
         "sh", "-c", "id -u; echo x > /r0/f; touch /r0/t; mount -o remount,rw /r0; echo x > /r0/f"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert root.stdout.startswith("0\n") and root.stderr.count("Read-only file system") >= 3, root
    assert sh(sandboxd, readers[1]["id"], "cat /r1/f")["stdout"] == b"shared\n"
    assert (sandboxd.state_dir / "volumes" / volume / "mnt" / "f").read_bytes() == b"shared\n"
    assert not (sandboxd.state_dir / "volumes" / volume / "mnt" / "t").exists()

    # While readers remain, still no writer; when the last reader goes, a writer may mount it.
    for r in readers[:2]:
        sandboxd.request("DELETE", f"/v1/sandboxes/{r['id']}")
    # A deleted reader's read-only bind of the volume goes with it (the teardown ends in the background).
    deadline = time.monotonic() + 30
    while (sandboxd.state_dir / "gvisor" / readers[0]["id"]).exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f"/gvisor/{readers[0]['id']}/" not in Path("/proc/self/mountinfo").read_text()
    refused(sandboxd, "POST", "/v1/sandboxes", {"volumes": [{"name": volume, "path": "/w"}]},
            409, "conflict", "read-only by 1 sandbox(es)")  # fmt: skip
    sandboxd.request("DELETE", f"/v1/sandboxes/{readers[2]['id']}")
    again = sandboxd.create(volumes=[{"name": volume, "path": "/w"}])
    assert sh(sandboxd, again["id"], "echo new > /w/f && cat /w/f")["stdout"] == b"new\n"


def test_concurrent_requests_for_one_volume_get_one_answer_each(sandboxd: Sandboxd) -> None:
    with ThreadPoolExecutor(4) as pool:
        made = list(
            pool.map(
                lambda _: sandboxd.request("POST", "/v1/volumes", {"name": "race", "size_mb": 8}), range(4)
            )
        )
        assert sorted(r.status for r in made) == [201, 409, 409, 409]
        body = {"volumes": [{"name": "race", "path": "/data"}]}
        creates = list(pool.map(lambda _: sandboxd.request("POST", "/v1/sandboxes", body), range(3)))
    assert sorted(r.status for r in creates) == [201, 409, 409], [r.body for r in creates]
    winner = next(r.json()["id"] for r in creates if r.status == 201)
    assert volumes(sandboxd)["race"]["attached_to"] == winner
    assert all(f"mounted writable by sandbox {winner}" in r.error[1] for r in creates if r.status == 409)
    _cleanup(sandboxd, "race")
    assert "race" not in volumes(sandboxd)


# --- mount rule 2 and the create request ------------------------------------------------------------------


def test_eight_mounts_at_most_and_paths_that_are_refused(sandboxd: Sandboxd) -> None:
    names = [f"eight-{i}" for i in range(9)]
    for name in names:
        assert sandboxd.request("POST", "/v1/volumes", {"name": name, "size_mb": 4}).status == 201
    try:
        nine = [{"name": n, "path": f"/v/{n}"} for n in names]
        refused(sandboxd, "POST", "/v1/sandboxes", {"volumes": nine}, 400, "invalid_request",
                "volumes: 9 mounts given; at most 8 are allowed")  # fmt: skip
        for mounts, status, code, message in [
            ([{"name": "eight-0", "path": "/d"}, {"name": "eight-1", "path": "/d/e"}], 400, "invalid_request",
             "volumes[1]: path '/d/e' and volumes[0] path '/d' nest or coincide"),
            ([{"name": "eight-0", "path": "/d"}, {"name": "eight-1", "path": "/d/"}], 400, "invalid_request",
             "nest or coincide"),
            ([{"name": "eight-0", "path": "/etc/x"}], 400, "invalid_request", "under /etc"),
            ([{"name": "eight-0", "path": "/tmp"}], 400, "invalid_request", "under /tmp"),
            ([{"name": "eight-0", "path": "/.sbx/x"}], 400, "invalid_request", "under /.sbx"),
            ([{"name": "eight-0", "path": "rel"}], 400, "invalid_request", "relative"),
            ([{"name": "eight-0", "path": "/var/lock/x"}], 400, "invalid_request",
             "passes through a symbolic link in the image (/var/lock)"),
            ([{"name": "eight-0", "path": "/etc2"}, {"name": "nope", "path": "/n"}], 404, "not_found",
             "volumes[1].name: no volume 'nope' on this node"),
        ]:  # fmt: skip
            refused(sandboxd, "POST", "/v1/sandboxes", {"volumes": mounts}, status, code, message)
        assert all(v["attached_to"] is None for n, v in volumes(sandboxd).items() if n in names)
        assert not any(host_mounted(sandboxd, n) for n in names)

        eight = [{"name": n, "path": f"/v/{n}", "read_only": i % 2 == 1} for i, n in enumerate(names[:8])]
        box = sandboxd.create(volumes=eight)
        script = "; ".join(f"echo {i} > /v/eight-{i}/f 2>/dev/null; echo $?" for i in range(8))
        codes = sh(sandboxd, box["id"], script)["stdout"].split()
        assert codes == [b"0" if i % 2 == 0 else b"2" for i in range(8)]
        assert all(volumes(sandboxd)[n]["attached_to"] == box["id"] for n in names[:8])
        events = sandboxd.request("GET", f"/v1/sandboxes/{box['id']}/events").json()["events"]
        created = next(e for e in events if e["type"] == "sandbox.created")
        assert created["volumes"] == [
            {"name": m["name"], "path": m["path"], "read_only": m["read_only"]} for m in eight
        ]
    finally:
        _cleanup(sandboxd, *names)


# --- restarts and pools ------------------------------------------------------------------------------------


def test_contents_and_holders_survive_sandboxd_restarts(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory()
    assert server.request("POST", "/v1/volumes", {"name": "keep", "size_mb": 16}).status == 201
    writer = server.create(volumes=[{"name": "keep", "path": "/data"}])
    sh(server, writer["id"], "echo before > /data/f")

    server.signal(signal.SIGKILL)
    server.start()
    # Taken back: still the writer, still mounted, and rule 1 still holds.
    assert volumes(server)["keep"]["attached_to"] == writer["id"]
    assert host_mounted(server, "keep")
    refused(server, "POST", "/v1/sandboxes", {"volumes": [{"name": "keep", "path": "/r", "read_only": True}]},
            409, "conflict", f"mounted writable by sandbox {writer['id']}")  # fmt: skip
    refused(server, "DELETE", "/v1/volumes/keep", None, 409, "conflict", "mounted by sandbox")
    sh(server, writer["id"], "echo after >> /data/f")
    assert server.request("DELETE", f"/v1/sandboxes/{writer['id']}").status == 204

    server.signal(signal.SIGTERM)
    server.start()
    assert volumes(server)["keep"]["attached_to"] is None
    assert not host_mounted(server, "keep")  # released by the teardown (or by the restart)
    reader = server.create(volumes=[{"name": "keep", "path": "/data", "read_only": True}])
    assert sh(server, reader["id"], "cat /data/f")["stdout"] == b"before\nafter\n"

    # A restart with no sandbox using a volume that was left mounted unmounts it.
    server.signal(signal.SIGKILL)
    # While sandboxd is down its sandbox dies: the next start finds it lost and releases the volume.
    subprocess.run([RUNSC, "--root", str(server.state_dir / "gvisor" / "runsc"), "kill", reader["id"], "KILL"],
                   capture_output=True, check=False, timeout=30)  # fmt: skip
    time.sleep(1)
    server.start()
    assert volumes(server)["keep"]["attached_to"] is None  # the lost sandbox was terminated
    deadline = time.monotonic() + 15
    while host_mounted(server, "keep") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not host_mounted(server, "keep")
    assert server.request("DELETE", "/v1/volumes/keep").status == 204


def test_a_pooled_sandbox_never_takes_a_request_with_volumes(
    sandboxd_factory: Callable[..., Sandboxd],
) -> None:
    server = sandboxd_factory('[[pools]]\nimage = "default"\nsize = 1\n')
    deadline = time.monotonic() + 90
    while sum(server.request("GET", "/v1/node").json()["pooled"].values()) < 1:
        assert time.monotonic() < deadline, "the pool never filled"
        time.sleep(0.05)
    assert server.request("POST", "/v1/volumes", {"name": "p", "size_mb": 8}).status == 201
    box = server.create(volumes=[{"name": "p", "path": "/p"}])
    created = server.request("GET", f"/v1/sandboxes/{box['id']}/events").json()["events"][0]
    assert created["type"] == "sandbox.created" and "reason" not in created
    assert created["volumes"] == [{"name": "p", "path": "/p", "read_only": False}]
    assert sum(server.request("GET", "/v1/node").json()["pooled"].values()) == 1
    assert sh(server, box["id"], "echo x > /p/x && cat /p/x")["stdout"] == b"x\n"


def test_a_suspended_sandbox_still_holds_its_volumes(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory()
    if not server.request("GET", "/v1/capabilities").json()["capabilities"]["suspend"]:
        pytest.skip("needs capability suspend (checkpoint/restore in the backend)")
    assert server.request("POST", "/v1/volumes", {"name": "held", "size_mb": 16}).status == 201
    box = server.create(volumes=[{"name": "held", "path": "/data"}])
    sh(server, box["id"], "echo one > /data/f")
    assert server.request("POST", f"/v1/sandboxes/{box['id']}/suspend").status == 200
    assert volumes(server)["held"]["attached_to"] == box["id"]
    refused(server, "POST", "/v1/sandboxes", {"volumes": [{"name": "held", "path": "/d", "read_only": True}]},
            409, "conflict", f"mounted writable by sandbox {box['id']}")  # fmt: skip
    refused(server, "DELETE", "/v1/volumes/held", None, 409, "conflict", f"mounted by sandbox {box['id']}")

    # As after a host reboot: sandboxd gone and the volume's host mount with it. The restart mounts it
    # again for its suspended holder, so the resume sees the volume, not an empty directory.
    server.signal(signal.SIGKILL)
    subprocess.run(["umount", str(server.state_dir / "volumes" / "held" / "mnt")], check=True, timeout=30)
    server.start()
    assert volumes(server)["held"]["attached_to"] == box["id"]
    assert host_mounted(server, "held")
    assert server.request("POST", f"/v1/sandboxes/{box['id']}/resume").status == 200
    assert sh(server, box["id"], "echo two >> /data/f; cat /data/f")["stdout"] == b"one\ntwo\n"
    assert (server.state_dir / "volumes" / "held" / "mnt" / "f").read_bytes() == b"one\ntwo\n"


def test_a_mount_namespace_holding_a_copy_of_the_volume_never_gets_it_a_second_loop_device(
    sandboxd_factory: Callable[..., Sandboxd],
) -> None:
    """A program on the host that makes a mount namespace while a volume is mounted (``unshare -m``, ``ip
    netns exec``: another test's server did, and the next mount was refused for 5 s) keeps a copy of the
    mount that sandboxd's unmount does not reach where the host's mounts are private (this machine's). The
    next sandbox mounts the loop device still bound to the volume's image (the same file system, with what
    was written), never a second one over the same file, which would corrupt it. The test holds a copy of
    that one mount (tests/support/mount_holder.py), which leaves the kernel in the same state."""
    from sbx.backends.layers import loop_devices_of

    server = sandboxd_factory()
    assert server.request("POST", "/v1/volumes", {"name": "keep", "size_mb": 16}).status == 201
    writer = server.create(volumes=[{"name": "keep", "path": "/data"}])["id"]
    sh(server, writer, "echo before > /data/f")
    image = server.state_dir / "volumes" / "keep" / "disk.img"
    (device,) = loop_devices_of(image)
    with holding_mount(server.state_dir / "volumes" / "keep" / "mnt"):
        assert server.request("DELETE", f"/v1/sandboxes/{writer}").status == 204
        deadline = time.monotonic() + 10
        while volumes(server)["keep"]["attached_to"] is not None or host_mounted(server, "keep"):
            assert time.monotonic() < deadline, volumes(server)
            time.sleep(0.05)
        assert loop_devices_of(image) == [device]  # still bound: the copy holds the file system
        reader = server.create(volumes=[{"name": "keep", "path": "/data"}])["id"]
        assert loop_devices_of(image) == [device]
        assert sh(server, reader, "cat /data/f; echo after >> /data/f; cat /data/f")["stdout"] == (
            b"before\nbefore\nafter\n"
        )
        assert server.request("DELETE", f"/v1/sandboxes/{reader}").status == 204
