"""The node's image store: one directory per installed image, installed atomically.

Layout under ``images_dir`` (``/var/lib/sandboxd/images`` by default, mode 0700)::

    <slug>-<hash>/              one installed image; the name comes from the reference (see image_dir_name)
        image.json              reference, digest, bytes, installed_at, config, annotations, layers
        rootfs/                 the image root, shared read-only by every sandbox started from it
        usr.erofs, usr.erofs.lock  the gVisor backend's EROFS image of rootfs/usr, once built (not counted in
                                ``bytes``, which is the root's; sbx.backends.usr_erofs), removed with the image
                                (and counted in what its removal frees)
    .tmp-<slug>-<hash>-<rand>/  an install in progress (or left by a killed one): never listed
    .trash-<slug>-<hash>-<rand>/ an image being removed or replaced: never listed
    .locks/<slug>-<hash>.lock   flock held while an image is installed or removed
    blobs/sha256/<hex>          pulled layers, shared by the images that record them (sbx.images.blobs)

An image appears under its final name only through one ``rename`` of a complete directory (rootfs built,
flushed to disk, image.json written), so a kill or power loss at any moment never leaves a half image listed.
Leftover ``.tmp-``/``.trash-`` directories are ignored by :meth:`ImageStore.list` and deleted by
:meth:`ImageStore.clean_leftovers` once nobody holds their reference's lock (flock is released when the
process holding it dies, so a killed installer's leftovers become removable at once).

Every image root holds the mount points a sandbox needs (see :data:`MOUNT_POINT_DIRS`), created at install
time when the image lacks them, so the per-sandbox writable layer only has to add them for images installed
by something else. Nothing writes into an installed ``rootfs/``: sandboxes write to their own layer.

The methods block (file I/O, flock, a build callable); call them through ``asyncio.to_thread`` from async
code.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sbx.api.errors import Conflict, Internal, InvalidRequest, NotFound, SandboxError
from sbx.statefile import fsync_dir, write_json_atomic

log = logging.getLogger(__name__)

#: Version of the image.json layout; a reader refuses a newer one rather than misread it.
IMAGE_JSON_FORMAT = 1

#: Longest reference the store accepts, in characters (OCI references are far shorter in practice).
MAX_REFERENCE_CHARS = 1024

#: uid and gid of the sandbox user; it owns ``/sandbox/home`` in every image root.
SANDBOX_UID = 1000
SANDBOX_GID = 1000

#: Directories every image root must have, with the mode they get when created: the agent's control
#: directory (``/.sbx/ctl``), the sandbox user's home, and the mount points of proc, dev, sys and tmp.
MOUNT_POINT_DIRS: dict[str, int] = {
    ".sbx": 0o755,
    ".sbx/ctl": 0o700,
    "sandbox": 0o755,
    "sandbox/home": 0o755,
    "proc": 0o555,
    "dev": 0o755,
    "sys": 0o555,
    "tmp": 0o1777,
}
#: Empty files every image root must have: the agent binary is bind-mounted onto ``/.sbx/agent``.
MOUNT_POINT_FILES: dict[str, int] = {".sbx/agent": 0o755}

_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_LOCK_DIR = ".locks"
_IMAGE_JSON = "image.json"
_ROOTFS = "rootfs"
_SLUG_CHARS = 40


@dataclass(frozen=True)
class ImageConfig:
    """How to run processes from an image, as an OCI image config states it (all optional).

    ``env`` is merged under each sandbox's own environment; ``user`` is ``"uid[:gid]"`` or a name;
    ``working_dir`` is an absolute guest path.
    """

    env: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    user: str | None = None
    entrypoint: tuple[str, ...] | None = None
    cmd: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``config`` object of image.json."""
        return {
            "env": dict(self.env),
            "working_dir": self.working_dir,
            "user": self.user,
            "entrypoint": None if self.entrypoint is None else list(self.entrypoint),
            "cmd": None if self.cmd is None else list(self.cmd),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ImageConfig:
        """Inverse of :meth:`to_json`; missing keys take their defaults."""
        entrypoint = obj.get("entrypoint")
        cmd = obj.get("cmd")
        return cls(
            env={str(k): str(v) for k, v in (obj.get("env") or {}).items()},
            working_dir=obj.get("working_dir"),
            user=obj.get("user"),
            entrypoint=None if entrypoint is None else tuple(str(a) for a in entrypoint),
            cmd=None if cmd is None else tuple(str(a) for a in cmd),
        )


@dataclass(frozen=True)
class InstalledImage:
    """One installed image as image.json records it.

    ``bytes`` is the disk space of its root (``du``: allocated blocks, hard links counted once);
    ``digest`` is ``sha256:<hex>``, either the registry's manifest digest or :func:`tree_digest` of the root;
    ``installed_at`` is UTC; ``path`` is the image's directory; ``layers`` are the digests of the blobs
    (:mod:`sbx.images.blobs`) the root was unpacked from, kept while an installed image records them.
    """

    reference: str
    digest: str
    bytes: int
    installed_at: datetime
    config: ImageConfig
    annotations: dict[str, str]
    path: Path
    layers: tuple[str, ...] = ()

    @property
    def rootfs(self) -> Path:
        """The read-only image root sandboxes start from."""
        return self.path / _ROOTFS

    def to_json(self) -> dict[str, Any]:
        """The contents of image.json."""
        return {
            "format": IMAGE_JSON_FORMAT,
            "reference": self.reference,
            "digest": self.digest,
            "bytes": self.bytes,
            "installed_at": self.installed_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "config": self.config.to_json(),
            "annotations": dict(self.annotations),
            "layers": list(self.layers),
        }


def image_dir_name(reference: str) -> str:
    """The directory name of ``reference``: a readable slug plus a hash of the whole reference.

    The slug keeps ``[A-Za-z0-9._-]`` (anything else becomes ``_``) and at most 40 characters, never starting
    with a dot (hidden names are the store's own); the 16 hex digits of SHA-256 make distinct references map
    to distinct names whatever their characters or case, e.g. ``docker.io/library/python:3.12`` gives
    ``docker.io_library_python_3.12-<16 hex>``.
    """
    _check_reference(reference)
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", reference)[:_SLUG_CHARS].lstrip(".") or "image"
    digest = hashlib.sha256(reference.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{slug}-{digest}"


def _check_reference(reference: str) -> None:
    if not isinstance(reference, str) or not reference:
        raise InvalidRequest("an image reference must be a non-empty string")
    if len(reference) > MAX_REFERENCE_CHARS:
        raise InvalidRequest(f"an image reference must be at most {MAX_REFERENCE_CHARS} characters")
    if "\x00" in reference:
        raise InvalidRequest("an image reference must not contain NUL")


class ImageStore:
    """Installed images under one directory; safe to use from several threads and processes at once."""

    def __init__(self, images_dir: Path) -> None:
        self.images_dir = Path(images_dir)

    # --- reading ---------------------------------------------------------------------------------------

    def list(self) -> list[InstalledImage]:
        """Every installed image, sorted by reference; installs in progress and leftovers are not listed.

        A directory whose image.json is unreadable is skipped with a warning in the log.
        """
        images: list[InstalledImage] = []
        try:
            entries = sorted(os.scandir(self.images_dir), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        for entry in entries:
            if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                image = self._read(Path(entry.path))
                if image is not None and image_dir_name(image.reference) == entry.name:
                    images.append(image)
            except SandboxError as exc:
                log.warning("skipping image directory %s: %s", entry.path, exc.message)
        return sorted(images, key=lambda i: i.reference)

    def get(self, reference: str) -> InstalledImage | None:
        """The installed image ``reference``, or None when it is not installed.

        Raises Internal when its image.json exists but cannot be read (the message says which file).
        """
        image = self._read(self.images_dir / image_dir_name(reference))
        if image is not None and image.reference != reference:
            raise Internal(f"{image.path} holds image {image.reference!r}, not {reference!r}; remove it")
        return image

    def _read(self, directory: Path) -> InstalledImage | None:
        path = directory / _IMAGE_JSON
        try:
            obj = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise Internal(f"cannot read {path}: {exc}; remove {directory} and install again") from exc
        try:
            if obj.get("format", 1) > IMAGE_JSON_FORMAT:
                raise ValueError(f"format {obj['format']} is newer than this sandboxd understands")
            return InstalledImage(
                reference=str(obj["reference"]),
                digest=str(obj["digest"]),
                bytes=int(obj["bytes"]),
                installed_at=datetime.strptime(obj["installed_at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC),
                config=ImageConfig.from_json(obj.get("config") or {}),
                annotations={str(k): str(v) for k, v in (obj.get("annotations") or {}).items()},
                path=directory,
                layers=tuple(str(d) for d in obj.get("layers") or ()),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise Internal(f"{path} is not a valid image record ({exc}); remove {directory}") from exc

    # --- changing ----------------------------------------------------------------------------------------

    def install_rootfs(
        self,
        reference: str,
        build: Callable[[Path], None],
        *,
        config: ImageConfig | None = None,
        digest: str | None = None,
        annotations: dict[str, str] | None = None,
        replace: bool = False,
        layers: Sequence[str] = (),
    ) -> InstalledImage:
        """Build an image root with ``build`` and install it as ``reference``.

        ``build(rootfs)`` fills the existing empty directory ``rootfs`` (inside a temporary directory in
        images_dir, so the final rename never crosses file systems). Then the store adds missing mount
        points, flushes the file system, measures the size, computes ``digest`` when None (see
        :func:`tree_digest`), writes image.json and renames the whole directory into place.

        An image already installed as ``reference`` raises Conflict, unless ``replace`` is true: then the
        new one takes its place in one atomic exchange and the old directory is deleted (sandboxes still
        running from it must have been stopped by the caller). Concurrent installs of one reference wait
        for each other. If ``build`` raises, its exception propagates and nothing is left behind.
        ``layers`` (blob digests) is recorded in image.json so unused layers can be collected later.
        """
        image_dir = self.images_dir / image_dir_name(reference)
        self._make_images_dir()
        with self._locked(image_dir.name, blocking=True):
            self._clean_leftovers_of(image_dir.name)
            try:
                installed = self._read(image_dir) is not None
            except Internal as exc:
                # A damaged directory is not an image: the new one replaces it.
                log.warning("replacing damaged image directory: %s", exc.message)
                installed = False
            if installed and not replace:
                raise Conflict(f"image {reference!r} is already installed; remove it first")
            tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{image_dir.name}-", dir=self.images_dir))
            try:
                rootfs = tmp / _ROOTFS
                rootfs.mkdir(mode=0o755)
                build(rootfs)
                ensure_mount_points(rootfs)
                _syncfs(tmp)
                image = InstalledImage(
                    reference=reference,
                    digest=digest or tree_digest(rootfs),
                    bytes=disk_usage_bytes(rootfs),
                    installed_at=datetime.now(UTC).replace(microsecond=0),
                    config=config or ImageConfig(),
                    annotations=dict(annotations or {}),
                    path=image_dir,
                    layers=tuple(layers),
                )
                write_json_atomic(tmp / _IMAGE_JSON, image.to_json())
                if image_dir.exists():
                    _exchange(tmp, image_dir)  # tmp now holds the old image
                else:
                    os.rename(tmp, image_dir)
                fsync_dir(self.images_dir)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        log.info("installed image %s (%s, %d bytes) in %s", reference, image.digest, image.bytes, image_dir)
        return image

    def remove(self, reference: str) -> int:
        """Delete the installed image ``reference``; returns the bytes it held: its root's (as recorded; 0 if
        damaged) and what backends built beside it (:func:`derived_bytes`).

        It disappears from listings at once (one rename), then its files are deleted. Raises NotFound when
        it is not installed. Whether a sandbox still uses it is the caller's check.
        """
        image_dir = self.images_dir / image_dir_name(reference)
        with self._locked(image_dir.name, blocking=True):
            try:
                image = self.get(reference)
                freed = 0 if image is None else image.bytes
            except Internal as exc:
                log.warning("removing damaged image directory: %s", exc.message)
                freed = 0
            if not image_dir.is_dir():
                raise NotFound(f"image {reference!r} is not installed")
            freed += derived_bytes(image_dir)
            trash = Path(tempfile.mkdtemp(prefix=f"{_TRASH_PREFIX}{image_dir.name}-", dir=self.images_dir))
            os.rename(image_dir, trash / "image")
            fsync_dir(self.images_dir)
            shutil.rmtree(trash, ignore_errors=True)
        log.info("removed image %s (%d bytes)", reference, freed)
        return freed

    def clean_leftovers(self) -> int:
        """Delete the temporary directories of installs and removals whose process is gone.

        Returns how many were deleted; those of an install still running in any process are kept. Call it
        at startup; :meth:`install_rootfs` also cleans its own reference's leftovers.
        """
        if not self.images_dir.is_dir():
            return 0
        names = {_owner_of(entry) for entry in os.listdir(self.images_dir)}
        removed = 0
        for name in sorted(n for n in names if n is not None):
            with self._locked(name, blocking=False) as acquired:
                if acquired:
                    removed += self._clean_leftovers_of(name)
        return removed

    def _clean_leftovers_of(self, dir_name: str) -> int:
        """Delete the leftovers of ``dir_name``; the caller holds its lock."""
        removed = 0
        for entry in os.listdir(self.images_dir):
            if _owner_of(entry) == dir_name:
                log.info("deleting leftover %s", self.images_dir / entry)
                shutil.rmtree(self.images_dir / entry, ignore_errors=True)
                removed += 1
        return removed

    def _make_images_dir(self) -> None:
        # 0700: image roots hold /sandbox/home owned by uid 1000, which must not be writable by a host user
        # who happens to have that uid.
        self.images_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        (self.images_dir / _LOCK_DIR).mkdir(mode=0o700, exist_ok=True)

    @contextmanager
    def _locked(self, dir_name: str, *, blocking: bool) -> Iterator[bool]:
        """Hold the flock of one image directory name; yields False if ``blocking`` is false and it is held."""
        self._make_images_dir()
        fd = os.open(self.images_dir / _LOCK_DIR / f"{dir_name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)


# A leftover is ``.tmp-<image dir name>-<mkdtemp's 8 random characters>[-old]``; the image directory name ends
# in 16 hex digits, which the random part (8 characters) can never look like.
_LEFTOVER = re.compile(r"^\.(?:tmp|trash)-(.+-[0-9a-f]{16})-")


def _owner_of(entry: str) -> str | None:
    """The image directory name a ``.tmp-``/``.trash-`` entry belongs to, or None for anything else."""
    match = _LEFTOVER.match(entry)
    return match.group(1) if match else None


# --- image roots ---------------------------------------------------------------------------------------------


def ensure_mount_points(rootfs: Path) -> None:
    """Create the mount points of :data:`MOUNT_POINT_DIRS` and :data:`MOUNT_POINT_FILES` that ``rootfs`` lacks.

    Existing ones are left as they are. Never follows a symlink inside the image (an image could point
    ``/sandbox`` at a host directory): a path that exists as anything but a directory (or, for files, a
    regular file) raises InvalidRequest naming it. ``/sandbox/home`` is created owned by the sandbox user
    when running as root.
    """
    root_fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for rel, mode in MOUNT_POINT_DIRS.items():
            owner = (SANDBOX_UID, SANDBOX_GID) if rel == "sandbox/home" else (0, 0)
            os.close(_open_dir(root_fd, rel, mode, owner))
        for rel, mode in MOUNT_POINT_FILES.items():
            parent, name = rel.rsplit("/", 1)
            parent_fd = _open_dir(root_fd, parent, 0o755, (0, 0))
            try:
                try:
                    fd = os.open(
                        name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=parent_fd
                    )
                    os.fchmod(fd, mode)
                    os.close(fd)
                except FileExistsError:
                    st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                    if not stat.S_ISREG(st.st_mode):
                        raise InvalidRequest(
                            f"the image has /{rel} as something other than a regular file; sandboxes mount "
                            "the agent there"
                        ) from None
            finally:
                os.close(parent_fd)
    finally:
        os.close(root_fd)


def _open_dir(root_fd: int, rel: str, mode: int, owner: tuple[int, int]) -> int:
    """Open (creating when missing, with ``mode`` and ``owner``) the directory ``rel`` below ``root_fd``."""
    fd = os.dup(root_fd)
    try:
        names = rel.split("/")
        for index, name in enumerate(names):
            created = False
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
                created = True
            except FileExistsError:
                pass
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise InvalidRequest(
                        f"the image has /{rel} (or a parent) as a symlink or file; sandboxes need a directory "
                        "there"
                    ) from None
                raise
            os.close(fd)
            fd = child
            if created:
                # chmod after mkdir: mkdir's mode is filtered by the umask, and 1777 needs the sticky bit.
                is_last = index == len(names) - 1
                os.fchmod(fd, mode if is_last else 0o755)
                if is_last and os.geteuid() == 0:
                    os.fchown(fd, *owner)
        return fd
    except BaseException:
        os.close(fd)
        raise


def derived_bytes(image_dir: Path) -> int:
    """Allocated bytes of the files a backend built beside an image's root from it (``usr.erofs``): every
    regular file directly in ``image_dir`` but image.json, which go with the image."""
    total = 0
    for entry in image_dir.iterdir():
        st = entry.lstat()
        if stat.S_ISREG(st.st_mode) and entry.name != _IMAGE_JSON:
            total += st.st_blocks * 512
    return total


def disk_usage_bytes(path: Path) -> int:
    """Disk space used by ``path`` and everything below it, in bytes, as ``du -s -B1`` counts it.

    Allocated blocks, hard-linked files counted once, symlinks not followed.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for entry_path, st in _walk(path):
        del entry_path
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
        total += st.st_blocks * 512
    return total


def tree_digest(root: Path) -> str:
    """``sha256:<hex>`` of the content of the tree ``root``, independent of timestamps and disk layout.

    Hashes, for every entry sorted by path: its relative path, type, permission bits, uid, gid, and the
    SHA-256 of a file's content, a symlink's target or a device's number. Two roots with equal digests hold
    the same files; rebuilding an image from the same recipe usually gives a new digest (debootstrap writes
    logs and generated keys).
    """
    outer = hashlib.sha256()
    entries = sorted(_walk(root), key=lambda item: os.fsencode(item[0]))
    for full, st in entries:
        rel = os.fsencode(os.path.relpath(full, root))
        kind = stat.S_IFMT(st.st_mode)
        if stat.S_ISREG(kind):
            payload = _file_sha256(full)
        elif stat.S_ISLNK(kind):
            payload = hashlib.sha256(os.fsencode(os.readlink(full))).hexdigest()
        elif stat.S_ISCHR(kind) or stat.S_ISBLK(kind):
            payload = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        else:
            payload = ""
        line = b"%s\0%o\0%o\0%d\0%d\0%s\n" % (
            rel,
            kind,
            stat.S_IMODE(st.st_mode),
            st.st_uid,
            st.st_gid,
            payload.encode(),
        )
        outer.update(line)
    return f"sha256:{outer.hexdigest()}"


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _walk(root: Path) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry below ``root`` (``root`` included) with its lstat, never following symlinks."""
    stack = [os.fspath(root)]
    yield stack[0], os.lstat(stack[0])
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                yield entry.path, st
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)


# --- durable file-system operations --------------------------------------------------------------------------


_libc: ctypes.CDLL | None = None


def _get_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _syncfs(path: Path) -> None:
    """Flush the file system holding ``path`` (a built root has thousands of files; fsync each is slower)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _get_libc().syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> None:
    """Swap two directories in one atomic step (renameat2 RENAME_EXCHANGE).

    Falls back to two renames where the file system lacks it; a kill between them leaves ``b`` absent (never
    half there), and ``a``'s directory is then a leftover cleaned later.
    """
    rc = _get_libc().renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        raise OSError(err, os.strerror(err), str(b))
    parked = a.parent / f"{a.name}-old"
    os.rename(b, parked)
    os.rename(a, b)
    os.rename(parked, a)
