"""The EROFS image of an image's /usr (sbx.backends.usr_erofs): which trees may have one, the build (a real
mkfs.erofs on small trees, in an image store's layout), the record a checkpoint keeps and the spec's mount."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
from pathlib import Path

import pytest

from sbx.agent.protocol import AgentFileError
from sbx.api.errors import Conflict, Refused
from sbx.api.network_policy import NetworkPolicy
from sbx.backends.base import BackendError, BootSpec, GuestUser
from sbx.backends.gvisor import USR_RECORD, _checkpointed_usr, _write_usr_record, oci_spec
from sbx.backends.runsc import RunscInfo
from sbx.backends.usr_erofs import USR_EROFS, ErofsFile, UsrImages, identity, writable_entry
from sbx.node.routes.files import file_error

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the trees are made with root's ownership")


def image(tmp_path: Path, *, record: bool = True) -> Path:
    """An image directory of an image store's layout with a small /usr; returns its rootfs."""
    root = tmp_path / "img" / "rootfs"
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "tool").write_text("#!/bin/sh\n")
    (root / "usr" / "lib").mkdir()
    (root / "usr" / "lib" / "data").write_bytes(os.urandom(10_000))
    os.symlink("bin/tool", root / "usr" / "link")
    if record:
        (root.parent / "image.json").write_text("{}")
    return root


@pytest.mark.parametrize(
    ("change", "found"),
    [
        pytest.param(lambda u: None, None, id="all-root-not-writable"),
        pytest.param(lambda u: os.chown(u / "lib" / "data", 1000, 1000), "usr/lib/data", id="file-of-a-user"),
        pytest.param(lambda u: os.chmod(u / "bin", 0o777), "usr/bin", id="world-writable-dir"),
        pytest.param(lambda u: os.chmod(u / "lib" / "data", 0o664), "usr/lib/data", id="group-writable-file"),
        pytest.param(lambda u: os.chmod(u, 0o775), "usr", id="usr-itself"),
        pytest.param(lambda u: os.lchown(u / "link", 1000, 1000), None, id="a-users-symlink-is-not-judged"),
    ],
)
def test_which_trees_may_be_read_only(tmp_path: Path, change: object, found: str | None) -> None:
    usr = image(tmp_path) / "usr"
    for path in (usr, usr / "bin", usr / "lib"):
        os.chmod(path, 0o755)
    os.chmod(usr / "lib" / "data", 0o644)
    change(usr)  # type: ignore[operator]
    assert writable_entry(usr) == found


async def test_built_once_in_the_background_then_ready(tmp_path: Path) -> None:
    root = image(tmp_path)
    (root.parent / f".{USR_EROFS}.999999").write_bytes(b"a killed build's")
    images = UsrImages(mkfs=None)
    if images.mkfs is None:
        pytest.fail("mkfs.erofs is missing: scripts/install.sh installs erofs-utils")
    assert images.ready(root) is None  # the first boot: the host's /usr, and the build starts
    built = await images.wait(root)
    assert built == ErofsFile(root.parent / USR_EROFS, identity(root.parent / USR_EROFS))
    assert images.ready(root) == built  # later boots: the same file, nothing built again
    assert sorted(p.name for p in root.parent.iterdir()) == [
        "image.json",
        "rootfs",
        USR_EROFS,
        f"{USR_EROFS}.lock",
    ]
    # An EROFS superblock: its magic at byte 1024.
    assert (root.parent / USR_EROFS).read_bytes()[1024:1028] == (0xE0F5E1E2).to_bytes(4, "little")
    # Another process's sandboxd (a fresh UsrImages) finds it made.
    assert UsrImages().ready(root) == built


@pytest.mark.parametrize(
    ("make", "mkfs"),
    [
        pytest.param(lambda r: os.chown(r / "usr" / "lib" / "data", 1000, 1000), None, id="writable-entry"),
        pytest.param(lambda r: None, "/bin/false", id="mkfs-fails"),
        pytest.param(lambda r: (r.parent / "image.json").unlink(), None, id="not-an-image-store-image"),
    ],
)
async def test_no_image_and_no_leftovers_when_it_cannot_have_one(
    tmp_path: Path, make: object, mkfs: str | None
) -> None:
    root = image(tmp_path)
    make(root)  # type: ignore[operator]
    images = UsrImages(mkfs=mkfs)
    assert await images.wait(root) is None
    assert not any(p.name.startswith((USR_EROFS, f".{USR_EROFS}")) and p.name != f"{USR_EROFS}.lock"
                   for p in root.parent.iterdir())  # fmt: skip
    assert images.ready(root) is None and not images._builds  # judged once: no second build


async def test_turned_off_there_is_none(tmp_path: Path) -> None:
    root = image(tmp_path)
    assert await UsrImages(enabled=False).wait(root) is None
    assert not (root.parent / USR_EROFS).exists()


async def test_close_cancels_a_build_and_removes_its_file(tmp_path: Path) -> None:
    root = image(tmp_path)
    slow = tmp_path / "slow-mkfs"
    slow.write_text('#!/bin/sh\necho partial > "$4"\nexec sleep 30\n')  # $4: the output file
    slow.chmod(0o755)
    images = UsrImages(mkfs=str(slow))
    assert images.ready(root) is None
    tmp = root.parent / f".{USR_EROFS}.{os.getpid()}"
    for _ in range(500):
        if tmp.exists():
            break
        await asyncio.sleep(0.01)
    assert tmp.exists(), "the build never started"
    await images.close()
    assert sorted(p.name for p in root.parent.iterdir()) == ["image.json", "rootfs", f"{USR_EROFS}.lock"]


def test_a_checkpoint_restores_with_the_file_it_was_taken_with(tmp_path: Path) -> None:
    bundle, checkpoint = tmp_path / "bundle", tmp_path / "checkpoint"
    bundle.mkdir()
    checkpoint.mkdir()
    erofs = tmp_path / USR_EROFS
    erofs.write_bytes(b"x" * 100)
    # No record (the host's /usr, or a checkpoint from before): none.
    _write_usr_record(bundle, None)
    assert not (bundle / USR_RECORD).exists() and _checkpointed_usr(checkpoint) is None
    _write_usr_record(bundle, ErofsFile(erofs, identity(erofs)))
    (checkpoint / USR_RECORD).write_bytes((bundle / USR_RECORD).read_bytes())
    assert _checkpointed_usr(checkpoint) == ErofsFile(erofs, identity(erofs))
    # The image installed again: another file at that path. Removed: none. Each refused, never mounted.
    replaced = tmp_path / "new"
    replaced.write_bytes(b"y" * 200)
    os.rename(replaced, erofs)
    words = "the snapshot's image was removed or installed again since it was taken"
    with pytest.raises(BackendError, match=words):
        _checkpointed_usr(checkpoint)
    erofs.unlink()
    with pytest.raises(BackendError, match=words):
        _checkpointed_usr(checkpoint)
    for damaged in ("{", "{}", '{"path": "/x"}', "[]"):
        (checkpoint / USR_RECORD).write_text(damaged)
        with pytest.raises(BackendError, match="the snapshot's record of its /usr cannot be read"):
            _checkpointed_usr(checkpoint)
    _write_usr_record(bundle, None)  # a fresh boot without one drops the record
    assert not (bundle / USR_RECORD).exists()


def test_the_spec_mounts_it_read_only_after_proc(tmp_path: Path) -> None:
    spec = BootSpec(
        sandbox_id="sb", image_root=tmp_path, cpus=1, memory_mb=256, disk_mb=1024,
        network=NetworkPolicy(mode="none"), hostname="h",
    )  # fmt: skip
    plain = oci_spec(spec, tmp_path, tmp_path / "agent", tmp_path / "ctl")
    assert [m for m in plain["mounts"] if m["destination"] == "/usr"] == []
    served = oci_spec(spec, tmp_path, tmp_path / "agent", tmp_path / "ctl", usr_image=tmp_path / USR_EROFS)
    assert served["mounts"][:2] == [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/usr", "type": "erofs", "source": str(tmp_path / USR_EROFS), "options": ["ro"]},
    ]
    assert served["mounts"][2:] == plain["mounts"][1:]


@pytest.mark.parametrize(
    ("release", "used"),
    [(20240729, False), (20260802, False), (20260803, True), (20261001, True), (0, False)],
    ids=["debian-20240729", "just-before", "the-pinned-release", "later", "no-release-in-its-version"],
)
def test_only_runsc_releases_it_was_tested_on_mount_it(release: int, used: bool) -> None:
    info = RunscInfo(
        path="runsc", version=f"release-{release}.0", release=release, flags=frozenset(), platforms=()
    )
    assert info.erofs_mounts is used


async def test_a_build_another_process_holds_is_waited_for_not_repeated(tmp_path: Path) -> None:
    root = image(tmp_path)
    held = os.open(root.parent / f"{USR_EROFS}.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)  # another process's build (flock is per open file: this one conflicts)
    images = UsrImages(mkfs="/bin/false")  # fails if it runs: a build that ignored the lock is refused
    assert images.ready(root) is None
    task = images._builds[root]
    await asyncio.sleep(0.3)  # time to try the lock (a build ignoring it would run /bin/false meanwhile)
    (root.parent / USR_EROFS).write_bytes(b"made by the other")  # its build ends
    os.close(held)
    await task  # the lock taken at last: it finds the image made and builds nothing
    assert root not in images._refused
    found = images.ready(root)
    assert found is not None and found.path.read_bytes() == b"made by the other"


GVISOR_GUEST = GuestUser(1000, 1000, "sandbox", "/sandbox/home", read_only_trees=("/usr",))
PLAIN_GUEST = GuestUser(1000, 1000, "sandbox", "/sandbox/home")


@pytest.mark.parametrize(
    ("guest", "path", "err", "kind", "message"),
    [
        (GVISOR_GUEST, "/usr/bin/env", errno.EROFS, Refused, "permission denied: /usr/bin/env (files are accessed as the sandbox user, uid 1000)"),
        (GVISOR_GUEST, "/usr", errno.EROFS, Refused, "permission denied: /usr (files are accessed as the sandbox user, uid 1000)"),
        (GVISOR_GUEST, "/usrx/f", errno.EROFS, Conflict, "read-only file system"),
        (GVISOR_GUEST, "/data/f", errno.EROFS, Conflict, "read-only file system"),
        (PLAIN_GUEST, "/usr/bin/env", errno.EROFS, Conflict, "read-only file system"),
        (GVISOR_GUEST, "/etc/passwd", errno.EACCES, Refused, "permission denied: /etc/passwd (files are accessed as the sandbox user, uid 1000)"),
    ],
    ids=["under-usr", "usr-itself", "a-name-that-only-starts-so", "a-read-only-volume", "a-backend-without-it", "eacces"],
)  # fmt: skip
def test_a_write_into_a_read_only_image_tree_is_refused_as_before(
    guest: GuestUser, path: str, err: int, kind: type, message: str
) -> None:
    found = file_error(AgentFileError(err, os.strerror(err)), path, guest)
    assert type(found) is kind and found.message == message
