"""The installed runsc: its release, the flags it knows, and the platform sandboxes run on.

sandboxd reads these once at start (:func:`inspect_runsc`, :func:`choose_platform`) and builds every runsc
command line and OCI spec from them, so that one sandboxd runs correctly on the runsc ``scripts/install.sh``
builds from gVisor's Go module (:data:`DEFAULT_RUNSC`, the version ``runsc/go.mod`` pins) and on older ones
(Debian 12's 20221219, bookworm-backports' 20240729), and says what an older one cannot do instead of failing
in ways a user only notices later (docs/backends.md, "runsc releases").

The platform: ``systrap`` (gVisor's default since release 20230621; system calls trapped with seccomp, a
few microseconds each) when this runsc has it and a probe sandbox boots on it here, else ``ptrace`` (every
system call is a ptrace stop: 2.5 to 6.5 times slower for syscall-bound work, measured in docs/benchmarks.md).
The probe boots the agent binary alone (``sbx-agent --version``) in an empty root: about 150 ms.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from sbx.backends.base import BackendError
from sbx.backends.layers import detach_all

log = logging.getLogger(__name__)

#: The runsc sandboxd runs unless ``[paths] runsc`` names another: the one scripts/install.sh builds (a link to
#: ``/var/lib/sandboxd/runsc/<version>/runsc``).
DEFAULT_RUNSC: Final = "/var/lib/sandboxd/runsc/runsc"
#: The oldest runsc release sandboxd has been tested with (Debian 12's own); older ones are refused.
MIN_RELEASE: Final = 20221219
#: The release scripts/install.sh builds (the ``// release:`` line of runsc/go.mod), and every later one.
RECOMMENDED_RELEASE: Final = 20260803
#: Releases before this refuse ``--network=sandbox`` when /proc/sys/net/core/rmem_default exists (their
#: test for "still in the host's network namespace", wrong on current kernels); upstream commit 19f6b0c07.
NETNS_CHECK_FIXED_RELEASE: Final = 20240807
#: Releases before this fail statx(2) with AT_NO_AUTOMOUNT (EINVAL), which coreutils passes: ``ls -l``,
#: ``stat`` and ``du`` fail (upstream commits 7a0c4b574 and 2df63d779, the second in release 20231030).
STATX_FIXED_RELEASE: Final = 20231030
#: Releases before this ignore ^D (VEOF) on terminals in canonical mode: ``cat`` on a tty never sees its end
#: of input (upstream commit e8c399a09).
VEOF_FIXED_RELEASE: Final = 20230911
#: From this release systrap's syscall threads wait for the sentry through seccomp user notifications (upstream
#: commit 14c05c175, which made ``seccompNotifyIsSupported`` true). Freezing the sandbox's cgroup interrupts that
#: wait; the kernel withdraws the notification and gVisor's ``waitForSeccompNotify`` takes the ENOENT that follows
#: as a dead stub (only a withdrawn *reply* is retried, commit 4a8eae08b): the guest's next process after a thaw
#: is killed (SIGSEGV or SIGKILL, "subprocess died"), measured here on the pinned release in 5 of 6 runs of
#: tests/integration/test_parking.py. Its idle sandboxes use no CPU without freezing (the sentry parks itself,
#: commits 32f98f20c and 88285dd6b), so sandboxd does not park them (docs/backends.md).
FREEZER_UNSAFE_ON_SYSTRAP_RELEASE: Final = 20250625
#: The first release an EROFS mount inside the root (the image's /usr, usr_erofs.py) is used with: the one it was
#: measured and tested on. Debian's 20240729 boots with such a mount, but ``find /usr`` took 1.8 s there in one
#: run on a busy host (not the 0.3-0.4 s of the pinned release), so older releases keep the host's /usr.
EROFS_MOUNT_RELEASE: Final = 20260803
#: From this release ``--overlay2=root:dir=...,size=N`` limits gVisor's own root overlay to N bytes (statfs
#: reports it, a write past it is ENOSPC; upstream 32c91c391, b14059d71) and ``runsc tar rootfs-upper`` exists
#: (8b9497569, release 20250721): what an ephemeral sandbox's root overlay needs (root_overlay.py).
SIZED_OVERLAY_RELEASE: Final = 20250721
#: The patch of runsc/patches/ after which ``runsc tar rootfs-upper`` reads each file in chunks of 1 MiB: gVisor
#: itself reads each one whole into the sentry's memory, which counts against the sandbox's limit (a file larger
#: than what is free gets the sandbox killed), so only with it may a root overlay be written out whatever its
#: files (root_overlay.py).
STREAMED_TAR_PATCH: Final = "tmpfs-tar-streams-files"
#: Beside a runsc scripts/install.sh built: how it was built, one line ending in ``patches: <name>@<digest> ...``.
BUILD_RECORD: Final = "build.txt"

Platform = Literal["systrap", "ptrace"]
#: Platforms sandboxd knows how to use, fastest first (kvm needs a host whose /dev/kvm runs guests).
PLATFORMS: Final[tuple[Platform, ...]] = ("systrap", "ptrace")
#: How long a platform probe may take before the platform counts as not working here, in seconds.
PROBE_TIMEOUT_SECS: Final = 20.0

#: What runsc (the pinned release; not 20240729: ``pinNullNetNS`` in ``runsc/container``) bind-mounts in its ``--root``: the empty network namespace
#: its gofers share, kept for the next sandbox. It outlives every container; see ``release_root``.
NULL_NETNS: Final = "null-netns"

_RELEASE = re.compile(r"(?<!\d)(20\d{6})(?!\d)")

#: Host descriptors counted per cached file-system entry when sizing the dentry cache: the sentry keeps an
#: ``O_PATH`` descriptor for each entry and another for each file it has open (1.3 per entry measured after
#: a ``find /usr``; see docs/backends.md).
FDS_PER_DENTRY: Final = 2
#: Descriptors left to the sentry besides its cached entries (the guest's open files, sockets, memory files).
DENTRY_FD_RESERVE: Final = 4096
#: runsc's own cache: 1,000 unused entries per mount (``--dcache`` unset).
RUNSC_DEFAULT_DENTRY_CACHE: Final = 1000
#: The largest cache sized automatically: each entry costs about 1.2 KiB of the sentry's memory and as much
#: of the host kernel's, both charged to the sandbox's memory limit (about 40 MiB at this size).
MAX_AUTO_DENTRY_CACHE: Final = 16384


@dataclass(frozen=True)
class RunscInfo:
    """What one runsc binary is. ``release`` is its gVisor release date (``yyyymmdd``), 0 when its version
    string names none (a build from source): then every workaround below stays on, which is only slower.
    ``patches``: the names of the patches of runsc/patches/ it was built with (:func:`read_patches`)."""

    path: str
    version: str
    release: int
    flags: frozenset[str]
    platforms: tuple[str, ...]
    patches: frozenset[str] = frozenset()

    def parking_refused(self, platform: str) -> str | None:
        """Why sandboxes on ``platform`` must not be frozen (parked), or None when they may. A build naming no
        release counts as a current one."""
        if platform == "systrap" and (self.release == 0 or self.release >= FREEZER_UNSAFE_ON_SYSTRAP_RELEASE):
            return (
                f"idle sandboxes are not parked: on runsc {self.version} with systrap, freezing a sandbox kills "
                "the guest's next process (its seccomp-notified syscall thread is interrupted), and an idle "
                "sandbox uses no CPU without it"
            )
        return None

    @property
    def erofs_mounts(self) -> bool:
        """Whether the image's /usr may be an EROFS mount (:data:`EROFS_MOUNT_RELEASE`)."""
        return self.release >= EROFS_MOUNT_RELEASE

    @property
    def sized_root_overlay(self) -> bool:
        """Whether ephemeral sandboxes may write into gVisor's own sized root overlay
        (:data:`SIZED_OVERLAY_RELEASE`)."""
        return self.release >= SIZED_OVERLAY_RELEASE

    @property
    def overlay_tar_streams(self) -> bool:
        """Whether ``runsc tar rootfs-upper`` writes a file of any size in a sandbox's memory
        (:data:`STREAMED_TAR_PATCH`)."""
        return STREAMED_TAR_PATCH in self.patches

    @property
    def netns_needs_procfs_mask(self) -> bool:
        """Whether ``--network=sandbox`` must run behind a tmpfs over /proc/sys/net (gvisor_net.py)."""
        return self.release == 0 or self.release < NETNS_CHECK_FIXED_RELEASE

    def start_flags(self, platform: str, dentry_cache: int = 0, root_overlay: str | None = None) -> list[str]:
        """The global flags of ``runsc run`` and ``runsc restore`` for sandboxes on ``platform``.

        ``--overlay2=none``: the root's writes land in the sandbox's own ext4 layer (its ``disk_mb``, which
        disk snapshots copy). Since release 20230605 runsc's default, ``root:self``, keeps them in a
        ``.gvisor.filestore`` file of its own that ``df`` shows as an 8 EiB file system. ``root_overlay``
        (an ephemeral sandbox's, root_overlay.py): the whole ``--overlay2=...`` flag to give instead, a sized
        overlay whose content the backend snapshots itself. directfs (the sentry opens the root's files
        itself, default since 20230807) is kept: measured as fast as or faster than the gofer.

        ``--dcache``: ``dentry_cache`` unused file-system entries kept cached per sandbox, across its mounts
        (0: runsc's own 1,000 per mount). An entry that falls out is looked up on the host again, which is
        what made a ``git clone`` of 5,000 files 4x and a second ``find /usr`` 5x slower than with a cache
        that holds them (docs/benchmarks.md).
        """
        flags = [f"--platform={platform}"]
        if root_overlay is not None:
            flags.append(root_overlay)
        elif "overlay2" in self.flags:
            flags.append("--overlay2=none")
        if dentry_cache > 0 and "dcache" in self.flags:
            flags.append(f"--dcache={dentry_cache}")
        return flags

    def limitations(self, platform: str) -> list[str]:
        """What sandboxes on this runsc and ``platform`` cannot do or do slowly, one sentence each."""
        found = []
        if self.release == 0:
            found.append(
                f"runsc version {self.version!r} names no release; assuming the workarounds of older releases"
            )
        elif self.release < STATX_FIXED_RELEASE:
            found.append(
                f"runsc {self.release} fails statx with AT_NO_AUTOMOUNT: `ls -l`, `stat` and `du` fail with "
                f"'Invalid argument'; install runsc {RECOMMENDED_RELEASE} or later (scripts/install.sh does)"
            )
        if 0 < self.release < VEOF_FIXED_RELEASE:
            found.append(
                f"runsc {self.release} terminals ignore ^D in canonical mode: an attach's end of input reaches "
                "`cat` or `sh` on a terminal as nothing (bash, reading it itself, still ends)"
            )
        if platform == "ptrace":
            found.append(
                "platform ptrace: every system call is a ptrace stop, 2.5 to 6.5 times slower than systrap "
                "for syscall-bound work"
            )
        found.append(
            "extended attributes are not supported inside sandboxes (every xattr call answers EOPNOTSUPP): "
            "runsc's gofer answers getxattr with EBADF on symlinks and EACCES on unreadable files"
        )
        found.append(
            "a sandbox with cpus 1 sees 2 CPUs (runsc keeps at least two so its sentry and systrap's fast "
            "path stay usable); its CPU time is still limited to 1 core"
        )
        return found


def dentry_cache_size(configured: int, nofile_limit: int) -> int:
    """The ``--dcache`` of every sandbox: ``configured`` when not 0, else as many entries as the open-file
    limit sandboxd (and so each sentry) runs with can hold, :data:`FDS_PER_DENTRY` descriptors each after
    :data:`DENTRY_FD_RESERVE`, between runsc's own default and :data:`MAX_AUTO_DENTRY_CACHE`. A sentry out of
    descriptors fails the guest's opens with "Too many open files" instead of dropping entries (measured), so
    the cache must stay below the limit."""
    if configured > 0:
        return configured
    fitting = (nofile_limit - DENTRY_FD_RESERVE) // FDS_PER_DENTRY
    return max(RUNSC_DEFAULT_DENTRY_CACHE, min(MAX_AUTO_DENTRY_CACHE, fitting))


def inspect_runsc(runsc: str = DEFAULT_RUNSC) -> RunscInfo:
    """Read ``runsc --version`` and ``runsc flags`` (about 20 ms each). BackendError when runsc is missing,
    does not answer, or is older than :data:`MIN_RELEASE`."""
    path = shutil.which(runsc)
    if path is None:
        raise BackendError(
            f"runsc not found at {runsc}: run scripts/install.sh, which builds gVisor's runsc there, or name "
            "another one with [paths] runsc"
        )
    version = read_version(path)
    match = _RELEASE.search(version)
    release = int(match.group(1)) if match else 0
    if 0 < release < MIN_RELEASE:
        raise BackendError(
            f"{path} is runsc {version}, older than release {MIN_RELEASE}, the oldest sandboxd runs on; "
            f"install runsc {RECOMMENDED_RELEASE} or later (scripts/install.sh does)"
        )
    flags_text = _output([path, "flags"])
    flags = frozenset(re.findall(r"^\s+-([A-Za-z0-9_-]+)", flags_text, re.MULTILINE))
    return RunscInfo(path, version, release, flags, _platforms(flags_text), read_patches(path))


def read_patches(path: str) -> frozenset[str]:
    """The patches the runsc at ``path`` (a link is followed) was built with, from the :data:`BUILD_RECORD`
    beside it; none for a runsc without one (Debian's, another build)."""
    try:
        text = (Path(os.path.realpath(path)).parent / BUILD_RECORD).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return frozenset()
    _, found, listed = text.strip().rpartition("patches:")
    return frozenset(entry.split("@", 1)[0] for entry in listed.split()) if found else frozenset()


def read_version(path: str) -> str:
    """The version ``runsc --version`` names (``0.0~20240729.0``, ``release-20260803.0-49-g7a7d8c355``: the first
    line without its ``runsc version`` prefix). BackendError when it cannot be run."""
    version_text = _output([path, "--version"])
    first = version_text.splitlines()[0] if version_text.strip() else ""
    return first.removeprefix("runsc version").strip() or first.strip()


def _platforms(flags_text: str) -> tuple[str, ...]:
    """Platform names from the help of ``-platform`` ("specifies which platform to use: systrap (default),
    ptrace, kvm."); ptrace alone when the text cannot be read (every release has it)."""
    help_line = re.search(r"^\s+-platform\b.*\n\s+.*?:([^.]*)", flags_text, re.MULTILINE)
    names = re.findall(r"[a-z]+", help_line.group(1)) if help_line else []
    return tuple(dict.fromkeys(n for n in names if n != "default")) or ("ptrace",)


def _output(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, timeout=30, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BackendError(f"{' '.join(argv)} could not be run: {exc}") from exc
    # `runsc flags` prints its list on stderr in some releases, stdout in others.
    return (done.stdout + done.stderr).decode(errors="replace")


def choose_platform(info: RunscInfo, requested: str, agent_path: Path, workdir: Path) -> tuple[Platform, str]:
    """The platform sandboxes run on and why. ``requested``: ``auto`` (the first of :data:`PLATFORMS`
    this runsc has and a probe boots on here) or a platform name (used as told, BackendError when this
    runsc lacks it). The probe runs in a temporary directory under ``workdir``."""
    if requested != "auto":
        if requested not in info.platforms:
            raise BackendError(
                f"[gvisor] platform = {requested!r}, but runsc {info.version} offers only "
                f"{', '.join(info.platforms)}; choose one of those or 'auto'"
            )
        return requested, "configured"  # type: ignore[return-value]
    reasons = []
    for platform in PLATFORMS:
        if platform not in info.platforms:
            reasons.append(f"runsc {info.version} has no {platform} platform")
            continue
        if platform == "ptrace":
            break  # the last resort: every release has it, a probe would not change the choice
        problem = probe_platform(info, platform, agent_path, workdir)
        if problem is None:
            return platform, "probed"
        reasons.append(f"a probe sandbox on {platform} failed: {problem}")
    log.warning("sandboxes run on the ptrace platform", extra={"reasons": reasons})
    return "ptrace", "; ".join(reasons)


def probe_platform(
    info: RunscInfo, platform: str, agent_path: Path, workdir: Path, timeout_secs: float = PROBE_TIMEOUT_SECS
) -> str | None:
    """Boot ``sbx-agent --version`` alone on ``platform``; None when it printed its version, else why not.
    Leaves nothing behind (runsc removes a container that was not detached; the directory goes too)."""
    workdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    base = Path(tempfile.mkdtemp(prefix="platform-probe-", dir=workdir))
    try:
        rootfs = base / "rootfs"
        bundle = base / "bundle"
        rootfs.mkdir()
        bundle.mkdir()
        (rootfs / "agent").touch()
        spec = {
            "ociVersion": "1.0.0",
            "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": ["/agent", "--version"],
                        "env": ["PATH=/"], "cwd": "/"},
            "root": {"path": str(rootfs), "readonly": True},
            "mounts": [{"destination": "/agent", "type": "bind", "source": str(agent_path),
                        "options": ["rbind", "ro"]}],
            "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
        }  # fmt: skip
        (bundle / "config.json").write_text(json.dumps(spec), encoding="utf-8")
        container = f"probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        argv = [info.path, "--root", str(base / "state"), "--network=none", "--ignore-cgroups",
                f"--platform={platform}", "run", "--bundle", str(bundle), container]  # fmt: skip
        try:
            done = subprocess.run(
                argv, capture_output=True, timeout=timeout_secs, check=False, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            _force_delete(info, base, container)
            return f"no answer within {timeout_secs:g} s"
        except OSError as exc:
            return str(exc)
        if done.returncode == 0 and b"sbx-agent protocol" in done.stdout:
            return None
        _force_delete(info, base, container)
        tail = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()[-1:] or [""]
        return f"exit {done.returncode}: {tail[0][:300]}"
    finally:
        release_root(base / "state")
        shutil.rmtree(base, ignore_errors=True)


def release_root(root: Path) -> None:
    """Unmount what runsc left mounted in its ``--root`` directory ``root``: the ``null-netns`` pin of the
    gofers' empty network namespace (stacked when concurrent starts each made one). Without it the directory
    cannot be removed (EBUSY) and every removed state directory leaks a mount. Safe while sandboxes run: a
    running gofer has entered its namespace already, and the next start pins a new one. Idempotent."""
    detach_all(root / NULL_NETNS)


def release_roots_under(directory: Path) -> None:
    """``release_root`` for every runsc root under ``directory`` (the pins mounted there, as the kernel's
    mount table lists them): what a tool that removes a whole tree of runsc state runs first."""
    prefix = str(directory.resolve()).rstrip("/") + "/"
    with open("/proc/self/mountinfo", encoding="utf-8") as table:
        # Field 5 is the mount point, octal-escaped (a space is \040): what names its directory is enough.
        points = {line.split()[4] for line in table}
    for point in sorted(points):
        if point.startswith(prefix) and point.endswith("/" + NULL_NETNS):
            detach_all(Path(point))


def _force_delete(info: RunscInfo, base: Path, container: str) -> None:
    subprocess.run(
        [info.path, "--root", str(base / "state"), "delete", "--force", container],
        capture_output=True, timeout=30, check=False,
    )  # fmt: skip
