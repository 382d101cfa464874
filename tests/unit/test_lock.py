"""requirements.lock, the pinned Python dependency set: it fits pyproject.toml's ranges, and this virtualenv holds
exactly its versions, so what the suite checks (docs/openapi.yaml is what msgspec generates, say) is what a fresh
install checks. `bash scripts/lock.sh` remakes the lock; `bash scripts/install.sh` installs it."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements.lock"
#: A pin's first line in the lock: ``name==version`` then ``; markers`` when it applies to some platforms only.
PIN = re.compile(r"^(?P<req>[A-Za-z0-9][^\s\\]*==[^\s\\;]+(?:\s*;[^\\]*)?)\s*\\?$")


def pins() -> dict[str, Requirement]:
    """Every pin of the lock by canonical name."""
    found: dict[str, Requirement] = {}
    for line in LOCK.read_text(encoding="utf-8").splitlines():
        match = PIN.match(line)
        if match:
            req = Requirement(match["req"])
            found[canonicalize_name(req.name)] = req
    return found


def pinned_version(req: Requirement) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", req
    return spec.version


def declared() -> list[Requirement]:
    """pyproject.toml's dependencies, its test extra and its build backend."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    lines = [
        *project["project"]["dependencies"],
        *project["project"]["optional-dependencies"]["test"],
        *project["build-system"]["requires"],
    ]
    return [Requirement(line) for line in lines]


def test_the_lock_pins_every_package_with_hashes() -> None:
    text = LOCK.read_text(encoding="utf-8")
    assert len(pins()) > 50
    # Each pin is followed by at least one hash line (pip's --require-hashes refuses the lock otherwise).
    for block in re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 2)[2]):
        if PIN.match(block.splitlines()[0]):
            assert "--hash=sha256:" in block, block.splitlines()[0]


@pytest.mark.parametrize("req", declared(), ids=str)
def test_every_declared_range_is_met_by_its_pin(req: Requirement) -> None:
    pin = pins().get(canonicalize_name(req.name))
    assert pin is not None, (
        f"{req.name} is in pyproject.toml but not in requirements.lock: run bash scripts/lock.sh"
    )
    assert req.specifier.contains(pinned_version(pin), prereleases=True), (
        f"requirements.lock pins {pin} outside pyproject.toml's {req}: run bash scripts/lock.sh"
    )


def test_this_virtualenv_holds_exactly_the_locked_versions() -> None:
    wrong = []
    for name, req in sorted(pins().items()):
        if req.marker is not None and not req.marker.evaluate():
            continue  # another platform's package (pywin32, colorama, ...)
        try:
            have = version(name)
        except PackageNotFoundError:
            have = "not installed"
        if have != pinned_version(req):
            wrong.append(f"{name} {have} (the lock: {pinned_version(req)})")
    assert not wrong, f"this virtualenv is not the lock's, run bash scripts/install.sh: {', '.join(wrong)}"
