"""Which runsc made what (sbx.node.runtimes): the stamps of state from before they were recorded, the marker,
and the records that carry them."""

from __future__ import annotations

import json
import stat
from dataclasses import asdict
from pathlib import Path

import pytest

from sbx.api.network_policy import NetworkPolicy
from sbx.node.records import SandboxRecord, SandboxState
from sbx.node.runtimes import MARKER_NAME, UNKNOWN, RuntimeLedger, describe, runsc_on_path
from sbx.node.snapshots import SnapshotRecord, SnapshotStore
from sbx.statefile import read_json, write_json_atomic

OLD = "0.0~20240729.0"
NEW = "release-20260803.0-49-g7a7d8c355"


def test_describe() -> None:
    assert describe(OLD) == f"runsc {OLD}"
    assert describe(UNKNOWN) == describe(None)
    assert "not recorded" in describe(UNKNOWN)


# -- the ledger: the marker, and what unrecorded state is taken to be made by -----------------------------------


class Finder:
    """A ``find_previous`` that counts its calls."""

    def __init__(self, answer: str | None) -> None:
        self.answer = answer
        self.calls = 0

    def __call__(self) -> str | None:
        self.calls += 1
        return self.answer


# (case, marker content, runsc on PATH, current, recorded stamps, expected stamps, PATH asked, marker after)
LEDGER_CASES = [
    ("first start after the upgrade: PATH's runsc", None, OLD, NEW, [None, None], [OLD, OLD], 1, NEW),
    ("no runsc on PATH: unknown", None, None, NEW, [None], [UNKNOWN], 1, NEW),
    ("the marker says who served it", {"runsc_version": OLD}, "other", NEW, [None], [OLD], 0, NEW),
    ("recorded stamps are kept", None, OLD, NEW, [NEW, OLD], [NEW, OLD], 0, NEW),
    ("a fresh state dir: nothing asked", None, OLD, NEW, [], [], 0, NEW),
    ("the same runsc again: marker unchanged", {"runsc_version": NEW}, OLD, NEW, [NEW], [NEW], 0, NEW),
    ("a backend without runsc: nothing stamped", None, OLD, None, [None], [None], 0, None),
    ("a damaged marker counts as none", {"runsc_version": 7}, OLD, NEW, [None], [OLD], 1, NEW),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "marker", "on_path", "current", "recorded", "expected", "asked", "marker_after"),
    LEDGER_CASES,
    ids=[c[0] for c in LEDGER_CASES],
)
def test_ledger(
    tmp_path: Path, case: str, marker: dict[str, object] | None, on_path: str | None, current: str | None,
    recorded: list[str | None], expected: list[str | None], asked: int, marker_after: str | None,
) -> None:  # fmt: skip
    if marker is not None:
        write_json_atomic(tmp_path / MARKER_NAME, marker)
    finder = Finder(on_path)
    ledger = RuntimeLedger(tmp_path, current, finder)
    assert [ledger.stamp(r) for r in recorded] == expected
    assert finder.calls == asked
    ledger.save()
    after = read_json(tmp_path / MARKER_NAME)
    if marker_after is None:
        assert after == marker
    else:
        assert after == {"runsc_version": marker_after}
    # The next start reads the marker: unrecorded state is taken as the marker's, nothing is asked of PATH.
    again = Finder("never")
    assert RuntimeLedger(tmp_path, current, again).stamp(None) == marker_after
    assert again.calls == 0


def fake_runsc(directory: Path, script: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "runsc"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        (f"printf 'runsc version {OLD}\\nspec: 1.0.2-dev\\n'", OLD),
        ("exit 1", None),  # prints no version
        (None, None),  # no runsc on PATH
    ],
)
def test_runsc_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script: str | None, expected: str | None
) -> None:
    if script is not None:
        fake_runsc(tmp_path / "bin", script)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    assert runsc_on_path() == expected


# -- the records ----------------------------------------------------------------------------------------------


def sandbox_record(sandbox_id: str, state: SandboxState, runsc_version: str | None = None) -> SandboxRecord:
    return SandboxRecord(
        id=sandbox_id, state=state, image="default", cpus=1, memory_mb=256, disk_mb=512,
        network=NetworkPolicy("none"), idle_timeout_secs=600, created_at="2026-12-01T00:00:00.000Z",
        runsc_version=runsc_version,
    )  # fmt: skip


def snapshot_record(snapshot_id: str, kind: str, runsc_version: str | None = None) -> SnapshotRecord:
    return SnapshotRecord(
        id=snapshot_id, sandbox="sbx_gone", image="default", kind=kind, bytes=3,  # type: ignore[arg-type]
        created_at="2026-12-01T00:00:00.000Z", cpus=1, memory_mb=256, disk_mb=512,
        network={"mode": "none", "allow": None, "deny": []}, runsc_version=runsc_version,
    )  # fmt: skip


def test_records_from_before_the_stamps_read_back_without_one(tmp_path: Path) -> None:
    data = sandbox_record("sbx_a", SandboxState.RUNNING).to_disk()
    del data["runsc_version"]
    assert SandboxRecord.from_disk(data).runsc_version is None
    stamped = sandbox_record("sbx_a", SandboxState.RUNNING, OLD)
    assert SandboxRecord.from_disk(json.loads(json.dumps(stamped.to_disk()))).runsc_version == OLD

    old = asdict(snapshot_record("snap_a", "memory"))
    del old["runsc_version"]
    (tmp_path / "snap_a").mkdir()
    write_json_atomic(tmp_path / "snap_a" / "snapshot.json", old)
    store = SnapshotStore(tmp_path)
    store.load()
    assert store.get("snap_a").runsc_version is None
    store.set_runsc_version("snap_a", OLD)
    again = SnapshotStore(tmp_path)
    again.load()
    assert again.get("snap_a").runsc_version == OLD
