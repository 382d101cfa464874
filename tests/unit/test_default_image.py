"""The default image's recipe plumbing: which mirror the apt sources give, and when to rebuild."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from sbx.images.default_image import (
    DEBIAN_DEFAULT_MIRROR,
    DEFAULT_IMAGE,
    RECIPE_ANNOTATION,
    RECIPE_ID,
    apt_source_lines,
    debian_mirror,
    installed_default,
    is_current,
    security_mirror,
)
from sbx.images.store import ImageConfig, ImageStore, InstalledImage, image_dir_name

BOOKWORM_DEB822 = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
"""

# (case, {relative file: contents}, expected mirror)
MIRROR_CASES: list[tuple[str, dict[str, str], str]] = [
    ("no sources at all", {}, DEBIAN_DEFAULT_MIRROR),
    (
        "deb822 as on Debian 12",
        {"sources.list.d/debian.sources": BOOKWORM_DEB822},
        "http://deb.debian.org/debian",
    ),
    (
        "one-line with options and a trailing slash",
        {
            "sources.list": "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example.org/debian/ bookworm main\n"
        },
        "http://mirror.example.org/debian",
    ),
    (
        "security and a vendor repository are skipped",
        {
            "sources.list": "deb http://security.example.org/debian-security bookworm-security main\n"
            "deb https://vendor.example.com/apt stable-vendor main\n"
            "deb http://ftp.example.net/debian bookworm main\n"
        },
        "http://ftp.example.net/debian",
    ),
    (
        "deb-src, comments and disabled stanzas are skipped",
        {
            "sources.list": "# deb http://commented.example/debian bookworm main\n"
            "deb-src http://src.example/debian bookworm main\n",
            "sources.list.d/a.sources": "Enabled: no\nTypes: deb\nURIs: http://off.example/debian\n"
            "Suites: bookworm\nComponents: main\n",
            "sources.list.d/b.sources": "Types: deb deb-src\nURIs: http://on.example/debian\nSuites: bookworm\n"
            "Components: main\n",
        },
        "http://on.example/debian",
    ),
    (
        "bookworm wins over another Debian suite",
        {
            "sources.list": "deb http://trixie.example/debian trixie main\n",
            "sources.list.d/z.list": "deb http://bookworm.example/debian bookworm main\n",
        },
        "http://bookworm.example/debian",
    ),
    (
        "another Debian suite beats the fallback",
        {"sources.list": "deb http://stable.example/debian stable main\n"},
        "http://stable.example/debian",
    ),
    (
        "unfetchable schemes are skipped",
        {
            "sources.list": "deb cdrom:[Debian 12]/ bookworm main\n"
            "deb mirror+file:/etc/apt/mirrors.txt bookworm main\n"
        },
        DEBIAN_DEFAULT_MIRROR,
    ),
    (
        "deb822 continuation lines",
        {"sources.list.d/c.sources": "Types: deb\nURIs:\n http://cont.example/debian\nSuites: bookworm\n"},
        "http://cont.example/debian",
    ),
]


@pytest.mark.parametrize(
    ("files", "expected"), [c[1:] for c in MIRROR_CASES], ids=[c[0] for c in MIRROR_CASES]
)
def test_mirror_from_apt_sources(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    (tmp_path / "sources.list.d").mkdir()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert debian_mirror(tmp_path) == expected


@pytest.mark.parametrize(
    ("annotations", "current"),
    [({RECIPE_ANNOTATION: RECIPE_ID}, True), ({RECIPE_ANNOTATION: "0" * 16}, False), ({}, False)],
)
def test_rebuild_only_when_the_recipe_changed(annotations: dict[str, str], current: bool) -> None:
    image = InstalledImage(
        reference="default",
        digest="sha256:" + "0" * 64,
        bytes=1,
        installed_at=datetime.now(UTC),
        config=ImageConfig(),
        annotations=annotations,
        path=Path("/nonexistent"),
    )
    assert is_current(image) is current


def test_damaged_default_counts_as_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = ImageStore(tmp_path)
    assert installed_default(store) is None
    damaged = tmp_path / image_dir_name(DEFAULT_IMAGE)
    damaged.mkdir()
    (damaged / "image.json").write_text("{")
    assert installed_default(store) is None
    assert "rebuilding the damaged default image" in capsys.readouterr().err


# (case, {relative file: contents}, expected security mirror)
SECURITY_CASES: list[tuple[str, dict[str, str], str | None]] = [
    ("deb822 as on Debian 12", {"sources.list.d/debian.sources": BOOKWORM_DEB822},
     "http://deb.debian.org/debian-security"),
    ("one-line", {"sources.list": "deb http://security.example.org/debian-security/ bookworm-security main\n"},
     "http://security.example.org/debian-security"),
    ("another suite's security only", {"sources.list": "deb http://s.example/debian-security trixie-security main\n"},
     None),
    ("none at all", {}, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("files", "expected"), [c[1:] for c in SECURITY_CASES], ids=[c[0] for c in SECURITY_CASES]
)
def test_security_mirror_from_apt_sources(
    tmp_path: Path, files: dict[str, str], expected: str | None
) -> None:
    (tmp_path / "sources.list.d").mkdir()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert security_mirror(tmp_path) == expected


def test_image_sources_with_and_without_security() -> None:
    assert apt_source_lines("http://m.example/debian", "http://s.example/debian-security") == [
        "deb http://m.example/debian bookworm main",
        "deb http://m.example/debian bookworm-updates main",
        "deb http://s.example/debian-security bookworm-security main",
    ]
    assert apt_source_lines("file:/srv/mirror", None) == [
        "deb file:/srv/mirror bookworm main",
        "deb file:/srv/mirror bookworm-updates main",
    ]
