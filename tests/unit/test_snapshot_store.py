"""The snapshot store: commit, list, remove, restart; and the POST .../snapshots body."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.api.codec import to_builtins
from sbx.api.errors import InvalidRequest, NotFound
from sbx.api.requests import parse_snapshot_create
from sbx.node.snapshots import SnapshotRecord, SnapshotStore, new_snapshot_id


def record(snapshot_id: str, sandbox: str = "sbx_a", created_at: str = "2026-11-22T00:00:00.000Z",
           scheduled: bool = False) -> SnapshotRecord:  # fmt: skip
    return SnapshotRecord(
        id=snapshot_id, sandbox=sandbox, image="default", kind="memory", bytes=3, created_at=created_at,
        cpus=1, memory_mb=512, disk_mb=1024, network={"mode": "none", "allow": None, "deny": []},
        scheduled=scheduled, next_pid=4,
    )  # fmt: skip


def take(store: SnapshotStore, rec: SnapshotRecord) -> None:
    staging = store.staging(rec.id)
    (staging / "disk.img").write_bytes(b"abc")
    store.commit(staging, rec)


@pytest.mark.parametrize(
    ("body", "kind"),
    [(b"", "memory"), (b"{}", "memory"), (b'{"kind": "memory"}', "memory"), (b'{"kind": "disk"}', "disk")],
)
def test_snapshot_kind(body: bytes, kind: str) -> None:
    assert parse_snapshot_create(body) == kind


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b'{"kind": "Memory"}', "kind must be memory or disk, not 'Memory'"),
        (b'{"kind": 1}', "kind"),
        (b'{"kind": null}', "kind"),
        (b'{"kind": "disk", "keep": 1}', "keep"),
        (b"[]", "object"),
    ],
)
def test_bad_snapshot_bodies(body: bytes, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_snapshot_create(body)


@pytest.mark.parametrize(("node", "prefix"), [(None, "snap_"), ("n1", "snap_n1_")])
def test_ids(node: str | None, prefix: str) -> None:
    a, b = new_snapshot_id(node), new_snapshot_id(node)
    assert a.startswith(prefix) and a != b and len(a) == len(prefix) + 16


def test_commit_list_get_and_wire_form(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    store.load()
    take(store, record("snap_1", created_at="2026-11-22T00:00:01.000Z"))
    take(store, record("snap_2", created_at="2026-11-22T00:00:02.000Z", scheduled=True))
    assert [r.id for r in store.records()] == ["snap_2", "snap_1"]  # newest first
    assert [r.id for r in store.of_sandbox("sbx_a")] == ["snap_1", "snap_2"]  # oldest first
    assert to_builtins(store.get("snap_1").wire()) == {
        "id": "snap_1", "sandbox": "sbx_a", "image": "default", "kind": "memory", "bytes": 3,
        "created_at": "2026-11-22T00:00:01.000Z", "cpus": 1, "memory_mb": 512, "disk_mb": 1024,
    }  # fmt: skip
    assert to_builtins(store.get("snap_2").wire())["scheduled"] is True
    assert store.disk_image("snap_1").read_bytes() == b"abc"
    assert not list(tmp_path.glob(".staging-*"))


def test_a_restart_lists_finished_snapshots_and_drops_unfinished_ones(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    store.load()
    take(store, record("snap_done"))
    (store.staging("snap_cut") / "disk.img").write_bytes(b"partial")  # a stop mid-snapshot
    (tmp_path / "snap_half_removed").mkdir()  # a removal cut after its record went
    again = SnapshotStore(tmp_path)
    again.load()
    assert [r.id for r in again.records()] == ["snap_done"]
    assert again.get("snap_done") == store.get("snap_done")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["snap_done"]


def test_remove(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path)
    store.load()
    take(store, record("snap_x"))
    assert store.remove("snap_x").id == "snap_x"
    assert not (tmp_path / "snap_x").exists() and store.records() == []
    with pytest.raises(NotFound, match="no snapshot 'snap_x' on this node"):
        store.remove("snap_x")
    with pytest.raises(NotFound, match="GET /v1/snapshots"):
        store.get("snap_x")
