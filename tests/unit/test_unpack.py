"""Layer unpacking: OCI whiteouts, metadata, and hostile tarballs that must never write outside the root."""

from __future__ import annotations

import gzip
import io
import os
import shutil
import stat
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sbx.images.unpack import UnpackError, apply_layer, apply_layers, clean_name

IS_ROOT = os.geteuid() == 0


@dataclass
class E:
    """One tar entry: kind is file, dir, symlink, hardlink, chr, blk or fifo."""

    name: str
    kind: str = "file"
    data: bytes = b""
    link: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int = 1_600_000_000


_TYPES = {
    "file": tarfile.REGTYPE,
    "dir": tarfile.DIRTYPE,
    "symlink": tarfile.SYMTYPE,
    "hardlink": tarfile.LNKTYPE,
    "chr": tarfile.CHRTYPE,
    "blk": tarfile.BLKTYPE,
    "fifo": tarfile.FIFOTYPE,
}


def make_layer(path: Path, entries: list[E], compression: str = "gz") -> Path:
    """Write ``entries`` as a tar (names verbatim, no sanitising) compressed with gz, zst or nothing."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type = _TYPES[e.kind]
            info.mode = e.mode if e.kind != "dir" or e.mode != 0o644 else 0o755
            info.uid, info.gid, info.mtime = e.uid, e.gid, e.mtime
            info.linkname = e.link
            if e.kind in ("chr", "blk"):
                info.devmajor, info.devminor = 1, 3
            if e.kind == "file":
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
            else:
                tar.addfile(info)
    raw = buf.getvalue()
    if compression == "gz":
        raw = gzip.compress(raw)
    elif compression == "zst":
        raw = subprocess.run(["zstd", "-q", "-c"], input=raw, stdout=subprocess.PIPE, check=True).stdout
    path.write_bytes(raw)
    return path


def snapshot(top: Path, exclude: Path) -> dict[str, tuple[int, int, int]]:
    """Every path below ``top`` except ``exclude``'s tree, with (mode, size, mtime_ns), never following links."""
    result: dict[str, tuple[int, int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(top):
        if Path(dirpath) == exclude or exclude in Path(dirpath).parents:
            continue
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p == exclude:
                continue
            st = p.lstat()
            result[str(p)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return result


@dataclass
class Scene:
    root: Path
    outside: Path
    tmp: Path
    n: int = 0

    def layer(self, entries: list[E], compression: str = "gz") -> Path:
        self.n += 1
        return make_layer(self.tmp / f"layer{self.n}.tar", entries, compression)

    def apply(self, entries: list[E], compression: str = "gz") -> None:
        apply_layer(self.root, self.layer(entries, compression))


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[Scene]:
    """A root and, beside it, an ``outside`` directory holding a file a hostile layer must not touch.

    After the test, nothing outside the root may have changed (compared with a snapshot taken before).
    """
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "target").write_text("precious")
    layers_dir = tmp_path / "layers"
    layers_dir.mkdir()
    s = Scene(root, outside, layers_dir)
    before = snapshot(tmp_path, exclude=layers_dir)
    before = {k: v for k, v in before.items() if not k.startswith(str(root))}
    yield s
    after = {k: v for k, v in snapshot(tmp_path, exclude=layers_dir).items() if not k.startswith(str(root))}
    assert after == before, "a layer changed something outside the root"
    assert (outside / "target").read_text() == "precious"


@pytest.mark.parametrize(
    ("name", "parts"),
    [
        ("a/b", ["a", "b"]),
        ("./a/./b/", ["a", "b"]),
        ("/etc/passwd", ["etc", "passwd"]),
        ("../x", ["x"]),
        ("../../../../etc/x", ["etc", "x"]),
        ("a/../../b", ["b"]),
        ("a//b", ["a", "b"]),
        ("..", []),
        ("./", []),
        ("a/b/..", ["a"]),
    ],
)
def test_clean_name(name: str, parts: list[str]) -> None:
    assert clean_name(name) == parts


# --- hostile layers -------------------------------------------------------------------------------------------


def test_dot_dot_name_lands_inside_the_root(scene: Scene) -> None:
    scene.apply([E("../x", data=b"1"), E("a/../../../outside/target", data=b"pwned")])
    assert (scene.root / "x").read_bytes() == b"1"
    assert (scene.root / "outside" / "target").read_bytes() == b"pwned"
    assert not (scene.root.parent / "x").exists()


def test_absolute_name_lands_inside_the_root(scene: Scene) -> None:
    name = f"sbx-test-{uuid.uuid4().hex}"
    scene.apply([E(f"/etc/{name}", data=b"1"), E(f"{scene.outside}/new", data=b"2")])
    assert (scene.root / "etc" / name).read_bytes() == b"1"
    assert (scene.root / str(scene.outside).lstrip("/") / "new").read_bytes() == b"2"
    assert not Path("/etc", name).exists()


def test_file_through_a_symlink_to_slash_stays_inside(scene: Scene) -> None:
    name = f"sbx-test-{uuid.uuid4().hex}"
    scene.apply(
        [E("evil", "symlink", link="/"), E(f"evil/etc/{name}", data=b"1"), E("evil/tmp/x", data=b"2")]
    )
    assert os.readlink(scene.root / "evil") == "/"
    assert (scene.root / "etc" / name).read_bytes() == b"1"
    assert not Path("/etc", name).exists()


def test_file_through_a_symlink_to_an_outside_directory_stays_inside(scene: Scene) -> None:
    scene.apply([E("evil", "symlink", link=str(scene.outside)), E("evil/pwned", data=b"x"),
                 E("evil/target", data=b"overwritten")])  # fmt: skip
    inside = scene.root / str(scene.outside).lstrip("/")
    assert (inside / "pwned").read_bytes() == b"x"
    assert (inside / "target").read_bytes() == b"overwritten"
    assert not (scene.outside / "pwned").exists()


def test_symlink_over_two_layers_is_not_followed(scene: Scene) -> None:
    # The symlink comes in one layer, the write through it in the next (a per-layer check would miss it).
    scene.apply([E("up", "symlink", link="../../../../../../..")])
    scene.apply([E("up/tmp/pwned", data=b"x"), E(f"up/{str(scene.outside).lstrip('/')}/target", data=b"y")])
    assert (scene.root / "tmp" / "pwned").read_bytes() == b"x"
    assert (scene.root / str(scene.outside).lstrip("/") / "target").read_bytes() == b"y"


def test_file_entry_replaces_a_symlink_instead_of_writing_through_it(scene: Scene) -> None:
    scene.apply([E("link", "symlink", link=str(scene.outside / "target"))])
    scene.apply([E("link", data=b"new content", mode=0o600)])
    assert not (scene.root / "link").is_symlink()
    assert (scene.root / "link").read_bytes() == b"new content"


def test_dir_entry_replaces_a_symlink_to_outside(scene: Scene) -> None:
    scene.apply([E("d", "symlink", link=str(scene.outside)), E("d", "dir"), E("d/f", data=b"in")])
    assert (scene.root / "d").is_dir() and not (scene.root / "d").is_symlink()
    assert (scene.root / "d" / "f").read_bytes() == b"in"


def test_hard_link_to_a_host_file_is_refused(scene: Scene) -> None:
    host = os.stat("/etc/passwd")
    with pytest.raises(UnpackError, match="not in the image"):
        scene.apply([E("pw", "hardlink", link="/etc/passwd")])
    with pytest.raises(UnpackError, match="not in the image"):
        scene.apply([E("t", "hardlink", link="../outside/target")])
    assert not (scene.root / "pw").exists()
    assert os.stat("/etc/passwd").st_nlink == host.st_nlink


def test_hard_link_through_a_symlink_to_outside_is_refused(scene: Scene) -> None:
    with pytest.raises(UnpackError, match="not in the image"):
        scene.apply([E("s", "symlink", link=str(scene.outside)), E("h", "hardlink", link="s/target")])
    assert os.stat(scene.outside / "target").st_nlink == 1


def test_hard_link_to_the_images_own_file_links_inside(scene: Scene) -> None:
    host = os.stat("/etc/passwd")
    scene.apply([E("etc/passwd", data=b"root:x:0:0::/root:/bin/sh\n")])
    scene.apply([E("pw", "hardlink", link="/etc/passwd"), E("pw2", "hardlink", link="../etc/passwd")])
    inside = os.stat(scene.root / "etc" / "passwd")
    assert os.stat(scene.root / "pw").st_ino == inside.st_ino == os.stat(scene.root / "pw2").st_ino
    assert inside.st_nlink == 3
    assert (host.st_dev, host.st_ino) != (inside.st_dev, inside.st_ino)
    assert os.stat("/etc/passwd").st_nlink == host.st_nlink


def test_hard_link_to_a_directory_is_refused(scene: Scene) -> None:
    with pytest.raises(UnpackError, match="directory"):
        scene.apply([E("d", "dir"), E("h", "hardlink", link="d")])


def test_device_nodes_and_fifos_are_skipped(scene: Scene) -> None:
    layer = scene.layer([E("dev/mem", "chr"), E("dev/sda", "blk"), E("run/fifo", "fifo"), E("ok", data=b"1")])
    stats = apply_layer(scene.root, layer)
    assert stats.skipped_devices == 3
    assert not (scene.root / "dev" / "mem").exists()
    assert not (scene.root / "dev" / "sda").exists()
    assert not (scene.root / "run" / "fifo").exists()
    assert (scene.root / "ok").read_bytes() == b"1"


def test_symlink_loop_is_refused(scene: Scene) -> None:
    with pytest.raises(UnpackError, match="too many symlinks"):
        scene.apply([E("a", "symlink", link="b"), E("b", "symlink", link="a"), E("a/x", data=b"1")])


def test_entry_below_a_regular_file_is_refused(scene: Scene) -> None:
    with pytest.raises(UnpackError, match="not a directory"):
        scene.apply([E("f", data=b"1"), E("f/x", data=b"2")])


def test_whiteout_through_a_symlink_deletes_nothing_outside(scene: Scene) -> None:
    scene.apply([E("s", "symlink", link=str(scene.outside))])
    scene.apply([E("s/.wh.target"), E(".wh.s")])
    assert not (scene.root / "s").is_symlink()


def test_invalid_whiteout_names_are_ignored(scene: Scene) -> None:
    scene.apply([E("d/keep", data=b"1")])
    scene.apply([E("d/.wh.."), E("d/.wh..."), E("d/.wh."), E(".wh..."), E("d/.wh..wh.plnk")])
    assert (scene.root / "d" / "keep").read_bytes() == b"1"


def test_whiteout_of_a_dot_dot_name_stays_inside(scene: Scene) -> None:
    scene.apply([E("../.wh.outside"), E("../../.wh.target")])


def test_corrupt_archive_is_a_clear_error(scene: Scene) -> None:
    good = scene.layer([E("a", data=os.urandom(10000))])
    bad = scene.tmp / "bad.tar.gz"
    bad.write_bytes(good.read_bytes()[:200])
    with pytest.raises(UnpackError, match="not a valid tar archive"):
        apply_layer(scene.root, bad)
    junk = scene.tmp / "junk"
    junk.write_bytes(b"\x1f\x8b" + os.urandom(5000))
    with pytest.raises(UnpackError, match="tar archive"):
        apply_layer(scene.root, junk)


# --- OCI semantics ----------------------------------------------------------------------------------------------


def test_whiteout_of_a_directory(scene: Scene) -> None:
    scene.apply([E("d", "dir"), E("d/a", data=b"1"), E("d/sub/b", data=b"2"), E("keep", data=b"k")])
    scene.apply([E(".wh.d"), E("other", data=b"o")])
    assert not (scene.root / "d").exists()
    assert (scene.root / "keep").read_bytes() == b"k"
    assert (scene.root / "other").read_bytes() == b"o"


def test_whiteout_then_recreate_in_a_later_layer(scene: Scene) -> None:
    scene.apply([E("d/a", data=b"1")])
    scene.apply([E(".wh.d")])
    scene.apply([E("d/b", data=b"2")])
    assert sorted(os.listdir(scene.root / "d")) == ["b"]


def test_whiteout_does_not_hide_an_entry_of_its_own_layer(scene: Scene) -> None:
    scene.apply([E("x", data=b"old")])
    scene.apply([E("x", data=b"new"), E(".wh.x")])
    assert (scene.root / "x").read_bytes() == b"new"


def test_opaque_directory(scene: Scene) -> None:
    scene.apply(
        [E("o/old", data=b"1"), E("o/sub/old2", data=b"2"), E("o/gone/x", data=b"3"), E("p/x", data=b"4")]
    )
    scene.apply([E("o", "dir"), E("o/.wh..wh..opq"), E("o/new", data=b"n"), E("o/sub/new2", data=b"m")])
    assert sorted(os.listdir(scene.root / "o")) == ["new", "sub"]
    assert sorted(os.listdir(scene.root / "o" / "sub")) == ["new2"]
    assert (scene.root / "p" / "x").read_bytes() == b"4"


def test_opaque_marker_after_the_layers_own_entries(scene: Scene) -> None:
    scene.apply([E("o/old", data=b"1"), E("o/sub/old2", data=b"2")])
    scene.apply([E("o/new", data=b"n"), E("o/sub/new2", data=b"m"), E("o/.wh..wh..opq")])
    assert sorted(os.listdir(scene.root / "o")) == ["new", "sub"]
    assert sorted(os.listdir(scene.root / "o" / "sub")) == ["new2"]


def test_later_layer_replaces_kinds(scene: Scene) -> None:
    scene.apply(
        [E("was_dir/x", data=b"1"), E("was_file", data=b"2"), E("was_link", "symlink", link="was_file")]
    )
    scene.apply([E("was_dir", data=b"now a file"), E("was_file", "dir"), E("was_file/y", data=b"3"),
                 E("was_link", "symlink", link="elsewhere")])  # fmt: skip
    assert (scene.root / "was_dir").read_bytes() == b"now a file"
    assert (scene.root / "was_file" / "y").read_bytes() == b"3"
    assert os.readlink(scene.root / "was_link") == "elsewhere"


def test_directories_merge_across_layers(scene: Scene) -> None:
    scene.apply([E("usr", "dir"), E("usr/bin/a", data=b"a")])
    scene.apply([E("usr", "dir", mode=0o750), E("usr/bin/b", data=b"b")])
    assert sorted(os.listdir(scene.root / "usr" / "bin")) == ["a", "b"]
    assert stat.S_IMODE((scene.root / "usr").stat().st_mode) == 0o750


def test_writes_through_a_symlinked_parent_resolve_inside_the_root(scene: Scene) -> None:
    # usrmerge images: /lib -> usr/lib; a later layer may name lib/x.
    scene.apply([E("usr/lib", "dir"), E("lib", "symlink", link="usr/lib")])
    scene.apply([E("lib/libfoo.so", data=b"elf")])
    assert (scene.root / "usr" / "lib" / "libfoo.so").read_bytes() == b"elf"
    assert (scene.root / "lib").is_symlink()


@pytest.mark.skipif(not IS_ROOT, reason="ownership needs root")
def test_metadata_preserved(scene: Scene) -> None:
    scene.apply([
        E("bin/su", data=b"elf", mode=0o4755, uid=0, gid=0, mtime=1_500_000_000),
        E("home/u", "dir", mode=0o700, uid=1234, gid=4321, mtime=1_400_000_000),
        E("home/u/f", data=b"x", mode=0o2640, uid=1234, gid=4321),
        E("tmp", "dir", mode=0o1777),
        E("l", "symlink", link="/bin/su", uid=7, gid=8),
    ])  # fmt: skip
    su = (scene.root / "bin" / "su").stat()
    assert stat.S_IMODE(su.st_mode) == 0o4755 and su.st_mtime == 1_500_000_000
    home = (scene.root / "home" / "u").stat()
    assert (stat.S_IMODE(home.st_mode), home.st_uid, home.st_gid) == (0o700, 1234, 4321)
    assert home.st_mtime == 1_400_000_000, "directory mtime restored after writing into it"
    f = (scene.root / "home" / "u" / "f").stat()
    assert (stat.S_IMODE(f.st_mode), f.st_uid, f.st_gid) == (0o2640, 1234, 4321)
    assert stat.S_IMODE((scene.root / "tmp").stat().st_mode) == 0o1777
    link = (scene.root / "l").lstat()
    assert (link.st_uid, link.st_gid) == (7, 8)


@pytest.mark.parametrize("compression", ["gz", "none", pytest.param("zst", marks=pytest.mark.skipif(
    shutil.which("zstd") is None, reason="needs the zstd program"))])  # fmt: skip
def test_compressions(scene: Scene, compression: str) -> None:
    big = os.urandom(3 << 20)
    layers = [scene.layer([E("a/big", data=big)], compression), scene.layer([E("b", data=b"2")], compression)]
    stats = apply_layers(scene.root, layers)
    assert (scene.root / "a" / "big").read_bytes() == big
    assert [s.files for s in stats] == [1, 1]
    assert stats[0].file_bytes == len(big)


def test_hard_link_in_the_same_layer(scene: Scene) -> None:
    scene.apply([E("a", data=b"x"), E("b", "hardlink", link="a"), E("b", "hardlink", link="a")])
    assert os.stat(scene.root / "a").st_ino == os.stat(scene.root / "b").st_ino


def test_multi_member_gzip(scene: Scene) -> None:
    plain = scene.layer([E("a", data=os.urandom(200_000)), E("b", data=b"2")], "none").read_bytes()
    split = scene.tmp / "multi.tar.gz"
    split.write_bytes(gzip.compress(plain[:70_001]) + gzip.compress(plain[70_001:]))
    apply_layer(scene.root, split)
    assert (scene.root / "a").stat().st_size == 200_000
    assert (scene.root / "b").read_bytes() == b"2"
