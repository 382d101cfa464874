"""Suspend/resume, memory and disk snapshots, forks and schedules against real gVisor sandboxes."""

from __future__ import annotations

import base64
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
from guest_counter import COUNTER, count, expect_error, text, wait_count_above
from sandboxd_harness import Response, Sandboxd

CONFIG = """
[limits]
min_snapshot_every_secs = 1
max_snapshot_keep = 3

[network]
ceiling = "open"
"""


@pytest.fixture(scope="module")
def server() -> Iterator[Sandboxd]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxd-", dir="/var/tmp"))
    s = Sandboxd(workdir, CONFIG).start()
    yield s
    s.teardown()
    shutil.rmtree(workdir, ignore_errors=True)


def host_processes(sandbox_id: str) -> int:
    """Host processes whose command line names the sandbox (runsc's sandbox, gofer and their children)."""
    found = subprocess.run(["pgrep", "-f", sandbox_id], capture_output=True, text=True, check=False)
    return len(found.stdout.split())


def state_of(server: Sandboxd, ref: str) -> str:
    return str(server.request("GET", f"/v1/sandboxes/{ref}").json()["state"])


def snapshot(server: Sandboxd, ref: str, kind: str = "memory") -> dict[str, Any]:
    resp = server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": kind})
    assert resp.status == 201, (resp.status, resp.body)
    return resp.json()  # type: ignore[no-any-return]


def events(server: Sandboxd, ref: str) -> list[dict[str, Any]]:
    return server.request("GET", f"/v1/sandboxes/{ref}/events").json()["events"]  # type: ignore[no-any-return]


def test_capabilities_say_suspend_and_snapshots(server: Sandboxd) -> None:
    caps = server.request("GET", "/v1/capabilities").json()["capabilities"]
    assert caps["suspend"] and caps["memory_snapshot"] and caps["disk_snapshot"]


# ---- suspend and resume ------------------------------------------------------------------------------


def test_twenty_suspend_resume_cycles_lose_nothing(server: Sandboxd) -> None:
    s = server.create(name="sleeper")
    ref = s["id"]
    text(server, ref, "sh", "-c", COUNTER)
    last = wait_count_above(server, ref, 0)
    for cycle in range(20):
        # Written just before the suspend: must be there after the resume.
        text(server, ref, "sh", "-c", f"echo {cycle} >> /sandbox/home/cycles")
        resp = server.request("POST", f"/v1/sandboxes/{ref}/suspend")
        assert resp.status == 200 and resp.json()["state"] == "suspended", resp.body
        resp = server.request("POST", f"/v1/sandboxes/{ref}/resume")
        assert resp.status == 200 and resp.json()["state"] == "running", resp.body
        assert resp.json()["id"] == ref
        last = wait_count_above(server, ref, last)  # the counter goes on from where it was
    assert text(server, ref, "cat", "/sandbox/home/cycles").split() == [str(i) for i in range(20)]
    lines = [int(x) for x in text(server, ref, "cat", "/sandbox/home/lines").split()]
    assert lines == list(range(1, len(lines) + 1))  # no tick lost or repeated across 20 cycles
    types = [e["type"] for e in events(server, ref)]
    assert types.count("sandbox.suspended") == 20 and types.count("sandbox.resumed") == 20
    # runsc's control socket of each stopped run was removed, never moved to /var/run or /tmp instead.
    assert not [d for d in ("/var/run", "/run", "/tmp") if Path(d, f"runsc-{ref}.sock").exists()]
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_a_suspended_sandbox_runs_nothing_and_refuses_work(server: Sandboxd) -> None:
    ref = server.create()["id"]
    text(server, ref, "sh", "-c", COUNTER)
    wait_count_above(server, ref, 0)
    assert host_processes(ref) > 0
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    assert host_processes(ref) == 0  # no CPU, no memory: nothing of it runs on the host
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["true"]}), 409, "conflict",
                 "suspended")  # fmt: skip
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/suspend"), 409, "conflict", "suspended")
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "memory"}), 409,
                 "conflict", "suspended; a memory snapshot is taken of a running sandbox (resume it first)")  # fmt: skip
    expect_error(server.request("PUT", f"/v1/sandboxes/{ref}/snapshot-schedule", {"every_secs": 5}), 409,
                 "conflict", "a schedule is set on a running sandbox")  # fmt: skip
    # A disk snapshot of it is taken without waking it; its fork boots with the files.
    disk = snapshot(server, ref, "disk")
    assert (disk["kind"], state_of(server, ref), host_processes(ref)) == ("disk", "suspended", 0)
    fork = server.create(snapshot_id=disk["id"])["id"]
    assert text(server, fork, "head", "-n", "1", "/sandbox/home/lines") == "1\n"  # what the daemon wrote
    server.request("DELETE", f"/v1/sandboxes/{fork}")
    server.request("DELETE", f"/v1/snapshots/{disk['id']}")
    assert server.request("GET", f"/v1/sandboxes/{ref}").json()["snapshot_every_secs"] == 0
    metrics = server.request("GET", f"/v1/sandboxes/{ref}/metrics")
    assert metrics.status == 200
    # PATCH of name and labels works on a suspended sandbox without waking it (rule 5).
    resp = server.request("PATCH", f"/v1/sandboxes/{ref}", {"labels": {"held": "yes"}})
    assert resp.status == 200 and resp.json()["state"] == "suspended"
    assert server.request("POST", f"/v1/sandboxes/{ref}/resume").status == 200
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/resume"), 409, "conflict", "not suspended")
    assert server.request("DELETE", f"/v1/sandboxes/{ref}").status == 204


def test_suspend_while_a_process_runs_is_409_and_changes_nothing(server: Sandboxd) -> None:
    ref = server.create()["id"]
    proc = server.request("POST", f"/v1/sandboxes/{ref}/processes", {"argv": ["sleep", "30"]}).json()
    resp = server.request("POST", f"/v1/sandboxes/{ref}/suspend")
    expect_error(resp, 409, "conflict", f"process(es) running (pid {proc['pid']})")
    assert state_of(server, ref) == "running"
    assert text(server, ref, "echo", "still") == "still\n"
    assert "sandbox.suspended" not in [e["type"] for e in events(server, ref)]
    server.request("POST", f"/v1/sandboxes/{ref}/processes/{proc['pid']}/signal", {"signal": 9})
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_deleting_a_suspended_sandbox_terminates_it(server: Sandboxd) -> None:
    ref = server.create()["id"]
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    assert server.request("DELETE", f"/v1/sandboxes/{ref}").status == 204
    assert state_of(server, ref) == "terminated"
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/resume"), 409, "conflict", "terminated")


# ---- snapshots and forks ------------------------------------------------------------------------------


def test_memory_fork_resumes_with_processes_running_and_diverges(server: Sandboxd) -> None:
    ref = server.create(cpus=1, memory_mb=512)["id"]
    # A process the API started (still running at the snapshot) and a daemon it does not track.
    proc = server.request("POST", f"/v1/sandboxes/{ref}/processes", {
        "argv": ["sh", "-c", "i=0; while [ $i -lt 100000 ]; do i=$((i+1)); echo tick $i; sleep 0.05; done"],
    }).json()  # fmt: skip
    text(server, ref, "sh", "-c", COUNTER)
    wait_count_above(server, ref, 5)
    snap = snapshot(server, ref)
    assert (
        snap["kind"] == "memory" and snap["sandbox"] == ref and snap["bytes"] > 0 and "scheduled" not in snap
    )
    # The original carries on.
    wait_count_above(server, ref, count(server, ref))
    forks = [server.create(snapshot_id=snap["id"]) for _ in range(2)]
    for fork in forks:
        assert (fork["cpus"], fork["memory_mb"], fork["image"]) == (1, 512, snap["image"])
        f = fork["id"]
        # The daemon runs on in the fork, from where the snapshot was: its file lines have no gap.
        n = wait_count_above(server, f, count(server, f))
        lines = [int(x) for x in text(server, f, "cat", "/sandbox/home/lines").split()]
        assert lines == list(range(1, len(lines) + 1)) and lines[-1] >= n
        # The API process is the fork's too, still running, its output going on.
        listed = server.request("GET", f"/v1/sandboxes/{f}/processes/{proc['pid']}").json()
        assert listed["state"] == "running", listed
    # Forks diverge: each writes its own file, the other does not see it.
    text(server, forks[0]["id"], "sh", "-c", "echo mine > /sandbox/home/only-0")
    assert server.run(forks[1]["id"], ["cat", "/sandbox/home/only-0"])["exit_code"] != 0
    # Fresh randomness in each fork, even for a process that existed before the snapshot.
    rand = [text(server, f["id"], "python3", "-c", "import os; print(os.urandom(16).hex())") for f in forks]
    assert rand[0] != rand[1]
    created = [e for e in events(server, forks[0]["id"]) if e["type"] == "sandbox.created"]
    assert created[0]["snapshot"] == snap["id"]
    for f in [ref, *(x["id"] for x in forks)]:
        server.request("DELETE", f"/v1/sandboxes/{f}")


def test_snapshot_of_a_busy_writer_is_consistent(server: Sandboxd) -> None:
    ref = server.create()["id"]
    # Appends as fast as it can: memory (its counter) and disk (the file) must agree in the fork.
    text(server, ref, "sh", "-c", "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i >> /sandbox/home/fast; "
         "done' >/dev/null 2>&1 &")  # fmt: skip
    time.sleep(0.3)
    snap = snapshot(server, ref)
    fork = server.create(snapshot_id=snap["id"])["id"]
    time.sleep(0.3)
    lines = [int(x) for x in text(server, fork, "cat", "/sandbox/home/fast").split()]
    assert len(lines) > 10 and lines == list(range(1, len(lines) + 1))
    for f in (ref, fork):
        server.request("DELETE", f"/v1/sandboxes/{f}")


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_file_written_before_a_snapshot_is_in_its_fork(server: Sandboxd, kind: str) -> None:
    """The guest's writes land in the sandbox's own disk layer, which snapshots copy (with runsc's default
    overlay since release 20230605 they went to a file of runsc's own and a disk fork lost them)."""
    ref = server.create()["id"]
    text(
        server,
        ref,
        "sh",
        "-c",
        "mkdir -p /sandbox/home/d && echo before > /sandbox/home/d/f && ln -s f /sandbox/home/d/l",
    )
    put = server.request("PUT", f"/v1/sandboxes/{ref}/files?path=/sandbox/home/put", body=b"put")
    assert put.status == 204
    snap = snapshot(server, ref, kind)
    fork = server.create(snapshot_id=snap["id"])["id"]
    assert text(server, fork, "cat", "/sandbox/home/d/f", "/sandbox/home/d/l", "/sandbox/home/put") == (
        "before\nbefore\nput"
    )
    for f in (ref, fork):
        assert not list((server.state_dir / "gvisor" / f / "layer").rglob(".gvisor.filestore*"))
        server.request("DELETE", f"/v1/sandboxes/{f}")


def test_disk_fork_boots_afresh_with_the_files(server: Sandboxd) -> None:
    ref = server.create(cpus=1, memory_mb=256, disk_mb=512)["id"]
    text(server, ref, "sh", "-c", "echo kept > /sandbox/home/file; " + COUNTER)
    snap = snapshot(server, ref, "disk")
    assert snap["kind"] == "disk"
    fork = server.create(snapshot_id=snap["id"], memory_mb=384, disk_mb=1024)
    assert (fork["cpus"], fork["memory_mb"], fork["disk_mb"]) == (1, 384, 1024)  # request's, else original's
    assert text(server, fork["id"], "cat", "/sandbox/home/file") == "kept\n"

    # Booted afresh: the daemon of the original does not run here, so its file stays as the copy caught it
    # (which may be between the daemon's truncate and its write: empty, and never written again).
    def counter_file() -> str:
        return text(server, fork["id"], "sh", "-c", "cat /sandbox/home/count 2>/dev/null; echo .")

    caught = counter_file()
    time.sleep(0.2)
    assert counter_file() == caught
    free_mb = int(text(server, fork["id"], "python3", "-c",
                       "import os; s = os.statvfs('/sandbox/home'); print(s.f_blocks * s.f_frsize >> 20)"))  # fmt: skip
    assert 900 < free_mb <= 1024  # the copied layer was grown to the asked disk
    for f in (ref, fork["id"]):
        server.request("DELETE", f"/v1/sandboxes/{f}")


@pytest.mark.parametrize(
    ("kind", "fields", "status", "code", "words"),
    [
        (
            "memory",
            {"cpus": 2},
            400,
            "invalid_request",
            "keeps its resources; omit cpus (snapshot 1, asked 2)",
        ),
        ("memory", {"memory_mb": 1024}, 400, "invalid_request", "omit memory_mb"),
        ("memory", {"disk_mb": 2048}, 400, "invalid_request", "omit disk_mb"),
        ("memory", {"image": "docker.io/library/alpine:3"}, 400, "invalid_request", "runs its image"),
        ("disk", {"image": "docker.io/library/alpine:3"}, 400, "invalid_request", "runs its image"),
        ("disk", {"disk_mb": 16}, 500, "internal", "do not fit in disk_mb 16"),
        ("memory", {"network": {"mode": "open"}}, 501, "unsupported", "cannot fork a memory snapshot"),
        ("memory", {"persistent": True, "name": "pfork"}, 501, "unsupported", "cannot be persistent"),
    ],
)
def test_fork_rules(
    server: Sandboxd, kind: str, fields: dict[str, Any], status: int, code: str, words: str
) -> None:
    ref = server.create(cpus=1, memory_mb=512, disk_mb=1024)["id"]
    text(server, ref, "sh", "-c", "head -c 40000000 /dev/urandom > /sandbox/home/big")
    snap = snapshot(server, ref, kind)
    before = server.request("GET", "/v1/sandboxes").json()["sandboxes"]
    expect_error(server.request("POST", "/v1/sandboxes", {"snapshot_id": snap["id"], **fields}), status, code,
                 words)  # fmt: skip
    assert server.request("GET", "/v1/sandboxes").json()["sandboxes"] == before  # nothing made
    # The same resources as the snapshot's are fine.
    same = server.create(snapshot_id=snap["id"], cpus=1, memory_mb=512)
    for f in (ref, same["id"]):
        server.request("DELETE", f"/v1/sandboxes/{f}")
    assert server.request("DELETE", f"/v1/snapshots/{snap['id']}").status == 204


def test_unknown_snapshot_and_bad_kind(server: Sandboxd) -> None:
    expect_error(server.request("POST", "/v1/sandboxes", {"snapshot_id": "snap_nope"}), 404, "not_found",
                 "no snapshot 'snap_nope'")  # fmt: skip
    ref = server.create()["id"]
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "both"}), 400,
                 "invalid_request", "kind must be memory or disk")  # fmt: skip
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "disk", "x": 1}), 400,
                 "invalid_request", "x")  # fmt: skip
    expect_error(server.request("DELETE", "/v1/snapshots/snap_nope"), 404, "not_found", "no snapshot")
    assert [
        s for s in server.request("GET", "/v1/snapshots").json()["snapshots"] if s["sandbox"] == ref
    ] == []
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_one_snapshot_at_a_time_with_progress(server: Sandboxd) -> None:
    ref = server.create()["id"]
    text(server, ref, "sh", "-c", "head -c 100000000 /dev/urandom > /sandbox/home/big")
    results: list[Response] = []
    first = threading.Thread(target=lambda: results.append(
        server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "disk"})))  # fmt: skip
    first.start()
    progress = None
    deadline = time.monotonic() + 10
    while progress is None and time.monotonic() < deadline:
        progress = server.request("GET", f"/v1/sandboxes/{ref}").json().get("snapshotting")
    assert progress is not None, "snapshotting never showed"
    assert progress["phase"] in ("capture", "store") and progress["scheduled"] is False
    assert progress["estimated_bytes"] >= 100_000_000 and "started_at" in progress
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "disk"}), 409, "conflict",
                 "being taken")  # fmt: skip
    first.join()
    assert results[0].status == 201
    assert "snapshotting" not in server.request("GET", f"/v1/sandboxes/{ref}").json()
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_deleting_the_sandbox_does_not_cancel_its_snapshot(server: Sandboxd) -> None:
    ref = server.create()["id"]
    text(server, ref, "sh", "-c", COUNTER)
    results: list[Response] = []
    taking = threading.Thread(target=lambda: results.append(
        server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "memory"})))  # fmt: skip
    taking.start()
    while "snapshotting" not in server.request("GET", f"/v1/sandboxes/{ref}").json():
        time.sleep(0.005)
    started = time.monotonic()
    assert server.request("DELETE", f"/v1/sandboxes/{ref}").status == 204
    assert time.monotonic() - started < 5
    taking.join()
    listed = [s for s in server.request("GET", "/v1/snapshots").json()["snapshots"] if s["sandbox"] == ref]
    if results[0].status == 201:  # finished: listed, and a fork of it works
        assert [s["id"] for s in listed] == [results[0].json()["id"]]
        fork = server.create(snapshot_id=listed[0]["id"])["id"]
        wait_count_above(server, fork, count(server, fork))
        server.request("DELETE", f"/v1/sandboxes/{fork}")
    else:  # unfinished: nothing left
        assert listed == []
    assert state_of(server, ref) == "terminated"


def test_snapshots_survive_a_restart(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory()
    ref = server.create()["id"]
    text(server, ref, "sh", "-c", "echo before > /sandbox/home/f; " + COUNTER)
    snap = snapshot(server, ref)
    server.signal(signal.SIGKILL)
    server.start()
    assert [s["id"] for s in server.request("GET", "/v1/snapshots").json()["snapshots"]] == [snap["id"]]
    fork = server.create(snapshot_id=snap["id"])["id"]
    assert text(server, fork, "cat", "/sandbox/home/f") == "before\n"
    wait_count_above(server, fork, count(server, fork))


# ---- schedules ---------------------------------------------------------------------------------------


def test_schedule_keeps_the_newest_scheduled_and_never_a_requested_one(server: Sandboxd) -> None:
    ref = server.create()["id"]
    requested = snapshot(server, ref, "disk")
    resp = server.request("PUT", f"/v1/sandboxes/{ref}/snapshot-schedule", {"every_secs": 1, "keep": 2})
    assert resp.status == 200 and (resp.json()["snapshot_every_secs"], resp.json()["snapshot_keep"]) == (1, 2)
    deadline = time.monotonic() + 30
    while len([e for e in events(server, ref) if e["type"] == "snapshot.deleted"]) < 2:
        assert time.monotonic() < deadline, "retention never removed two snapshots"
        time.sleep(0.2)
    resp = server.request("PUT", f"/v1/sandboxes/{ref}/snapshot-schedule", {"every_secs": 0})
    assert resp.status == 200 and resp.json()["snapshot_every_secs"] == 0
    time.sleep(0.5)  # a snapshot under way when the schedule stopped may still finish
    mine = [s for s in server.request("GET", "/v1/snapshots").json()["snapshots"] if s["sandbox"] == ref]
    scheduled = [s for s in mine if s.get("scheduled")]
    assert len(scheduled) <= 2 + 1
    assert requested["id"] in [s["id"] for s in mine]
    deleted = [e for e in events(server, ref) if e["type"] == "snapshot.deleted"]
    assert all(e["reason"] == "retention" and e["snapshot"] != requested["id"] for e in deleted)
    server.request("DELETE", f"/v1/sandboxes/{ref}")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"every_secs": 0.5}, "every_secs"),
        ({"every_secs": -1}, "every_secs"),
        ({"every_secs": 10, "keep": 4}, "limits.max_snapshot_keep = 3"),
        ({"every_secs": 10, "keep": 0}, "keep"),
        ({"keep": 2}, "every_secs is required"),
    ],
)
def test_schedule_outside_limits_is_400(server: Sandboxd, body: dict[str, Any], words: str) -> None:
    ref = server.create()["id"]
    expect_error(server.request("PUT", f"/v1/sandboxes/{ref}/snapshot-schedule", body), 400, "invalid_request",
                 words)  # fmt: skip
    assert server.request("GET", f"/v1/sandboxes/{ref}").json()["snapshot_every_secs"] == 0
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_volumes_exclude_snapshots(server: Sandboxd) -> None:
    assert server.request("POST", "/v1/volumes", {"name": "snapvol", "size_mb": 64}).status == 201
    expect_error(
        server.request("POST", "/v1/sandboxes", {"volumes": [{"name": "snapvol", "path": "/data"}],
                                                 "snapshot_every_secs": 5}),
        409, "conflict", "cannot have a snapshot schedule",
    )  # fmt: skip
    [vol] = [v for v in server.request("GET", "/v1/volumes").json()["volumes"] if v["name"] == "snapvol"]
    assert not vol["attached_to"]  # refused before anything was made or held
    ref = server.create(volumes=[{"name": "snapvol", "path": "/data"}])["id"]
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "disk"}), 409, "conflict",
                 "has volumes")  # fmt: skip
    expect_error(server.request("PUT", f"/v1/sandboxes/{ref}/snapshot-schedule", {"every_secs": 5}), 409,
                 "conflict", "has volumes")  # fmt: skip
    assert [
        s for s in server.request("GET", "/v1/snapshots").json()["snapshots"] if s["sandbox"] == ref
    ] == []
    assert server.request("GET", f"/v1/sandboxes/{ref}").json()["snapshot_every_secs"] == 0
    # A suspended sandbox still holds its volumes.
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    expect_error(server.request("DELETE", "/v1/volumes/snapvol"), 409, "conflict", "")
    assert server.request("POST", f"/v1/sandboxes/{ref}/resume").status == 200
    server.request("DELETE", f"/v1/sandboxes/{ref}")
    other = server.create()["id"]
    snap = snapshot(server, other, "disk")
    expect_error(server.request("POST", "/v1/sandboxes", {"snapshot_id": snap["id"],
                                                          "volumes": [{"name": "snapvol", "path": "/data"}]}),
                 400, "invalid_request", "cannot mount volumes")  # fmt: skip
    server.request("DELETE", f"/v1/sandboxes/{other}")


def test_sdk_suspends_snapshots_and_forks(server: Sandboxd) -> None:
    from sbx.client.sync import Client

    with Client(f"unix://{server.socket_path}") as client:
        sandbox = client.sandboxes.create()
        sandbox.files.write("/sandbox/home/f", "sdk")
        assert sandbox.suspend().info.state == "suspended"
        assert sandbox.resume().info.state == "running"
        snap = sandbox.snapshot("memory")
        assert snap.id in [s.id for s in client.snapshots.list()]
        fork = client.sandboxes.create(snapshot_id=snap.id)
        assert fork.files.read_text("/sandbox/home/f") == "sdk"
        assert sandbox.set_snapshot_schedule(0).info.snapshot_every_secs == 0
        for s in (sandbox, fork):
            s.delete()
        client.snapshots.delete(snap.id)
        assert snap.id not in [s.id for s in client.snapshots.list()]


def test_closing_the_connection_does_not_cancel_a_snapshot(server: Sandboxd) -> None:
    import socket

    ref = server.create()["id"]
    body = b'{"kind": "memory"}'
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(server.socket_path))
        sock.sendall(b"POST /v1/sandboxes/%s/snapshots HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (ref.encode(), len(body), body))  # fmt: skip
        while "snapshotting" not in server.request("GET", f"/v1/sandboxes/{ref}").json():
            time.sleep(0.005)
    # The client is gone; the snapshot is finished and listed anyway.
    deadline = time.monotonic() + 30
    while not [s for s in server.request("GET", "/v1/snapshots").json()["snapshots"] if s["sandbox"] == ref]:
        assert time.monotonic() < deadline, "the snapshot was cancelled with its connection"
        time.sleep(0.05)
    assert text(server, ref, "echo", "ok") == "ok\n"
    server.request("DELETE", f"/v1/sandboxes/{ref}")


@pytest.mark.parametrize(
    ("moved_to", "state_after"),
    [(None, "suspended"), ("suspend-image", "suspended"), ("capture-image", "running")],
)
def test_suspended_and_half_checkpointed_sandboxes_survive_a_kill(
    sandboxd_factory: Callable[..., Sandboxd], moved_to: str | None, state_after: str
) -> None:
    """A suspended sandbox stays suspended across a SIGKILL of sandboxd (``moved_to`` None). And sandboxd
    killed right after a checkpoint, before it wrote the new state (suspend) or restored the sandbox (memory
    snapshot): the next start finishes the job from the checkpoint on disk."""
    import json

    server = sandboxd_factory()
    ref = server.create()["id"]
    text(server, ref, "sh", "-c", COUNTER)
    before = wait_count_above(server, ref, 0)
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    server.signal(signal.SIGKILL)
    directory = server.state_dir / "sandboxes" / ref
    if moved_to is not None:
        # Make the disk look as it would have at the kill: the checkpoint made, the record still "running".
        (directory / "suspend-image").rename(directory / moved_to)
        record = json.loads((directory / "sandbox.json").read_text())
        record["state"] = "running"
        (directory / "sandbox.json").write_text(json.dumps(record))
    server.start()
    assert state_of(server, ref) == state_after
    if state_after == "suspended":
        assert server.request("POST", f"/v1/sandboxes/{ref}/resume").status == 200
    wait_count_above(server, ref, before)
    assert not (directory / "capture-image").exists()


# ---- raw tunnels across a capture ---------------------------------------------------------------------------

# Answers "hello <n>" to each connection on 127.0.0.1:PORT, then waits for the client to close.
HELLO_SERVER = """
import socket, sys, threading
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[1]))); srv.listen(8)
print("listening", flush=True)
n = 0
def serve(c, n):
    c.sendall(b"hello %d" % n)
    while c.recv(65536):
        pass
    c.close()
while True:
    c, _ = srv.accept(); n += 1
    threading.Thread(target=serve, args=(c, n), daemon=True).start()
"""


def _tunnel_hello(server: Sandboxd, ref: str, port: int) -> tuple[socket.socket, bytes]:
    """An open tunnel to the hello server and the greeting it read."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(str(server.socket_path))
    sock.sendall(f"GET /v1/sandboxes/{ref}/tunnel?port={port} HTTP/1.1\r\nHost: localhost\r\n"
                 "Connection: Upgrade\r\nUpgrade: sbx-tunnel/1\r\n\r\n".encode())  # fmt: skip
    data = b""
    while b"hello" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    head, greeting = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock, greeting


def test_a_memory_snapshot_with_a_raw_tunnel_open_ends_it_and_the_fork_tunnels_again(
    server: Sandboxd,
) -> None:
    """gVisor cannot save a sandbox holding a host socket: the agent's quiesce closes raw tunnels and their
    socket, so the capture succeeds; the client's tunnel ends, and both the original and a fork (whose agent
    listens again at its wake) take new raw tunnels."""
    ref = server.create()["id"]
    started = server.request(
        "POST", f"/v1/sandboxes/{ref}/processes", {"argv": ["python3", "-c", HELLO_SERVER, "8020"]}
    )
    assert started.status == 201, started.body
    assert b"listening" in base64.b64decode(next(server.follow(ref, started.json()["pid"]))["data"])
    sock, greeting = _tunnel_hello(server, ref, 8020)
    assert greeting == b"hello 1"
    snap = snapshot(server, ref)
    rest = b""
    while chunk := sock.recv(4096):  # the tunnel ended with the quiesce
        rest += chunk
    sock.close()
    assert rest == b""
    again, greeting = _tunnel_hello(server, ref, 8020)
    again.close()
    assert greeting == b"hello 2"
    fork = server.create(snapshot_id=snap["id"])["id"]
    in_fork, greeting = _tunnel_hello(server, fork, 8020)
    in_fork.close()
    assert greeting == b"hello 2"  # the fork's server, from where the snapshot was
    assert "takes no raw tunnels" not in server.log_text()
    for r in (ref, fork):
        server.request("DELETE", f"/v1/sandboxes/{r}")
