"""The gVisor backend: each sandbox is a `runsc` sandbox (ptrace platform) with the agent as its init.

Per sandbox, under ``<state>/gvisor/<id>/``::

    bundle/config.json   the OCI spec runsc boots from
    layer/               writable layer and overlay root (see layers.py)
    ctl/                 mode 0700, bind-mounted at /.sbx/ctl; the agent creates agent.sock here
    console.log          the agent's and runsc's own diagnostics

The agent binary is bind-mounted read-only at /.sbx/agent; runsc runs with ``--host-uds=create`` so the agent
can create its listening socket in the control directory, where the host connects (and reconnects after a
sandboxd restart). runsc keeps its own state in ``<state>/gvisor/runsc``; ``runsc run --detach`` leaves the
sandbox running outside sandboxd's process tree, so killing sandboxd never stops a sandbox.

Isolation: pid, mount, ipc, uts and network namespaces; CPU quota, memory and pid limits through the cgroup
``/sandboxd/<id>``; network mode ``none`` (loopback only, gVisor's own stack).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

from sbx.backends.base import BackendError, BackendUsage, BootSpec
from sbx.backends.host_counters import read_usage
from sbx.backends.layers import LayerPool, WritableLayer, run_tool

#: The in-sandbox paths of the agent and its control directory.
GUEST_AGENT_PATH = "/.sbx/agent"
GUEST_CTL_DIR = "/.sbx/ctl"
AGENT_SOCKET_NAME = "agent.sock"

#: Host threads and processes a sandbox may have (ptrace runs a stub per guest address space); stops a fork
#: bomb from exhausting the host's pid space.
PIDS_LIMIT = 2048
CPU_PERIOD_US = 100_000
CGROUP_PARENT = "/sandboxd"

_GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def oci_spec(spec: BootSpec, rootfs: Path, agent_path: Path, ctl_dir: Path) -> dict[str, Any]:
    """The OCI runtime spec for one sandbox: the agent as init, limits in the cgroup."""
    return {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [GUEST_AGENT_PATH, "--listen", f"{GUEST_CTL_DIR}/{AGENT_SOCKET_NAME}"],
            "env": [f"PATH={_GUEST_PATH}"],
            "cwd": "/",
            "capabilities": {
                key: ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL", "CAP_SETGID", "CAP_SETUID"]
                for key in ("bounding", "effective", "permitted")
            },
            "noNewPrivileges": False,
        },
        "root": {"path": str(rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
            # runsc mounts /sys, /dev/pts and a tmpfs /tmp by itself; naming them again costs ~15 ms a boot.
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "nodev"]},
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


class GVisorBackend:
    """Runs sandboxes with gVisor's runsc. ``state_dir`` is sandboxd's state directory."""

    name = "gvisor"
    network_modes = frozenset({"none"})

    def __init__(
        self,
        state_dir: Path,
        agent_path: Path,
        platform: str = "ptrace",
        runsc: str = "runsc",
        pooled_disk_mb: int = 0,
    ) -> None:
        """``pooled_disk_mb`` > 0 keeps writable layers of that size (the default disk) ready ahead of time."""
        self.base = state_dir / "gvisor"
        self.runsc_root = self.base / "runsc"
        self.agent_path = agent_path
        self.platform = platform
        self.runsc = runsc
        self.layer_pool = LayerPool(self.base / "layer-pool", pooled_disk_mb) if pooled_disk_mb else None

    async def start(self) -> None:
        """Background work: keep the layer pool filled."""
        if self.layer_pool is not None:
            await self.layer_pool.start()

    async def close(self) -> None:
        if self.layer_pool is not None:
            await self.layer_pool.close()

    def check(self) -> None:
        """Raise BackendError naming what is missing on this host."""
        if shutil.which(self.runsc) is None:
            raise BackendError(
                f"{self.runsc} not found: install gVisor (Debian package runsc) or run scripts/install.sh"
            )
        for tool in ("mkfs.ext4", "mount", "umount"):
            if shutil.which(tool) is None:
                raise BackendError(f"{tool} not found: install e2fsprogs and mount (scripts/install.sh does)")
        if not self.agent_path.is_file():
            raise BackendError(
                f"the sandbox agent {self.agent_path} is missing: build it with "
                f"`python -m sbx.agent.build --out {self.agent_path}` (scripts/install.sh does)"
            )
        if os.geteuid() != 0:
            raise BackendError("sandboxd must run as root to create gVisor sandboxes")
        self.runsc_root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _dir(self, sandbox_id: str) -> Path:
        return self.base / sandbox_id

    def agent_socket(self, sandbox_id: str) -> Path:
        return self._dir(sandbox_id) / "ctl" / AGENT_SOCKET_NAME

    def _runsc_argv(self, *args: str) -> list[str]:
        return [self.runsc, "--root", str(self.runsc_root), *args]

    def _runsc_for(self, sandbox_id: str, *args: str) -> list[str]:
        """argv of a runsc command about an existing sandbox (state, kill, delete, checkpoint, restore).

        Every such command must go through here: a sandbox with its own network namespace has an abstract
        control socket that is reachable only from inside that namespace.
        """
        return self._runsc_argv(*args)

    async def boot(self, spec: BootSpec) -> None:
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
            await layer.create(spec.image_root, spec.disk_mb, self.layer_pool)
            (bundle / "config.json").write_text(
                json.dumps(oci_spec(spec, layer.rootfs, self.agent_path, ctl_dir)), encoding="utf-8"
            )
            await self._start(spec.sandbox_id, bundle, directory / "console.log")
        except BaseException:
            await self.destroy(spec.sandbox_id)
            raise

    async def _start(self, sandbox_id: str, bundle: Path, console: Path) -> None:
        with open(console, "ab") as log:  # noqa: ASYNC230 - opening a log file does not wait on anything
            proc = await asyncio.create_subprocess_exec(
                *self._runsc_argv(
                    f"--platform={self.platform}", "--network=none", "--host-uds=create", "--cpu-num-from-quota",
                    "run", "--detach", "--bundle", str(bundle), sandbox_id,
                ),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True,  # never in sandboxd's process group: a signal to it must not reach here
            )  # fmt: skip
            code = await proc.wait()
        if code != 0:
            tail = console.read_bytes()[-2000:].decode(errors="replace").strip()
            raise BackendError(f"runsc could not start the sandbox (exit {code}): {tail}")

    async def is_running(self, sandbox_id: str) -> bool:
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

    async def destroy(self, sandbox_id: str) -> None:
        directory = self._dir(sandbox_id)
        if (
            (self.runsc_root / sandbox_id).exists()
            or (self.runsc_root / f"{sandbox_id}_sandbox").exists()
            or any(self.runsc_root.glob(f"{sandbox_id}*"))
        ):
            # kill may fail when it already stopped; delete --force then cleans up what is left.
            for args in (("kill", sandbox_id, "KILL"), ("delete", "--force", sandbox_id)):
                try:
                    await run_tool(*self._runsc_for(sandbox_id, *args))
                except BackendError:
                    pass
        await WritableLayer(directory / "layer").remove()
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
        """The host end of the sandbox's network interface; None while sandboxes get none (mode ``none``)."""
        return None

    async def usage(self, sandbox_id: str) -> BackendUsage | None:
        """The counters of the sandbox's cgroup, processes and interface (see host_counters.py)."""
        # On the event loop: about ten reads of kernel-generated files, 0.15 ms in all, which never wait on a
        # disk; a worker thread would double the CPU cost (measured).
        return read_usage(f"{CGROUP_PARENT}/{sandbox_id}", self.host_interface(sandbox_id))
