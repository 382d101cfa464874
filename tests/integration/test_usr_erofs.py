"""The image's /usr served from an EROFS image the sentry reads itself (docs/backends.md, "The image's /usr
from EROFS"): what the guest sees, that writes still land where they did, and that suspend, memory forks,
disk forks and a sandbox booted with the host's /usr keep working. scripts/install.sh builds the default
image's; without it sandboxd builds it at the first boot (tested in tests/unit/test_usr_erofs.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from guest_counter import text
from sandboxd_harness import IMAGES_DIR, Sandboxd

from sbx.backends.gvisor import USR_RECORD
from sbx.backends.usr_erofs import USR_EROFS, identity

#: The guest's own view of /usr's mount: file system type and options.
USR_MOUNT = "awk '$2 == \"/usr\" { print $3, substr($4, 1, 2) }' /proc/mounts"


#: A daemon that keeps one file of /usr open and appends a line to ~/reads after each read of it from the start.
READER = (
    "(exec 3</usr/bin/python3; while sleep 0.05; do head -c4 /proc/self/fd/3 >/dev/null && echo r >> ~/reads;"
    " done) >/dev/null 2>&1 &"
)


def reads(server: Sandboxd, ref: str) -> int:
    return int(text(server, ref, "sh", "-c", "cat ~/reads 2>/dev/null | wc -l"))


def wait_reads_above(server: Sandboxd, ref: str, n: int, timeout: float = 30.0) -> int:
    """Wait until the reader has read more than ``n`` times (it runs, and its open file still reads)."""
    deadline = time.monotonic() + timeout
    while (got := reads(server, ref)) <= n:
        assert time.monotonic() < deadline, f"the reader stopped at {got} reads"
        time.sleep(0.1)
    return got


def default_image_dir() -> Path:
    return next(p.parent for p in IMAGES_DIR.glob("default-*/image.json"))


@pytest.fixture(scope="module")
def server() -> Iterator[Sandboxd]:
    if not (default_image_dir() / USR_EROFS).is_file():
        pytest.fail(f"{default_image_dir() / USR_EROFS} is missing: scripts/install.sh builds it")
    workdir = Path(tempfile.mkdtemp(prefix="sbxd-", dir="/var/tmp"))
    s = Sandboxd(workdir).start()
    yield s
    s.teardown()
    shutil.rmtree(workdir, ignore_errors=True)


def bundle(server: Sandboxd, ref: str) -> dict[str, Any]:
    path = server.state_dir / "gvisor" / ref / "bundle" / "config.json"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def usr_mounts(config: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in config["mounts"] if m["destination"] == "/usr"]


def test_usr_is_the_images_erofs_read_only_and_writes_land_where_they_did(server: Sandboxd) -> None:
    ref = server.create()["id"]
    erofs = default_image_dir() / USR_EROFS
    assert usr_mounts(bundle(server, ref)) == [
        {"destination": "/usr", "type": "erofs", "source": str(erofs), "options": ["ro"]}
    ]
    assert text(server, ref, "sh", "-c", USR_MOUNT).strip() == "erofs ro"
    # The same tree the image holds: a file's bytes, a listing's size, a program run from it.
    guest = text(server, ref, "sha256sum", "/usr/lib/os-release").split()[0]
    assert (
        guest == hashlib.sha256((default_image_dir() / "rootfs/usr/lib/os-release").read_bytes()).hexdigest()
    )
    listed = int(text(server, ref, "sh", "-c", "ls /usr/bin | wc -l"))
    assert listed == len(list((default_image_dir() / "rootfs/usr/bin").iterdir()))
    assert text(server, ref, "python3", "-c", "import json; print(json.dumps([1]))") == "[1]\n"
    # The user could not write there before either; the home, /tmp and pip --user still work.
    denied = server.run(ref, ["sh", "-c", "touch /usr/x"])
    assert denied["exit_code"] != 0 and b"/usr/x" in denied["stderr"]
    assert (
        server.run(ref, ["sh", "-c", "echo hi > ~/f && cat ~/f /etc/hostname >/dev/null"])["exit_code"] == 0
    )
    # Writes still go to the writable layer: df / shows the disk, not the image.
    size = int(text(server, ref, "sh", "-c", "df -k --output=size / | tail -1"))
    assert 1_700_000 < size <= 2 * 1024 * 1024, size
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_suspend_memory_and_disk_forks_keep_the_same_usr(server: Sandboxd) -> None:
    ref = server.create(cpus=1, memory_mb=512)["id"]
    # A daemon holding a file of /usr open, reading it again and again: it must go on after each restore.
    text(server, ref, "sh", "-c", READER)
    wait_reads_above(server, ref, 3)
    assert server.request("POST", f"/v1/sandboxes/{ref}/suspend").status == 200
    assert server.request("POST", f"/v1/sandboxes/{ref}/resume").status == 200
    wait_reads_above(server, ref, reads(server, ref))
    erofs = str(default_image_dir() / USR_EROFS)
    for kind in ("memory", "disk"):
        resp = server.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": kind})
        assert resp.status == 201, resp.body
        snap = resp.json()
        fork = server.create(snapshot_id=snap["id"])["id"]
        assert [m["source"] for m in usr_mounts(bundle(server, fork))] == [erofs]
        assert text(server, fork, "sh", "-c", USR_MOUNT).strip() == "erofs ro"
        assert text(server, fork, "python3", "-c", "print(2 + 2)") == "4\n"
        if kind == "memory":  # its reader runs on from where the snapshot was, on the fork's /usr
            wait_reads_above(server, fork, reads(server, fork))
        server.request("DELETE", f"/v1/sandboxes/{fork}")
    server.request("DELETE", f"/v1/sandboxes/{ref}")


def test_a_node_without_it_serves_the_hosts_usr_and_forks_of_either_kind_work(tmp_path: Path) -> None:
    """``usr_erofs = false``: the host's /usr through the overlay, as before; its checkpoints name no EROFS, so
    a memory fork of one boots the same way."""
    s = Sandboxd(tmp_path, "[gvisor]\nusr_erofs = false\n").start()
    try:
        ref = s.create()["id"]
        assert usr_mounts(bundle(s, ref)) == []
        assert text(s, ref, "sh", "-c", USR_MOUNT).strip() == ""
        resp = s.request("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "memory"})
        assert resp.status == 201, resp.body
        fork = s.create(snapshot_id=resp.json()["id"])["id"]
        assert usr_mounts(bundle(s, fork)) == [] and text(s, fork, "python3", "-c", "print(1)") == "1\n"
    finally:
        s.teardown()


def test_the_bundle_records_which_file_it_mounts(server: Sandboxd) -> None:
    ref = server.create()["id"]
    record = json.loads((server.state_dir / "gvisor" / ref / "bundle" / USR_RECORD).read_text())
    erofs = default_image_dir() / USR_EROFS
    assert record == {"path": str(erofs), "identity": identity(erofs)}
    server.request("DELETE", f"/v1/sandboxes/{ref}")
