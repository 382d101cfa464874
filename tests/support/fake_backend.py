"""A fake backend for tests, with NO isolation: each sandbox is the real sbx-agent run as a host process.

It implements :class:`sbx.backends.base.Backend` as simply as it can, so that the backend contract
(tests/integration/test_backend_contract.py) is checked against a second implementation and node code can be
tested without gVisor. Never registered as a ``[backend] kind`` sandboxd accepts: tests that want it in a node
call :func:`sbx.node.backend_kinds.register` themselves.

Per sandbox, under ``<state>/fake/<id>/``: ``agent.sock``, ``pid`` (of ``unshare``, whose child the agent is,
pid 1 of its own pid namespace: killing ``unshare`` ends every process of the sandbox) and ``console.log``.
Processes run as ``nobody`` in a home shared by all sandboxes (made in the host's temp directory by
:meth:`FakeBackend.check`, where nobody can reach it, and removed by :meth:`FakeBackend.close`), on the host's
files.
Volumes are plain directories (:class:`DirVolumes`), whose size is not enforced, and cannot be shown in a
sandbox (a boot with volumes is refused). Parking stops every process of the sandbox with SIGSTOP (SIGCONT
lets them go on); a sandbox is parked while its agent is stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import tempfile
import uuid
from pathlib import Path

from sbx.agent.client import AgentClient
from sbx.api.network_policy import NetworkPolicy
from sbx.api.node import Runtime
from sbx.backends.base import BackendError, BackendUsage, BootSpec, GuestUser, VolumeDisks

NOBODY = 65534
#: How long a boot waits for the agent's socket, in seconds.
BOOT_WAIT_SECS = 10.0


class DirVolumes:
    """Volumes as directories: ``<volume dir>/data``, owned by the guest user; attached means it exists."""

    def __init__(self, owner: GuestUser) -> None:
        self.owner = owner

    async def create(self, directory: Path, size_mb: int) -> None:
        (directory / "data").mkdir()
        os.chown(directory / "data", self.owner.uid, self.owner.gid)
        (directory / "attached").unlink(missing_ok=True)

    def is_attached(self, directory: Path) -> bool:
        return (directory / "attached").exists()

    async def attach(self, directory: Path) -> Path:
        if not (directory / "data").is_dir():
            raise BackendError(f"volume {directory.name!r} has no data directory")
        (directory / "attached").touch()
        return directory / "data"

    async def flush(self, directory: Path) -> None:
        return None

    async def detach(self, directory: Path) -> None:
        (directory / "attached").unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _state(pid: int) -> str:
    """The process's state letter from /proc (``T`` stopped, ``Z`` zombie), "" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants, from /proc's children lists."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                queue.extend(int(child) for child in task.read_text().split())
            except OSError:
                continue
    return found


class FakeBackend:
    """Sandboxes as host processes of the agent binary at ``agent_path``; state under ``state_dir/fake``."""

    name = "fake"
    network_modes: frozenset[str] = frozenset({"none"})
    parking_refused: str | None = None

    def __init__(self, state_dir: Path, agent_path: Path) -> None:
        self.base = state_dir / "fake"
        self.agent_path = agent_path
        home = Path(tempfile.gettempdir()) / f"sbx-fake-home-{uuid.uuid4().hex[:12]}"
        self.guest = GuestUser(uid=NOBODY, gid=NOBODY, name="nobody", home=str(home))
        self.volumes: VolumeDisks = DirVolumes(self.guest)

    def check(self) -> None:
        if not self.agent_path.is_file():
            raise BackendError(f"the sandbox agent {self.agent_path} is missing")
        if shutil.which("unshare") is None:
            raise BackendError("unshare not found: install util-linux")
        if os.geteuid() != 0:
            raise BackendError("the fake backend runs the agent as root, which then drops to nobody")
        home = Path(self.guest.home)
        home.mkdir(exist_ok=True)
        os.chown(home, NOBODY, NOBODY)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        shutil.rmtree(self.guest.home, ignore_errors=True)

    def _dir(self, sandbox_id: str) -> Path:
        return self.base / sandbox_id

    def _pid(self, sandbox_id: str) -> int | None:
        try:
            return int((self._dir(sandbox_id) / "pid").read_text())
        except (OSError, ValueError):
            return None

    async def boot(self, spec: BootSpec) -> None:
        if spec.network.mode != "none":
            raise BackendError(f"network mode {spec.network.mode} is not supported by the fake backend")
        if spec.volumes:
            raise BackendError("the fake backend cannot show volumes in a sandbox")
        if not spec.image_root.is_dir():
            raise BackendError(f"the image root {spec.image_root} is not a directory")
        directory = self._dir(spec.sandbox_id)
        try:
            directory.mkdir(parents=True, mode=0o700)
            socket_path = directory / "agent.sock"
            with open(directory / "console.log", "ab") as log:  # noqa: ASYNC230 - a log file opens at once
                proc = await asyncio.create_subprocess_exec(
                    "unshare", "--pid", "--fork", "--kill-child", "--", str(self.agent_path),
                    "--listen", str(socket_path),
                    stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                )  # fmt: skip
            (directory / "pid").write_text(str(proc.pid))
            deadline = asyncio.get_running_loop().time() + BOOT_WAIT_SECS
            while not socket_path.exists():
                if proc.returncode is not None or asyncio.get_running_loop().time() > deadline:
                    raise BackendError("the agent did not start listening")
                await asyncio.sleep(0.01)
        except BaseException:
            await self.destroy(spec.sandbox_id)
            raise

    async def connect_agent(self, sandbox_id: str, timeout_secs: float) -> AgentClient:
        return await AgentClient.connect(self._dir(sandbox_id) / "agent.sock", timeout_secs)

    async def is_running(self, sandbox_id: str) -> bool:
        pid = self._pid(sandbox_id)
        return pid is not None and _alive(pid)

    async def destroy(self, sandbox_id: str) -> None:
        pid = self._pid(sandbox_id)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # --kill-child: the agent, pid 1 of the namespace, goes too
            for _ in range(500):  # asyncio's child watcher reaps it
                if not _alive(pid):
                    break
                await asyncio.sleep(0.01)
        shutil.rmtree(self._dir(sandbox_id), ignore_errors=True)

    async def usage(self, sandbox_id: str) -> BackendUsage | None:
        """CPU time and resident memory of the sandbox's processes (``unshare`` and all below it, exited ones
        included)."""
        pid = self._pid(sandbox_id)
        if pid is None or not _alive(pid):
            return None
        ticks, cpu_ns, rss = os.sysconf("SC_CLK_TCK"), 0, 0
        for each in _tree(pid):
            try:
                fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            # Its own time and that of the children it has waited for (the agent reaps exited processes).
            cpu_ns += sum(int(f) for f in fields[11:15]) * 1_000_000_000 // ticks
            rss += int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        return BackendUsage(cpu_ns=cpu_ns, memory_bytes=rss)

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> None:
        raise BackendError("the fake backend has no network to change")

    def _agent_pid(self, sandbox_id: str) -> int | None:
        """The agent's pid (the child of ``unshare``), None when the sandbox does not run."""
        pid = self._pid(sandbox_id)
        if pid is None or not _alive(pid):
            return None
        tree = _tree(pid)
        return tree[1] if len(tree) > 1 else None

    def _signal_tree(self, sandbox_id: str, signum: int) -> bool:
        """Send ``signum`` to every process of the sandbox, repeated until no new one appears (one forked
        while the signals went out is caught by the next pass); False when the sandbox does not run."""
        pid = self._pid(sandbox_id)
        if pid is None or not _alive(pid):
            return False
        signalled: set[int] = set()
        while True:
            fresh = [p for p in _tree(pid) if p not in signalled]
            if not fresh:
                return True
            for each in fresh:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(each, signum)
                signalled.add(each)

    async def park(self, sandbox_id: str) -> None:
        if not self._signal_tree(sandbox_id, signal.SIGSTOP):
            raise BackendError(f"sandbox {sandbox_id} is not running")
        pid = self._pid(sandbox_id)
        for _ in range(500):  # stopped within a few ms
            # Every process, not only the agent: a SIGSTOP is taken when its process next runs, so on a busy
            # host a guest's spinning process used CPU after the agent had stopped (a parked sandbox uses none).
            if pid is None or all(_state(each) in ("T", "Z", "") for each in _tree(pid)):
                return
            await asyncio.sleep(0.01)
        self._signal_tree(sandbox_id, signal.SIGCONT)
        raise BackendError("the sandbox's processes did not stop")

    async def unpark(self, sandbox_id: str) -> None:
        self._signal_tree(sandbox_id, signal.SIGCONT)

    async def is_parked(self, sandbox_id: str) -> bool:
        agent = self._agent_pid(sandbox_id)
        return agent is not None and _state(agent) == "T"

    def runtime_report(self) -> Runtime:
        return Runtime(platform="host", platform_reason="the fake backend runs the agent on the host",
                       limitations=["no isolation: for tests only"])  # fmt: skip
