"""Which runsc made what (sbx.node.runtimes): the version checks, the stamps of state from before they were
recorded, and the node refusing, before touching a sandbox, what one runsc cannot restore of another's.

The real upgrade (a state dir made with Debian's runsc, served with the pinned build) is
tests/integration/test_runtime_upgrade.py; here the backend is a stub that records what it was asked.
"""

from __future__ import annotations

import json
import stat
from dataclasses import asdict
from pathlib import Path

import pytest
from fake_backend import FakeBackend

from sbx.agent.client import AgentClient, AgentError
from sbx.api.errors import Conflict, Internal
from sbx.api.network_policy import NetworkPolicy
from sbx.api.node import Runtime
from sbx.api.requests import CreateSpec
from sbx.images.store import ImageStore
from sbx.node import runtimes
from sbx.node.audit import AuditLog
from sbx.node.config import Capacity, NodeConfig
from sbx.node.manager import SandboxManager
from sbx.node.records import SandboxRecord, SandboxState
from sbx.node.reservations import Reservations
from sbx.node.runtimes import (
    MARKER_NAME,
    UNKNOWN,
    RuntimeLedger,
    checkpoint_refusal,
    describe,
    differs,
    fork_refusal,
    resume_refusal,
    runsc_on_path,
)
from sbx.node.snapshots import SnapshotRecord, SnapshotStore
from sbx.statefile import read_json, write_json_atomic

OLD = "0.0~20240729.0"
NEW = "release-20260803.0-49-g7a7d8c355"


@pytest.mark.parametrize(
    ("made_by", "current", "expected"),
    [
        (NEW, NEW, False),  # the same runsc restores its own images
        (OLD, NEW, True),
        (NEW, OLD, True),  # a downgrade is another runsc too
        (UNKNOWN, NEW, True),  # unknown is refused rather than risked
        (None, NEW, True),  # never stamped: as unknown
        (OLD, None, False),  # a backend without runsc compares nothing
        (None, None, False),
    ],
)
def test_differs(made_by: str | None, current: str | None, expected: bool) -> None:
    assert differs(made_by, current) is expected


def test_describe() -> None:
    assert describe(OLD) == f"runsc {OLD}"
    assert describe(UNKNOWN) == describe(None)
    assert "not recorded" in describe(UNKNOWN)


REFUSALS = [
    (lambda made, cur: checkpoint_refusal("sbx_a", made, cur, "it is not suspended"),
     ["sandbox sbx_a was started by", "it is not suspended (it runs on, unchanged)",
      'POST /v1/sandboxes/sbx_a/snapshots with {"kind": "disk"}) and create from it', "or recreate the sandbox"]),
    (lambda made, cur: resume_refusal("sbx_a", made, cur),
     ["sandbox sbx_a was suspended by", "cannot restore its checkpoint; it stays suspended with its disk",
      'POST /v1/sandboxes/sbx_a/snapshots with {"kind": "disk"}', "or delete it"]),
    (lambda made, cur: fork_refusal("snap_a", made, cur),
     ["snapshot snap_a is a memory snapshot made by", "the snapshot is kept", "fork a disk snapshot instead",
      "DELETE /v1/snapshots/snap_a"]),
]  # fmt: skip


@pytest.mark.parametrize(("refusal", "words"), REFUSALS)
@pytest.mark.parametrize(
    ("made_by", "current", "names"),
    [
        (NEW, NEW, None),
        (OLD, None, None),
        (OLD, NEW, [f"runsc {OLD}", f"this node now runs runsc {NEW}"]),
        (UNKNOWN, NEW, ["a runsc whose version was not recorded", f"this node now runs runsc {NEW}"]),
        (None, NEW, ["a runsc whose version was not recorded", f"this node now runs runsc {NEW}"]),
    ],
)
def test_refusals_name_both_runscs_and_what_to_do(
    refusal: object, words: list[str], made_by: str | None, current: str | None, names: list[str] | None
) -> None:
    found = refusal(made_by, current)  # type: ignore[operator]
    if names is None:
        assert found is None
        return
    assert isinstance(found, Conflict) and found.status == 409 and found.code == "conflict"
    for expected in [*words, *names]:
        assert expected in found.message, (expected, found.message)


@pytest.mark.parametrize(
    ("made_by", "hint"),
    [
        (OLD, f"a node serving this state with runsc {OLD} again ([paths] runsc) could resume it"),
        (UNKNOWN, None),
    ],
)
def test_a_resume_refusal_names_the_runsc_that_could_resume_it_when_known(
    made_by: str, hint: str | None
) -> None:
    found = resume_refusal("sbx_a", made_by, NEW)
    assert found is not None
    assert (hint in found.message) if hint else ("could resume" not in found.message)


@pytest.mark.parametrize(
    ("made_by", "where"),
    [(OLD, f"fork it on a node running runsc {OLD}"), (UNKNOWN, "the runsc that made it")],
)
def test_a_fork_refusal_says_where_it_could_be_forked(made_by: str, where: str) -> None:
    found = fork_refusal("snap_a", made_by, NEW)
    assert found is not None and where in found.message


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


# -- the node: stamps at start, refusals before anything is touched ---------------------------------------------


class StubCheckpoints(FakeBackend):
    """The fake backend with a runsc version and checkpoint methods that only record being called. Every
    sandbox it is asked about counts as parked (taken back without an agent); none runs."""

    wake_path = "/.sbx/ctl/wake"

    def __init__(self, state_dir: Path, agent_path: Path, runsc_version: str) -> None:
        super().__init__(state_dir, agent_path)
        self.runsc_version = runsc_version
        self.parked: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def runtime_report(self) -> Runtime:
        return Runtime(platform="host", runsc_version=self.runsc_version)

    async def is_parked(self, sandbox_id: str) -> bool:
        return sandbox_id in self.parked

    async def is_running(self, sandbox_id: str) -> bool:
        return sandbox_id in self.parked

    async def connect_agent(self, sandbox_id: str, timeout_secs: float) -> AgentClient:
        raise AgentError("the stub runs no agent")

    def has_checkpoint(self, image_dir: Path) -> bool:
        return (image_dir / "checkpoint.img").is_file()

    async def checkpoint(self, sandbox_id: str, image_dir: Path, restored_at_once: bool = False) -> None:
        self.calls.append(("checkpoint", sandbox_id))

    async def restore(self, sandbox_id: str, image_dir: Path) -> None:
        self.calls.append(("restore", sandbox_id))

    async def wake(self, sandbox_id: str) -> None:
        self.calls.append(("wake", sandbox_id))

    async def copy_disk(self, sandbox_id: str, dest: Path, below_checkpoint: bool = False) -> None:
        self.calls.append(("copy_disk", sandbox_id))
        dest.write_bytes(b"ext4")

    def disk_used_bytes(self, sandbox_id: str) -> int:
        return 4

    async def boot_from_snapshot(self, spec: object, disk_image: Path, memory_image: Path | None) -> None:
        self.calls.append(("boot_from_snapshot", str(memory_image)))


def write_sandbox(state: Path, record: SandboxRecord, checkpoint_in: str | None = None) -> Path:
    directory = state / "sandboxes" / record.id
    directory.mkdir(parents=True)
    data = record.to_disk()
    if record.runsc_version is None:
        del data["runsc_version"]  # as the sandboxd before the stamps wrote it
    write_json_atomic(directory / "sandbox.json", data)
    if checkpoint_in is not None:
        (directory / checkpoint_in).mkdir()
        (directory / checkpoint_in / "checkpoint.img").write_bytes(b"img")
    return directory


def write_snapshot(state: Path, record: SnapshotRecord) -> None:
    directory = state / "snapshots" / record.id
    directory.mkdir(parents=True)
    data = asdict(record)
    del data["runsc_version"]
    write_json_atomic(directory / "snapshot.json", data)


def manager_on(state: Path, tmp_path: Path, backend: StubCheckpoints) -> SandboxManager:
    return SandboxManager(
        NodeConfig(), state, backend=backend, images=ImageStore(tmp_path / "images"),
        audit=AuditLog(tmp_path / "audit"),
        reservations=Reservations(Capacity(cpus=8, memory_mb=8192, disk_mb=20000)),
    )  # fmt: skip


def fork(snapshot_id: str) -> CreateSpec:
    return CreateSpec(
        image="default", cpus=1, memory_mb=256, disk_mb=512, idle_timeout_secs=600, network=NetworkPolicy("none"),
        snapshot_id=snapshot_id, fields_given=frozenset({"snapshot_id"}),
    )  # fmt: skip


async def test_state_of_the_old_runsc_is_stamped_at_start_and_refused_before_anything_is_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state dir the sandboxd before the stamps made with Debian's runsc on PATH, started on the new one."""
    state = tmp_path / "state"
    running = sandbox_record("sbx_running", SandboxState.RUNNING)
    suspended = sandbox_record("sbx_suspended", SandboxState.SUSPENDED)
    captured = sandbox_record("sbx_captured", SandboxState.RUNNING)  # killed mid-capture, then upgraded
    write_sandbox(state, running)
    suspended_dir = write_sandbox(state, suspended, "suspend-image")
    captured_dir = write_sandbox(state, captured, "capture-image")
    write_snapshot(state, snapshot_record("snap_memory", "memory"))
    write_snapshot(state, snapshot_record("snap_disk", "disk"))
    (state / "snapshots" / "snap_disk" / "disk.img").write_bytes(b"ext4")
    finder = Finder(OLD)
    monkeypatch.setattr(runtimes, "runsc_on_path", finder)
    backend = StubCheckpoints(state, tmp_path / "agent", NEW)
    backend.parked.add(running.id)

    manager = manager_on(state, tmp_path, backend)
    await manager.start()
    try:
        assert finder.calls == 1
        assert read_json(state / MARKER_NAME) == {"runsc_version": NEW}
        for sandbox_id in (running.id, suspended.id, captured.id):
            on_disk = read_json(state / "sandboxes" / sandbox_id / "sandbox.json")
            assert on_disk["runsc_version"] == OLD, sandbox_id
        for snapshot_id in ("snap_memory", "snap_disk"):
            assert read_json(state / "snapshots" / snapshot_id / "snapshot.json")["runsc_version"] == OLD
        # The capture another runsc made is kept, as a suspended sandbox, never restored (it would fail).
        assert [r.state for r in manager.records() if r.id == captured.id] == [SandboxState.SUSPENDED]
        assert (captured_dir / "suspend-image" / "checkpoint.img").is_file()
        assert not (captured_dir / "capture-image").exists()

        checkpoints = manager.checkpoints
        assert checkpoints is not None
        refused = [
            (lambda: checkpoints.suspend(running.id), "it is not suspended"),
            (lambda: checkpoints.snapshot(running.id, "memory"), "no memory snapshot of it is taken"),
            (lambda: checkpoints.snapshot(running.id, "memory", scheduled=True), "no memory snapshot"),
            (lambda: checkpoints.resume(suspended.id), "cannot restore its checkpoint"),
            (lambda: checkpoints.resume(captured.id), "cannot restore its checkpoint"),
            (lambda: checkpoints.snapshot(suspended.id, "memory"), "resume it first"),
        ]
        for call, words in refused:
            with pytest.raises(Conflict, match=words):
                await call()
        with pytest.raises(Conflict, match="it cannot have a snapshot schedule"):
            checkpoints.set_schedule(running.id, 60, 1)
        with pytest.raises(Conflict, match=f"made by runsc {OLD}"):
            checkpoints.fork_request(fork("snap_memory"))
        assert backend.calls == []  # nothing was touched
        assert {r.id: r.state for r in manager.records()} == {
            running.id: SandboxState.RUNNING, suspended.id: SandboxState.SUSPENDED,
            captured.id: SandboxState.SUSPENDED,
        }  # fmt: skip
        assert (suspended_dir / "suspend-image" / "checkpoint.img").is_file()
        assert checkpoints.set_schedule(running.id, 0, 1).snapshot_every_secs == 0  # stopping one is fine

        # What works across runscs: a disk snapshot of the suspended sandbox, and a disk fork.
        taken = await checkpoints.snapshot(suspended.id, "disk")
        assert (taken.kind, taken.sandbox, taken.runsc_version) == ("disk", suspended.id, OLD)
        assert backend.calls == [("copy_disk", suspended.id)]
        snapshot, _ = checkpoints.fork_request(fork("snap_disk"))
        assert snapshot.id == "snap_disk"
    finally:
        await manager.close()

    # A restart keeps the stamps and asks PATH nothing.
    monkeypatch.setattr(runtimes, "runsc_on_path", Finder("never"))
    manager = manager_on(state, tmp_path, StubCheckpoints(state, tmp_path / "agent", NEW))
    await manager.start()
    try:
        assert {r.id: r.runsc_version for r in manager.records()} == dict.fromkeys(
            (running.id, suspended.id, captured.id), OLD
        )
        assert manager.checkpoints is not None
        with pytest.raises(Conflict, match=f"made by runsc {OLD}"):
            manager.checkpoints.fork_request(fork("snap_memory"))
    finally:
        await manager.close()


async def test_state_of_this_runsc_is_not_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    write_sandbox(state, sandbox_record("sbx_suspended", SandboxState.SUSPENDED, NEW), "suspend-image")
    write_json_atomic(state / MARKER_NAME, {"runsc_version": NEW})
    memory = snapshot_record("snap_memory", "memory", NEW)
    (state / "snapshots" / memory.id).mkdir(parents=True)
    write_json_atomic(state / "snapshots" / memory.id / "snapshot.json", asdict(memory))
    backend = StubCheckpoints(state, tmp_path / "agent", NEW)
    manager = manager_on(state, tmp_path, backend)
    await manager.start()
    try:
        assert manager.checkpoints is not None
        snapshot, _ = manager.checkpoints.fork_request(fork(memory.id))
        assert snapshot.id == memory.id
        # The resume goes on to the backend (whose restored sandbox has no agent here: 500, not 409).
        with pytest.raises(Internal, match="the stub runs no agent"):
            await manager.checkpoints.resume("sbx_suspended")
        assert backend.calls == [("restore", "sbx_suspended")]
    finally:
        await manager.close()
