"""The gVisor backend: each sandbox is a `runsc` sandbox (systrap platform where it works) with the agent as
its init.

Per sandbox, under ``<state>/gvisor/<id>/``::

    bundle/config.json   the OCI spec runsc boots from
    layer/               writable layer and overlay root (see layers.py)
    ctl/                 mode 0700, bind-mounted at /.sbx/ctl; the agent creates agent.sock here. Root in
                         the guest can write it: the host never follows a name in it (ctl_dir.py)
    console.log          the agent's and runsc's own diagnostics

The agent binary is bind-mounted read-only at /.sbx/agent; runsc runs with ``--host-uds=create`` so the agent
can create its listening socket in the control directory, where the host connects (and reconnects after a
sandboxd restart). runsc keeps its own state in ``<state>/gvisor/runsc``; ``runsc run --detach`` leaves the
sandbox running outside sandboxd's process tree, so killing sandboxd never stops a sandbox.

Isolation: pid, mount, ipc, uts and network namespaces; CPU quota, memory and pid limits through the cgroup
``/sandboxd/<id>``; network mode ``none`` (loopback only, gVisor's own stack), modes ``allowlist`` and ``open``
in a network namespace of their own behind the egress proxy (gvisor_net.py, docs/network.md).

Which runsc release is installed and which platform works here decide the flags (runsc.py): read once by
:meth:`GVisorBackend.check`, reported by ``GET /v1/node`` (:meth:`GVisorBackend.runtime_report`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import resource
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sbx.agent import raw_tunnel
from sbx.agent.client import AgentClient
from sbx.api.codec import to_builtins
from sbx.api.network_policy import NetworkPolicy
from sbx.api.node import Runtime
from sbx.api.validation import DEFAULT_CWD
from sbx.backends.base import BackendError, BackendUsage, BootSpec, GuestUser, VolumeBind, VolumeDisks
from sbx.backends.ctl_dir import touch_regular
from sbx.backends.disk_copy import copy_frozen
from sbx.backends.freezer import CgroupFreezer
from sbx.backends.gvisor_net import SandboxNetworks
from sbx.backends.host_counters import read_usage
from sbx.backends.host_tool import run_tool
from sbx.backends.layers import LayerPool, WritableLayer, bind_read_only, is_mounted, mount_loop, unmount_all
from sbx.backends.loop_volumes import LoopVolumes
from sbx.backends.root_overlay import (
    SUSPENDED_TAR,
    RootOverlay,
    filestore_bytes,
    overlay_refusal,
    read_record,
    sized,
    tar_refusal,
    write_record,
)
from sbx.backends.runsc import (
    DEFAULT_RUNSC,
    DENTRY_FD_RESERVE,
    FDS_PER_DENTRY,
    RunscInfo,
    choose_platform,
    dentry_cache_size,
    inspect_runsc,
    release_root,
)
from sbx.backends.upper_tar import apply_upper_tar
from sbx.backends.usr_erofs import GUEST_USR, ErofsFile, UsrImages, identity
from sbx.images.store import SANDBOX_GID, SANDBOX_UID
from sbx.net.egress import Egress, EgressConfig, instance_tag

log = logging.getLogger(__name__)

#: The in-sandbox paths of the agent and its control directory.
GUEST_AGENT_PATH = "/.sbx/agent"
GUEST_CTL_DIR = "/.sbx/ctl"
AGENT_SOCKET_NAME = "agent.sock"
#: File in the control directory that ends the agent's QUIESCE (see docs/agent-protocol.md).
WAKE_FILE_NAME = "wake"
#: The file ``runsc checkpoint`` writes last into its image directory: a checkpoint is whole once it is there.
CHECKPOINT_FILE = "checkpoint.img"
#: Beside a bundle and in each checkpoint taken of it: the EROFS /usr it mounts (usr_erofs.py), JSON
#: ``{"path": ..., "identity": ...}``; absent: the host's /usr. A memory restore must mount the same file.
USR_RECORD = "usr-erofs.json"
#: The sandbox user every image has (sbx.images.store makes its home), as the spec's ``/sandbox/home`` says.
GUEST = GuestUser(
    uid=SANDBOX_UID, gid=SANDBOX_GID, name="sandbox", home=DEFAULT_CWD, read_only_trees=(GUEST_USR,)
)

#: Host threads and processes a sandbox may have (ptrace runs a stub per guest address space); stops a fork
#: bomb from exhausting the host's pid space.
PIDS_LIMIT = 2048
CPU_PERIOD_US = 100_000
CGROUP_PARENT = "/sandboxd"
#: How long a checkpointed sandbox's processes may take to exit before runsc delete is used, in seconds.
STOP_WAIT_SECS = 5.0

_GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def tmpfs_size_option(spec: BootSpec) -> str:
    """The size of /tmp and of /dev/shm, half of ``memory_mb`` each (Linux's tmpfs default is half the RAM):
    they live in the sandbox's memory, so filling one answers ENOSPC instead of getting the whole sandbox
    killed at its memory limit, and ``df`` shows what they can hold."""
    return f"size={max(1, spec.memory_mb // 2)}m"


def oci_spec(
    spec: BootSpec,
    rootfs: Path,
    agent_path: Path,
    ctl_dir: Path,
    agent_args: tuple[str, ...] = (),
    usr_image: Path | None = None,
) -> dict[str, Any]:
    """The OCI runtime spec for one sandbox: the agent as init (with ``agent_args``), limits in the cgroup;
    with ``usr_image``, /usr read-only from that EROFS image of the image's own (usr_erofs.py)."""
    return {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [
                GUEST_AGENT_PATH,
                *agent_args,
                "--listen",
                f"{GUEST_CTL_DIR}/{AGENT_SOCKET_NAME}",
                "--tunnel-listen",
                f"{GUEST_CTL_DIR}/{raw_tunnel.SOCKET_NAME}",
            ],
            "env": [f"PATH={_GUEST_PATH}"],
            "cwd": "/",
            "capabilities": {
                key: ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"]
                for key in ("bounding", "effective", "permitted")
            },
            # Processes run as the sandbox user and stay it: setuid binaries of the image (su, mount, passwd,
            # ...) cannot make them root, so root in the guest (which may write /.sbx/ctl) is not reachable.
            # The agent itself starts as root and drops to the user by setuid(2), which this does not stop.
            "noNewPrivileges": True,
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            *(
                ({"destination": GUEST_USR, "type": "erofs", "source": str(usr_image), "options": ["ro"]},)
                if usr_image is not None
                else ()
            ),
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            # runsc mounts /sys and /dev/pts by itself; naming them again costs ~15 ms a boot. Its own /tmp
            # would be a tmpfs without a size (a full one gets the sandbox killed at its memory limit).
            {
                "destination": "/dev/shm",
                "type": "tmpfs",
                "source": "shm",
                "options": ["nosuid", "nodev", tmpfs_size_option(spec)],
            },
            {
                "destination": "/tmp",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "nodev", "mode=1777", tmpfs_size_option(spec)],
            },
            {
                "destination": GUEST_AGENT_PATH,
                "type": "bind",
                "source": str(agent_path),
                "options": ["rbind", "ro"],
            },
            {
                "destination": GUEST_CTL_DIR,
                "type": "bind",
                "source": str(ctl_dir),
                "options": ["rbind", "rw"],
            },
            # Volumes: "ro" makes gVisor mount them read-only, so every write fails EROFS, even root's.
            *(
                {
                    "destination": v.path,
                    "type": "bind",
                    "source": str(v.source),
                    "options": ["rbind", "ro" if v.read_only else "rw", "nosuid", "nodev"],
                }
                for v in spec.volumes
            ),
        ],
        "linux": {
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
            "cgroupsPath": f"{CGROUP_PARENT}/{spec.sandbox_id}",
            "resources": {
                "memory": {"limit": spec.memory_mb * 1024 * 1024},
                "cpu": {"quota": spec.cpus * CPU_PERIOD_US, "period": CPU_PERIOD_US},
                "pids": {"limit": PIDS_LIMIT},
            },
        },
    }


def _write_usr_record(bundle: Path, usr: ErofsFile | None) -> None:
    """Record in ``bundle`` which EROFS /usr its config mounts (none: no record), for its checkpoints."""
    record = bundle / USR_RECORD
    if usr is None:
        record.unlink(missing_ok=True)
    else:
        record.write_text(json.dumps({"path": str(usr.path), "identity": usr.identity}), encoding="utf-8")


def _checkpointed_usr(image_dir: Path) -> ErofsFile | None:
    """The EROFS /usr the sandbox checkpointed in ``image_dir`` mounted (None: the host's), which its restore
    must mount again; BackendError when that file is gone or was replaced (the image removed or installed
    again since): its kernel holds files of the old one open."""
    try:
        raw = json.loads((image_dir / USR_RECORD).read_text(encoding="utf-8"))
        path, recorded = Path(raw["path"]), str(raw["identity"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BackendError(f"the snapshot's record of its /usr cannot be read: {exc!r}") from exc
    try:
        same = identity(path) == recorded
    except OSError:
        same = False
    if not same:
        raise BackendError(
            "the snapshot's image was removed or installed again since it was taken, so its memory cannot be "
            "restored; fork a disk snapshot of it instead, or delete it"
        )
    return ErofsFile(path, recorded)


async def _apply_onto_image(tar: Path, image_file: Path, mount_point: Path) -> None:
    """Apply the root overlay's ``tar`` onto the layer image ``image_file`` (not in use: a copy), mounted at
    ``mount_point`` for it and unmounted after, flushed."""
    mount_point.mkdir(exist_ok=True)
    try:
        await mount_loop(image_file, mount_point, fresh=True)
        try:
            await asyncio.to_thread(apply_upper_tar, tar, mount_point / "upper")
        finally:
            await unmount_all([mount_point])  # unmounting flushes the copy to its image file
    finally:
        with contextlib.suppress(OSError):
            mount_point.rmdir()


def _fsync_tree(directory: Path) -> None:
    """fsync every file of ``directory`` (one level: a checkpoint's) and the directory itself."""
    for path in [*directory.iterdir(), directory]:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class GVisorBackend:
    """Runs sandboxes with gVisor's runsc. ``state_dir`` is sandboxd's state directory."""

    name = "gvisor"
    network_modes: frozenset[str] = frozenset({"none"})
    guest = GUEST

    def __init__(
        self,
        state_dir: Path,
        agent_path: Path,
        platform: str = "auto",
        runsc: str = DEFAULT_RUNSC,
        pooled_disk_mb: int = 0,
        egress: EgressConfig | None = None,
        dentry_cache: int = 0,
        usr_erofs: bool = True,
        root_overlay: bool = True,
    ) -> None:
        """``pooled_disk_mb`` > 0 keeps writable layers of that size (the default disk) ready ahead of time.
        ``usr_erofs``: serve each image's /usr from an EROFS image of it once built (usr_erofs.py).
        ``root_overlay``: an ephemeral sandbox writes into gVisor's own overlay sized to its disk, above its
        ext4 layer, where this runsc has one and writes it out in bounded memory (root_overlay.py; else
        :attr:`root_overlay_refused` says why not); False: into the ext4 layer, as a persistent one always does.
        ``egress``: enforce modes allowlist and open with that configuration (gvisor_net.py); None: mode
        none only. ``platform``: ``auto`` (systrap where a probe boots on it, else ptrace) or a platform
        name (runsc.py)."""
        self.base = state_dir / "gvisor"
        self.runsc_root = self.base / "runsc"
        self.agent_path = agent_path
        #: What was asked for; :attr:`platform` is what :meth:`check` chose, and ``platform_reason`` why.
        self.requested_platform = platform
        self.platform = platform
        self.platform_reason = ""
        self.runsc = runsc
        #: What was asked for (0: sized by :meth:`check`) and, once checked, the size every sandbox gets.
        self.requested_dentry_cache = dentry_cache
        self.dentry_cache = dentry_cache
        #: The installed runsc, read by :meth:`check`.
        self.runsc_info: RunscInfo | None = None
        self.layer_pool = LayerPool(self.base / "layer-pool", pooled_disk_mb) if pooled_disk_mb else None
        #: The EROFS images of the images' /usr trees, built in the background.
        self.usr_images = UsrImages(usr_erofs)
        self.root_overlay = root_overlay
        #: Why ephemeral sandboxes write into their ext4 layer although ``root_overlay`` asked for gVisor's
        #: overlay (check() decides from this runsc), or None.
        self.root_overlay_refused: str | None = None
        #: Volumes are ext4 images loop-mounted on the host and bound into sandboxes (runsc's gofer serves them).
        self.volumes: VolumeDisks = LoopVolumes(GUEST)
        #: One checkpoint, restore, disk copy or teardown at a time per sandbox.
        self._locks: dict[str, asyncio.Lock] = {}
        #: Sandboxes being destroyed: a checkpoint or restore racing with the teardown gives up.
        self._doomed: set[str] = set()
        #: Network namespaces for sandboxes with egress (None: every sandbox gets --network=none).
        self.net = (
            SandboxNetworks(self.base, Egress(egress, instance_tag(str(state_dir.resolve()))))
            if egress is not None
            else None
        )
        self.network_modes = frozenset({"none", "allowlist", "open"} if egress is not None else {"none"})
        #: Why sandboxes are not parked here (check() decides: the host's freezer, this runsc and platform).
        self.parking_refused: str | None = None
        #: Parks sandboxes by freezing their cgroups (freezer.py).
        self.freezer = CgroupFreezer(CGROUP_PARENT)

    async def start(self) -> None:
        """Background work: keep the layer pool filled."""
        if self.layer_pool is not None:
            await self.layer_pool.start()
        if self.net is not None:
            await self.net.start()

    async def close(self) -> None:
        await self.usr_images.close()
        if self.layer_pool is not None:
            await self.layer_pool.close()
        if self.net is not None:
            await self.net.close()
        # runsc's pin of the gofers' network namespace: sandboxes that go on running keep theirs, and the next
        # start makes a new pin, so a stopped sandboxd leaves nothing mounted in its state directory.
        release_root(self.runsc_root)

    def check(self) -> None:
        """Raise BackendError naming what is missing on this host; read runsc and choose the platform."""
        info = inspect_runsc(self.runsc)
        # Layers, volumes and snapshots: mkfs, checks and resizes of ext4 images, unmounts and freezes.
        for tool in ("mkfs.ext4", "e2fsck", "resize2fs", "umount", "fsfreeze"):
            if shutil.which(tool) is None:
                raise BackendError(
                    f"{tool} not found: install e2fsprogs, mount and util-linux (scripts/install.sh does)"
                )
        if not self.agent_path.is_file():
            raise BackendError(
                f"the sandbox agent {self.agent_path} is missing: build it with "
                f"`python -m sbx.agent.build --out {self.agent_path}` (scripts/install.sh does)"
            )
        if os.geteuid() != 0:
            raise BackendError("sandboxd must run as root to create gVisor sandboxes")
        if self.net is not None and not self.net.usable():
            self.network_modes = frozenset({"none"})  # why is logged; the ceiling is lowered to match
        if not self.freezer.usable():
            log.warning("this host has no cgroup freezer: idle sandboxes cannot be parked and keep using CPU")
        self.runsc_root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.platform, self.platform_reason = choose_platform(
            info, self.requested_platform, self.agent_path, self.base
        )
        nofile_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        self.dentry_cache = dentry_cache_size(self.requested_dentry_cache, nofile_limit)
        if self.dentry_cache * FDS_PER_DENTRY + DENTRY_FD_RESERVE > nofile_limit:
            log.warning(
                "the dentry cache may need more descriptors than a sentry may open",
                extra={"dentry_cache": self.dentry_cache, "nofile_limit": nofile_limit},
            )
        self.runsc_info = info
        self.parking_refused = (
            "no cgroup freezer on this host: idle sandboxes are never parked"
            if not self.freezer.usable()
            else info.parking_refused(self.platform)
        )
        self.root_overlay_refused = overlay_refusal(info) if self.root_overlay else None
        if self.net is not None:
            self.net.procfs_mask = info.netns_needs_procfs_mask
        log.info(
            "gVisor runtime",
            extra={**to_builtins(self.runtime_report()), "dentry_cache": self.dentry_cache},
        )

    def runtime_report(self) -> Runtime:
        """The runsc and platform sandboxes run on, and what they cannot do (``GET /v1/node`` ``runtime``)."""
        info = self.runsc_info
        limitations = info.limitations(self.platform) if info is not None else []
        if self.parking_refused is not None:
            limitations.append(self.parking_refused)
        if self.root_overlay_refused is not None:
            limitations.append(self.root_overlay_refused)
        return Runtime(
            platform=self.platform,
            platform_reason=self.platform_reason,
            limitations=limitations,
            runsc_version=info.version if info is not None else "",
            runsc_path=info.path if info is not None else "",
        )

    def _runsc(self) -> RunscInfo:
        if self.runsc_info is None:
            raise BackendError("the gVisor backend was used before check() read runsc")
        return self.runsc_info

    def _dir(self, sandbox_id: str) -> Path:
        return self.base / sandbox_id

    def agent_socket(self, sandbox_id: str) -> Path:
        """Host path of the socket the sandbox's agent listens on (runsc's --host-uds=create makes it)."""
        return self._dir(sandbox_id) / "ctl" / AGENT_SOCKET_NAME

    async def connect_agent(self, sandbox_id: str, timeout_secs: float) -> AgentClient:
        return await AgentClient.connect(
            self.agent_socket(sandbox_id),
            timeout_secs,
            self._dir(sandbox_id) / "ctl" / raw_tunnel.SOCKET_NAME,
        )

    def _runsc_argv(self, *args: str) -> list[str]:
        return [self.runsc, "--root", str(self.runsc_root), *args]

    def _runsc_for(self, sandbox_id: str, *args: str) -> list[str]:
        """argv of a runsc command about an existing sandbox (state, kill, delete, checkpoint, restore).

        Every such command must go through here: a sandbox with its own network namespace has an abstract
        control socket that is reachable only from inside that namespace.
        """
        if self.net is None:
            return self._runsc_argv(*args)
        return self.net.command_argv(sandbox_id, self._runsc_argv(*args))

    def _sandbox_process_argv(self, sandbox_id: str, *args: str) -> list[str]:
        """argv of a runsc command that starts the sandbox's processes (``run``, ``restore``): ``args`` without
        any ``--network`` flag, which this adds (none, or sandbox inside the sandbox's namespace)."""
        if self.net is None:
            return self._runsc_argv("--network=none", *args)
        return self.net.process_argv(sandbox_id, self._runsc_argv(*args))

    async def prepare_network_for_restore(self, sandbox_id: str) -> None:
        """Before a ``runsc restore``: put the sandbox's addresses back into its namespace (runsc moved them
        into the sandbox it checkpointed). Idempotent; nothing for a sandbox without a network."""
        if self.net is not None:
            await self.net.prepare_for_restore(sandbox_id)

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> None:
        """Apply ``policy`` to a running sandbox at once; connections it no longer permits are cut.
        BackendError when the sandbox has no network interface (it was created with mode none)."""
        if self.net is None or self.net.host_interface(sandbox_id) is None:
            raise BackendError(
                "the sandbox was created with network mode none and has no network interface; create a new "
                "sandbox with mode allowlist or open to give it egress"
            )
        await self.net.set_policy(sandbox_id, policy)

    async def boot(self, spec: BootSpec) -> None:
        await self._boot(
            spec,
            lambda layer: layer.create(spec.image_root, spec.disk_mb, self.layer_pool, spec.durable_disk),
        )

    async def boot_from_snapshot(self, spec: BootSpec, disk_image: Path, memory_image: Path | None) -> None:
        """Boot a new sandbox whose writable layer is a copy of ``disk_image`` resized to ``spec.disk_mb``;
        with ``memory_image`` (a checkpoint directory) it is restored from it, processes running, instead of
        booted afresh (the spec's image and resources must then be those of the checkpointed sandbox)."""
        await self._boot(
            spec,
            lambda layer: layer.create_from_copy(
                spec.image_root, disk_image, spec.disk_mb, spec.durable_disk
            ),
            memory_image,
        )

    async def _boot(
        self,
        spec: BootSpec,
        make_layer: Callable[[WritableLayer], Awaitable[None]],
        memory_image: Path | None = None,
    ) -> None:
        if spec.network.mode not in self.network_modes:
            raise BackendError(f"network mode {spec.network.mode} is not supported by the gvisor backend")
        directory = self._dir(spec.sandbox_id)
        layer = WritableLayer(directory / "layer")
        ctl_dir = directory / "ctl"
        bundle = directory / "bundle"
        try:
            directory.mkdir(parents=True, mode=0o700)
            ctl_dir.mkdir(mode=0o700)
            bundle.mkdir()
            await make_layer(layer)
            spec = dataclasses.replace(spec, volumes=self._read_only_binds(spec))
            usr = (
                self._fresh_usr(spec.image_root) if memory_image is None else _checkpointed_usr(memory_image)
            )
            config = oci_spec(
                spec, layer.rootfs, self.agent_path, ctl_dir, ("--no-xattr",), usr.path if usr else None
            )
            _write_usr_record(bundle, usr)
            write_record(bundle, self._boot_overlay(spec, layer, memory_image))
            if self.net is not None and spec.network.mode != "none":
                await self.net.create(spec.sandbox_id, spec.network)
                self.net.configure_spec(spec.sandbox_id, config)
            (bundle / "config.json").write_text(json.dumps(config), encoding="utf-8")
            if memory_image is not None:
                touch_regular(ctl_dir, WAKE_FILE_NAME)  # the restored agent listens again at once
            await self._start(spec.sandbox_id, bundle, directory / "console.log", memory_image)
        except BaseException:
            await self.destroy(spec.sandbox_id)
            raise

    # -- stop and start again (persistent sandboxes) ---------------------------------------------------

    async def stop(self, sandbox_id: str) -> None:
        """End the sandbox's processes (runsc kill and delete), keeping its directory: bundle, writable layer
        (synced to the host's disk), control directory and network namespace. Idempotent."""
        async with self._lock(sandbox_id):
            if sandbox_id in self._doomed:
                raise BackendError("the sandbox is being deleted")
            await self._stop_locked(sandbox_id)

    async def _stop_locked(self, sandbox_id: str) -> None:
        self.freezer.thaw(sandbox_id)  # runsc's kill asks the sentry, which a frozen cgroup cannot answer
        if self._has_runsc_state(sandbox_id):
            for args in (("kill", sandbox_id, "KILL"), ("delete", "--force", sandbox_id)):
                with contextlib.suppress(BackendError):  # kill fails when it already stopped
                    await run_tool(*self._runsc_for(sandbox_id, *args))
        self._control_socket(sandbox_id).unlink(missing_ok=True)
        await WritableLayer(self._dir(sandbox_id) / "layer").sync()

    async def restart(self, spec: BootSpec) -> None:
        """``runsc run`` the sandbox again on the layer it kept: whatever a crash left of it stopped first, the
        layer and overlay mounted again where a reboot took them (journal replayed), the bundle written anew
        for ``spec`` (its volumes' binds), the network namespace made again where it is gone. On failure the
        sandbox is stopped again; its layer is never removed here."""
        sandbox_id = spec.sandbox_id
        async with self._lock(sandbox_id):
            if sandbox_id in self._doomed:
                raise BackendError("the sandbox is being deleted")
            directory = self._dir(sandbox_id)
            layer = WritableLayer(directory / "layer")
            ctl_dir, bundle = directory / "ctl", directory / "bundle"
            if not layer.image_file.is_file() or not bundle.is_dir() or not ctl_dir.is_dir():
                raise BackendError(f"nothing of sandbox {sandbox_id} is left to start again from")
            await self._stop_locked(sandbox_id)
            try:
                await layer.ensure_mounted(spec.image_root)
                spec = dataclasses.replace(spec, volumes=self._read_only_binds(spec))
                usr = self._fresh_usr(spec.image_root)  # a fresh boot: whatever is ready now
                config = oci_spec(
                    spec, layer.rootfs, self.agent_path, ctl_dir, ("--no-xattr",), usr.path if usr else None
                )
                _write_usr_record(bundle, usr)
                write_record(bundle, None)  # a fresh run on the layer it kept: its writes go there
                if self.net is not None and spec.network.mode != "none":
                    await self.net.ensure(sandbox_id, spec.network)  # a reboot took it: made again
                    self.net.configure_spec(sandbox_id, config)
                (bundle / "config.json").write_text(json.dumps(config), encoding="utf-8")
                if self.net is not None:
                    # The guest end's address went into the sandbox that stopped; a fresh run needs it back.
                    await self.prepare_network_for_restore(sandbox_id)
                await self._start(sandbox_id, bundle, directory / "console.log")
            except BaseException:
                await asyncio.shield(self._stop_locked(sandbox_id))
                raise

    def _boot_overlay(
        self, spec: BootSpec, layer: WritableLayer, memory_image: Path | None
    ) -> RootOverlay | None:
        """The root overlay a new sandbox's sentry mounts: a restore's is the checkpoint's (its kernel holds
        it); a fresh boot of an ephemeral sandbox gets one sized to ``disk_mb`` less what its layer holds,
        where enabled and this runsc has it; a persistent sandbox never (its disk must outlive the sentry)."""
        if memory_image is not None:
            overlay = read_record(memory_image)
            if overlay is not None and spec.durable_disk:
                raise BackendError(
                    "this memory snapshot's files are in gVisor's overlay of an ephemeral sandbox, which a "
                    "persistent sandbox cannot keep; fork it without persistent, or fork a disk snapshot of it"
                )
            return overlay
        if spec.durable_disk or not self.root_overlay or self.root_overlay_refused is not None:
            return None
        return sized(spec.disk_mb, layer.used_bytes())

    def _fresh_usr(self, image_root: Path) -> ErofsFile | None:
        """The EROFS /usr a fresh boot of ``image_root`` mounts: None when this runsc is too old for it
        (:attr:`RunscInfo.erofs_mounts`) or it is not built yet."""
        return self.usr_images.ready(image_root) if self._runsc().erofs_mounts else None

    def _read_only_binds(self, spec: BootSpec) -> tuple[VolumeBind, ...]:
        """The volumes with each read-only one's source replaced by a read-only bind of it in the sandbox's
        directory (``volumes/<n>``, unmounted by destroy). runsc 20240729 with directfs truncates the host
        file of ``open(O_TRUNC)`` on a read-only mount before it answers EROFS (upstream fix 0a99125cd, in
        release 20250707): through a read-only host mount the kernel refuses the truncation itself."""
        binds = []
        for index, volume in enumerate(spec.volumes):
            if volume.read_only:
                target = self._dir(spec.sandbox_id) / "volumes" / str(index)
                if not is_mounted(target):  # a restart of a stopped sandbox finds its binds still there
                    bind_read_only(volume.source, target)
                volume = dataclasses.replace(volume, source=target)
            binds.append(volume)
        return tuple(binds)

    async def _start(
        self, sandbox_id: str, bundle: Path, console: Path, image_dir: Path | None = None
    ) -> None:
        """``runsc run`` the bundle, or ``runsc restore`` it from the checkpoint in ``image_dir``."""
        command = ("restore", "--image-path", str(image_dir)) if image_dir is not None else ("run",)
        overlay = read_record(bundle)
        flags = self._runsc().start_flags(
            self.platform, self.dentry_cache, overlay.flag(bundle.parent / "layer") if overlay else None
        )
        if image_dir is not None:
            await self.prepare_network_for_restore(sandbox_id)
        with open(console, "ab") as log:  # noqa: ASYNC230 - opening a log file does not wait on anything
            proc = await asyncio.create_subprocess_exec(
                *self._sandbox_process_argv(
                    sandbox_id, *flags, "--host-uds=create",
                    "--cpu-num-from-quota",
                    *command, "--detach", "--bundle", str(bundle), sandbox_id,
                ),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True,  # never in sandboxd's process group: a signal to it must not reach here
            )  # fmt: skip
            code = await proc.wait()
        if code != 0:
            tail = console.read_bytes()[-2000:].decode(errors="replace").strip()
            what = "restore" if image_dir is not None else "start"
            raise BackendError(f"runsc could not {what} the sandbox (exit {code}): {tail}")

    async def is_running(self, sandbox_id: str) -> bool:
        if self.freezer.state(sandbox_id) in ("frozen", "freezing"):
            # `runsc state` asks the sandbox and would wait for the thaw (measured: it hangs). A frozen group
            # with processes in it is a sandbox that runs, parked.
            return self.freezer.has_tasks(sandbox_id)
        proc = await asyncio.create_subprocess_exec(
            *self._runsc_for(sandbox_id, "state", sandbox_id),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        out, _ = await proc.communicate()
        if proc.returncode != 0:
            return False
        try:
            return bool(json.loads(out).get("status") == "running")
        except ValueError:
            return False

    # -- checkpoints (suspend, snapshots, forks) ------------------------------------------------------

    #: Where the agent's QUIESCE waits for the wake file (a guest path; see docs/agent-protocol.md).
    wake_path = f"{GUEST_CTL_DIR}/{WAKE_FILE_NAME}"

    def _lock(self, sandbox_id: str) -> asyncio.Lock:
        return self._locks.setdefault(sandbox_id, asyncio.Lock())

    def has_checkpoint(self, image_dir: Path) -> bool:
        return (image_dir / CHECKPOINT_FILE).is_file()

    async def checkpoint(self, sandbox_id: str, image_dir: Path, restored_at_once: bool = False) -> None:
        """Save the sandbox's memory and processes into ``image_dir`` (created); the sandbox then stops, its
        writable layer stays. The agent must be quiesced first (gVisor cannot save a host socket).

        A sandbox in gVisor's root overlay (root_overlay.py) first has its overlay written as a tar beside its
        layer, so that :meth:`copy_disk` can give its files while it is suspended: they are its files as its
        suspend began (what its processes write in the moments between the tar and the checkpoint is in its
        memory, which resumes with it, but not in that tar). Not when ``restored_at_once`` (a memory snapshot:
        the caller restores it right after copying the disk below).

        On failure ``image_dir`` (and that tar) is removed; the sandbox may still run (then :meth:`wake` it)
        or be gone.
        """
        async with self._lock(sandbox_id):
            if sandbox_id in self._doomed:
                raise BackendError("the sandbox is being deleted")
            image_dir.mkdir(parents=True, exist_ok=True)
            bundle = self._dir(sandbox_id) / "bundle"
            tar = self._dir(sandbox_id) / "layer" / SUSPENDED_TAR
            try:
                record = bundle / USR_RECORD
                if record.is_file():  # a fork restored from this checkpoint must mount the same /usr
                    shutil.copyfile(record, image_dir / USR_RECORD)
                overlay = read_record(bundle)
                write_record(image_dir, overlay)  # and the same root overlay
                if overlay is not None and not restored_at_once:
                    # Not paused first: runsc cannot tar a paused sandbox's overlay (it waits for ever).
                    await self._tar_upper(sandbox_id, tar)
                await run_tool(
                    *self._runsc_for(sandbox_id, "checkpoint", "--image-path", str(image_dir), sandbox_id)
                )
            except BaseException:
                shutil.rmtree(image_dir, ignore_errors=True)
                tar.unlink(missing_ok=True)
                raise
            await self._forget_stopped(sandbox_id)
            if not restored_at_once:
                # A suspended sandbox must wake after a host crash: its layer (a fresh one's journal commits
                # only every 5 s) and its checkpoint on the host's disk first (test_persistent's reboot case).
                await WritableLayer(self._dir(sandbox_id) / "layer").sync()
                await asyncio.to_thread(_fsync_tree, image_dir)

    async def _tar_upper(self, sandbox_id: str, dest: Path) -> None:
        """Write the running sandbox's root overlay as a tar at ``dest`` (replaced whole, never half-written:
        made beside it and renamed). The sentry holds the overlay's tree locked while it writes, so no file is
        made, renamed or removed meanwhile: the tar is of one moment of the tree, as a crash would leave it; and
        each file's lock from its header to its content (runsc/patches/tmpfs-tar-writes-each-file-locked.patch),
        so a process writing it meanwhile never fails the tar.
        A runsc whose tar reads each file whole (not :attr:`RunscInfo.overlay_tar_streams`: the sandbox was
        booted by a runsc that streams, which was replaced since) refuses (BackendError, nothing written) when
        the overlay's files would not fit in what the sandbox's memory has free (root_overlay.tar_refusal)."""
        if not self._runsc().overlay_tar_streams:
            usage = read_usage(f"{CGROUP_PARENT}/{sandbox_id}", None)
            held = filestore_bytes(self._sentry_pids(sandbox_id), self._dir(sandbox_id) / "layer")
            if usage is not None and (
                refusal := tar_refusal(held, usage.memory_bytes, usage.memory_limit_bytes)
            ):
                raise BackendError(refusal)
        partial = dest.with_name(f".{dest.name}.partial")
        try:
            await run_tool(
                *self._runsc_for(sandbox_id, "tar", "rootfs-upper", "--file", str(partial), sandbox_id)
            )
            os.replace(partial, dest)
        finally:
            partial.unlink(missing_ok=True)

    async def _forget_stopped(self, sandbox_id: str) -> None:
        """After a checkpoint: wait for the sandbox's processes to exit, then drop runsc's state file, which
        would refuse a restore under the same id.

        ``runsc delete`` would do the same but spends 1.3 s here (measured) after there is nothing left to
        stop; the cgroup is kept and reused by the restore. Falls back to ``runsc delete`` when the state
        cannot be read or a process outlives the wait.
        """
        pids = self._runsc_pids(sandbox_id)
        deadline = asyncio.get_running_loop().time() + STOP_WAIT_SECS
        while pids and any(_alive(pid) for pid in pids if pid > 0):
            if asyncio.get_running_loop().time() > deadline:
                pids = []
                break
            await asyncio.sleep(0.005)
        if not pids:
            # Best effort: the checkpoint is made; a restore deletes whatever state is left first.
            with contextlib.suppress(BackendError):
                await run_tool(*self._runsc_for(sandbox_id, "delete", "--force", sandbox_id))
            return
        for leftover in self.runsc_root.glob(f"{sandbox_id}_sandbox:{sandbox_id}.*"):
            leftover.unlink(missing_ok=True)
        self._control_socket(sandbox_id).unlink(missing_ok=True)

    def _control_socket(self, sandbox_id: str) -> Path:
        """The unix socket runsc (release 20230130 and later) controls a sandbox through. A stopped sandbox's
        socket must go before a restore under the same id: runsc would not reuse it and would try /var/run,
        /run and /tmp instead, leaving a socket file in each, then fail."""
        return self.runsc_root / f"runsc-{sandbox_id}.sock"

    async def restore(self, sandbox_id: str, image_dir: Path) -> None:
        """Start the checkpointed sandbox again from ``image_dir``, on its own bundle and layer; its agent
        listens again at once. Raises BackendError when the sandbox is being deleted."""
        async with self._lock(sandbox_id):
            if sandbox_id in self._doomed:
                raise BackendError("the sandbox is being deleted")
            directory = self._dir(sandbox_id)
            if self._has_runsc_state(sandbox_id):  # the checkpoint's cleanup did not happen (a crash)
                await run_tool(*self._runsc_for(sandbox_id, "delete", "--force", sandbox_id))
            self._control_socket(sandbox_id).unlink(missing_ok=True)
            _checkpointed_usr(image_dir)  # the /usr its bundle mounts is still the file it checkpointed with
            # After a host reboot the mounts and the network namespace are gone: made again first.
            await WritableLayer(directory / "layer").ensure_mounted()
            if self.net is not None:
                await self.net.ensure(sandbox_id)
            touch_regular(directory / "ctl", WAKE_FILE_NAME)
            await self._start(sandbox_id, directory / "bundle", directory / "console.log", image_dir)
            # It runs on: its overlay, back from the checkpoint, is no longer what the tar of its suspend holds.
            (directory / "layer" / SUSPENDED_TAR).unlink(missing_ok=True)

    async def wake(self, sandbox_id: str) -> None:
        """End a quiesce of a sandbox that still runs (a checkpoint failed or was not needed)."""
        touch_regular(self._dir(sandbox_id) / "ctl", WAKE_FILE_NAME)

    async def copy_disk(self, sandbox_id: str, dest: Path, below_checkpoint: bool = False) -> None:
        """Copy the sandbox's disk to ``dest`` as an ext4 layer image, consistent. Works whether the sandbox
        runs or is checkpointed.

        The ext4 layer is copied frozen (writers wait meanwhile). A sandbox in gVisor's root overlay
        (root_overlay.py) has its files above that layer: its overlay, as a tar (made now, or the one its
        suspend made), is applied onto the copy (upper_tar.py), so the copy holds every file it sees.
        ``below_checkpoint``: the copy goes with the checkpoint just taken (a memory snapshot), which holds the
        overlay itself; only the layer below is copied.
        """
        async with self._lock(sandbox_id):
            if sandbox_id in self._doomed:
                raise BackendError("the sandbox is being deleted")
            directory = self._dir(sandbox_id)
            layer = WritableLayer(directory / "layer")
            if below_checkpoint or read_record(directory / "bundle") is None:
                await copy_frozen(layer.disk_dir, layer.image_file, dest)
                return
            tar = layer.directory / SUSPENDED_TAR
            made = self._sentry_running(sandbox_id)  # asked for its overlay now; else its suspend's tar
            if made:
                # A tar beside a running sandbox is stale (a sandboxd killed between a suspend's tar and its
                # checkpoint left it): never to be read for it.
                tar.unlink(missing_ok=True)
                tar = directory / "snapshot-upper.tar"
                await self._tar_upper(sandbox_id, tar)
            elif not tar.is_file():
                raise BackendError(
                    "the suspended sandbox's files are only in its checkpoint (its suspend kept no tar of them); "
                    "resume it, then take the disk snapshot"
                )
            try:
                await copy_frozen(layer.disk_dir, layer.image_file, dest)
                await _apply_onto_image(tar, dest, directory / "snapshot-mount")
            finally:
                if made:
                    tar.unlink(missing_ok=True)

    def disk_used_bytes(self, sandbox_id: str) -> int:
        """Bytes in use on the sandbox's disk: its ext4 layer's, and what its root overlay holds (the
        filestore its sentry keeps open, or the tar its suspend made); 0 when it has none."""
        directory = self._dir(sandbox_id)
        layer = WritableLayer(directory / "layer")
        used = layer.used_bytes()
        try:
            overlay = read_record(directory / "bundle")
        except BackendError:
            overlay = None
        if overlay is None:
            return used
        if self._sentry_running(sandbox_id):
            return used + filestore_bytes(self._sentry_pids(sandbox_id), layer.directory)
        with contextlib.suppress(OSError):  # suspended: its overlay is as large as its suspend's tar
            return used + (layer.directory / SUSPENDED_TAR).stat().st_blocks * 512
        return used

    def _sentry_running(self, sandbox_id: str) -> bool:
        """Whether the sandbox's sentry runs (a checkpointed one has no runsc state left: _forget_stopped)."""
        return any(_alive(pid) for pid in self._sentry_pids(sandbox_id))

    def _sentry_pids(self, sandbox_id: str) -> list[int]:
        """The pid of the sandbox's sentry (first of :meth:`_runsc_pids`); empty when it has none."""
        return self._runsc_pids(sandbox_id)[:1]

    def _runsc_pids(self, sandbox_id: str) -> list[int]:
        """The pids of the sandbox's sentry and of its gofer (0 when it has none) from runsc's state file;
        empty when there is no state file or it cannot be read."""
        for state_file in self.runsc_root.glob(f"{sandbox_id}_sandbox:{sandbox_id}.state"):
            try:
                state = json.loads(state_file.read_text())
                return [int(state["sandbox"]["pid"]), int(state.get("goferPid") or 0)]
            except (OSError, ValueError, KeyError, TypeError):
                return []
        return []

    async def destroy(self, sandbox_id: str) -> None:
        # Marked first: a checkpoint or restore under way for it must not bring it back.
        self._doomed.add(sandbox_id)
        try:
            await self._destroy(sandbox_id)
        finally:
            self._doomed.discard(sandbox_id)
            self._locks.pop(sandbox_id, None)

    def _has_runsc_state(self, sandbox_id: str) -> bool:
        """Whether runsc still keeps state for the sandbox's container."""
        return any(self.runsc_root.glob(f"{sandbox_id}*"))

    async def _destroy(self, sandbox_id: str) -> None:
        directory = self._dir(sandbox_id)
        # A parked sandbox first: runsc's kill asks the sentry, and a v1 frozen task ignores SIGKILL until thawed.
        self.freezer.thaw(sandbox_id)
        if self._has_runsc_state(sandbox_id):
            # kill may fail when it already stopped; delete --force then cleans up what is left.
            for args in (("kill", sandbox_id, "KILL"), ("delete", "--force", sandbox_id)):
                try:
                    await run_tool(*self._runsc_for(sandbox_id, *args))
                except BackendError:
                    pass
        self._control_socket(sandbox_id).unlink(missing_ok=True)
        if self.net is not None:
            await self.net.destroy(sandbox_id)  # reads the sandbox's network.json: before the rmtree
        async with self._lock(sandbox_id):  # after a disk copy under way: a frozen layer cannot unmount
            await WritableLayer(directory / "layer").remove()
            binds = directory / "volumes"
            await unmount_all(sorted(binds.iterdir()) if binds.is_dir() else [])
            shutil.rmtree(directory, ignore_errors=True)
        self._remove_cgroup(sandbox_id)

    @staticmethod
    def _remove_cgroup(sandbox_id: str) -> None:
        """runsc leaves empty cgroup directories behind on cgroup v1; remove them."""
        root = Path("/sys/fs/cgroup")
        for candidate in [root / CGROUP_PARENT.strip("/") / sandbox_id] + [
            c / CGROUP_PARENT.strip("/") / sandbox_id for c in root.iterdir() if c.is_dir()
        ]:
            try:
                candidate.rmdir()
            except OSError:
                pass

    def host_interface(self, sandbox_id: str) -> str | None:
        """The host end of the sandbox's veth; None for a sandbox without network (mode ``none``)."""
        return self.net.host_interface(sandbox_id) if self.net is not None else None

    # -- parking (freezer.py) ---------------------------------------------------------------------------

    async def park(self, sandbox_id: str) -> None:
        """Freeze the sandbox's cgroup (sentry, gofer and systrap stubs: no CPU at all); see freezer.py."""
        await self.freezer.freeze(sandbox_id)

    async def unpark(self, sandbox_id: str) -> None:
        """Thaw the sandbox's cgroup; nothing when it is not frozen or does not exist."""
        self.freezer.thaw(sandbox_id)

    async def is_parked(self, sandbox_id: str) -> bool:
        return self.freezer.state(sandbox_id) == "frozen" and self.freezer.has_tasks(sandbox_id)

    async def usage(self, sandbox_id: str) -> BackendUsage | None:
        """The counters of the sandbox's cgroup, processes and interface (see host_counters.py)."""
        # On the event loop: about ten reads of kernel-generated files, 0.15 ms in all, which never wait on a
        # disk; a worker thread would double the CPU cost (measured).
        return read_usage(f"{CGROUP_PARENT}/{sandbox_id}", self.host_interface(sandbox_id))
