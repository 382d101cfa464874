"""Applying gVisor's tar of a sandbox's root overlay onto a copy of its ext4 layer (disk snapshots).

``runsc tar rootfs-upper`` writes the upper layer of the sentry's own root overlay (root_overlay.py): what the
guest changed on top of our layer. A disk snapshot of such a sandbox is a copy of our layer's image with that
tar applied onto its ``upper/`` directory, so that Linux overlayfs over the image root shows exactly what the
guest saw. The tar speaks overlay too, and is applied with overlayfs upper-directory rules:

- a whiteout (a character device 0:0) hides what lies below: what our layer has there goes and an overlayfs
  whiteout takes its place;
- an opaque directory (pax xattr ``trusted.overlay.opaque=y``) hides what was below it: what our layer had in
  it goes, and it is marked opaque; so is a directory that replaces a file or whiteout of ours, which hid the
  image's directory from the guest;
- any other entry replaces what our layer has at its name; a plain directory merges with ours.

The tar is written from inside the sandbox, whose kernel may be hostile, and this runs as root on the host:
nothing outside ``upper`` is read, written, created, chowned or deleted, whatever the tar says. Names that are
absolute, hold ``..``, ``.``, an empty component or a NUL are refused, as are entry types a layer cannot hold
and overlayfs xattrs other than opaque (they steer the host kernel's overlayfs). Every path is walked one
component at a time from a descriptor of ``upper``, each opened with O_NOFOLLOW, and every change is made
relative to its parent's descriptor without following a symlink, so a symlink (the tar's, or one already in
the layer) is replaced but never gone through. Device nodes are made, never opened.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tarfile
from pathlib import Path
from typing import IO

from sbx.backends.base import BackendError

CHUNK_BYTES = 1024 * 1024
_OPAQUE = "trusted.overlay.opaque"
_XATTR = "SCHILY.xattr."
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# GNU sparse files are regular ones: tarfile reads them back with their holes as zeros.
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.GNUTYPE_SPARSE)
_NODES = {tarfile.FIFOTYPE: stat.S_IFIFO, tarfile.CHRTYPE: stat.S_IFCHR, tarfile.BLKTYPE: stat.S_IFBLK}
_KNOWN = {tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, *_REGULAR, *_NODES}
_Xattrs = dict[str, bytes]
_BAD_PARTS = {"": "an empty component", ".": "a '.' component", "..": "a '..' component"}


class UpperTarError(BackendError):
    """The sandbox's tar of its root overlay is malformed or hostile, or applying it failed."""


def _refused(entry: str, what: str) -> UpperTarError:
    return UpperTarError(f"entry {entry!r} of the sandbox's tar is refused: {what}")


def _parts(name: str, entry: str) -> tuple[str, ...]:
    """The components of ``name`` (an entry's or a hard link's target) under ``upper``; () is ``upper``."""
    if "\0" in name:
        raise _refused(entry, f"{name!r} holds a NUL byte")
    if name.startswith("/"):
        raise _refused(entry, f"{name!r} is absolute; names must be relative")
    parts = name.split("/")
    if parts[0] == ".":
        parts = parts[1:]  # "./a" as runsc writes, or "." for the root itself
    for part in parts:
        if part in _BAD_PARTS:
            raise _refused(entry, f"{name!r} has {_BAD_PARTS[part]}")
    return tuple(parts)


def _open_dir(parent_fd: int, name: str, where: str, entry: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refused(entry, f"./{where} is a symlink or a file, never gone through") from exc
        if exc.errno == errno.ENOENT:
            raise _refused(entry, f"./{where} does not exist (list directories first)") from exc
        raise


class _Dirs:
    """Descriptors of one directory path under ``upper`` and each of its ancestors, kept open: entries come
    parents first, so the next entry's directory is mostly the last one's or a child of it."""

    def __init__(self, root_fd: int) -> None:
        self._fds = [root_fd]
        self._names: list[str] = []

    def open(self, parts: tuple[str, ...], entry: str) -> int:
        """A descriptor of the directory ``parts`` (owned by this stack: not to be closed)."""
        common = 0
        while common < min(len(parts), len(self._names)) and parts[common] == self._names[common]:
            common += 1
        self._truncate(common)
        for name in parts[common:]:
            self._fds.append(_open_dir(self._fds[-1], name, "/".join([*self._names, name]), entry))
            self._names.append(name)
        return self._fds[-1]

    def forget(self, parts: tuple[str, ...]) -> None:
        """Drop descriptors at or under ``parts``, which an entry may just have replaced or emptied."""
        if tuple(self._names[: len(parts)]) == parts:
            self._truncate(max(len(parts) - 1, 0))

    def _truncate(self, depth: int) -> None:
        while len(self._names) > depth:
            os.close(self._fds.pop())
            self._names.pop()


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _remove(parent_fd: int, name: str) -> None:
    """Remove whatever is at ``name`` (a directory with all under it), never following a symlink."""
    st = _lstat(parent_fd, name)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=parent_fd)  # fd-based: checked at the start of apply_upper_tar
    else:
        os.unlink(name, dir_fd=parent_fd)


def _empty(dir_fd: int) -> None:
    for name in os.listdir(dir_fd):
        _remove(dir_fd, name)


def _xattrs(member: tarfile.TarInfo) -> tuple[bool, _Xattrs]:
    """Whether ``member`` is an opaque directory, and its other xattrs."""
    opaque, others = False, {}
    for key, value in member.pax_headers.items():
        if not key.startswith(_XATTR):
            continue
        name = key.removeprefix(_XATTR)
        if name == _OPAQUE and value == "y" and member.isdir():
            opaque = True
        elif name.startswith("trusted.overlay."):
            raise _refused(
                member.name, f"{name}={value!r}: the one overlayfs xattr taken is {_OPAQUE}=y on a dir"
            )
        else:
            others[name] = value.encode("utf-8", "surrogateescape")  # how tarfile decoded binary values
    return opaque, others


def _set_attrs(fd: int, member: tarfile.TarInfo, xattrs: _Xattrs) -> None:
    os.fchown(fd, member.uid, member.gid)
    os.fchmod(fd, member.mode & 0o7777)  # after the chown, which clears setuid and setgid bits
    for name, value in xattrs.items():
        os.setxattr(fd, name, value)  # after the chown, which clears security.capability


def _write(fd: int, source: IO[bytes]) -> None:
    """Copy ``source`` into ``fd`` in chunks; chunks of zeros are left as holes (a sparse file in the guest
    comes as zeros and would otherwise fill the snapshot's disk)."""
    offset = 0
    while chunk := source.read(CHUNK_BYTES):
        if chunk.count(0) != len(chunk):
            view = memoryview(chunk)
            while view:
                written = os.pwrite(fd, view, offset + len(chunk) - len(view))
                view = view[written:]
        offset += len(chunk)
    os.ftruncate(fd, offset)


class _Applier:
    def __init__(self, tar: tarfile.TarFile, root_fd: int) -> None:
        self.tar, self.root_fd = tar, root_fd
        self.dirs, self.link_dirs = _Dirs(root_fd), _Dirs(root_fd)
        #: Directories and their mtimes, set last: what is written in a directory changes its mtime.
        self.dir_times: list[tuple[tuple[str, ...], float]] = []

    def entry(self, member: tarfile.TarInfo) -> None:
        name = member.name
        if member.type not in _KNOWN:
            kind = member.type.decode(errors="replace")
            raise _refused(name, f"type {kind!r} is not one a layer holds (files, dirs, links, devices)")
        parts = _parts(name, name)
        opaque, xattrs = _xattrs(member)
        if not parts and not member.isdir():
            raise _refused(name, "the root must be a directory")
        try:
            if not parts:
                self._dir_attrs(self.root_fd, member, opaque, opaque, xattrs)
                self.dir_times.append(((), member.mtime))
            else:
                self._child(self.dirs.open(parts[:-1], name), parts, member, opaque, xattrs)
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise UpperTarError(f"cannot apply entry {name!r} of the sandbox's tar: {reason}") from exc
        for stack in (self.dirs, self.link_dirs):
            stack.forget(parts)

    def _child(
        self, parent: int, parts: tuple[str, ...], member: tarfile.TarInfo, opaque: bool, xattrs: _Xattrs
    ) -> None:
        leaf, times = parts[-1], (member.mtime, member.mtime)
        if member.ischr() and member.devmajor == 0 and member.devminor == 0:
            _remove(parent, leaf)
            os.mknod(leaf, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=parent)
        elif member.isdir():
            st = _lstat(parent, leaf)
            existed = st is not None and stat.S_ISDIR(st.st_mode)
            # A file or whiteout of ours hid the image's directory from the guest: the new one must too.
            replaced = st is not None and not existed
            if replaced:
                os.unlink(leaf, dir_fd=parent)
            if not existed:
                os.mkdir(leaf, 0o700, dir_fd=parent)
            fd = os.open(leaf, _DIR_FLAGS, dir_fd=parent)
            try:
                self._dir_attrs(fd, member, opaque or replaced, opaque and existed, xattrs)
            finally:
                os.close(fd)
            self.dir_times.append((parts, member.mtime))
        elif member.type in _REGULAR:
            _remove(parent, leaf)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(leaf, flags, 0o600, dir_fd=parent)
            try:
                source = self.tar.extractfile(member)
                assert source is not None  # always a file for a regular entry
                with source:
                    _write(fd, source)
                _set_attrs(fd, member, xattrs)
                os.utime(fd, times)
            finally:
                os.close(fd)
        elif member.issym():
            _remove(parent, leaf)
            os.symlink(member.linkname, leaf, dir_fd=parent)  # verbatim: the guest resolves it, we never do
            os.chown(leaf, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)
            os.utime(leaf, times, dir_fd=parent, follow_symlinks=False)
        elif member.islnk():
            target = _parts(member.linkname, member.name)
            if not target:
                raise _refused(member.name, "a hard link to the root")
            source_dir = self.link_dirs.open(target[:-1], member.name)
            _remove(parent, leaf)
            os.link(target[-1], leaf, src_dir_fd=source_dir, dst_dir_fd=parent, follow_symlinks=False)
        else:  # a fifo or a device: made, never opened
            _remove(parent, leaf)
            device = os.makedev(member.devmajor, member.devminor)
            os.mknod(leaf, _NODES[member.type] | 0o600, device, dir_fd=parent)
            os.chown(leaf, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)
            # Would follow a symlink (os.chmod cannot take dir_fd and not follow), but mknod just made the
            # name, and nothing else writes in this copy.
            os.chmod(leaf, member.mode & 0o7777, dir_fd=parent)
            os.utime(leaf, times, dir_fd=parent, follow_symlinks=False)

    @staticmethod
    def _dir_attrs(fd: int, member: tarfile.TarInfo, opaque: bool, empty: bool, xattrs: _Xattrs) -> None:
        if empty:
            _empty(fd)  # what our layer had in it is hidden by the guest's opaque directory
        _set_attrs(fd, member, xattrs)
        if opaque:
            os.setxattr(fd, _OPAQUE, b"y")

    def set_dir_times(self) -> None:
        for parts, mtime in self.dir_times:
            try:
                os.utime(self.dirs.open(parts, "/".join(parts) or "."), (mtime, mtime))
            except OSError as exc:
                raise UpperTarError(f"cannot set the mtime of ./{'/'.join(parts)}: {exc.strerror}") from exc

    def close(self) -> None:
        for stack in (self.dirs, self.link_dirs):
            stack.forget(())


def _check_end(tar_path: Path, offset: int) -> None:
    """tarfile ends quietly at a header it cannot read: what follows the last entry must be zeros (the end
    marker and padding), else the tar was cut short or is not one tar."""
    with open(tar_path, "rb") as f:
        f.seek(offset)
        while chunk := f.read(CHUNK_BYTES):
            if chunk.count(0) != len(chunk):
                raise UpperTarError(
                    f"the sandbox's tar {tar_path} has data past its last readable entry (at byte {offset}): "
                    "it was cut short or is corrupt"
                )


def apply_upper_tar(tar_path: Path, upper: Path) -> None:
    """Apply the tar ``tar_path`` of ``runsc tar rootfs-upper`` onto the overlayfs upper directory ``upper``
    (of a copy of a layer, mounted alone), with overlayfs rules, never touching anything outside ``upper``.

    Raises UpperTarError (naming the entry and what is wrong with it) for a tar that is malformed or tries to
    leave ``upper``, and for any failure to apply it; ``upper`` is then left half-done, so the caller discards
    the copy. Synchronous (streams file contents in chunks of CHUNK_BYTES): run it in a thread.
    """
    if not shutil.rmtree.avoids_symlink_attacks:
        raise UpperTarError("this host's Python cannot remove directories without following symlinks")
    try:
        root_fd = os.open(upper, _DIR_FLAGS)
    except OSError as exc:
        raise UpperTarError(f"cannot open the layer's upper directory {upper}: {exc.strerror}") from exc
    try:
        with tarfile.open(tar_path, "r:") as tar:
            applier = _Applier(tar, root_fd)
            try:
                while (member := tar.next()) is not None:
                    applier.entry(member)
                    # tarfile keeps every header it read (an attribute typeshed does not declare), and a layer
                    # can hold millions of files.
                    tar.members.clear()  # type: ignore[attr-defined]
                applier.set_dir_times()
            finally:
                applier.close()
            _check_end(tar_path, tar.offset)
    except tarfile.TarError as exc:
        raise UpperTarError(f"the sandbox's tar {tar_path} cannot be read: {exc}") from exc
    except OSError as exc:
        raise UpperTarError(f"the sandbox's tar {tar_path} cannot be read: {exc.strerror or exc}") from exc
    finally:
        os.close(root_fd)
