"""apply_upper_tar: gVisor's tar of a root overlay, applied onto our layer's upper directory, reads through a
real overlayfs as what the guest saw; and a hostile tar never reaches outside the upper directory."""

from __future__ import annotations

import io
import os
import stat
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sbx.backends.upper_tar import UpperTarError, apply_upper_tar

#: Overlay mounts, chown to others, whiteouts (mknod) and trusted xattrs need root; refusals do not.
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts, mknod, trusted xattrs)")
OPAQUE = {"trusted.overlay.opaque": "y"}
T_ROOT = 1_500_000_000  # mtimes, in seconds
T_FILE = 1_600_000_000
T_VAR = 1_600_000_100
T_HOME = 1_600_000_200
T_LINK = 1_600_000_300

Entry = tuple[tarfile.TarInfo, bytes | None]


def info(
    name: str,
    kind: bytes,
    mode: int = 0o644,
    owner: tuple[int, int] | None = None,
    mtime: int = T_FILE,
    xattrs: dict[str, str] | None = None,
) -> tarfile.TarInfo:
    """A tar header; owned by whoever runs the test unless ``owner`` (uid, gid) says otherwise."""
    item = tarfile.TarInfo(name)
    item.type, item.mode, item.mtime = kind, mode, mtime
    item.uid, item.gid = owner if owner is not None else (os.getuid(), os.getgid())
    item.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in (xattrs or {}).items()}
    return item


def file(
    name: str,
    data: bytes = b"",
    mode: int = 0o644,
    owner: tuple[int, int] | None = None,
    xattrs: dict[str, str] | None = None,
) -> Entry:
    item = info(name, tarfile.REGTYPE, mode, owner, T_FILE, xattrs)
    item.size = len(data)
    return item, data


def folder(
    name: str,
    opaque: bool = False,
    mode: int = 0o755,
    owner: tuple[int, int] | None = None,
    mtime: int = T_FILE,
) -> Entry:
    return info(name, tarfile.DIRTYPE, mode, owner, mtime, OPAQUE if opaque else None), None


def link(name: str, target: str, owner: tuple[int, int] | None = None, mtime: int = T_FILE) -> Entry:
    item = info(name, tarfile.SYMTYPE, 0o777, owner, mtime)
    item.linkname = target
    return item, None


def hard(name: str, target: str) -> Entry:
    item = info(name, tarfile.LNKTYPE)
    item.linkname = target
    return item, None


def node(name: str, kind: bytes, major: int = 0, minor: int = 0, mode: int = 0o600) -> Entry:
    item = info(name, kind, mode)
    item.devmajor, item.devminor = major, minor
    return item, None


def whiteout(name: str) -> Entry:
    return node(name, tarfile.CHRTYPE, mode=0)


def write_tar(path: Path, entries: list[Entry]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for item, data in entries:
            tar.addfile(item, io.BytesIO(data) if data is not None else None)
    return path


def plant(root: Path, files: dict[str, str]) -> None:
    """Files (and their directories) under ``root``: ``{"a/b": "content"}``."""
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content)


# --- Semantics, read through a real overlayfs ---------------------------------------------------------------

LOWER = {
    "etc/conf": "image's", "etc/gone": "image's", "etc/keep": "image's",
    "opt/tool/bin": "image's", "var/lib/old": "image's", "srv/image": "image's", "home/image": "image's",
    "lib/image": "image's", "mnt/image": "image's",
}  # fmt: skip
OURS = {
    "opt/ours": "ours", "srv/ours": "ours", "srv/sub/deep": "ours", "home/ours": "ours", "home/mine": "ours",
    "lib": "ours, a file over the image's directory",
}  # fmt: skip


@dataclass(frozen=True)
class Layers:
    upper: Path
    merged: Path
    outside: Path


@pytest.fixture(scope="module")
def layers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layers]:
    """Our layer (OURS) over the image (LOWER) with the guest's tar applied, mounted as the guest's root."""
    base = tmp_path_factory.mktemp("overlay")
    lower, upper, work, merged, outside = (base / n for n in ("lower", "upper", "work", "merged", "outside"))
    for d in (lower, upper, work, merged, outside):
        d.mkdir()
    plant(lower, LOWER)
    plant(upper, OURS)
    os.mknod(upper / "mnt", stat.S_IFCHR, os.makedev(0, 0))  # ours deleted the image's /mnt
    plant(outside, {"target": "host's"})
    tar = write_tar(base / "upper.tar", [
        folder(".", mode=0o751, owner=(0, 0), mtime=T_ROOT),
        file("./new.txt", b"new", mode=0o640, owner=(1000, 1001), xattrs={"user.note": "hi"}),
        folder("./etc"),
        file("./etc/conf", b"the guest's"),
        whiteout("./etc/gone"),
        whiteout("./opt"),
        folder("./var", opaque=True, mode=0o750, owner=(1001, 1002), mtime=T_VAR),
        file("./var/fresh", b"fresh"),
        folder("./srv", opaque=True),
        file("./srv/kept", b"kept"),
        folder("./home", mode=0o700, mtime=T_HOME),
        file("./home/ours", b"replaced"),
        whiteout("./home/mine"),
        file("./home/new", b"new"),
        folder("./lib"),
        file("./lib/new", b"new"),
        folder("./mnt"),
        link("./link", str(outside / "target"), owner=(1000, 1000), mtime=T_LINK),
        hard("./hard", "./new.txt"),
        node("./pipe", tarfile.FIFOTYPE, mode=0o620),
        node("./null", tarfile.CHRTYPE, 1, 3, mode=0o666),
        file("./su", b"#!/bin/sh\n", mode=0o4755, owner=(0, 0)),
    ])  # fmt: skip
    apply_upper_tar(tar, upper)
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], check=True)
    try:
        yield Layers(upper, merged, outside)
    finally:
        subprocess.run(["umount", str(merged)], check=True)


# (case, path in the guest's root, what it saw there: a file's content, a directory's names, or None: absent)
MERGED_VIEW: list[tuple[str, str, bytes | list[str] | None]] = [
    ("new file", "new.txt", b"new"),
    ("file over the image's", "etc/conf", b"the guest's"),
    ("whiteout of the image's file", "etc/gone", None),
    ("plain directory over the image's", "etc", ["conf", "keep"]),
    ("whiteout of a directory tree in both layers", "opt", None),
    ("opaque directory over the image's", "var", ["fresh"]),
    ("opaque directory over ours and the image's", "srv", ["kept"]),
    ("file over ours", "home/ours", b"replaced"),
    ("whiteout of a file only ours has", "home/mine", None),
    ("plain directory merging ours and the image's", "home", ["image", "new", "ours"]),
    ("hard link", "hard", b"new"),
    ("plain directory over a file of ours", "lib", ["new"]),
    ("plain directory over a whiteout of ours", "mnt", []),
]


@needs_root
@pytest.mark.parametrize(("case", "path", "seen"), MERGED_VIEW, ids=[c[0] for c in MERGED_VIEW])
def test_the_merged_view_is_what_the_guest_saw(
    layers: Layers, case: str, path: str, seen: bytes | list[str] | None
) -> None:
    target = layers.merged / path
    if seen is None:
        assert not os.path.lexists(target)
    elif isinstance(seen, bytes):
        assert target.read_bytes() == seen
    else:
        assert sorted(os.listdir(target)) == seen


# (case, path, uid, gid, mode, mtime) as the guest had them
METADATA = [
    ("root", ".", 0, 0, 0o751, T_ROOT),
    ("file", "new.txt", 1000, 1001, 0o640, T_FILE),
    ("setuid file keeps its bit after the chown", "su", 0, 0, 0o4755, T_FILE),
    ("directory written into after its entry", "var", 1001, 1002, 0o750, T_VAR),
    ("merged directory written into after its entry", "home", os.getuid(), os.getgid(), 0o700, T_HOME),
    ("symlink", "link", 1000, 1000, 0o777, T_LINK),
    ("fifo", "pipe", os.getuid(), os.getgid(), 0o620, T_FILE),
]


@needs_root
@pytest.mark.parametrize(
    ("case", "path", "uid", "gid", "mode", "mtime"), METADATA, ids=[c[0] for c in METADATA]
)
def test_owner_mode_and_mtime_are_the_guests(
    layers: Layers, case: str, path: str, uid: int, gid: int, mode: int, mtime: int
) -> None:
    st = os.lstat(layers.merged / path)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), st.st_mtime) == (uid, gid, mode, mtime)


@needs_root
def test_node_types_links_and_xattrs(layers: Layers) -> None:
    upper, merged = layers.upper, layers.merged
    assert os.readlink(merged / "link") == str(layers.outside / "target")  # verbatim, absolute
    assert (layers.outside / "target").read_text() == "host's"
    assert os.stat(layers.outside / "target").st_uid == 0  # the lchown did not follow it
    assert os.stat(upper / "hard").st_ino == os.stat(upper / "new.txt").st_ino
    assert stat.S_ISFIFO(os.lstat(merged / "pipe").st_mode)
    null = os.lstat(upper / "null")
    assert stat.S_ISCHR(null.st_mode) and (os.major(null.st_rdev), os.minor(null.st_rdev)) == (1, 3)
    gone = os.lstat(upper / "etc" / "gone")  # an overlayfs whiteout
    assert stat.S_ISCHR(gone.st_mode) and gone.st_rdev == 0
    assert os.getxattr(upper / "var", "trusted.overlay.opaque") == b"y"
    assert sorted(os.listdir(upper / "srv")) == ["kept"]  # what was ours in the opaque directory is gone
    assert os.getxattr(merged / "new.txt", "user.note") == b"hi"


# --- Hostile tars ------------------------------------------------------------------------------------------


def snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int, int, int, bytes | str | None]]:
    """Everything under ``root`` but ``skip``: type and mode, owner, mtime, and content or link target."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if Path(dirpath, d) != skip]
        for name in [*dirnames, *filenames]:
            path = Path(dirpath, name)
            st = os.lstat(path)
            body: bytes | str | None = None
            if stat.S_ISREG(st.st_mode):
                body = path.read_bytes()
            elif stat.S_ISLNK(st.st_mode):
                body = os.readlink(path)
            seen[str(path)] = (st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, body)
    return seen


def symlink_in_ours(upper: Path, outside: Path) -> None:
    (upper / "x").symlink_to(outside)  # as a hostile earlier layer could have left


def dir_link_in_ours(upper: Path, outside: Path) -> None:
    (upper / "d").mkdir()
    (upper / "d" / "x").symlink_to(outside)


def nothing(upper: Path, outside: Path) -> None:
    pass


def nul_named(name: str) -> Entry:
    item, data = file("./placeholder", b"x")
    item.pax_headers["path"] = name  # a pax name can hold a NUL, a ustar one cannot
    return item, data


def typed(name: str, kind: bytes) -> Entry:
    item, data = file(name, b"")
    item.type = kind
    return item, data


# (case, what our layer holds first, the tar's entries (given the outside directory), the error's pattern)
REFUSED: list[tuple[str, Callable[[Path, Path], None], Callable[[Path], list[Entry]], str]] = [
    ("absolute name", nothing, lambda out: [file(str(out / "pwned"), b"x")], "is absolute"),
    ("'..'", nothing, lambda out: [file("../outside/pwned", b"x")], "has a '..' component"),
    ("'..' inside", nothing,
     lambda out: [folder("./a"), file("a/../../outside/pwned")], "has a '..' component"),
    ("empty component", nothing, lambda out: [folder("./a"), file("./a//b")], "has an empty component"),
    ("NUL", nothing, lambda out: [nul_named("./a\0b")], "holds a NUL byte"),
    ("file through the tar's symlink", nothing,
     lambda out: [link("./x", str(out)), file("./x/pwned", b"x")], r"\./x is a symlink or a file, never"),
    ("whiteout through the tar's symlink", nothing,
     lambda out: [link("./x", str(out)), whiteout("./x/sentinel")], r"\./x is a symlink"),
    ("directory through the tar's symlink", nothing,
     lambda out: [link("./x", str(out)), folder("./x/sub")], r"\./x is a symlink"),
    ("file through a symlink of ours", symlink_in_ours,
     lambda out: [file("./x/pwned", b"x")], r"\./x is a symlink"),
    ("opaque directory through a symlink of ours", dir_link_in_ours,
     lambda out: [folder("./d"), folder("./d/x/sub", opaque=True)], r"\./d/x is a symlink"),
    ("hard link to '..'", nothing, lambda out: [hard("./h", "../outside/sentinel")], "has a '..' component"),
    ("hard link to an absolute name", nothing,
     lambda out: [hard("./h", str(out / "sentinel"))], "is absolute"),
    ("hard link through the tar's symlink", nothing,
     lambda out: [link("./x", str(out)), hard("./h", "./x/sentinel")], r"\./x is a symlink"),
    ("hard link through a symlink of ours", symlink_in_ours,
     lambda out: [hard("./h", "./x/sentinel")], r"\./x is a symlink"),
    ("unknown type", nothing, lambda out: [typed("./odd", b"Z")], "type 'Z' is not one a layer holds"),
    ("contiguous file", nothing, lambda out: [typed("./odd", tarfile.CONTTYPE)], "type '7' is not one"),
    ("root that is not a directory", nothing, lambda out: [file(".")], "the root must be a directory"),
    ("parent not listed first", nothing, lambda out: [file("./nowhere/f")], r"\./nowhere does not exist"),
    ("other overlayfs xattr", nothing,
     lambda out: [file("./f", xattrs={"trusted.overlay.redirect": "/"})], "redirect='/': the one overlayfs"),
    ("opaque file", nothing,
     lambda out: [file("./f", xattrs=OPAQUE)], "overlayfs xattr taken is trusted.overlay.opaque=y on a dir"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "ours", "entries", "pattern"), REFUSED, ids=[c[0] for c in REFUSED])
def test_hostile_tars_are_refused_and_nothing_outside_changes(
    tmp_path: Path,
    case: str,
    ours: Callable[[Path, Path], None],
    entries: Callable[[Path], list[Entry]],
    pattern: str,
) -> None:
    upper, outside = tmp_path / "upper", tmp_path / "outside"
    upper.mkdir()
    plant(outside, {"sentinel": "host's", "sub/deeper": "host's"})
    ours(upper, outside)
    tar = write_tar(tmp_path / "upper.tar", entries(outside))
    before = snapshot(tmp_path, skip=upper)
    with pytest.raises(UpperTarError, match=pattern):
        apply_upper_tar(tar, upper)
    assert snapshot(tmp_path, skip=upper) == before


# (case, the tar's entry at ./x, where our layer has ./x a symlink to a file or a directory outside)
OVER_OUR_SYMLINK = [
    pytest.param(file("./x", b"mine", mode=0o600), stat.S_ISREG, id="file"),
    pytest.param(folder("./x"), stat.S_ISDIR, id="directory"),
    pytest.param(folder("./x", opaque=True), stat.S_ISDIR, id="opaque directory", marks=needs_root),
    pytest.param(link("./x", "/elsewhere"), stat.S_ISLNK, id="symlink"),
    pytest.param(whiteout("./x"), stat.S_ISCHR, id="whiteout", marks=needs_root),
    pytest.param(node("./x", tarfile.FIFOTYPE), stat.S_ISFIFO, id="fifo"),
]


@pytest.mark.parametrize("target", ["sentinel", "sub"])
@pytest.mark.parametrize(("entry", "is_kind"), OVER_OUR_SYMLINK)
def test_an_entry_replaces_a_symlink_of_ours_without_following_it(
    tmp_path: Path, entry: Entry, is_kind: Callable[[int], bool], target: str
) -> None:
    upper, outside = tmp_path / "upper", tmp_path / "outside"
    upper.mkdir()
    plant(outside, {"sentinel": "host's", "sub/deeper": "host's"})
    (upper / "x").symlink_to(outside / target)
    tar = write_tar(tmp_path / "upper.tar", [entry])
    before = snapshot(tmp_path, skip=upper)
    apply_upper_tar(tar, upper)
    assert is_kind(os.lstat(upper / "x").st_mode)
    assert snapshot(tmp_path, skip=upper) == before


@needs_root
@pytest.mark.parametrize(
    "entry",
    [whiteout("./d"), folder("./d", opaque=True), file("./d", b"mine")],
    ids=["whiteout", "opaque", "file"],
)
def test_a_tree_of_ours_holding_symlinks_out_is_removed_without_following_them(
    tmp_path: Path, entry: Entry
) -> None:
    upper, outside = tmp_path / "upper", tmp_path / "outside"
    upper.mkdir()
    plant(outside, {"sentinel": "host's", "sub/deeper": "host's"})
    plant(upper, {"d/sub/ours": "ours"})
    (upper / "d" / "out").symlink_to(outside)
    (upper / "d" / "sub" / "out").symlink_to(outside / "sub")
    tar = write_tar(tmp_path / "upper.tar", [entry])
    before = snapshot(tmp_path, skip=upper)
    apply_upper_tar(tar, upper)
    assert not (upper / "d" / "out").exists() and not (upper / "d" / "sub").exists()
    assert snapshot(tmp_path, skip=upper) == before


def test_a_hard_link_to_a_symlink_links_the_symlink(tmp_path: Path) -> None:
    upper, outside = tmp_path / "upper", tmp_path / "outside"
    upper.mkdir()
    plant(outside, {"sentinel": "host's"})
    (upper / "x").symlink_to(outside / "sentinel")
    apply_upper_tar(write_tar(tmp_path / "upper.tar", [hard("./h", "./x")]), upper)
    assert os.lstat(upper / "h").st_ino == os.lstat(upper / "x").st_ino
    assert os.stat(outside / "sentinel").st_nlink == 1


@needs_root
def test_entries_after_a_directory_they_replaced(tmp_path: Path) -> None:
    """Directories already walked (kept open while parents come first) are walked again once replaced."""
    upper = tmp_path / "upper"
    upper.mkdir()
    tar = write_tar(tmp_path / "upper.tar", [
        folder("./d"), file("./d/a", b"first"), hard("./h1", "./d/a"),
        whiteout("./d"), folder("./d", opaque=True), file("./d/a", b"second"), hard("./h2", "./d/a"),
    ])  # fmt: skip
    apply_upper_tar(tar, upper)
    assert (upper / "h2").read_bytes() == b"second" and (upper / "h1").read_bytes() == b"first"
    assert os.stat(upper / "h2").st_ino == os.stat(upper / "d" / "a").st_ino


def test_holes_stay_holes_and_content_streams(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    data = b"head" + bytes(8 * 1024 * 1024) + b"tail"
    apply_upper_tar(write_tar(tmp_path / "upper.tar", [file("./big", data)]), upper)
    assert (upper / "big").read_bytes() == data
    assert os.stat(upper / "big").st_blocks * 512 < 4 * 1024 * 1024


def test_a_cut_tar_is_refused(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    upper.mkdir()
    tar = write_tar(tmp_path / "upper.tar", [file("./a", b"a" * 2000), file("./b", b"b")])
    with tarfile.open(tar) as t:
        a, b = t.getmembers()
    whole = tar.read_bytes()
    # (where the tar is cut, the error): in a file's content tarfile notices; in a header it would end quietly
    for cut, pattern in ((a.offset_data + 100, "cannot be read"), (b.offset + 300, "cut short")):
        tar.write_bytes(whole[:cut])
        with pytest.raises(UpperTarError, match=pattern):
            apply_upper_tar(tar, upper)
