"""touch_regular in a directory the guest can write: whatever the guest put at the name, the host never
follows it, never opens it, and ends with a regular file of its own there."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from sbx.backends.base import BackendError
from sbx.backends.ctl_dir import touch_regular


def plant_nothing(ctl: Path, outside: Path) -> None:
    pass


def plant_file(ctl: Path, outside: Path) -> None:
    (ctl / "wake").write_bytes(b"the guest's")


def plant_link_to_missing(ctl: Path, outside: Path) -> None:
    (ctl / "wake").symlink_to(outside / "created-by-the-guest")


def plant_link_to_host_file(ctl: Path, outside: Path) -> None:
    (outside / "host-file").write_bytes(b"host data")
    (ctl / "wake").symlink_to(outside / "host-file")


def plant_link_to_host_dir(ctl: Path, outside: Path) -> None:
    (ctl / "wake").symlink_to(outside)


def plant_fifo(ctl: Path, outside: Path) -> None:
    os.mkfifo(ctl / "wake")  # opening it for writing would block with no reader


def plant_dir(ctl: Path, outside: Path) -> None:
    (ctl / "wake" / "deep").mkdir(parents=True)
    (ctl / "wake" / "deep" / "escape").symlink_to(outside)


@pytest.mark.parametrize(
    "plant",
    [plant_nothing, plant_file, plant_link_to_missing, plant_link_to_host_file, plant_link_to_host_dir,
     plant_fifo, plant_dir],
)  # fmt: skip
def test_touch_regular_never_follows_what_the_guest_put(
    tmp_path: Path, plant: Callable[[Path, Path], None]
) -> None:
    ctl, outside = tmp_path / "ctl", tmp_path / "host"
    ctl.mkdir()
    outside.mkdir()
    plant(ctl, outside)
    before = sorted((p.name, p.stat().st_size) for p in outside.iterdir())
    touch_regular(ctl, "wake")
    found = os.stat(ctl / "wake", follow_symlinks=False)
    assert stat.S_ISREG(found.st_mode)
    assert sorted((p.name, p.stat().st_size) for p in outside.iterdir()) == before  # the host side untouched
    if plant is plant_file:
        assert (ctl / "wake").read_bytes() == b"the guest's"  # a regular file is left as it is
    else:
        assert found.st_size == 0 and stat.S_IMODE(found.st_mode) == 0o600


def test_a_control_directory_that_is_a_link_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "ctl").symlink_to(elsewhere)
    with pytest.raises(BackendError, match="cannot be opened"):
        touch_regular(tmp_path / "ctl", "wake")
    assert list(elsewhere.iterdir()) == []
