"""sbx-agent run as a normal host process (as root), driven through AgentClient.

The agent is compiled once into a temp dir; each test gets its own agent on its own socket.
Processes run as uid/gid 65534 where a test proves the uid switch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hashlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sbx.agent import protocol as p
from sbx.agent.build import ensure_agent
from sbx.agent.client import (
    AgentClient,
    AgentConnectionLost,
    AgentFileError,
    AgentRequestError,
    AgentTcpStream,
    AgentUnavailable,
    CommandNotFound,
    SpawnFailed,
)
from sbx.agent.protocol import STAGE_CWD

NOBODY = 65534
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C"}

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("gcc") is None, reason="needs root (uid switch) and gcc"
)


@pytest.fixture(scope="session")
def agent_bin() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="sbx-agent-bin-"))
    yield ensure_agent(d / "sbx-agent")
    shutil.rmtree(d, ignore_errors=True)


def test_agent_source_has_no_warnings(tmp_path: Path) -> None:
    from sbx.agent.build import SOURCES

    cmd = ["gcc", "-O2", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", *map(str, SOURCES)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_build_is_idempotent(agent_bin: Path) -> None:
    before = agent_bin.stat().st_mtime_ns
    assert ensure_agent(agent_bin) == agent_bin
    assert agent_bin.stat().st_mtime_ns == before
    out = subprocess.run([str(agent_bin), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "sbx-agent protocol 4"


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    dir: Path
    sock: Path
    tunnel_sock: Path

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


@pytest.fixture
def agent(agent_bin: Path) -> Iterator[Agent]:
    d = Path(tempfile.mkdtemp(prefix="sbxa-"))  # short: unix socket paths are limited to 107 bytes
    d.chmod(0o755)
    with open(d / "agent.log", "wb") as log:
        proc = subprocess.Popen(
            [str(agent_bin), "--listen", str(d / "agent.sock"), "--tunnel-listen", str(d / "tunnel.sock")],
            stderr=log,
        )
    a = Agent(proc, d, d / "agent.sock", d / "tunnel.sock")
    # Some tests dial the tunnel socket directly, with no retry: it must listen before they run. The
    # agent listens on it before it binds the main one, so the main socket's file means it listens
    # (the main socket itself may still be between bind and listen: AgentClient.connect retries).
    deadline = time.monotonic() + 10
    while not (a.sock.exists() and a.tunnel_sock.exists()):
        assert proc.poll() is None, (
            f"the agent exited with {proc.returncode}: {(d / 'agent.log').read_text()}"
        )
        assert time.monotonic() < deadline, "the agent did not listen on both sockets within 10 s"
        time.sleep(0.005)
    yield a
    # Kill what a failed test left running (each child leads its own group; orphans were
    # reparented to the agent, a subreaper), then the agent.
    for child in _children(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signal.SIGKILL)
    proc.kill()
    proc.wait()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def client(agent: Agent) -> AsyncIterator[AgentClient]:
    c = await AgentClient.connect(agent.sock, 5, agent.tunnel_sock)
    yield c
    await c.close()


class Recorder:
    """A sink that keeps everything; ``delay_secs`` per chunk makes it a slow host."""

    def __init__(self, delay_secs: float = 0.0) -> None:
        self.out: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self.exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.delay_secs = delay_secs
        self.calls = 0

    async def on_output(self, stream: str, data: bytes) -> None:
        self.calls += 1
        if self.delay_secs:
            await asyncio.sleep(self.delay_secs)
        self.out[stream] += data

    async def on_exit(self, exit_code: int) -> None:
        self.exit.set_result(exit_code)

    async def wait(self, timeout: float = 20) -> int:
        return await asyncio.wait_for(self.exit, timeout)

    def text(self, stream: str = "stdout") -> str:
        return self.out[stream].decode()


async def run(
    c: AgentClient, handle: int, argv: list[str], uid: int = 0, cwd: str = "/", **kw: object
) -> Recorder:
    rec = Recorder()
    await c.spawn(handle, argv, kw.pop("env", ENV), cwd, uid, uid, sink=rec, **kw)  # type: ignore[arg-type]
    await rec.wait()
    return rec


async def test_echo_separates_streams(client: AgentClient) -> None:
    rec = await run(client, 1, ["sh", "-c", "echo out; echo err >&2"])
    assert rec.exit.result() == 0
    assert rec.text() == "out\n" and rec.text("stderr") == "err\n"


async def test_process_pipes_hold_a_mebibyte(client: AgentClient) -> None:
    """Each fill of a pipe is a round trip between two tasks through gVisor's sentry: the agent asks 1 MiB
    for each (Linux's pipe-max-size) rather than the default 64 KiB. F_GETPIPE_SZ is 1032."""
    script = "import fcntl; print(*(fcntl.fcntl(fd, 1032) for fd in (0, 1, 2)))"
    rec = await run(client, 1, [sys.executable, "-c", script])
    assert (rec.exit.result(), rec.text()) == (0, "1048576 1048576 1048576\n")


@pytest.mark.parametrize(
    ("script", "code"),
    [("exit 0", 0), ("exit 3", 3), ("exit 255", 255), ("kill -TERM $$", 143), ("kill -KILL $$", 137)],
)
async def test_exit_codes(client: AgentClient, script: str, code: int) -> None:
    assert (await run(client, 1, ["sh", "-c", script])).exit.result() == code


async def test_runs_as_the_requested_user(client: AgentClient) -> None:
    rec = await run(client, 1, ["sh", "-c", "id -u; id -g; id -G"], uid=NOBODY)
    assert rec.text().split() == [str(NOBODY)] * 3


async def test_env_is_exactly_the_given_one_and_cwd_applies(client: AgentClient) -> None:
    env = {"PATH": "/usr/bin:/bin", "FOO": "bar baz"}
    rec = await run(client, 1, ["sh", "-c", 'pwd; echo "$FOO"; env | sort'], cwd="/tmp", env=env)
    lines = rec.text().splitlines()
    assert lines[:2] == ["/tmp", "bar baz"]
    assert {ln.split("=")[0] for ln in lines[2:]} <= {"FOO", "PATH", "PWD", "SHLVL", "_", "OLDPWD"}


async def test_child_gets_umask_022_and_default_signals(client: AgentClient) -> None:
    # The agent ignores SIGPIPE and blocks SIGCHLD for itself; neither may leak into the child.
    rec = await run(client, 1, ["sh", "-c", "umask; grep -E '^Sig(Blk|Ign)' /proc/self/status"])
    lines = rec.text().split()
    assert lines[0] == "0022"
    assert int(lines[2], 16) == 0 and not int(lines[4], 16) & (1 << (signal.SIGPIPE - 1))


@pytest.mark.parametrize(
    ("argv", "cls", "err"),
    [
        (["no-such-program-xyz"], CommandNotFound, errno.ENOENT),
        (["/no/such/dir/prog"], CommandNotFound, errno.ENOENT),
        (["{dir}/plain"], CommandNotFound, errno.EACCES),  # exists, not executable
        (["{dir}/plain/x"], CommandNotFound, errno.ENOTDIR),
    ],
)
async def test_missing_program_is_command_not_found(
    client: AgentClient, agent: Agent, argv: list[str], cls: type[Exception], err: int
) -> None:
    (agent.dir / "plain").write_text("echo not a program\n")
    argv = [a.format(dir=agent.dir) for a in argv]
    with pytest.raises(cls) as info:
        await client.spawn(1, argv, ENV, "/", 0, 0)
    assert info.value.errno == err  # type: ignore[attr-defined]
    assert await client.list_processes() == []  # the failed child was reaped, nothing retained


@pytest.mark.parametrize(
    ("path", "cwd", "program", "out"),
    [
        ("{dir}/bin1:/usr/bin:/bin", "/", "prog", "one"),  # the requested env's PATH, not the agent's
        ("{dir}/noexec:{dir}/bin1", "/", "prog", "one"),  # EACCES is remembered, the search goes on
        ("{dir}/isdir:{dir}/bin1", "/", "prog", "one"),  # a directory of that name is skipped
        ("{dir}/bin2:{dir}/bin1", "/", "prog", "two"),  # the first match wins
        ("/usr/bin:", "{dir}/bin2", "prog", "two"),  # an empty entry is the working directory
        ("bin1", "{dir}", "prog", "one"),  # a relative entry is relative to the working directory
        ("{dir}/bin1", "/", "noshebang", "via-sh"),  # a file without #! runs with /bin/sh
        (None, "/", "true", ""),  # no PATH: libc's default (/bin:/usr/bin)
    ],
)
async def test_program_search_is_execvp_over_the_requested_path(
    client: AgentClient, agent: Agent, path: str | None, cwd: str, program: str, out: str
) -> None:
    for name, text in [("bin1/prog", "echo one"), ("bin2/prog", "echo two"), ("noexec/prog", "echo no")]:
        f = agent.dir / name
        f.parent.mkdir(exist_ok=True)
        f.write_text(f"#!/bin/sh\n{text}\n")
        f.chmod(0o644 if name.startswith("noexec") else 0o755)
    (agent.dir / "bin1" / "noshebang").write_text("echo via-sh\n")
    (agent.dir / "bin1" / "noshebang").chmod(0o755)
    (agent.dir / "isdir" / "prog").mkdir(parents=True)
    env = {"LANG": "C"} if path is None else {"PATH": path.format(dir=agent.dir)}
    rec = await run(client, 1, [program], cwd=cwd.format(dir=agent.dir), env=env)
    assert (rec.exit.result(), rec.text().strip()) == (0, out)


async def test_program_found_only_without_permission_is_eacces(client: AgentClient, agent: Agent) -> None:
    (agent.dir / "noexec").mkdir()
    (agent.dir / "noexec" / "prog").write_text("#!/bin/sh\n")
    with pytest.raises(CommandNotFound) as info:
        await client.spawn(1, ["prog"], {"PATH": f"/nonexistent:{agent.dir}/noexec"}, "/", 0, 0)
    assert info.value.errno == errno.EACCES


async def test_bad_cwd_is_a_spawn_failure_not_command_not_found(client: AgentClient) -> None:
    with pytest.raises(SpawnFailed) as info:
        await client.spawn(1, ["true"], ENV, "/no/such/dir", 0, 0)
    assert not isinstance(info.value, CommandNotFound)
    assert info.value.stage == STAGE_CWD and info.value.errno == errno.ENOENT
    # A directory the user may not enter is refused too (checked after the uid switch).
    with pytest.raises(SpawnFailed, match="working directory"):
        await client.spawn(2, ["true"], ENV, "/root", NOBODY, NOBODY)


async def test_duplicate_handle_is_refused(client: AgentClient) -> None:
    await run(client, 1, ["true"])
    other = await AgentClient.connect(client_sock(client), 5)  # a fresh connection knows no handles
    with pytest.raises(SpawnFailed, match="already in use"):
        await other.spawn(1, ["true"], ENV, "/", 0, 0)
    await other.close()


def client_sock(c: AgentClient) -> Path:
    return Path(c._writer.get_extra_info("peername"))


async def test_stdin_round_trip_with_close(client: AgentClient) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)  # several windows: proves stdin flow control
    rec = Recorder()
    await client.spawn(1, ["sha256sum"], ENV, "/", NOBODY, NOBODY, sink=rec)
    await client.write_stdin(1, data)
    await client.close_stdin(1)
    assert await rec.wait() == 0
    assert rec.text().split()[0] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("listed", [True, False])  # pipelined behind SPAWN, or after SPAWNED
@pytest.mark.parametrize(
    ("argv", "tty", "size"),
    [
        (["cat"], None, 0),
        (["cat"], None, 5),
        (["sha256sum"], None, 3 * 1024 * 1024 + 17),
        (["cat"], (24, 80), 0),
    ],
)
async def test_spawn_with_stdin_and_close(
    client: AgentClient, listed: bool, argv: list[str], tty: tuple[int, int] | None, size: int
) -> None:
    if listed:
        await client.list_processes()
    data = os.urandom(size // 2).hex().encode()[:size] if argv == ["cat"] else os.urandom(size)
    rec = Recorder()
    await client.spawn(1, argv, ENV, "/", NOBODY, NOBODY, tty=tty, sink=rec, stdin=data, close_stdin=True)
    assert await rec.wait() == 0  # ended by the close (a terminal's ^D), not left waiting for input
    if argv == ["sha256sum"]:
        assert rec.text().split()[0] == hashlib.sha256(data).hexdigest()
    elif tty is None:
        assert rec.out["stdout"] == data


async def test_refused_spawn_with_pipelined_close_leaves_nothing_behind(client: AgentClient) -> None:
    await client.list_processes()
    with pytest.raises(CommandNotFound):
        await client.spawn(1, ["no-such-program-xyz"], ENV, "/", 0, 0, stdin=b"x", close_stdin=True)
    assert await client.list_processes() == []
    rec = await run(client, 1, ["sh", "-c", "echo ok"])
    assert rec.text() == "ok\n"


async def test_signal_reaches_the_whole_process_group(client: AgentClient) -> None:
    rec = Recorder()
    await client.spawn(1, ["sh", "-c", "sleep 1000 & echo $!; wait"], ENV, "/", 0, 0, sink=rec)
    while b"\n" not in rec.out["stdout"]:
        await asyncio.sleep(0.01)
    child = int(rec.text())
    await client.signal(1, signal.SIGTERM)
    assert await rec.wait() == 143
    deadline = time.monotonic() + 5
    while Path(f"/proc/{child}").exists():  # the background sleep died and was reaped by the agent
        assert time.monotonic() < deadline, "the background child survived the group signal"
        await asyncio.sleep(0.01)


async def test_forget(client: AgentClient) -> None:
    rec = Recorder()
    await client.spawn(1, ["sleep", "1000"], ENV, "/", 0, 0, sink=rec)
    with pytest.raises(AgentRequestError) as info:
        await client.forget(1)
    assert info.value.errno == errno.EBUSY
    await client.signal(1, signal.SIGKILL)
    assert await rec.wait() == 137
    [proc] = await client.list_processes()
    assert proc.exit_code == 137
    await client.forget(1)
    assert await client.list_processes() == []
    with pytest.raises(AgentRequestError):
        await client.signal(1, signal.SIGTERM)


async def test_large_output_to_a_slow_host_keeps_agent_memory_bounded(
    client: AgentClient, agent: Agent
) -> None:
    size = 50 * 1024 * 1024
    expected = hashlib.sha256((b"0123456789abcde\n" * (size // 16 + 1))[:size]).hexdigest()

    class Digesting(Recorder):
        def __init__(self) -> None:
            super().__init__()
            self.h = hashlib.sha256()
            self.n = 0
            self.max_rss_kib = 0

        async def on_output(self, stream: str, data: bytes) -> None:
            self.h.update(data)
            self.n += len(data)
            if self.n < 8 * 1024 * 1024:  # slow for the first 8 MiB: the producer must block
                await asyncio.sleep(0.005)
            self.max_rss_kib = max(self.max_rss_kib, agent.rss_kib())

    rec = Digesting()
    argv = ["sh", "-c", f"yes 0123456789abcde | head -c {size}"]
    await client.spawn(1, argv, ENV, "/", NOBODY, NOBODY, sink=rec)
    assert await rec.wait(120) == 0
    assert rec.n == size and rec.h.hexdigest() == expected
    # 1 MiB window + 256 KiB outgoing buffer + a static binary: far below what 50 MiB would need.
    assert rec.max_rss_kib < 8 * 1024, f"agent RSS reached {rec.max_rss_kib} KiB"


async def test_reconnect_mid_stream_loses_and_duplicates_nothing(agent: Agent) -> None:
    size = 20 * 1024 * 1024
    expected = (b"0123456789\n" * (size // 11 + 1))[:size]

    class DiesAfter(Recorder):
        """Records until 2 MiB, then hangs like a host that was SIGKILLed mid-write."""

        async def on_output(self, stream: str, data: bytes) -> None:
            if len(self.out[stream]) >= 2 * 1024 * 1024:
                await asyncio.Event().wait()
            self.out[stream] += data

    first = await AgentClient.connect(agent.sock, 5)
    dying = DiesAfter()
    await first.spawn(
        1, ["sh", "-c", f"yes 0123456789 | head -c {size}; echo done >&2"], ENV, "/", 0, 0, sink=dying
    )
    while len(dying.out["stdout"]) < 2 * 1024 * 1024:
        await asyncio.sleep(0.01)

    second = await AgentClient.connect(agent.sock, 5)  # replaces the first connection
    await asyncio.wait_for(first.closed.wait(), 5)
    with pytest.raises(AgentConnectionLost):
        await first.list_processes()
    [info] = await second.list_processes()
    assert info.handle == 1
    have = bytes(dying.out["stdout"])
    rest = Recorder()
    await second.set_process_sink(1, rest, stdout_offset=len(have), stderr_offset=0)
    assert await rest.wait(60) == 0
    assert have + bytes(rest.out["stdout"]) == expected
    assert rest.text("stderr") == "done\n"
    # Output already acknowledged is gone: resuming before it is refused, not silently wrong.
    third = await AgentClient.connect(agent.sock, 5)
    await third.list_processes()
    with pytest.raises(AgentRequestError) as info_err:
        await third.set_process_sink(1, Recorder(), stdout_offset=0)
    assert info_err.value.errno == errno.ERANGE
    await third.close()
    await first.close()
    await second.close()


async def test_exited_process_is_resumable_after_reconnect(agent: Agent) -> None:
    first = await AgentClient.connect(agent.sock, 5)
    await first.spawn(1, ["sh", "-c", "echo one; echo two >&2; exit 7"], ENV, "/", 0, 0)  # no sink yet
    await first.close()
    second = await AgentClient.connect(agent.sock, 5)
    deadline = time.monotonic() + 5
    # The exit can be listed before the agent has drained the last pipe: wait for both.
    while (procs := await second.list_processes())[0].exit_code is None or procs[0].stderr_bytes < 4:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    assert (procs[0].exit_code, procs[0].stdout_bytes, procs[0].stderr_bytes) == (7, 4, 4)
    rec = Recorder()
    await second.set_process_sink(1, rec, stdout_offset=2, stderr_offset=0)
    assert await rec.wait() == 7
    assert rec.text() == "e\n" and rec.text("stderr") == "two\n"
    await second.close()


async def test_connect_times_out_clearly(tmp_path: Path) -> None:
    with pytest.raises(AgentUnavailable, match="did not accept a connection"):
        await AgentClient.connect(tmp_path / "nothing.sock", 0.2)


async def test_processes_keep_running_without_a_host(agent: Agent) -> None:
    first = await AgentClient.connect(agent.sock, 5)
    await first.spawn(1, ["sh", "-c", "read x; echo got $x"], ENV, "/", 0, 0)
    await first.write_stdin(1, b"hello\n")
    await first.close()
    await asyncio.sleep(0.2)
    second = await AgentClient.connect(agent.sock, 5)
    [info] = await second.list_processes()
    assert info.exit_code == 0 and info.stdout_bytes == len("got hello\n")
    await second.close()


async def _wait_for(check: Callable[[], bool], timeout_secs: float = 5) -> None:
    deadline = time.monotonic() + timeout_secs
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_quiesce_gives_up_every_socket_until_the_wake_file_appears(agent: Agent) -> None:
    first = await AgentClient.connect(agent.sock, 5)
    rec = Recorder()
    await first.spawn(1, ["sh", "-c", "i=0; while [ $i -lt 300 ]; do echo $i; i=$((i+1)); sleep 0.002; done"],
                      ENV, "/", 0, 0, sink=rec)  # fmt: skip
    await _wait_for(lambda: len(rec.out["stdout"]) > 20)
    wake = agent.dir / "wake"
    wake.touch()  # stale: removed by QUIESCE, so it cannot end the quiesce at once
    await first.quiesce(str(wake))
    assert first.closed.is_set() and not agent.sock.exists() and not wake.exists()
    await asyncio.sleep(0.1)
    assert not agent.sock.exists()  # still quiesced: nothing listens
    wake.touch()
    await _wait_for(agent.sock.exists)
    # The agent listens first and removes the wake file after (a failed listen is retried while the file stays):
    # the file is gone a moment after the socket is back, not necessarily at once.
    await _wait_for(lambda: not wake.exists())
    second = await AgentClient.connect(agent.sock, 5)
    rest = Recorder()
    have = bytes(rec.out["stdout"])
    await second.set_process_sink(1, rest, stdout_offset=len(have), stderr_offset=0)
    assert await rest.wait() == 0
    # Nothing lost or doubled across the quiesce: the process ran on and its output waited.
    assert (have + bytes(rest.out["stdout"])).decode().split() == [str(i) for i in range(300)]
    await second.close()


@pytest.mark.parametrize(("path", "err"), [("relative", errno.EINVAL), ("", errno.EINVAL)])
async def test_quiesce_needs_an_absolute_wake_path(
    client: AgentClient, agent: Agent, path: str, err: int
) -> None:
    with pytest.raises(AgentRequestError) as info:
        await client.quiesce(path)
    assert info.value.errno == err
    assert agent.sock.exists() and not client.closed.is_set()  # nothing changed
    assert await client.list_processes() == []


# ---- files ------------------------------------------------------------------------------------


async def chunks(data: bytes, size: int = 100_000) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def test_write_and_read_a_big_file_as_the_user(client: AgentClient, agent: Agent) -> None:
    data = os.urandom(9 * 1024 * 1024 + 3)
    home = agent.dir / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    target = home / "a" / "b" / "big.bin"
    await client.write_file(str(target), chunks(data), NOBODY, NOBODY, mode=0o640)
    st = target.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777, st.st_size) == (NOBODY, NOBODY, 0o640, len(data))
    for parent in (home / "a", home / "a" / "b"):
        assert (parent.stat().st_uid, parent.stat().st_gid) == (NOBODY, NOBODY)
    assert sorted(os.listdir(target.parent)) == ["big.bin"]  # no temp file left behind
    h = hashlib.sha256()
    async for chunk in client.read_file(str(target), NOBODY, NOBODY):
        h.update(chunk)
    assert h.digest() == hashlib.sha256(data).digest()
    reader = await client.open_read(str(target), 0, 0)
    assert reader.size == len(data)
    await reader.aclose()  # abandoning a read midway is fine
    assert (await client.stat(str(target), 0, 0)).size == len(data)


async def test_write_replaces_atomically_and_empty_files_work(client: AgentClient, agent: Agent) -> None:
    target = agent.dir / "f"
    target.write_bytes(b"old")
    await client.write_file(str(target), chunks(b""), 0, 0)
    assert target.read_bytes() == b""
    assert [c async for c in client.read_file(str(target), 0, 0)] == []


async def test_list_stat_and_remove(client: AgentClient, agent: Agent) -> None:
    d = agent.dir / "d"
    (d / "sub").mkdir(parents=True)
    (d / "file").write_bytes(b"12345")
    (d / "link").symlink_to(d / "sub")
    (d / "dangling").symlink_to(d / "nowhere")
    entries = {e.name: (e.type, e.size) for e in await client.list_dir(str(d), 0, 0)}
    assert entries == {"sub": ("dir", 0), "file": ("file", 5), "link": ("dir", 0), "dangling": ("file", 0)}
    assert (await client.stat(str(d), 0, 0)).type == "dir"
    assert (await client.stat(str(d / "file"), 0, 0)).type == "file"
    many = agent.dir / "many"
    many.mkdir()
    for i in range(1000):  # several DIR_ENTRIES batches
        (many / f"f{i}").touch()
    assert len(await client.list_dir(str(many), 0, 0)) == 1000
    await client.remove(str(d / "file"), 0, 0)
    await client.remove(str(d / "sub"), 0, 0)
    assert not (d / "file").exists() and not (d / "sub").exists()


@pytest.mark.parametrize(
    ("op", "path", "uid", "err"),
    [
        ("read", "missing", 0, errno.ENOENT),
        ("read", "secret", NOBODY, errno.EACCES),
        ("read", "dir", 0, errno.EISDIR),
        ("write", "secret_dir/x", NOBODY, errno.EACCES),
        ("write", "dir", 0, errno.EISDIR),
        ("write", "secret/x", 0, errno.ENOTDIR),
        ("remove", "missing", 0, errno.ENOENT),
        ("remove", "dir", 0, errno.ENOTEMPTY),
        ("remove", "secret_dir/inner", NOBODY, errno.EACCES),
        ("list", "missing", 0, errno.ENOENT),
        ("list", "secret_dir", NOBODY, errno.EACCES),
        ("list", "secret", 0, errno.ENOTDIR),
        ("stat", "missing", 0, errno.ENOENT),
        ("stat", "secret_dir/inner", NOBODY, errno.EACCES),
    ],
)
async def test_file_errors(client: AgentClient, agent: Agent, op: str, path: str, uid: int, err: int) -> None:
    (agent.dir / "dir").mkdir()
    (agent.dir / "dir" / "child").touch()
    (agent.dir / "secret").write_bytes(b"s")
    (agent.dir / "secret").chmod(0o600)
    (agent.dir / "secret_dir").mkdir(mode=0o700)
    (agent.dir / "secret_dir" / "inner").touch()
    full = str(agent.dir / path)
    with pytest.raises(AgentFileError) as info:
        if op == "read":
            [c async for c in client.read_file(full, uid, uid)]
        elif op == "write":
            await client.write_file(full, chunks(b"data"), uid, uid)
        elif op == "remove":
            await client.remove(full, uid, uid)
        elif op == "list":
            await client.list_dir(full, uid, uid)
        else:
            await client.stat(full, uid, uid)
    assert info.value.errno == err, info.value
    # The agent switched back to root: a root operation still works afterwards.
    assert (await client.stat(str(agent.dir / "secret"), 0, 0)).size == 1


# ---- terminals ----------------------------------------------------------------------------


async def test_tty_is_a_terminal_of_the_requested_size(client: AgentClient) -> None:
    rec = Recorder()
    await client.spawn(1, ["sh", "-c", "tty; stty size"], ENV, "/", NOBODY, NOBODY, tty=(24, 80), sink=rec)
    assert await rec.wait() == 0
    lines = rec.text().replace("\r", "").splitlines()
    assert lines[0].startswith("/dev/pts/") and lines[1] == "24 80"
    assert rec.out["stderr"] == b""


async def test_tty_resize_and_end_of_input(client: AgentClient) -> None:
    rec = Recorder()
    script = "read x; stty size; cat; echo end"
    await client.spawn(1, ["sh", "-c", script], ENV, "/", 0, 0, tty=(24, 80), sink=rec)
    await client.resize(1, 50, 132)
    await client.write_stdin(1, b"go\n")
    await client.close_stdin(1)  # ^D ends cat
    assert await rec.wait() == 0
    out = rec.text().replace("\r", "")
    assert "50 132\n" in out and out.endswith("end\n")


async def test_resize_of_a_pipe_process_is_refused(client: AgentClient) -> None:
    rec = Recorder()
    await client.spawn(1, ["sleep", "1000"], ENV, "/", 0, 0, sink=rec)
    with pytest.raises(AgentRequestError) as info:
        await client.resize(1, 10, 10)
    assert info.value.errno == errno.ENOTTY
    await client.signal(1, signal.SIGKILL)
    await rec.wait()


# ---- robustness -----------------------------------------------------------------------------


async def test_garbage_and_oversized_frames_do_not_kill_the_agent(agent: Agent) -> None:
    await (await AgentClient.connect(agent.sock, 5)).close()  # the socket exists from here on
    for junk in (b"\x7f" + b"\0" * 8, b"\x01\0\0\0\1\0\0\0\0", struct.pack(">BII", 3, 1, 1 << 30)):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(agent.sock))
        s.sendall(junk)
        s.settimeout(2)
        try:
            s.recv(100)
        except (TimeoutError, ConnectionError):
            pass
        s.close()
    c = await AgentClient.connect(agent.sock, 5)
    assert (await run(c, 1, ["true"])).exit.result() == 0
    assert agent.proc.poll() is None
    await c.close()


async def test_idle_agent_is_small(agent: Agent, client: AgentClient) -> None:
    await run(client, 1, ["true"])
    assert agent.rss_kib() < 4 * 1024


# ---- TCP tunnels ----------------------------------------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def tcp_server(handler: Handler, host: str = "127.0.0.1") -> AsyncIterator[int]:
    """A server on ``host`` (the agent's "guest loopback": it runs on the host here); yields its port."""
    server = await asyncio.start_server(handler, host, 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: What a guest writer streams at a host that does not read, and the most it may have written meanwhile: the
#: kernel buffers part of it whatever the agent does (the agent's TCP receive buffer autotunes up to
#: net.ipv4.tcp_rmem's maximum, 32 MiB on Debian; the writer's send buffer up to tcp_wmem's, 4 MiB; the unix
#: socket to the host net.core.wmem_default), so the bound is above those and far below what is sent.
FIREHOSE_BYTES = 256 * 1024 * 1024
HELD_BACK_BYTES = 64 * 1024 * 1024


def fd_count(agent: Agent) -> int:
    return len(os.listdir(f"/proc/{agent.proc.pid}/fd"))


async def read_all(stream: AgentTcpStream) -> bytes:
    out = bytearray()
    while data := await stream.read():
        out += data
    return bytes(out)


def blocks(total: int, seed: bytes) -> Iterator[bytes]:
    """``total`` bytes in blocks of odd sizes; a counter in each makes reordered blocks visible."""
    base = hashlib.shake_256(seed).digest(1 << 20)
    sent, i = 0, 0
    while sent < total:
        block = (i.to_bytes(8, "big") + base)[: min(total - sent, (1 << 20) - 7)]
        sent += len(block)
        i += 1
        yield block


def expected_digest(total: int, seed: bytes) -> tuple[int, str]:
    """(``total``, hex SHA-256 of ``blocks(total, seed)``): what a reader of those blocks must end with."""
    h = hashlib.sha256()
    for b in blocks(total, seed):
        h.update(b)
    return total, h.hexdigest()


async def read_digest(read: Callable[[], Awaitable[bytes]]) -> tuple[int, str]:
    """Call ``read`` until it returns no data: (bytes read, their hex SHA-256)."""
    h, n = hashlib.sha256(), 0
    while data := await read():
        h.update(data)
        n += len(data)
    return n, h.hexdigest()


async def test_tunnel_echo_reaches_guest_loopback(client: AgentClient) -> None:
    peers: list[str] = []

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        peers.append(w.get_extra_info("peername")[0])
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    async with tcp_server(echo) as port:
        stream = await client.open_tcp(port)
        assert stream.port == port
        await stream.write(b"hello")
        assert await stream.read() == b"hello"
        await stream.write_eof()
        assert await stream.read() == b""  # the server closed after our end of data
        await stream.close()
        await stream.close()  # idempotent
    assert peers == ["127.0.0.1"]


async def test_tunnel_carries_100_mib_each_way(client: AgentClient, agent: Agent) -> None:
    size = 100 * 1024 * 1024
    got_by_guest: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()

    async def server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        async def send() -> None:
            for b in blocks(size, b"down"):
                w.write(b)
                await w.drain()
            w.write_eof()

        sending = asyncio.create_task(send())
        got_by_guest.set_result(await read_digest(lambda: r.read(1 << 20)))
        await sending
        w.close()

    async with tcp_server(server) as port:
        stream = await client.open_tcp(port)

        async def upload() -> None:
            for b in blocks(size, b"up"):
                await stream.write(b)
            await stream.write_eof()

        t = time.monotonic()
        _, got_by_host = await asyncio.wait_for(asyncio.gather(upload(), read_digest(stream.read)), 120)
        secs = time.monotonic() - t
        assert got_by_host == expected_digest(size, b"down")
        assert await asyncio.wait_for(got_by_guest, 10) == expected_digest(size, b"up")
        await stream.close()
    print(f"tunnel: 100 MiB each way at once in {secs:.2f}s ({2 * size / secs / 1e6:.0f} MB/s total)")
    assert agent.rss_kib() < 8 * 1024


async def test_tunnel_half_close_from_the_host(client: AgentClient, agent: Agent) -> None:
    async def counter(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        data = await r.read()  # until the host's end of data
        w.write(f"got {len(data)} bytes".encode())  # still writable after our end of input
        await w.drain()
        w.close()

    async with tcp_server(counter) as port:
        before = fd_count(agent)
        stream = await client.open_tcp(port)
        await stream.write(b"x" * 100_000)
        await stream.write_eof()
        await stream.write_eof()  # idempotent
        assert await read_all(stream) == b"got 100000 bytes"
        with pytest.raises(AgentRequestError) as info:
            await stream.write(b"more")
        assert info.value.errno == errno.EPIPE
        # Both directions ended, so the agent freed the socket without waiting for close().
        deadline = time.monotonic() + 5
        while fd_count(agent) > before:
            assert time.monotonic() < deadline, "the agent kept a finished tunnel's socket"
            await asyncio.sleep(0.01)
        await stream.close()


async def test_tunnel_half_close_from_the_guest(client: AgentClient) -> None:
    received: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def greeter(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"hello")
        w.write_eof()  # shutdown(SHUT_WR): the guest says no more, but still listens
        received.set_result(await r.read())
        w.close()

    async with tcp_server(greeter) as port:
        stream = await client.open_tcp(port)
        assert await read_all(stream) == b"hello"
        assert await stream.read() == b""  # end of data stays the end
        await stream.write(b"after the guest's eof")
        await stream.write_eof()
        assert await asyncio.wait_for(received, 5) == b"after the guest's eof"
        await stream.close()


async def test_guest_reset_is_an_error_after_the_data_before_it(client: AgentClient) -> None:
    async def resetter(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"partial")
        await w.drain()
        await r.readexactly(4)  # the host is there: what we sent is on its way
        sock = w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.transport.abort()  # close with RST

    async with tcp_server(resetter) as port:
        stream = await client.open_tcp(port)
        await stream.write(b"ping")
        assert await stream.read() == b"partial"
        with pytest.raises(AgentRequestError) as info:
            await stream.read()
        assert info.value.errno == errno.ECONNRESET
        with pytest.raises(AgentRequestError):
            await stream.write(b"more")
        await stream.close()


async def test_refused_ports_and_loopback_only(client: AgentClient) -> None:
    async def idle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    with pytest.raises(AgentRequestError) as info:
        await client.open_tcp(free_port())
    assert info.value.errno == errno.ECONNREFUSED and "nothing is listening" in info.value.message
    # A server on another loopback address is out of reach: the agent connects to 127.0.0.1 only.
    async with tcp_server(idle, host="127.0.0.2") as port:
        with pytest.raises(AgentRequestError) as info:
            await client.open_tcp(port)
        assert info.value.errno == errno.ECONNREFUSED
    for bad in (0, 65536, -1):
        with pytest.raises(ValueError):
            await client.open_tcp(bad)
    # The channel is still usable after refusals.
    assert (await run(client, 1, ["true"])).exit.result() == 0


async def test_many_tunnels_alongside_processes_and_files(client: AgentClient, agent: Agent) -> None:
    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    async def one(port: int, i: int) -> None:
        data = hashlib.shake_256(str(i).encode()).digest(300_000 + i)
        async with await client.open_tcp(port) as stream:
            writing = asyncio.create_task(stream.write(data))
            got = bytearray()
            while len(got) < len(data):
                got += await stream.read()
            await writing
            assert bytes(got) == data
            await stream.write_eof()
            assert await stream.read() == b""

    file_data = os.urandom(2 * 1024 * 1024)
    async with tcp_server(echo) as port:
        before = fd_count(agent)
        rec, _, _ = await asyncio.gather(
            run(client, 1, ["sh", "-c", "head -c 3000000 /dev/zero | wc -c"]),
            asyncio.gather(*(one(port, i) for i in range(64))),
            client.write_file(str(agent.dir / "f"), chunks(file_data), 0, 0),
        )
        assert rec.text().strip() == "3000000"
        assert b"".join([c async for c in client.read_file(str(agent.dir / "f"), 0, 0)]) == file_data
        assert fd_count(agent) <= before


async def test_slow_host_reader_keeps_agent_memory_bounded(client: AgentClient, agent: Agent) -> None:
    size = FIREHOSE_BYTES
    written = [0]

    async def firehose(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for b in blocks(size, b"hose"):
            w.write(b)
            await w.drain()
            written[0] += len(b)
        w.close()

    async with tcp_server(firehose) as port:
        stream = await client.open_tcp(port)
        await asyncio.sleep(1.0)  # the host does not read: the agent must stop reading the socket
        stalled = written[0]
        await asyncio.sleep(0.5)
        assert written[0] == stalled < HELD_BACK_BYTES, "the guest's writer was never held back"
        rss = agent.rss_kib()
        print(f"host not reading: guest writer held at {stalled / 2**20:.1f} MiB, agent RSS {rss} KiB")
        assert rss < 8 * 1024, f"agent RSS reached {rss} KiB"
        h = hashlib.sha256()
        n = 0
        while data := await stream.read():
            h.update(data)
            n += len(data)
            if n < 8 * 1024 * 1024:
                await asyncio.sleep(0.001)  # slow at first, then as fast as it goes
        expected = hashlib.sha256()
        for b in blocks(size, b"hose"):
            expected.update(b)
        assert (n, h.digest()) == (size, expected.digest())
        assert agent.rss_kib() < 8 * 1024
        await stream.close()


async def test_slow_guest_reader_holds_back_the_host_writer(client: AgentClient, agent: Agent) -> None:
    size = 32 * 1024 * 1024
    go = asyncio.Event()
    got: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()

    async def sleepy(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await go.wait()
        got.set_result(await read_digest(lambda: r.read(1 << 20)))
        w.close()

    async with tcp_server(sleepy) as port:
        stream = await client.open_tcp(port)

        async def upload() -> None:
            for b in blocks(size, b"up"):
                await stream.write(b)
            await stream.write_eof()

        uploading = asyncio.create_task(upload())
        await asyncio.sleep(1.5)
        assert not uploading.done(), "the host wrote 32 MiB into a guest that reads nothing"
        assert agent.rss_kib() < 8 * 1024, f"agent RSS reached {agent.rss_kib()} KiB"
        go.set()
        await asyncio.wait_for(uploading, 60)
        assert await asyncio.wait_for(got, 30) == expected_digest(size, b"up")
        await stream.close()


@pytest.mark.parametrize("how", ["host closes", "newer host takes over"])
async def test_losing_the_channel_closes_every_tunnel(agent: Agent, how: str) -> None:
    ended: list[bytes] = []

    async def holder(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        # Answer only once "data" arrived, so the channel is cut with nothing left in flight.
        got = await r.readexactly(4)
        w.write(b"hi")
        await w.drain()
        ended.append(got + await r.read())  # the read ends once the agent closed its end
        w.close()

    first = await AgentClient.connect(agent.sock, 5)
    await first.spawn(1, ["sleep", "1000"], ENV, "/", 0, 0)
    async with tcp_server(holder) as port:
        before = fd_count(agent)
        streams = [await first.open_tcp(port) for _ in range(3)]
        for s in streams:
            await s.write(b"data")
            assert await s.read() == b"hi"
        assert fd_count(agent) == before + 3
        if how == "host closes":
            await first.close()
            second = await AgentClient.connect(agent.sock, 5)
        else:
            second = await AgentClient.connect(agent.sock, 5)
            await asyncio.wait_for(first.closed.wait(), 5)
        deadline = time.monotonic() + 5
        while len(ended) < 3:
            assert time.monotonic() < deadline, "a tunnel outlived its channel"
            await asyncio.sleep(0.01)
        assert ended == [b"data"] * 3
        assert fd_count(agent) == before
        for s in streams:
            with pytest.raises(AgentConnectionLost):
                await s.read()
            with pytest.raises(AgentConnectionLost):
                await s.write(b"x")
            await s.close()
        # Processes are resumable, unlike tunnels.
        [info] = await second.list_processes()
        assert info.handle == 1 and info.exit_code is None
        await second.signal(1, signal.SIGKILL)
        await second.close()
        await first.close()


# ---- raw tunnels (protocol version 4) ----------------------------------------------------------------------


async def sock_read_digest(sock: socket.socket) -> tuple[int, str]:
    loop = asyncio.get_running_loop()
    return await read_digest(lambda: loop.sock_recv(sock, 1 << 20))


async def sock_read_all(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    out = bytearray()
    while data := await loop.sock_recv(sock, 65536):
        out += data
    return bytes(out)


async def _wait_fds(agent: Agent, count: int) -> None:
    await _wait_for(lambda: fd_count(agent) <= count)


async def test_raw_tunnel_carries_100_mib_each_way(client: AgentClient, agent: Agent) -> None:
    size = 100 * 1024 * 1024
    got_by_guest: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()

    async def server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        async def send() -> None:
            for b in blocks(size, b"down"):
                w.write(b)
                await w.drain()
            w.write_eof()

        sending = asyncio.create_task(send())
        got_by_guest.set_result(await read_digest(lambda: r.read(1 << 20)))
        await sending
        w.close()

    loop = asyncio.get_running_loop()
    async with tcp_server(server) as port:
        before = fd_count(agent)
        sock = await client.open_raw_tcp(port)
        assert sock is not None

        async def upload() -> None:
            for b in blocks(size, b"up"):
                await loop.sock_sendall(sock, b)
            sock.shutdown(socket.SHUT_WR)

        _, got_by_host = await asyncio.wait_for(asyncio.gather(upload(), sock_read_digest(sock)), 120)
        assert got_by_host == expected_digest(size, b"down")
        assert await asyncio.wait_for(got_by_guest, 10) == expected_digest(size, b"up")
        sock.close()
        await _wait_fds(agent, before)  # both directions ended: the agent freed both sockets
    assert agent.rss_kib() < 8 * 1024
    assert await client.list_processes() == []  # the main connection carried none of it and is still fine


@pytest.mark.parametrize("first", ["host", "guest"])
async def test_raw_tunnel_half_closes_pass_through(client: AgentClient, agent: Agent, first: str) -> None:
    """Whichever side ends its data first, the other still reads that end and can go on sending."""
    loop = asyncio.get_running_loop()

    async def guest(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if first == "host":
            data = await r.read()  # to the host's end of data
            w.write(f"got {len(data)} bytes".encode())
            await w.drain()
            w.close()
        else:
            w.write(b"banner")
            w.write_eof()
            data = await r.read()  # the host still sends after our end of data
            assert data == b"x" * 100_000
            w.close()

    async with tcp_server(guest) as port:
        before = fd_count(agent)
        sock = await client.open_raw_tcp(port)
        assert sock is not None
        if first == "host":
            await loop.sock_sendall(sock, b"x" * 100_000)
            sock.shutdown(socket.SHUT_WR)
            assert await asyncio.wait_for(sock_read_all(sock), 10) == b"got 100000 bytes"
        else:
            assert await asyncio.wait_for(sock_read_all(sock), 10) == b"banner"
            await loop.sock_sendall(sock, b"x" * 100_000)
            sock.shutdown(socket.SHUT_WR)
        await _wait_fds(agent, before + 1)  # ours stays open until we close it; the agent's are gone
        sock.close()
        await _wait_fds(agent, before)


async def _raw_answer(path: Path, header: bytes) -> tuple[bytes, bytes]:
    """Send ``header`` on a fresh tunnel connection: (the answer, what followed it until the agent closed)."""

    def call() -> tuple[bytes, bytes]:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(str(path))
            s.sendall(header)
            got = b""
            while chunk := s.recv(4096):
                got += chunk
            return got[:4], got[4:]

    return await asyncio.to_thread(call)


@pytest.mark.parametrize(
    ("header", "err"),
    [
        (b"SBXA" + struct.pack(">HH", 80, 0), errno.EINVAL),  # the main socket's magic
        (b"SBXT" + struct.pack(">HH", 0, 0), errno.EINVAL),  # port 0
        (b"SBXT" + struct.pack(">HH", 80, 1), errno.EINVAL),  # reserved bits set
    ],
)
async def test_raw_tunnel_refuses_a_malformed_header(
    client: AgentClient, agent: Agent, header: bytes, err: int
) -> None:
    before = fd_count(agent)
    answer, rest = await _raw_answer(agent.tunnel_sock, header)
    assert (struct.unpack(">I", answer)[0], rest) == (err, b"")
    await _wait_fds(agent, before)  # nothing kept
    assert await client.list_processes() == []  # and nothing else disturbed


async def test_raw_tunnel_to_a_closed_port_is_refused_before_any_byte(
    client: AgentClient, agent: Agent
) -> None:
    before = fd_count(agent)
    with pytest.raises(AgentRequestError) as info:
        await client.open_raw_tcp(free_port())
    assert info.value.errno == errno.ECONNREFUSED
    assert "nothing is listening" in info.value.message
    await _wait_fds(agent, before)


async def test_a_host_giving_up_on_a_slow_connect_frees_it_at_once(client: AgentClient, agent: Agent) -> None:
    """A server that never accepts, its backlog full: the agent's connect hangs (SYNs are dropped and retried for
    minutes). The host gives up after its timeout; the agent frees the tunnel then, not when the connect fails."""
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    port = full.getsockname()[1]
    queued = []
    try:
        for _ in range(2):  # what a backlog of 0 still queues
            c = socket.socket()
            c.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                c.connect(("127.0.0.1", port))
            queued.append(c)
        await asyncio.sleep(0.1)
        before = fd_count(agent)
        with pytest.raises(AgentRequestError) as info:
            await client.open_raw_tcp(port, timeout_secs=0.5)
        assert info.value.errno == errno.ETIMEDOUT
        await _wait_fds(agent, before)
    finally:
        for c in queued:
            c.close()
        full.close()


async def test_a_header_sent_in_pieces_is_still_one_header(agent: Agent) -> None:
    async def hello(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"hi")
        w.close()

    async with tcp_server(hello) as port:

        def call() -> bytes:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(5)
                s.connect(str(agent.tunnel_sock))
                for byte in b"SBXT" + struct.pack(">HH", port, 0):
                    s.sendall(bytes([byte]))
                    time.sleep(0.005)
                got = b""
                while chunk := s.recv(4096):
                    got += chunk
                return got

        assert await asyncio.to_thread(call) == b"\0\0\0\0hi"


async def test_raw_tunnels_outlive_the_main_connection(agent: Agent) -> None:
    """Unlike framed tunnels, a raw one has its own connection: a new host taking over leaves it alone."""
    loop = asyncio.get_running_loop()

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    first = await AgentClient.connect(agent.sock, 5, agent.tunnel_sock)
    async with tcp_server(echo) as port:
        sock = await first.open_raw_tcp(port)
        assert sock is not None
        second = await AgentClient.connect(agent.sock, 5, agent.tunnel_sock)
        await asyncio.wait_for(first.closed.wait(), 5)
        await loop.sock_sendall(sock, b"still here")
        assert await asyncio.wait_for(loop.sock_recv(sock, 100), 5) == b"still here"
        sock.close()
        await second.close()


async def test_a_host_that_goes_away_ends_its_raw_tunnels(client: AgentClient, agent: Agent) -> None:
    """A killed sandboxd closes its tunnel connections with it: the agent frees both sockets and the guest's
    server sees its connection end (a reset: it never stopped sending)."""
    ended: list[bool] = []

    async def chatty(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        async def talk() -> None:
            with contextlib.suppress(ConnectionError):
                while True:
                    w.write(b"x" * 65536)
                    await w.drain()

        talking = asyncio.create_task(talk())
        # A reset (the agent closed with our bytes unread), seen by this read or first by a write (EPIPE).
        with contextlib.suppress(ConnectionError):
            await r.read()
        ended.append(True)
        talking.cancel()
        w.close()

    async with tcp_server(chatty) as port:
        before = fd_count(agent)
        socks = [await client.open_raw_tcp(port) for _ in range(3)]
        assert all(s is not None for s in socks)
        await _wait_for(lambda: fd_count(agent) == before + 6)
        for s in socks:
            assert s is not None
            s.close()  # not a half-close: the host is gone
        await _wait_for(lambda: len(ended) == 3)
        await _wait_fds(agent, before)
        assert await client.list_processes() == []


async def test_quiesce_closes_raw_tunnels_and_their_socket_until_the_wake(agent: Agent) -> None:
    loop = asyncio.get_running_loop()

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read()
        w.close()

    client = await AgentClient.connect(agent.sock, 5, agent.tunnel_sock)
    async with tcp_server(silent) as port:
        sock = await client.open_raw_tcp(port)
        assert sock is not None
        wake = agent.dir / "wake"
        await client.quiesce(str(wake))
        # The checkpoint that follows may find no host socket: the tunnel is cut and its socket gone.
        assert await asyncio.wait_for(loop.sock_recv(sock, 100), 5) == b""
        sock.close()
        assert not agent.tunnel_sock.exists() and not agent.sock.exists()
        wake.touch()
        await _wait_for(agent.sock.exists)
        assert agent.tunnel_sock.exists()  # listened on again before the main socket
        again = await AgentClient.connect(agent.sock, 5, agent.tunnel_sock)
        sock = await again.open_raw_tcp(port)
        assert sock is not None
        sock.close()
        await again.close()


async def test_an_absent_or_replaced_tunnel_socket_means_a_framed_tunnel(
    agent: Agent, tmp_path: Path
) -> None:
    """The tunnel socket is in a directory root in the guest can write: a removed one makes the host use
    framed tunnels, and a symlink planted there is never followed to the socket it names."""
    bait = socket.socket(socket.AF_UNIX)
    bait.bind(str(tmp_path / "host.sock"))  # a host socket the guest would like sandboxd to reach
    bait.listen(1)
    bait.setblocking(False)
    client = await AgentClient.connect(agent.sock, 5, agent.tunnel_sock)
    try:
        agent.tunnel_sock.unlink()
        assert await client.open_raw_tcp(80) is None
        agent.tunnel_sock.symlink_to(tmp_path / "host.sock")
        assert await client.open_raw_tcp(80) is None
        with pytest.raises(BlockingIOError):
            bait.accept()  # nobody connected to it
        agent.tunnel_sock.unlink()
        agent.tunnel_sock.write_bytes(b"")  # a plain file
        assert await client.open_raw_tcp(80) is None
        assert await client.list_processes() == []
    finally:
        bait.close()
        await client.close()


async def test_raw_tunnel_with_a_host_not_reading_holds_the_guest_writer(
    client: AgentClient, agent: Agent
) -> None:
    size = FIREHOSE_BYTES
    written = [0]

    async def firehose(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        for b in blocks(size, b"hose"):
            w.write(b)
            await w.drain()
            written[0] += len(b)
        w.close()

    async with tcp_server(firehose) as port:
        sock = await client.open_raw_tcp(port)
        assert sock is not None
        await asyncio.sleep(1.0)  # the host does not read: the agent must stop reading the guest socket
        stalled = written[0]
        await asyncio.sleep(0.5)
        assert written[0] == stalled < HELD_BACK_BYTES, "the guest's writer was never held back"
        assert agent.rss_kib() < 8 * 1024
        assert await asyncio.wait_for(sock_read_digest(sock), 60) == expected_digest(size, b"hose")
        sock.close()


def _raw_call(sock: Path, *frames: tuple[p.Message, int]) -> list[p.Message]:
    """Send frames on a fresh connection, return one decoded reply per frame."""
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        s.settimeout(5)
        s.sendall(b"".join(p.encode(m, fid) for m, fid in frames))
        reader, out = p.FrameReader(), list[p.Message]()
        while len(out) < len(frames):
            data = s.recv(65536)
            assert data, "the agent closed the connection"
            out += [p.decode(f.type, f.payload) for f in reader.feed(data)]
        return out


@pytest.mark.parametrize(
    ("version", "reply"),
    [
        # A version 1 host gets the version 1 layout and an agent without tunnels.
        (1, [p.HelloOk(1, 0, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20), p.Error(errno.ENOSYS, "")]),
        (
            2,
            [
                p.HelloOk(2, 0, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20, 1 << 20),
                p.Error(errno.EINVAL, ""),
            ],
        ),
        (
            3,
            [
                p.HelloOk(3, 0, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20, 1 << 20),
                p.Error(errno.EINVAL, ""),
            ],
        ),
        (
            4,
            [
                p.HelloOk(4, 0, p.MAX_PAYLOAD, 1 << 20, 1 << 20, 1 << 20, 1 << 20),
                p.Error(errno.EINVAL, ""),
            ],
        ),
        (5, [p.Error(errno.EPROTONOSUPPORT, ""), p.Error(errno.EPROTO, "")]),
    ],
)
async def test_hello_versions(agent: Agent, version: int, reply: list[p.Message]) -> None:
    await (await AgentClient.connect(agent.sock, 5)).close()  # the socket exists from here on
    got = await asyncio.to_thread(_raw_call, agent.sock, (p.Hello(version=version), 1), (p.TcpOpen(0), 2))
    normalised = [
        dataclasses.replace(m, pid=0) if isinstance(m, p.HelloOk) else p.Error(m.errno, "")  # type: ignore[attr-defined]
        for m in got
    ]
    assert normalised == reply
