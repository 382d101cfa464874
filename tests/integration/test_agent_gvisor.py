"""Smoke test: sbx-agent as PID 1 of a real gVisor sandbox, reached through --host-uds=create.

Boots the installed default image (under ``$SBX_DATA_ROOT/images``, what scripts/install.sh builds) read-only
on the platform sandboxd would choose; the sandbox's writes go to tmpfs. Runs wherever the other integration
tests run (their skip, in conftest.py, names what is missing); needs gcc to build the agent from source.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sandboxd_harness import IMAGES_DIR, RUNSC

from sbx.agent.build import ensure_agent
from sbx.agent.client import AgentClient, AgentRequestError, CommandNotFound
from sbx.backends.runsc import choose_platform, inspect_runsc, release_root
from sbx.images.store import ImageStore

NOBODY = 65534
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp"}
# Docker's default set: enough for the agent to switch users and signal its children.
CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_MKNOD",
    "CAP_AUDIT_WRITE", "CAP_SETFCAP",
]  # fmt: skip


def _default_rootfs() -> Path:
    """The installed default image's root (missing_requirements() has checked that an image exists)."""
    image = ImageStore(IMAGES_DIR).get("default")
    assert image is not None, f"no default image in {IMAGES_DIR}: run scripts/install.sh"
    return image.rootfs


pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc builds sbx-agent: run scripts/install.sh"),
]


def _config(rootfs: Path, agent: Path, ctl: Path) -> dict[str, object]:
    return {
        "ociVersion": "1.0.0",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": ["/.sbx/agent", "--listen", "/.sbx/ctl/agent.sock"],
            "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "capabilities": {k: CAPS for k in ("bounding", "effective", "permitted")},
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "sandbox",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/.sbx/agent", "type": "bind", "source": str(agent), "options": ["rbind", "ro"]},
            {"destination": "/.sbx/ctl", "type": "bind", "source": str(ctl), "options": ["rbind", "rw"]},
        ],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")]},
    }


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Path]:
    """A running gVisor sandbox whose init is the agent; yields the host path of its socket."""
    state = Path(tempfile.mkdtemp(prefix="sbxg-"))
    agent = ensure_agent(state / "bin" / "sbx-agent")
    ctl = state / "ctl"
    ctl.mkdir(mode=0o700)
    bundle = state / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(_config(_default_rootfs(), agent, ctl)))
    root = state / "runroot"
    cid = f"sbx-agent-test-{uuid.uuid4().hex[:8]}"
    info = inspect_runsc(RUNSC)
    platform, _ = choose_platform(info, "auto", agent, state / "probe")
    base = [RUNSC, "--root", str(root), *info.start_flags(platform), "--network=none", "--host-uds=create"]
    with open(state / "runsc.log", "wb") as log:
        subprocess.run(
            [*base, "run", "--detach", "--bundle", str(bundle), cid],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True, timeout=60,
        )  # fmt: skip
    try:
        yield ctl / "agent.sock"
    finally:
        subprocess.run([*base, "kill", cid, "KILL"], capture_output=True, timeout=30, check=False)
        subprocess.run([*base, "delete", "-force", cid], capture_output=True, timeout=30, check=False)
        release_root(root)
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
async def client(sandbox: Path) -> AsyncIterator[AgentClient]:
    c = await AgentClient.connect(sandbox, timeout_secs=20)
    yield c
    await c.close()


class Recorder:
    def __init__(self) -> None:
        self.out = bytearray()
        self.exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_output(self, stream: str, data: bytes) -> None:
        self.out += data

    async def on_exit(self, exit_code: int) -> None:
        self.exit.set_result(exit_code)


_handles = iter(range(1, 1 << 30))


async def run(c: AgentClient, argv: list[str], uid: int = 0, tty: tuple[int, int] | None = None) -> Recorder:
    rec = Recorder()
    h = next(_handles)
    await c.spawn(h, argv, ENV, "/tmp", uid, uid, tty=tty, sink=rec)
    await asyncio.wait_for(rec.exit, 30)
    await c.forget(h)
    return rec


async def test_agent_is_init_and_runs_processes_as_the_user(client: AgentClient) -> None:
    assert client.agent_pid == 1
    rec = await run(client, ["sh", "-c", "id -u; cat /proc/1/cmdline | tr '\\0' ' '"], uid=NOBODY)
    assert rec.exit.result() == 0
    lines = rec.out.decode().splitlines()
    assert lines[0] == str(NOBODY) and lines[1].startswith("/.sbx/agent --listen")
    assert (await run(client, ["sh", "-c", "exit 5"])).exit.result() == 5
    with pytest.raises(CommandNotFound):
        await client.spawn(next(_handles), ["no-such-cmd"], ENV, "/", 0, 0)


async def test_process_pipes_hold_a_mebibyte_under_gvisor(client: AgentClient) -> None:
    """gVisor grants the agent's F_SETPIPE_SZ (each fill of a pipe is a round trip through the sentry)."""
    script = "import fcntl; print(*(fcntl.fcntl(fd, 1032) for fd in (0, 1, 2)))"  # F_GETPIPE_SZ
    rec = await run(client, ["python3", "-c", script], uid=NOBODY)
    assert (rec.exit.result(), rec.out.decode()) == (0, "1048576 1048576 1048576\n")


async def test_files_and_terminal(client: AgentClient) -> None:
    data = os.urandom(3 * 1024 * 1024)

    async def one() -> AsyncIterator[bytes]:
        yield data

    await client.write_file("/tmp/u/f.bin", one(), NOBODY, NOBODY)
    assert (await client.stat("/tmp/u", 0, 0)).uid == NOBODY
    got = b"".join([c async for c in client.read_file("/tmp/u/f.bin", NOBODY, NOBODY)])
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    assert [e.name for e in await client.list_dir("/tmp/u", 0, 0)] == ["f.bin"]
    rec = await run(client, ["sh", "-c", "tty; stty size"], tty=(30, 100))
    text = rec.out.decode().replace("\r", "")
    assert text.startswith("/dev/pts/") and "30 100" in text


async def test_reconnect_keeps_processes(sandbox: Path) -> None:
    first = await AgentClient.connect(sandbox, 20)
    await first.spawn(9001, ["sh", "-c", "sleep 0.5; echo after"], ENV, "/", 0, 0)
    await first.close()
    second = await AgentClient.connect(sandbox, 20)
    rec = Recorder()
    await second.set_process_sink(9001, rec)
    assert await asyncio.wait_for(rec.exit, 20) == 0 and rec.out == b"after\n"
    await second.forget(9001)
    await second.close()


async def test_round_trip_of_true(client: AgentClient) -> None:
    """Spawn latency inside gVisor: to SPAWNED, to EXITED, and a run (stdin closed with the spawn)."""
    await client.list_processes()  # every handle known: spawn may pipeline the stdin close
    to_spawned, to_exited, runs = [], [], []
    for i in range(35):
        for close in (False, True):
            rec, h = Recorder(), next(_handles)
            t = time.perf_counter()
            await client.spawn(h, ["/bin/true"], ENV, "/tmp", 0, 0, sink=rec, close_stdin=close)
            spawned = time.perf_counter() - t
            assert await asyncio.wait_for(rec.exit, 30) == 0
            exited = time.perf_counter() - t
            await client.forget(h)
            if i < 5:
                continue  # warm-up
            if close:
                runs.append(exited)
            else:
                to_spawned.append(spawned)
                to_exited.append(exited)

    def p50_ms(v: list[float]) -> float:
        return sorted(v)[len(v) // 2] * 1000

    status = (await run(client, ["cat", "/proc/1/status"])).out.decode()
    rss = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("VmRSS:"))
    print(
        f"gVisor /bin/true over {len(runs)}: spawn->SPAWNED p50 {p50_ms(to_spawned):.1f} ms, "
        f"spawn->EXITED p50 {p50_ms(to_exited):.1f} ms, run with stdin closed p50 {p50_ms(runs):.1f} ms; "
        f"agent RSS {rss} KiB"
    )
    assert p50_ms(runs) < 1000


# A socket server on guest loopback: reads until the host's half-close, answers with what it saw
# (peer address, byte count, digest) and the data four times over, then half-closes its side.
TCP_SERVER = r"""
import hashlib, socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(8)
print(s.getsockname()[1], flush=True)
c, peer = s.accept()
data = bytearray()
while chunk := c.recv(1 << 16):
    data += chunk
c.sendall(f"{peer[0]} {len(data)} {hashlib.sha256(data).hexdigest()}\n".encode())
for _ in range(4):
    c.sendall(data)
c.shutdown(socket.SHUT_WR)
c.recv(1)
"""


async def test_tcp_tunnel_to_guest_loopback(client: AgentClient) -> None:
    rec, h = Recorder(), next(_handles)
    await client.spawn(h, ["python3", "-c", TCP_SERVER], ENV, "/tmp", NOBODY, NOBODY, sink=rec)
    deadline = time.monotonic() + 30
    while b"\n" not in rec.out:
        assert not rec.exit.done(), f"the server exited: {rec.out!r}"
        assert time.monotonic() < deadline, "the server in the sandbox did not start listening"
        await asyncio.sleep(0.02)
    port = int(rec.out)
    with pytest.raises(AgentRequestError) as info:
        await client.open_tcp(port + 1 if port < 65535 else port - 1)
    assert info.value.errno == errno.ECONNREFUSED
    data = os.urandom(5 * 1024 * 1024)
    t = time.perf_counter()
    async with await client.open_tcp(port) as stream:
        await stream.write(data)
        await stream.write_eof()  # the server reads to its end of file, then answers
        got = bytearray()
        while chunk := await stream.read():  # ends at the server's shutdown(SHUT_WR)
            got += chunk
    secs = time.perf_counter() - t
    header, _, body = bytes(got).partition(b"\n")
    assert header.decode() == f"127.0.0.1 {len(data)} {hashlib.sha256(data).hexdigest()}"
    assert body == data * 4
    print(f"gVisor tunnel: 5 MiB in and 20 MiB out in {secs:.2f}s ({25 / secs:.0f} MiB/s)")
    assert await asyncio.wait_for(rec.exit, 10) == 0
    await client.forget(h)
