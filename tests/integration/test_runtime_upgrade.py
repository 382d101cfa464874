"""Upgrading runsc under existing state: a state dir made with Debian's runsc (0.0~20240729.0, /usr/bin/runsc),
then served with the pinned build (docs/backends.md, "Upgrading the runtime under existing state").

One runsc cannot restore another's checkpoint, so what would need that is refused with 409 before anything is
touched, and the rest works: a running sandbox of the old runsc runs and gives a disk snapshot but is never
suspended or memory-snapshotted (the old sentry would checkpoint it and the new runsc could not restore it: the
sandbox would be lost); a suspended one keeps its checkpoint and gives a disk snapshot; an old memory snapshot
is kept, listed and deletable but not forked, an old disk snapshot forks on the new runsc; an old pool's
sandbox is destroyed and the pool refilled.

The old state is what the sandboxd before the runsc stamps left: the old server here is today's sandboxd on
the old runsc (which stamps what it makes), and the stamps of the suspended sandbox and of the memory snapshot
are then removed with the state-level marker, as that sandboxd never wrote them: the new server infers them
from the runsc on PATH (Debian's, which that sandboxd ran). The running sandbox keeps its stamp: both ways of
knowing are exercised.

/usr/bin/runsc comes from Debian's runsc package (bookworm-backports); scripts/install.sh --test-deps installs
it. Without it this module is skipped, naming the package.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sandboxd_harness
from sandboxd_harness import REPO, Response, Sandboxd

from sbx.backends.runsc import read_version
from sbx.node.runtimes import UNKNOWN, describe, runsc_on_path

pytestmark = pytest.mark.timeout(600)

#: The runsc the old state is made with: Debian's package, from bookworm-backports (install.sh --test-deps).
OLD_RUNSC = "/usr/bin/runsc"
#: Its oldest release the test runs on (install.sh's TEST_RUNSC_VERSION).
OLDEST_RELEASE = 20240729
CONFIG = """
[parking]
park_after_secs = 0

[limits]
min_snapshot_every_secs = 1

[[pools]]
image = "default"
size = 1
"""
FILE = "/sandbox/home/made-before"


def _old_runsc_missing() -> str | None:
    package = f"Debian's runsc package (0.0~{OLDEST_RELEASE}.0 or later, bookworm-backports)"
    if not Path(OLD_RUNSC).is_file():
        return f"{package} is not installed at {OLD_RUNSC}: run scripts/install.sh --test-deps"
    release = re.search(r"(?<!\d)(20\d{6})(?!\d)", read_version(OLD_RUNSC))
    if release is None or int(release.group(1)) < OLDEST_RELEASE:
        # Before 20230130 a later runsc cannot even reach its sandboxes' control sockets (docs/backends.md).
        found = read_version(OLD_RUNSC)
        return f"{OLD_RUNSC} is runsc {found}; the test needs {package}: run scripts/install.sh --test-deps"
    if read_version(OLD_RUNSC) == read_version(sandboxd_harness.RUNSC):
        return (
            f"{OLD_RUNSC} is the runsc the tests run ({sandboxd_harness.RUNSC}): there is no upgrade to test"
        )
    return None


@dataclass
class Upgraded:
    """The new server on the old state, and what the old server made."""

    server: Sandboxd
    old_version: str
    new_version: str
    #: What the suspended sandbox and the memory snapshot, whose stamps were removed, are taken to be made by.
    inferred: str
    running: str
    suspended: str
    memory_snapshot: str
    disk_snapshot: str
    old_pooled: str


def expect_error(resp: Response, status: int, code: str, *words: str) -> str:
    assert resp.status == status, (resp.status, resp.body)
    got_code, message = resp.error
    assert got_code == code, message
    for word in words:
        assert word in message, (word, message)
    return message


def text(server: Sandboxd, ref: str, *argv: str) -> str:
    result = server.run(ref, list(argv))
    assert result["exit_code"] == 0, result
    return str(result["stdout"].decode())


def state_of(server: Sandboxd, ref: str) -> str:
    return str(server.request("GET", f"/v1/sandboxes/{ref}").json()["state"])


def snapshots_of(server: Sandboxd, ref: str) -> list[dict[str, Any]]:
    listed = server.request("GET", "/v1/snapshots").json()["snapshots"]
    return [s for s in listed if s["sandbox"] == ref]


def snapshot(server: Sandboxd, ref: str, kind: str) -> dict[str, Any]:
    resp = server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": kind})
    assert resp.status == 201, (resp.status, resp.body)
    return resp.json()  # type: ignore[no-any-return]


def record_of(server: Sandboxd, ref: str) -> dict[str, Any]:
    path = server.state_dir / "sandboxes" / ref / "sandbox.json"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def pooled_ids(server: Sandboxd) -> list[str]:
    pool = server.state_dir / "pool"
    return sorted(p.name for p in pool.iterdir()) if pool.is_dir() else []


def wait_for(what: str, check: Callable[[], bool], timeout_secs: float = 60) -> None:
    deadline = time.monotonic() + timeout_secs
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def host_processes(sandbox_id: str) -> int:
    found = subprocess.run(["pgrep", "-f", sandbox_id], capture_output=True, text=True, check=False)
    return len(found.stdout.split())


def strip_stamp(path: Path) -> None:
    """Remove the runsc stamp from a record, as the sandboxd before the stamps wrote it."""
    data = json.loads(path.read_text())
    data.pop("runsc_version", None)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def upgraded(request: pytest.FixtureRequest) -> Iterator[Upgraded]:
    missing = _old_runsc_missing()
    if missing:
        pytest.skip(missing)
    new_runsc = sandboxd_harness.RUNSC
    workdir = Path(tempfile.mkdtemp(prefix="sbxd-upgrade-", dir="/var/tmp"))
    failed_before = request.session.testsfailed
    sandboxd_harness.RUNSC = OLD_RUNSC  # read when the server's config is written
    try:
        server = Sandboxd(workdir, CONFIG)
    finally:
        sandboxd_harness.RUNSC = new_runsc
    try:
        server.start()
        old_version = read_version(OLD_RUNSC)
        assert server.request("GET", "/v1/node").json()["runtime"]["runsc_version"] == old_version
        running = server.create()["id"]
        text(server, running, "sh", "-c", f"echo from-old > {FILE}")
        memory_snapshot = snapshot(server, running, "memory")["id"]
        disk_snapshot = snapshot(server, running, "disk")["id"]
        suspended = server.create()["id"]
        text(server, suspended, "sh", "-c", f"echo from-old > {FILE}")
        assert server.request("POST", f"/v1/sandboxes/{suspended}/suspend").status == 200
        wait_for(
            "the old pool to be full",
            lambda: server.request("GET", "/v1/node").json()["pooled"] == {"default": 1},
        )
        [old_pooled] = pooled_ids(server)
        # Killed: its pooled sandbox is left running on the old runsc, the worst case for the pool.
        server.signal(signal.SIGKILL)
        (server.state_dir / "runtime.json").unlink(missing_ok=True)
        strip_stamp(server.state_dir / "sandboxes" / suspended / "sandbox.json")
        strip_stamp(server.state_dir / "snapshots" / memory_snapshot / "snapshot.json")
        config = server.config_path.read_text()
        server.config_path.write_text(config.replace(f'runsc = "{OLD_RUNSC}"', f'runsc = "{new_runsc}"'))
        server.start()
        yield Upgraded(
            server=server, old_version=old_version, new_version=read_version(new_runsc),
            inferred=runsc_on_path() or UNKNOWN, running=running, suspended=suspended,
            memory_snapshot=memory_snapshot, disk_snapshot=disk_snapshot, old_pooled=old_pooled,
        )  # fmt: skip
    finally:
        if request.session.testsfailed > failed_before:
            server.save_evidence(REPO / "test-artifacts" / "test_runtime_upgrade" / workdir.name)
        server.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_new_runsc_serves_the_old_state_and_stamps_it(upgraded: Upgraded) -> None:
    server = upgraded.server
    assert server.request("GET", "/v1/node").json()["runtime"]["runsc_version"] == upgraded.new_version
    assert json.loads((server.state_dir / "runtime.json").read_text()) == {
        "runsc_version": upgraded.new_version
    }
    assert record_of(server, upgraded.running)["runsc_version"] == upgraded.old_version
    assert record_of(server, upgraded.suspended)["runsc_version"] == upgraded.inferred
    stamped = json.loads(
        (server.state_dir / "snapshots" / upgraded.memory_snapshot / "snapshot.json").read_text()
    )
    assert stamped["runsc_version"] == upgraded.inferred
    assert "state made by another runsc" in server.log_text()


def test_a_running_sandbox_of_the_old_runsc_runs_and_is_never_checkpointed(upgraded: Upgraded) -> None:
    server, ref = upgraded.server, upgraded.running
    assert text(server, ref, "cat", FILE) == "from-old\n"
    names = (
        f"sandbox {ref} was started by runsc {upgraded.old_version}",
        f"this node now runs runsc {upgraded.new_version}",
        "take a disk snapshot",
        "or recreate the sandbox",
    )
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "memory"}), 409, "conflict",
                 *names, "no memory snapshot of it is taken")  # fmt: skip
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/snapshots"), 409, "conflict", *names)
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/suspend"), 409, "conflict", *names,
                 "it is not suspended")  # fmt: skip
    expect_error(server.request("PUT", f"/v1/sandboxes/{ref}/snapshot-schedule", {"every_secs": 1}), 409,
                 "conflict", *names, "cannot have a snapshot schedule")  # fmt: skip
    # Nothing changed: it runs, with its files, and it has only the memory snapshot the old runsc made.
    assert state_of(server, ref) == "running"
    assert text(server, ref, "cat", FILE) == "from-old\n"
    assert {s["id"] for s in snapshots_of(server, ref)} == {upgraded.memory_snapshot, upgraded.disk_snapshot}
    assert server.request("GET", f"/v1/sandboxes/{ref}").json()["snapshot_every_secs"] == 0
    directory = server.state_dir / "sandboxes" / ref
    assert not (directory / "suspend-image").exists() and not (directory / "capture-image").exists()
    # What works: a disk snapshot, and a fork from it on the new runsc with the files.
    disk = snapshot(server, ref, "disk")
    fork = server.create(snapshot_id=disk["id"])["id"]
    assert text(server, fork, "cat", FILE) == "from-old\n"
    assert record_of(server, fork)["runsc_version"] == upgraded.new_version
    assert state_of(server, ref) == "running"
    assert server.request("DELETE", f"/v1/sandboxes/{fork}").status == 204
    assert server.request("DELETE", f"/v1/snapshots/{disk['id']}").status == 204


def test_a_suspended_sandbox_of_the_old_runsc_keeps_its_checkpoint_and_gives_its_disk(
    upgraded: Upgraded,
) -> None:
    server, ref = upgraded.server, upgraded.suspended
    checkpoint = server.state_dir / "sandboxes" / ref / "suspend-image" / "checkpoint.img"
    assert checkpoint.is_file()
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/resume"), 409, "conflict",
                 f"sandbox {ref} was suspended by {describe(upgraded.inferred)}",
                 f"this node now runs runsc {upgraded.new_version}", "it stays suspended with its disk",
                 "take a disk snapshot", "or delete it")  # fmt: skip
    assert state_of(server, ref) == "suspended" and checkpoint.is_file()
    expect_error(server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "memory"}), 409, "conflict",
                 "is suspended", "resume it first")  # fmt: skip
    # Its files, through a disk snapshot (allowed on a suspended sandbox) and a fork on the new runsc.
    disk = snapshot(server, ref, "disk")
    assert disk["kind"] == "disk" and disk["sandbox"] == ref
    assert state_of(server, ref) == "suspended" and checkpoint.is_file()
    fork = server.create(snapshot_id=disk["id"])["id"]
    assert text(server, fork, "cat", FILE) == "from-old\n"
    assert server.request("DELETE", f"/v1/sandboxes/{fork}").status == 204
    assert server.request("DELETE", f"/v1/snapshots/{disk['id']}").status == 204


def test_a_memory_snapshot_of_the_old_runsc_is_kept_but_not_forked(upgraded: Upgraded) -> None:
    server, snap = upgraded.server, upgraded.memory_snapshot
    before = len(server.request("GET", "/v1/sandboxes").json()["sandboxes"])
    expect_error(server.request("POST", "/v1/sandboxes", {"snapshot_id": snap}), 409, "conflict",
                 f"snapshot {snap} is a memory snapshot made by {describe(upgraded.inferred)}",
                 f"this node now runs runsc {upgraded.new_version}", "the snapshot is kept",
                 f"DELETE /v1/snapshots/{snap}")  # fmt: skip
    assert [s["id"] for s in server.request("GET", "/v1/snapshots").json()["snapshots"]].count(snap) == 1
    assert len(server.request("GET", "/v1/sandboxes").json()["sandboxes"]) == before  # nothing was made


def test_a_disk_snapshot_of_the_old_runsc_forks_on_the_new_one(upgraded: Upgraded) -> None:
    server = upgraded.server
    fork = server.create(snapshot_id=upgraded.disk_snapshot)["id"]
    assert text(server, fork, "cat", FILE) == "from-old\n"
    assert record_of(server, fork)["runsc_version"] == upgraded.new_version
    assert server.request("DELETE", f"/v1/sandboxes/{fork}").status == 204


def test_the_old_pool_is_destroyed_and_refilled_on_the_new_runsc(upgraded: Upgraded) -> None:
    server, old = upgraded.server, upgraded.old_pooled
    wait_for("the old pooled sandbox to be destroyed",
             lambda: not (server.state_dir / "gvisor" / old).exists() and host_processes(old) == 0)  # fmt: skip
    assert "destroying a pooled sandbox left by an earlier run" in server.log_text()
    wait_for(
        "the pool to be refilled",
        lambda: server.request("GET", "/v1/node").json()["pooled"] == {"default": 1},
    )
    [pooled] = pooled_ids(server)
    assert pooled != old
    created = server.create()["id"]
    assert created == pooled  # handed out from the pool
    assert text(server, created, "echo", "ok") == "ok\n"
    assert record_of(server, created)["runsc_version"] == upgraded.new_version
    assert server.request("DELETE", f"/v1/sandboxes/{created}").status == 204


def test_a_restart_keeps_all_of_it_and_deletes_work(upgraded: Upgraded) -> None:
    server = upgraded.server
    # A sandbox of the new runsc is checkpointed as usual, and its suspend outlives the restart.
    fresh = server.create()["id"]
    text(server, fresh, "sh", "-c", f"echo from-new > {FILE}")
    assert server.request("POST", f"/v1/sandboxes/{fresh}/suspend").status == 200
    server.stop()
    server.start()
    assert server.request("POST", f"/v1/sandboxes/{fresh}/resume").status == 200
    assert text(server, fresh, "cat", FILE) == "from-new\n"
    old = f"runsc {upgraded.old_version}"
    expect_error(server.request("POST", f"/v1/sandboxes/{upgraded.running}/suspend"), 409, "conflict", old)
    expect_error(server.request("POST", f"/v1/sandboxes/{upgraded.suspended}/resume"), 409, "conflict",
                 describe(upgraded.inferred))  # fmt: skip
    expect_error(server.request("POST", "/v1/sandboxes", {"snapshot_id": upgraded.memory_snapshot}), 409,
                 "conflict", describe(upgraded.inferred))  # fmt: skip
    assert text(server, upgraded.running, "cat", FILE) == "from-old\n"
    # DELETE of everything the old runsc made works.
    for ref in (upgraded.running, upgraded.suspended, fresh):
        assert server.request("DELETE", f"/v1/sandboxes/{ref}").status == 204
        assert state_of(server, ref) == "terminated"
    assert not (server.state_dir / "sandboxes" / upgraded.suspended / "suspend-image").exists()
    for snap in (upgraded.memory_snapshot, upgraded.disk_snapshot):
        assert server.request("DELETE", f"/v1/snapshots/{snap}").status == 204
    assert upgraded.memory_snapshot not in [
        s["id"] for s in server.request("GET", "/v1/snapshots").json()["snapshots"]
    ]
    for ref in (upgraded.running, upgraded.suspended):
        wait_for(f"{ref} to be torn down", lambda ref=ref: host_processes(ref) == 0)
