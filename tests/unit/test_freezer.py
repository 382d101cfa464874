"""The cgroup freezer's file protocol (sbx.backends.freezer) on fake cgroup trees of both layouts: states read,
what a freeze and a thaw write, a freeze that does not complete is undone. The kernel's side (a frozen sandbox
uses no CPU): the backend contract suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from sbx.backends.base import BackendError
from sbx.backends.freezer import CgroupFreezer, FreezerState

SANDBOX = "sbx_0123456789abcdef"


def v1_tree(tmp_path: Path, state: str = "THAWED", procs: str = "41\n42\n") -> tuple[CgroupFreezer, Path]:
    group = tmp_path / "freezer" / "sandboxd" / SANDBOX
    group.mkdir(parents=True)
    (group / "freezer.state").write_text(state + "\n")
    (group / "cgroup.procs").write_text(procs)
    return CgroupFreezer("/sandboxd", root=tmp_path), group


def v2_tree(tmp_path: Path, freeze: str = "0", frozen: str = "0") -> tuple[CgroupFreezer, Path]:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    group = tmp_path / "sandboxd" / SANDBOX
    group.mkdir(parents=True)
    (group / "cgroup.freeze").write_text(freeze + "\n")
    (group / "cgroup.events").write_text(f"populated 1\nfrozen {frozen}\n")
    (group / "cgroup.procs").write_text("41\n")
    return CgroupFreezer("/sandboxd", root=tmp_path), group


@pytest.mark.parametrize(
    ("text", "state"), [("THAWED", "thawed"), ("FREEZING", "freezing"), ("FROZEN", "frozen")]
)
def test_v1_states(tmp_path: Path, text: str, state: FreezerState) -> None:
    freezer, _ = v1_tree(tmp_path, text)
    assert not freezer.unified and freezer.usable()
    assert freezer.state(SANDBOX) == state


@pytest.mark.parametrize(
    ("freeze", "frozen", "state"), [("0", "0", "thawed"), ("1", "0", "freezing"), ("1", "1", "frozen")]
)
def test_v2_states(tmp_path: Path, freeze: str, frozen: str, state: FreezerState) -> None:
    freezer, _ = v2_tree(tmp_path, freeze, frozen)
    assert freezer.unified and freezer.usable()
    assert freezer.state(SANDBOX) == state


async def test_a_group_that_does_not_exist(tmp_path: Path) -> None:
    (tmp_path / "freezer").mkdir()
    freezer = CgroupFreezer("/sandboxd", root=tmp_path)
    assert freezer.state(SANDBOX) is None and not freezer.has_tasks(SANDBOX)
    freezer.thaw(SANDBOX)  # nothing to thaw: not an error
    with pytest.raises(BackendError, match="does not exist; is it running"):
        await freezer.freeze(SANDBOX)
    assert not CgroupFreezer("/sandboxd", root=tmp_path / "nowhere").usable()  # no freezer mounted


async def test_v1_freeze_and_thaw_write_the_state(tmp_path: Path) -> None:
    freezer, group = v1_tree(tmp_path)
    await freezer.freeze(SANDBOX)  # a regular file reads back FROZEN at once, as an idle group does
    assert (group / "freezer.state").read_text() == "FROZEN"
    assert freezer.has_tasks(SANDBOX)
    freezer.thaw(SANDBOX)
    freezer.thaw(SANDBOX)
    assert (group / "freezer.state").read_text() == "THAWED"


async def test_v2_freeze_writes_one_and_waits_for_the_event(tmp_path: Path) -> None:
    freezer, group = v2_tree(tmp_path, frozen="1")
    await freezer.freeze(SANDBOX)
    assert (group / "cgroup.freeze").read_text() == "1"
    freezer.thaw(SANDBOX)
    assert (group / "cgroup.freeze").read_text() == "0"


async def test_a_freeze_that_does_not_complete_is_undone(tmp_path: Path) -> None:
    freezer, group = v2_tree(tmp_path, frozen="0")  # cgroup.events never says frozen: a task stuck in D state
    with pytest.raises(BackendError, match="were not all stopped within 0.05 s .* it was left running"):
        await freezer.freeze(SANDBOX, timeout_secs=0.05)
    assert (group / "cgroup.freeze").read_text() == "0"
