"""Volume rules without mounting anything: mount rule 1 (holders), names, mount points in the image, and the
store's bookkeeping (records on disk, holders and users, attached_to, delete refusals)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from fake_backend import NOBODY, DirVolumes

from sbx.api.codec import to_builtins
from sbx.api.errors import Conflict, InvalidRequest, NotFound, SandboxError
from sbx.api.network_policy import NetworkPolicy
from sbx.api.sandboxes import VolumeMount
from sbx.api.validation import validate_volume_name
from sbx.backends.base import GuestUser
from sbx.node import volumes as vol
from sbx.node.records import SandboxRecord, SandboxState
from sbx.node.volumes import VolumeStore, check_mount_points, holder_conflict

#: Volumes as directories; these tests never attach one.
DISKS = DirVolumes(GuestUser(NOBODY, NOBODY, "nobody", "/nonexistent"))

RO, RW = True, False


@pytest.mark.parametrize(
    ("holders", "read_only", "message"),
    [
        pytest.param({}, RW, None, id="first-writer"),
        pytest.param({}, RO, None, id="first-reader"),
        pytest.param({"sbx_a": RO}, RO, None, id="second-reader"),
        pytest.param({"sbx_a": RO, "sbx_b": RO, "sbx_c": RO}, RO, None, id="fourth-reader"),
        pytest.param({"sbx_a": RW}, RO, "mounted writable by sandbox sbx_a", id="reader-beside-writer"),
        pytest.param({"sbx_a": RW}, RW, "mounted writable by sandbox sbx_a", id="second-writer"),
        pytest.param({"sbx_a": RO}, RW, "read-only by 1 sandbox(es) (sbx_a)", id="writer-beside-reader"),
        pytest.param(
            {"sbx_a": RO, "sbx_b": RO, "sbx_c": RO}, RW, "read-only by 3 sandbox(es) (sbx_a, sbx_b, sbx_c)",
            id="writer-beside-three-readers",
        ),
        pytest.param(
            {f"sbx_{i}": RO for i in range(5)}, RW, "(sbx_0, sbx_1, sbx_2, ...)", id="many-readers-abridged"
        ),
        pytest.param({"sbx_self": RW}, RW, None, id="own-entry-ignored"),
    ],
)  # fmt: skip
def test_holder_conflict(holders: dict[str, bool], read_only: bool, message: str | None) -> None:
    why = holder_conflict("data", holders, "sbx_self", read_only)
    if message is None:
        assert why is None
    else:
        assert why is not None and message in why and "'data'" in why


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        pytest.param("data", True, id="plain"),
        pytest.param("a", True, id="one-char"),
        pytest.param("0cache.v2_x-y", True, id="punctuation"),
        pytest.param("sbx_data", True, id="id-like-prefix-allowed"),
        pytest.param("a" * 63, True, id="63-chars"),
        pytest.param("a" * 64, False, id="64-chars"),
        pytest.param("", False, id="empty"),
        pytest.param("Data", False, id="uppercase"),
        pytest.param("-data", False, id="leading-dash"),
        pytest.param(".data", False, id="leading-dot"),
        pytest.param("a/b", False, id="slash"),
        pytest.param("..", False, id="dotdot"),
    ],
)
def test_volume_names(name: str, ok: bool) -> None:
    if ok:
        assert validate_volume_name(name) == name
    else:
        with pytest.raises(InvalidRequest):
            validate_volume_name(name)


def _image(tmp_path: Path) -> Path:
    root = tmp_path / "rootfs"
    (root / "var" / "lib").mkdir(parents=True)
    (root / "run").mkdir()
    (root / "var" / "run").symlink_to("/run")
    (root / "opt").mkdir()
    (root / "opt" / "file").write_text("x")
    return root


@pytest.mark.parametrize(
    ("path", "message"),
    [
        pytest.param("/data", None, id="missing-is-made"),
        pytest.param("/var/lib/app", None, id="under-existing-dir"),
        pytest.param("/var/lib", None, id="existing-dir"),
        pytest.param("/var/run/x", "passes through a symbolic link in the image (/var/run)", id="symlink"),
        pytest.param("/opt/file", "/opt/file is a file in the image", id="file"),
        pytest.param("/opt/file/x", "/opt/file is a file in the image", id="below-file"),
    ],
)
def test_mount_points_in_image(tmp_path: Path, path: str, message: str | None) -> None:
    root = _image(tmp_path)
    mounts = [VolumeMount("a", "/elsewhere"), VolumeMount("b", path)]
    if message is None:
        check_mount_points(root, mounts)
    else:
        with pytest.raises(InvalidRequest) as info:
            check_mount_points(root, mounts)
        assert info.value.message.startswith("volumes[1].path: ") and message in info.value.message


# --- the store's bookkeeping (no mounts: nothing is ever mounted in these tests) --------------------------


def _store(tmp_path: Path, *names: str) -> VolumeStore:
    base = tmp_path / "volumes"
    for name in names:
        (base / name).mkdir(parents=True)
        record = {"name": name, "size_mb": 16, "created_at": "2026-01-01T00:00:00.000Z"}
        (base / name / vol.RECORD_NAME).write_text(json.dumps(record))
    store = VolumeStore(base, DISKS)
    asyncio.run(store.start())
    return store


def _attached(store: VolumeStore) -> dict[str, str | None]:
    return {v.name: v.attached_to for v in store.listing()}


def test_start_loads_records_and_removes_unfinished(tmp_path: Path) -> None:
    store = _store(tmp_path, "a", "b")
    (tmp_path / "volumes" / "half").mkdir()  # a create killed before its record was written
    (tmp_path / "volumes" / "half" / "disk.img").write_bytes(b"")
    again = VolumeStore(tmp_path / "volumes", DISKS)
    asyncio.run(again.start())
    assert [v.name for v in again.listing()] == ["a", "b"]
    assert not (tmp_path / "volumes" / "half").exists()
    assert to_builtins(store.listing()[0]) == {"name": "a", "size_mb": 16, "created_at": "2026-01-01T00:00:00.000Z",
                                  "attached_to": None}  # fmt: skip


def test_three_readers_then_a_writer_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    store = _store(tmp_path, "data")
    for sid in ("sbx_c", "sbx_a", "sbx_b"):
        store.hold(sid, [VolumeMount("data", "/data", read_only=True)])
    assert _attached(store) == {"data": "sbx_a"}  # readers only: the first by id
    with pytest.raises(Conflict, match="read-only by 3 sandbox"):
        store.hold("sbx_w", [VolumeMount("data", "/data")])
    assert store.holders_of("sbx_w") == []
    assert _attached(store) == {"data": "sbx_a"}


def test_writer_excludes_everyone_and_is_attached_to(tmp_path: Path) -> None:
    store = _store(tmp_path, "data", "other")
    store.hold("sbx_w", [VolumeMount("other", "/o", read_only=True), VolumeMount("data", "/data")])
    assert _attached(store) == {"data": "sbx_w", "other": "sbx_w"}
    with pytest.raises(Conflict, match="mounted writable by sandbox sbx_w"):
        store.hold("sbx_r", [VolumeMount("other", "/o", read_only=True), VolumeMount("data", "/d", True)])
    # All or nothing: the first mount (other, read-only, allowed) was not taken either.
    assert store.holders_of("sbx_r") == []


def test_missing_volume_is_404(tmp_path: Path) -> None:
    store = _store(tmp_path, "data")
    with pytest.raises(NotFound, match=r"volumes\[1\].name: no volume 'nope'"):
        store.check("", [VolumeMount("data", "/d"), VolumeMount("nope", "/n")])


def test_terminated_sandbox_frees_the_rule_at_once_and_the_mount_after_release(tmp_path: Path) -> None:
    store = _store(tmp_path, "data")
    store.hold("sbx_w", [VolumeMount("data", "/data")])
    store.drop_holder("sbx_w")  # terminated; its teardown still runs
    assert _attached(store) == {"data": None}
    store.hold("sbx_r", [VolumeMount("data", "/data", read_only=True)])  # rule 1 counts live ones only
    asyncio.run(store.release("sbx_w"))
    assert store.holders_of("sbx_r") == ["data"]


def test_take_back_restores_holders_without_rechecking(tmp_path: Path) -> None:
    store = _store(tmp_path, "data")
    store.take_back("sbx_w", [VolumeMount("data", "/data")], live=True)
    store.take_back("sbx_gone", [VolumeMount("data", "/data")], live=False)
    store.take_back("sbx_x", [VolumeMount("deleted", "/x")], live=True)  # skipped, logged
    assert _attached(store) == {"data": "sbx_w"}
    with pytest.raises(Conflict):
        store.hold("sbx_new", [VolumeMount("data", "/d", read_only=True)])


@pytest.mark.parametrize(
    ("setup", "error", "message"),
    [
        pytest.param("writer", Conflict, "mounted by sandbox sbx_w; delete the sandboxes", id="writer"),
        pytest.param("readers", Conflict, "mounted by sandbox sbx_a and 1 other(s)", id="readers"),
        pytest.param("missing", NotFound, "no volume 'nope'", id="missing"),
    ],
)
def test_delete_refusals_change_nothing(
    tmp_path: Path, setup: str, error: type[SandboxError], message: str
) -> None:
    store = _store(tmp_path, "data")
    if setup == "writer":
        store.hold("sbx_w", [VolumeMount("data", "/data")])
    elif setup == "readers":
        store.hold("sbx_b", [VolumeMount("data", "/data", read_only=True)])
        store.hold("sbx_a", [VolumeMount("data", "/data", read_only=True)])
    with pytest.raises(error) as info:
        asyncio.run(store.delete("nope" if setup == "missing" else "data"))
    assert message in info.value.message
    assert [v.name for v in store.listing()] == ["data"]
    assert (tmp_path / "volumes" / "data" / vol.RECORD_NAME).exists()


def test_delete_waits_for_a_stopping_sandbox(tmp_path: Path) -> None:
    store = _store(tmp_path, "data")
    store.hold("sbx_w", [VolumeMount("data", "/data")])
    store.drop_holder("sbx_w")

    async def scenario() -> None:
        deleting = asyncio.create_task(store.delete("data"))
        await asyncio.sleep(0.05)
        assert not deleting.done()
        assert store.listing() == []  # being deleted: no longer listed nor mountable
        with pytest.raises(NotFound):
            store.check("", [VolumeMount("data", "/d")])
        await store.release("sbx_w")
        await asyncio.wait_for(deleting, 5)

    asyncio.run(scenario())
    assert not (tmp_path / "volumes" / "data").exists()
    again = VolumeStore(tmp_path / "volumes", DISKS)
    asyncio.run(again.start())
    assert again.listing() == []


def test_duplicate_create_is_409_before_anything_is_made(tmp_path: Path) -> None:
    store = _store(tmp_path, "data")
    before = sorted(os.listdir(tmp_path / "volumes" / "data"))
    with pytest.raises(Conflict, match="a volume named 'data' exists"):
        asyncio.run(store.create("data", 16))
    assert sorted(os.listdir(tmp_path / "volumes" / "data")) == before


def test_sandbox_record_keeps_its_volumes_on_disk() -> None:
    record = SandboxRecord(
        id="sbx_1", state=SandboxState.RUNNING, image="default", cpus=1, memory_mb=512, disk_mb=1024,
        network=NetworkPolicy("none"), idle_timeout_secs=0, created_at="2026-01-01T00:00:00.000Z",
        volumes=(VolumeMount("a", "/a", True), VolumeMount("b", "/data/b")),
    )  # fmt: skip
    on_disk = json.loads(json.dumps(record.to_disk()))
    assert on_disk["volumes"] == [
        {"name": "a", "path": "/a", "read_only": True},
        {"name": "b", "path": "/data/b", "read_only": False},
    ]
    assert SandboxRecord.from_disk(on_disk) == record
    del on_disk["volumes"]  # a record written before volumes existed
    assert SandboxRecord.from_disk(on_disk).volumes == ()
    assert "volumes" not in to_builtins(record.wire())  # the spec's Sandbox has no such field
