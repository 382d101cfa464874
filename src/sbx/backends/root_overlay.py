"""gVisor's own overlay as the writable top of an ephemeral sandbox's root (runsc ``--overlay2=root:dir=,size=``).

Every sandbox's root is the image under its ext4 layer (layers.py), served by the gofer. With ``[gvisor]
root_overlay = true`` (the default) and a runsc scripts/install.sh built (:func:`overlay_refusal`), for an
ephemeral sandbox (one whose disk need not outlive its sentry: not persistent), the sentry puts an overlay of its
own on top of that: a tmpfs whose pages live in a file in the layer's directory on the host (the "filestore",
which runsc opens and unlinks), limited to ``size`` bytes. Every write of the guest lands there, at memory speed
(docs/benchmarks.md: the battery's file tasks 0.3-0.8x the host's ext4), and the ext4 layer stays as it was at
boot. What that changes, and what keeps each guarantee (docs/backends.md, "Ephemeral sandboxes in gVisor's
overlay"):

- ``disk_mb``: ``size`` is ``disk_mb`` less what the ext4 layer below holds, so a write past the disk is ENOSPC
  in the guest and ``df /`` shows the overlay's size.
- Memory snapshots, suspend and memory forks: the checkpoint holds the overlay with the rest of the kernel's
  memory, and the restore puts it back (into a new filestore in the restoring sandbox's directory); the disk
  below it is the unchanged ext4 layer. The record of the overlay (:data:`RECORD`, its size) goes with the
  bundle and with each checkpoint, so a restore mounts the same.
- Disk snapshots: ``runsc tar rootfs-upper`` writes the overlay as a tar (the sandbox paused for it, so the tar
  is of one moment), which upper_tar.py applies onto a copy of the ext4 layer: the snapshot is an ext4 layer
  like any other, and forks of it boot as from any disk snapshot. A suspended sandbox has no sentry to ask, so
  its checkpoint keeps that tar beside the layer (:data:`SUSPENDED_TAR`) unless the caller restores it at once.
  runsc writes it 1 MiB at a time (runsc/patches/tmpfs-tar-streams-files.patch: gVisor itself reads each file
  whole into the sandbox's memory, see :func:`tar_refusal`).
- ``disk_used_bytes``: the ext4 layer's use plus the filestore's allocated bytes (found through the sentry's
  open descriptors; the suspended tar's size while it has none).

A persistent sandbox never gets it: its disk must come back whole after a crash of its sentry or of the host,
and the overlay lives only as long as its sentry.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from sbx.backends.base import BackendError
from sbx.backends.runsc import SIZED_OVERLAY_RELEASE, RunscInfo

#: In a sandbox's bundle and in each checkpoint taken of it: the overlay its sentry mounts (JSON, ``size_bytes``);
#: no file, no overlay (the ext4 layer takes the writes).
RECORD = "root-overlay.json"
#: In the layer's directory of a suspended sandbox whose checkpoint holds its overlay: the overlay as a tar, for
#: a disk snapshot taken before it resumes; removed by the restore.
SUSPENDED_TAR = "upper.tar"
#: The smallest overlay given, in bytes, whatever the ext4 layer below already holds: the guest can still write.
MIN_SIZE_BYTES = 1024 * 1024
#: How runsc names the filestore it makes in the overlay's directory (then unlinks, keeping it open).
_FILESTORE_PREFIX = "runsc-filestore-"


@dataclass(frozen=True)
class RootOverlay:
    """The overlay of one sandbox: ``size_bytes`` of writes the guest may make above its ext4 layer."""

    size_bytes: int

    def flag(self, directory: Path) -> str:
        """runsc's flag for this overlay with its filestore in ``directory`` (absolute)."""
        return f"--overlay2=root:dir={directory},size={self.size_bytes}"


def sized(disk_mb: int, layer_used_bytes: int) -> RootOverlay:
    """The overlay of a sandbox of ``disk_mb`` MiB whose ext4 layer already holds ``layer_used_bytes``."""
    return RootOverlay(max(MIN_SIZE_BYTES, disk_mb * 1024 * 1024 - layer_used_bytes))


def write_record(directory: Path, overlay: RootOverlay | None) -> None:
    """Record ``overlay`` in ``directory`` (a bundle or a checkpoint); None removes the record."""
    path = directory / RECORD
    if overlay is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"size_bytes": overlay.size_bytes}), encoding="utf-8")
    os.replace(tmp, path)


def read_record(directory: Path) -> RootOverlay | None:
    """The overlay recorded in ``directory``; None without a record; BackendError when it is damaged."""
    try:
        raw = json.loads((directory / RECORD).read_text(encoding="utf-8"))
        size = raw["size_bytes"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BackendError(f"the record of the sandbox's root overlay cannot be read: {exc!r}") from exc
    if not isinstance(size, int) or isinstance(size, bool) or size < MIN_SIZE_BYTES:
        raise BackendError(f"the record of the sandbox's root overlay names no valid size: {raw!r}")
    return RootOverlay(size)


def overlay_refusal(info: RunscInfo) -> str | None:
    """Why ephemeral sandboxes on ``info`` must write into their ext4 layer instead of gVisor's overlay, or
    None when they may use it: a runsc that can size it and whose tar of it streams each file (a runsc without
    :attr:`RunscInfo.overlay_tar_streams` reads each whole into the sandbox's memory, see :func:`tar_refusal`)."""
    if not info.sized_root_overlay:
        return (
            f"ephemeral sandboxes write into their ext4 layer, not gVisor's faster overlay: runsc {info.version} "
            f"cannot size it or write it out (release {SIZED_OVERLAY_RELEASE} or later can)"
        )
    if not info.overlay_tar_streams:
        return (
            f"ephemeral sandboxes write into their ext4 layer, not gVisor's faster overlay: runsc {info.version} "
            "was not built by scripts/install.sh with runsc/patches/, and its tar of the overlay reads each file "
            "whole into the sandbox's memory (a snapshot of a large file would get the sandbox killed)"
        )
    return None


#: Memory kept free besides the overlay's bytes when gVisor writes the overlay out (its own buffers, the guest).
TAR_MARGIN_BYTES = 64 * 1024 * 1024


def tar_refusal(overlay_bytes: int, memory_bytes: int, limit_bytes: int) -> str | None:
    """Why the sandbox's overlay must not be written out as a tar now, or None when it may.

    Only for a sandbox whose runsc lacks :attr:`RunscInfo.overlay_tar_streams` (booted by one that had it,
    replaced since). gVisor's own ``tar rootfs-upper`` reads each file of the overlay whole into the sentry's
    memory (its tmpfs ``tarDefaultWriterCallbacks.regularFileWrite``), which counts against the sandbox's limit:
    a file larger than what is free gets the sentry, and the whole sandbox, killed by the OOM killer (measured:
    a 500 MB file in a sandbox of 512 MiB). So the overlay's bytes (an upper bound of its largest file) plus
    :data:`TAR_MARGIN_BYTES` must fit in ``limit_bytes`` less ``memory_bytes`` (what the sandbox holds that the
    host cannot reclaim: its guest memory and the sentry's own). ``limit_bytes`` 0: no limit known, no refusal.
    """
    if limit_bytes <= 0:
        return None
    free = limit_bytes - memory_bytes
    if overlay_bytes + TAR_MARGIN_BYTES <= free:
        return None
    mib = 1024 * 1024
    return (
        f"the sandbox's files above its image take {overlay_bytes // mib} MiB, and gVisor reads each one whole "
        f"into the sandbox's memory to save it, which has {max(0, free) // mib} MiB free of {limit_bytes // mib} "
        "MiB: saving them now could get the sandbox killed. Delete large files in it (or free memory), then retry; "
        "the runsc scripts/install.sh builds streams each file, and a node with [gvisor] root_overlay = false keeps "
        "sandboxes' files where this is never needed"
    )


def filestore_bytes(pids: list[int], directory: Path) -> int:
    """Allocated bytes of the filestore the processes ``pids`` (the sandbox's sentry) hold open in
    ``directory``; 0 when none does (the sandbox is not running). Read from /proc, no subprocess."""
    prefix = f"{directory}/{_FILESTORE_PREFIX}"
    seen: dict[tuple[int, int], int] = {}  # a file held through several descriptors counts once
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd).startswith(prefix):
                    st = os.stat(fd)  # the open file, unlinked or not
                    seen[(st.st_dev, st.st_ino)] = st.st_blocks * 512
            except OSError:
                continue
    return sum(seen.values())
