"""SSH into sandboxes through a real sandbox-gateway (--ssh-listen) in front of a real sandboxd, with Debian's
OpenSSH client tools: key and token logins and their refusals, commands and exit status, a PTY shell and its
window, scp both ways and sftp, ssh -L, revocation, the SSH key rules, audit and metrics."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pty
import re
import shlex
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncssh
import pytest
from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from pty_screen import read_until, set_size
from sandboxd_harness import Sandboxd, free_port
from ssh_client import SshClient, keygen, public_line

ALL = ("sandbox:read", "sandbox:create", "sandbox:delete", "sandbox:ssh")


@dataclass
class World:
    workdir: Path
    node: Sandboxd
    gw: GatewayProcess
    ssh: SshClient
    keys: dict[str, str]
    #: SSH private keys by name.
    ids: dict[str, Path]
    #: Sandbox ids by name.
    boxes: dict[str, str]
    metrics_port: int
    #: The gateway's GET /v1/ssh answer.
    ssh_info: dict[str, Any]

    def api(self, method: str, path: str, body: Any = None, key: str = "alice") -> Any:
        return self.gw.request(method, path, body, key=self.keys[key])

    def identity(self, name: str, key_type: str = "ed25519", bits: int | None = None) -> Path:
        """A new SSH key pair, known to the tests as ``name``."""
        self.ids[name] = keygen(self.workdir / "keys", name, key_type, bits)
        return self.ids[name]

    def register(self, identity: str, key: str = "alice", **fields: Any) -> dict[str, Any]:
        resp = self.api("POST", "/v1/ssh-keys", {"key": public_line(self.ids[identity]), **fields}, key=key)
        assert resp.status == 201, (resp.status, resp.body)
        return resp.json()  # type: ignore[no-any-return]

    def tokens(self) -> int:
        """Access tokens in the gateway's state file (read beside the serving gateway, read-only)."""
        with sqlite3.connect(f"file:{self.gw.state_path}?mode=ro", uri=True) as db:
            return int(db.execute("SELECT COUNT(*) FROM ssh_tokens").fetchone()[0])

    def audit(self) -> list[dict[str, Any]]:
        return [
            json.loads(line)
            for line in (self.gw.workdir / "audit" / "gateway.jsonl").read_text().splitlines()
        ]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            return resp.read().decode()  # type: ignore[no-any-return]

    def run(self, box: str, script: str) -> dict[str, Any]:
        resp = self.api("POST", f"/v1/sandboxes/{box}/run", {"argv": ["sh", "-c", script]}, key="admin")
        assert resp.status == 200, resp.body
        out = resp.json()
        out["stdout"] = base64.b64decode(out["stdout"]).decode()
        return out  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxssh-", dir="/var/tmp"))
    (workdir / "n1").mkdir()
    (workdir / "gw").mkdir()
    (workdir / "keys").mkdir()
    node = Sandboxd(workdir / "n1").start()
    ssh_port, metrics_port = free_port(), free_port()
    # Every test here logs in from 127.0.0.1, and a dozen logins are refused on purpose: the per-address limits
    # would slow the later tests down. They are tested, with their defaults, in test_gateway_ssh_limits.py.
    gw = GatewayProcess(workdir / "gw", [("n1", node)], [
        *FAST_ARGS, "--ssh-listen", f"127.0.0.1:{ssh_port}", "--metrics-listen", f"127.0.0.1:{metrics_port}",
        "--ssh-source-failures", "1000",
    ])  # fmt: skip
    keys = {
        "admin": gw.create_key("root", "admin"),
        "alice": gw.create_key("alice", *ALL, tenant="acme"),
        "bob": gw.create_key("bob", *ALL, tenant="beta"),
        "noscope": gw.create_key("nora", "sandbox:read", "sandbox:create"),
    }
    gw.start()
    try:
        info = gw.request("GET", "/v1/ssh", key=keys["alice"]).json()
        client = SshClient(workdir, "127.0.0.1", info["port"], info["host_keys"])
        ids = {name: keygen(workdir / "keys", name, "ed25519")
               for name in ("alice", "alice_box", "bob", "spare", "stranger")}  # fmt: skip
        world = World(workdir, node, gw, client, keys, ids, {}, metrics_port, info)
        for owner, name in (("alice", "box"), ("alice", "other"), ("bob", "bobs")):
            world.boxes[name] = gw.create(keys[owner], name=name)["id"]
        world.register("alice")
        world.register("alice_box", sandbox="box")
        world.register("bob", key="bob")
        yield world
    finally:
        gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def user_with_key(world: World, user: str, *scopes: str) -> tuple[str, str]:
    """A new API key for ``user`` (tenant acme) made through the admin API: (secret, key id)."""
    resp = world.api(
        "POST", "/v1/admin/keys", {"user": user, "tenant": "acme", "scopes": list(scopes)}, key="admin"
    )
    assert resp.status == 201, resp.body
    return resp.json()["secret"], resp.json()["id"]


# -- logins ---------------------------------------------------------------------------------------------


def test_get_ssh_reports_the_server_and_its_host_keys(world: World) -> None:
    info = world.api("GET", "/v1/ssh").json()
    assert info["host"] == "127.0.0.1" and info["port"] == world.ssh.port
    assert [line.split()[0] for line in info["host_keys"]] == ["ssh-ed25519", "ssh-rsa"]
    listed = subprocess.run(["ssh-keygen", "-l", "-f", "-"], input=info["host_keys"][0], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    assert listed.split()[1] == info["fingerprint"]
    state = world.gw.state_path
    for kind in ("ed25519", "rsa"):
        assert (state.parent / f"{state.name}.ssh_host_{kind}_key").stat().st_mode & 0o777 == 0o600


def test_key_login_by_name_and_id_runs_commands_with_their_exit_status(world: World) -> None:
    for user in ("box", world.boxes["box"]):
        done = world.ssh.ssh(user, "echo out; echo err >&2; exit 7", identity=world.ids["alice"])
        assert (done.returncode, done.stdout, done.stderr) == (7, b"out\n", b"err\n")
    piped = world.ssh.ssh("box", "wc -c; id -un", identity=world.ids["alice"], input=b"12345")
    assert (piped.returncode, piped.stdout) == (0, b"5\nsandbox\n")
    killed = world.ssh.ssh("box", "kill -TERM $$", identity=world.ids["alice"])
    assert killed.returncode == 128 + signal.SIGTERM  # as the node reports a death by signal


def test_token_login_with_the_ready_command(world: World) -> None:
    resp = world.api("POST", "/v1/sandboxes/box/ssh-access", {"ttl_secs": 600})
    assert resp.status == 201, resp.body
    access = resp.json()
    token = access["user"]
    assert re.fullmatch(r"sgt_[a-z0-9]{40}", token) and access["port"] == world.ssh.port
    assert access["command"] == f"ssh -p {world.ssh.port} {token}@127.0.0.1"
    expires = time.mktime(time.strptime(access["expires_at"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert abs(expires - (time.time() + 600)) < 30
    argv = shlex.split(access["command"])
    argv[1:1] = world.ssh.options(None)
    done = subprocess.run([*argv, "cat /etc/hostname >/dev/null && echo in"], capture_output=True, timeout=60,
                          stdin=subprocess.DEVNULL, check=False)  # fmt: skip
    assert (done.returncode, done.stdout) == (0, b"in\n"), done
    default = world.api("POST", "/v1/sandboxes/box/ssh-access").json()
    expires = time.mktime(time.strptime(default["expires_at"], "%Y-%m-%dT%H:%M:%SZ")) - time.timezone
    assert abs(expires - (time.time() + 900)) < 30  # 15 minutes when no ttl is given
    text = (world.gw.workdir / "audit" / "gateway.jsonl").read_text()
    assert token not in text and default["user"] not in text
    assert hashlib.sha256(token.encode()).hexdigest() not in text


@pytest.mark.parametrize(
    ("ttl", "message"),
    [
        (-1, "ttl_secs = -1: give 1 to 86400 seconds (24 hours), or 0 for 15 minutes"),
        (86401, "ttl_secs = 86401: give 1 to 86400 seconds (24 hours), or 0 for 15 minutes"),
        ("60", "ttl_secs: expected an integer, got a string"),
    ],
)
def test_ssh_access_refusals(world: World, ttl: Any, message: str) -> None:
    tokens = world.tokens()
    resp = world.api("POST", "/v1/sandboxes/box/ssh-access", {"ttl_secs": ttl})
    assert (resp.status, resp.error) == (400, ("invalid_request", message))
    assert world.tokens() == tokens
    other = world.api("POST", "/v1/sandboxes/bobs/ssh-access", {}, key="alice")
    assert (other.status, other.error) == (404, ("not_found", "no sandbox 'bobs' among yours"))


def test_expired_and_unknown_tokens_are_refused_with_a_reason(world: World) -> None:
    token = world.api("POST", "/v1/sandboxes/box/ssh-access", {"ttl_secs": 1}).json()["user"]
    time.sleep(1.5)
    expired = world.ssh.ssh(token, "true")
    assert expired.returncode == 255
    assert b"sbx: this SSH access token expired at " in expired.stderr, expired.stderr
    assert b"Permission denied" in expired.stderr
    unknown = world.ssh.ssh("sgt_" + "0" * 40, "true")
    assert unknown.returncode == 255 and b"sbx: unknown SSH access token" in unknown.stderr


def test_a_key_reaches_only_its_owners_sandboxes_and_a_limited_key_only_its_one(world: World) -> None:
    ok = world.ssh.ssh("box", "echo yes", identity=world.ids["alice_box"])
    assert (ok.returncode, ok.stdout) == (0, b"yes\n")
    cases = [("other", "alice_box"), ("bobs", "alice"), ("box", "bob"), ("nothing-here", "alice")]
    for user, identity in cases:
        refused = world.ssh.ssh(user, "echo yes", identity=world.ids[identity])
        assert refused.returncode == 255 and refused.stdout == b"", (user, identity, refused)
        assert f"reaches no sandbox '{user}'".encode() in refused.stderr, refused.stderr
    unregistered = world.ssh.ssh("box", "echo yes", identity=world.ids["stranger"])
    assert unregistered.returncode == 255 and b"sbx:" not in unregistered.stderr
    assert b"Permission denied (publickey)" in unregistered.stderr


def test_a_login_needs_an_active_ssh_scope(world: World) -> None:
    secret, key_id = user_with_key(world, "carol", *ALL)
    world.keys["carol"] = secret
    box = world.gw.create(secret, name="carols")["id"]
    world.register("spare", key="carol")
    assert world.ssh.ssh("carols", "true", identity=world.ids["spare"]).returncode == 0
    assert world.api("DELETE", f"/v1/admin/keys/{key_id}", key="admin").status == 204
    refused = world.ssh.ssh(box, "true", identity=world.ids["spare"])
    assert refused.returncode == 255
    assert b"holds no active API key with the scope sandbox:ssh (or admin) in its tenant" in refused.stderr
    # A key without the scope does not let its user log in either (nor register a key).
    secret2, _ = user_with_key(world, "carol", "sandbox:read")
    assert world.ssh.ssh(box, "true", identity=world.ids["spare"]).returncode == 255
    resp = world.gw.request("POST", "/v1/ssh-keys", {"key": public_line(world.ids["spare"])}, key=secret2)
    assert (resp.status, resp.error[0]) == (403, "refused")


# -- sessions -----------------------------------------------------------------------------------------


def test_pty_shell_follows_the_window_and_exits_with_its_status(world: World) -> None:
    master, slave = pty.openpty()
    set_size(slave, 33, 111)
    proc = world.ssh.popen("box", identity=world.ids["alice"], extra=["-tt"], stdin=slave, stdout=slave,
                           stderr=slave, start_new_session=True)  # fmt: skip
    os.close(slave)
    try:
        os.write(master, b"stty size; echo TERM=$TERM; tty\n")
        out = read_until(master, b"/dev/pts")
        assert b"33 111" in out and b"TERM=xterm" in out, out
        set_size(master, 50, 160)
        proc.send_signal(signal.SIGWINCH)
        time.sleep(0.5)
        os.write(master, b"stty size\n")
        assert b"50 160" in read_until(master, b"50 160")
        os.write(master, b"exit 5\n")
        assert proc.wait(timeout=30) == 5
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def test_a_shell_without_a_terminal_reads_commands_from_stdin(world: World) -> None:
    done = world.ssh.ssh("box", identity=world.ids["alice"], extra=["-T"], input=b"echo from-stdin\nexit 6\n")
    assert (done.returncode, done.stdout) == (6, b"from-stdin\n")


async def test_signals_subsystems_and_the_session_cap(world: World) -> None:
    # OpenSSH's client sends no signals and opens one session per connection: asyncssh's client does both.
    async with asyncssh.connect(
        "127.0.0.1", world.ssh.port, username="box", client_keys=[str(world.ids["alice"])],
        known_hosts=str(world.ssh.known_hosts), agent_path=None, config=None,
    ) as conn:  # fmt: skip
        proc = await conn.create_process("echo up; exec sleep 1007", encoding=None)
        assert await proc.stdout.readline() == b"up\n"
        proc.send_signal("TERM")
        assert (await proc.wait(timeout=30)).exit_status == 128 + signal.SIGTERM
        other = await conn.run(subsystem="foo", encoding=None, timeout=30)
        assert (
            other.exit_status == 1 and b"the subsystem 'foo' is not offered here; only sftp" in other.stderr
        )
        held = [await conn.create_process("exec sleep 1008", encoding=None) for _ in range(10)]
        refused = await conn.run("echo eleventh", encoding=None, timeout=30)
        assert refused.exit_status == 255 and refused.stdout == b""
        assert b"at most 10 sessions may be open on one connection" in refused.stderr
        for held_proc in held:
            held_proc.close()
    wait_for(lambda: not _sleeping(world, world.boxes["box"], "1008"), timeout_secs=15)


def test_environment_is_limited_to_safe_names(world: World) -> None:
    done = world.ssh.ssh(
        "box", "echo $LANG/$TZ/${SNEAKY:-none}/${LD_PRELOAD:-none}", identity=world.ids["alice"],
        extra=["-o", "SetEnv=LANG=C.UTF-8 TZ=UTC SNEAKY=1 LD_PRELOAD=/tmp/x.so"],
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, b"C.UTF-8/UTC/none/none\n")


def test_remote_and_agent_forwarding_are_refused(world: World) -> None:
    remote = world.ssh.ssh("box", "true", identity=world.ids["alice"],
                           extra=["-o", "ExitOnForwardFailure=yes", "-R", "0:127.0.0.1:9"])  # fmt: skip
    assert remote.returncode == 255 and b"remote port forwarding failed" in remote.stderr, remote.stderr
    agent = world.ssh.ssh("box", 'echo "${SSH_AUTH_SOCK:-none}"', identity=world.ids["alice"], extra=["-A"])
    assert agent.stdout == b"none\n"


def test_local_forward_reaches_a_server_in_the_sandbox(world: World) -> None:
    start = world.api("POST", "/v1/sandboxes/box/processes", {
        "argv": ["python3", "-m", "http.server", "8123", "--bind", "127.0.0.1", "--directory", "/etc"]})  # fmt: skip
    assert start.status == 201, start.body
    probe = "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8123))\" && echo up"
    wait_for(lambda: world.run("box", probe)["stdout"] == "up\n")
    local = free_port()
    forward = world.ssh.popen("box", identity=world.ids["alice"],
                              extra=["-N", "-o", "ExitOnForwardFailure=yes", "-L", f"{local}:localhost:8123"],
                              stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:

        def fetch() -> bytes | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{local}/hostname", timeout=10) as resp:
                    return resp.read()  # type: ignore[no-any-return]
            except OSError:
                return None

        assert wait_for(fetch) == world.run("box", "cat /etc/hostname")["stdout"].encode()
        refused = world.ssh.ssh("box", "true", identity=world.ids["alice"], extra=["-W", "10.0.0.1:80"])
        assert b"only the sandbox's own loopback is reachable" in refused.stderr, refused.stderr
        nothing = world.ssh.ssh("box", identity=world.ids["alice"], extra=["-W", "localhost:1"])
        assert nothing.returncode == 255 and b"cannot connect to 127.0.0.1:1 in the sandbox" in nothing.stderr
    finally:
        forward.terminate()
        forward.wait(timeout=30)
        world.api("POST", f"/v1/sandboxes/box/processes/{start.json()['pid']}/signal", {"signal": "KILL"})


def test_scp_50_mb_both_ways_with_checksums(world: World) -> None:
    data = os.urandom(50 * 1024 * 1024 + 4321)
    digest = hashlib.sha256(data).hexdigest()
    src = world.workdir / "upload.bin"
    src.write_bytes(data)
    for legacy in (False, True):
        remote = f"/tmp/scp-{int(legacy)}.bin"
        up = world.ssh.scp(str(src), f"box@:{remote}", identity=world.ids["alice"], legacy=legacy)
        assert up.returncode == 0, up.stderr
        assert world.run("box", f"sha256sum {remote}")["stdout"].split()[0] == digest
        back = world.workdir / f"download-{int(legacy)}.bin"
        down = world.ssh.scp(f"box@:{remote}", str(back), identity=world.ids["alice"], legacy=legacy)
        assert down.returncode == 0, down.stderr
        assert hashlib.sha256(back.read_bytes()).hexdigest() == digest
        back.unlink()
    world.run("box", "rm -f /tmp/scp-*.bin")


def test_sftp_past_the_put_cap_and_resumed_transfers(world: World) -> None:
    data = os.urandom(70 * 1024 * 1024 + 17)  # past the node's 64 MiB PUT body: the rest goes through dd
    digest = hashlib.sha256(data).hexdigest()
    local = world.workdir / "big70.bin"
    local.write_bytes(data)
    done = world.ssh.sftp("box", f"put {local} /tmp/big70\n", identity=world.ids["alice"])
    assert done.returncode == 0, done.stderr
    assert world.run("box", "sha256sum /tmp/big70")["stdout"].split()[0] == digest
    world.run("box", "head -c 10485760 /tmp/big70 > /tmp/part70")  # an upload cut at 10 MiB, resumed
    done = world.ssh.sftp("box", f"reput {local} /tmp/part70\n", identity=world.ids["alice"])
    assert done.returncode == 0, done.stderr
    assert world.run("box", "sha256sum /tmp/part70")["stdout"].split()[0] == digest
    partial = world.workdir / "part70.bin"
    partial.write_bytes(data[: 20 * 1024 * 1024])  # a download cut at 20 MiB, resumed
    done = world.ssh.sftp("box", f"reget /tmp/big70 {partial}\n", identity=world.ids["alice"])
    assert done.returncode == 0, done.stderr
    assert hashlib.sha256(partial.read_bytes()).hexdigest() == digest
    world.run("box", "rm -f /tmp/big70 /tmp/part70")
    local.unlink()
    partial.unlink()


def test_a_cut_upload_leaves_the_file_as_it_was(world: World) -> None:
    world.run("box", "echo old > /tmp/cut.bin")
    local = world.workdir / "cut.bin"
    local.write_bytes(os.urandom(8 * 1024 * 1024))
    upload = subprocess.Popen(  # sftp's put truncates (one PUT); at 1 MB/s it is cut well before its end
        ["sftp", "-l", "8000", *world.ssh.options(world.ids["alice"]), "-P", str(world.ssh.port), "-b", "-",
         "box@127.0.0.1"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert upload.stdin is not None
    upload.stdin.write(f"put {local} /tmp/cut.bin\n".encode())
    upload.stdin.flush()
    time.sleep(2)
    assert upload.poll() is None
    upload.kill()
    upload.wait()
    time.sleep(1)
    assert world.run("box", "cat /tmp/cut.bin")["stdout"] == "old\n"
    # scp over an existing file writes in place (dd): cut, what was written stays and no dd is left waiting.
    upload = subprocess.Popen(
        ["scp", "-l", "8000", *world.ssh.options(world.ids["alice"]), "-P", str(world.ssh.port), str(local),
         "box@127.0.0.1:/tmp/cut.bin"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for(
        lambda: b"dd of=/tmp/cut.bin" in world.node.run(world.boxes["box"], ["ps", "-eo", "args"])["stdout"]
    )
    time.sleep(1)
    upload.kill()
    upload.wait()
    wait_for(lambda: b"dd of=" not in world.node.run(world.boxes["box"], ["ps", "-eo", "args"])["stdout"])
    written = int(world.run("box", "wc -c < /tmp/cut.bin")["stdout"])
    assert 0 < written < len(local.read_bytes())
    world.run("box", "rm /tmp/cut.bin")


async def test_an_in_place_write_that_fails_says_why(world: World) -> None:
    local = world.workdir / "full.bin"
    local.write_bytes(os.urandom(4 * 1024 * 1024))
    done = world.ssh.scp(str(local), "box@:/dev/full", identity=world.ids["alice"])  # in place: dd, ENOSPC
    # scp keeps 64 writes in flight: dd's exit reaches the gateway during the writes (a write fails) or after
    # the last was taken (the fsetstat scp sends next fails, then the close). Either way the upload fails.
    failed_at = (b'remote "/dev/full": Failure', b"remote fsetstat: Failure")
    assert done.returncode == 1 and any(m in done.stderr for m in failed_at), done.stderr
    async with asyncssh.connect(  # asyncssh's client shows the server's reason, which OpenSSH's does not print
        "127.0.0.1", world.ssh.port, username="box", client_keys=[str(world.ids["alice"])],
        known_hosts=str(world.ssh.known_hosts), agent_path=None, config=None,
    ) as conn, conn.start_sftp_client() as sftp:  # fmt: skip
        with pytest.raises(asyncssh.SFTPError) as caught:
            async with sftp.open("/dev/full", asyncssh.FXF_WRITE, encoding=None) as remote:  # in place
                for _ in range(16):
                    await remote.write(os.urandom(256 * 1024))
    assert "No space left on device" in caught.value.reason
    assert b"dd of=/dev/full" not in world.node.run(world.boxes["box"], ["ps", "-eo", "args"])["stdout"]


def test_sandbox_cli_ssh(world: World) -> None:
    env = {
        **os.environ,
        "SANDBOX_URL": f"http://127.0.0.1:{world.gw.port}",
        "SANDBOX_TOKEN": world.keys["alice"],
    }
    cli = [sys.executable, "-m", "sbx.cli.main"]
    done = subprocess.run([*cli, "ssh", "box", "--", "echo", "hi;", "exit", "4"], env=env, capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=60, check=False)  # fmt: skip
    assert (done.returncode, done.stdout) == (4, b"hi\n"), done.stderr
    shown = subprocess.run(
        [*cli, "--json", "ssh", "box"], env=env, capture_output=True, timeout=60, check=True
    )
    answer = json.loads(shown.stdout)
    assert (
        answer["access"]["user"].startswith("sgt_")
        and answer["info"]["host_keys"] == world.ssh_info["host_keys"]
    )
    missing = subprocess.run(
        [*cli, "ssh", "nope"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert (missing.returncode, missing.stderr.strip()) == (1, "not_found: no sandbox 'nope' among yours")


def test_sftp_lists_and_changes_files_as_the_sandbox_user(world: World) -> None:
    local = world.workdir / "hello.txt"
    local.write_text("hello\n")
    local.chmod(0o751)
    batch = f"""pwd
mkdir work
put {local} work/hello.txt
ls -l work
rename work/hello.txt work/renamed.txt
chmod 640 work/renamed.txt
symlink renamed.txt work/link
ls -la work
-ls nope
-put {local} /root/denied.txt
-rmdir work
get work/link {world.workdir}/fetched.txt
rm work/link
rm work/renamed.txt
rmdir work
"""
    done = world.ssh.sftp("box", batch, identity=world.ids["alice"])
    assert done.returncode == 0, (done.stdout, done.stderr)
    out = done.stdout
    assert "Remote working directory: /sandbox/home" in out
    listing = [line for line in out.splitlines() if "hello.txt" in line and line.startswith("-")]
    assert listing and re.match(r"-rwxr-x--x +1 sandbox +sandbox +6 ", listing[0]), out
    assert re.search(r"-rw-r----- +1 sandbox +sandbox +6 .* renamed.txt", out), out
    assert re.search(r"lrwxrwxrwx .* link", out) and re.search(r"drwx.* \.\.?$", out, re.MULTILINE), out
    assert 'Can\'t ls: "/sandbox/home/nope" not found' in done.stderr
    assert "/root/denied.txt" in done.stderr and "Permission denied" in done.stderr, done.stderr
    assert (
        'remote rmdir "/sandbox/home/work": Failure' in done.stderr
    )  # not empty (a v3 client names no more)
    assert (world.workdir / "fetched.txt").read_text() == "hello\n"
    assert world.run("box", "ls /sandbox/home/work 2>&1 || echo gone")["stdout"].endswith("gone\n")


def test_sftp_names_are_arguments_never_shell_text(world: World) -> None:
    tricky = ["$(touch pwned)", "`touch pwned`", "a b", "semi;colon", "-rf", "quote'\"q", "new\nline"]
    quoted = [name.replace("\\", "\\\\").replace('"', '\\"') for name in tricky[:-1]]  # sftp's own quoting
    batch = "mkdir odd\n" + "".join(f'mkdir "odd/{name}"\n' for name in quoted) + "ls -1 odd\n"
    done = world.ssh.sftp("box", batch, identity=world.ids["alice"])
    assert done.returncode == 0, done.stderr
    for name in tricky[:-1]:
        assert name in done.stdout
    world.run("box", "mkdir -p /sandbox/home/odd && touch \"/sandbox/home/odd/$(printf 'new\\nline')\"")
    listed = world.ssh.sftp("box", "ls -1 odd\n", identity=world.ids["alice"])
    assert "new\nline" in listed.stdout or "new?line" in listed.stdout, listed.stdout
    assert world.run("box", "ls /sandbox/home/pwned 2>/dev/null || echo clean")["stdout"] == "clean\n"
    world.run("box", "rm -rf /sandbox/home/odd")


# -- revocation -----------------------------------------------------------------------------------------


def _open_session(world: World, user: str, identity: str, marker: str) -> subprocess.Popen[bytes]:
    proc = world.ssh.popen(user, f"echo started; exec sleep {marker}", identity=world.ids[identity],
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"started\n"
    return proc


def _accepted(world: World, user: str) -> list[dict[str, Any]]:
    """The accepted SSH logins of ``user`` in the gateway's audit."""
    return [e for e in world.audit() if e["type"] == "ssh.login" and e.get("result") == "accepted"
            and e.get("user") == user]  # fmt: skip


def _sleeping(world: World, box: str, marker: str) -> bool:
    """Whether ``sleep MARKER`` runs in ``box`` (asked of the node: the sandbox may be another gateway's)."""
    return f"sleep {marker}".encode() in world.node.run(box, ["ps", "-eo", "args"])["stdout"]


def test_revocation_cuts_an_open_session_before_the_call_returns(world: World) -> None:
    secret, key_id = user_with_key(world, "dave", *ALL)
    world.keys["dave"] = secret
    box = world.gw.create(secret, name="daves")["id"]
    dave_key = world.identity("dave")
    world.register("dave", key="dave")
    session = _open_session(world, "daves", "dave", "1001")
    forward = world.ssh.popen("daves", identity=dave_key, extra=["-N", "-L", f"{free_port()}:localhost:9"],
                              stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    other = _open_session(world, "box", "alice", "1002")  # another user's session stays
    wait_for(lambda: _sleeping(world, box, "1001"))
    # The forward's client started with the others but may still be logging in (its key checked, its signature
    # not yet): both of dave's logins accepted first, so both are open connections the revocation must cut.
    wait_for(lambda: len(_accepted(world, "dave")) == 2)
    before = time.monotonic()
    assert world.api("DELETE", f"/v1/admin/keys/{key_id}", key="admin").status == 204
    session.wait(timeout=5)  # the gateway closed it before answering; the client notices at once
    forward.wait(timeout=5)
    assert time.monotonic() - before < 5
    assert session.returncode == 255
    wait_for(lambda: not _sleeping(world, box, "1001"), timeout_secs=10)  # hung up through the node's API
    assert other.poll() is None
    entries = [e for e in world.audit() if e["type"] == "ssh.revoked" and e.get("user") == "dave"]
    assert len(entries) == 2 and {e["result"] for e in entries} == {"closed"}
    assert all(
        e["kind"] == "revocation" and e["target"] == box and e["key_id"].startswith("ssh_") for e in entries
    )
    assert all(e["fingerprint"].startswith("SHA256:") for e in entries)
    other.terminate()
    other.wait(timeout=30)


def test_removing_an_org_member_cuts_their_sessions_in_the_org(world: World) -> None:
    frank, _ = user_with_key(world, "frank", *ALL, "org:create")
    erin, _ = user_with_key(world, "erin", *ALL)
    assert world.gw.request("POST", "/v1/orgs", {"name": "sshorg"}, key=frank).status == 201
    added = world.gw.request("POST", "/v1/orgs/sshorg/members", {"user": "erin"}, key=frank)
    assert added.status == 201, added.body
    in_org = {"X-Sandbox-Org": "sshorg"}
    box = world.gw.request("POST", "/v1/sandboxes", {"name": "orgbox"}, key=erin, headers=in_org).json()["id"]
    own = world.gw.request("POST", "/v1/sandboxes", {"name": "erins"}, key=erin).json()["id"]
    erin_id = world.identity("erin")
    for headers in (in_org, {}):
        resp = world.gw.request(
            "POST", "/v1/ssh-keys", {"key": public_line(erin_id)}, key=erin, headers=headers
        )
        assert resp.status == 201, resp.body
    with pytest.raises(AssertionError):  # the key of the org's tenant reaches the org's sandboxes only
        world.register("erin", key="alice")
    in_the_org = _open_session(world, "orgbox", "erin", "1009")
    at_home = world.ssh.popen("erins", "echo started; exec sleep 1010", identity=erin_id, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert at_home.stdout is not None and at_home.stdout.readline() == b"started\n"
    resp = world.gw.request("DELETE", "/v1/orgs/sshorg/members/erin?tenant=acme", key=frank)
    assert resp.status == 204, resp.body
    in_the_org.wait(timeout=5)
    wait_for(lambda: not _sleeping(world, box, "1009"), timeout_secs=10)
    assert at_home.poll() is None and _sleeping(world, own, "1010")
    at_home.terminate()
    at_home.wait(timeout=30)


def test_a_gateway_stop_hangs_up_and_a_restart_keeps_the_host_keys(world: World) -> None:
    workdir = world.workdir / "gw2"
    workdir.mkdir()
    port = free_port()
    gw = GatewayProcess(workdir, [("n1", world.node)], [*FAST_ARGS, "--ssh-listen", f"127.0.0.1:{port}"])
    key = gw.create_key("gina", *ALL)
    gw.start()
    try:
        box = gw.create(key, name="ginas")["id"]
        ident = world.identity("gina")
        assert gw.request("POST", "/v1/ssh-keys", {"key": public_line(ident)}, key=key).status == 201
        info = gw.request("GET", "/v1/ssh", key=key).json()
        client = SshClient(workdir, "127.0.0.1", port, info["host_keys"])
        session = client.popen("ginas", "echo started; exec sleep 1011", identity=ident, stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        assert session.stdout is not None and session.stdout.readline() == b"started\n"
        started = time.monotonic()
        gw.stop()
        assert session.wait(timeout=15) == 255 and time.monotonic() - started < 15
        wait_for(lambda: not _sleeping(world, box, "1011"), timeout_secs=10)
        gw.start()
        assert gw.request("GET", "/v1/ssh", key=key).json() == info
        again = client.ssh("ginas", "echo back", identity=ident)  # the known_hosts written before still holds
        assert (again.returncode, again.stdout) == (0, b"back\n"), again.stderr
    finally:
        gw.stop()


def test_deleting_an_ssh_key_closes_only_the_connections_it_logged_in(world: World) -> None:
    spare = world.identity("alice_extra")
    record = world.register("alice_extra")
    by_spare = _open_session(world, "other", "alice_extra", "1003")
    by_main = _open_session(world, "other", "alice", "1004")
    assert world.api("DELETE", f"/v1/ssh-keys/{record['id']}").status == 204
    by_spare.wait(timeout=5)
    assert by_main.poll() is None
    again = world.ssh.ssh("other", "true", identity=spare)
    assert again.returncode == 255
    assert world.api("DELETE", f"/v1/ssh-keys/{record['id']}").status == 404
    by_main.terminate()
    by_main.wait(timeout=30)
    wait_for(lambda: not _sleeping(world, world.boxes["other"], "1004"), timeout_secs=10)


def test_a_client_that_goes_away_hangs_its_process_up(world: World) -> None:
    session = _open_session(world, "box", "alice", "1005")
    session.kill()
    session.wait()
    wait_for(lambda: not _sleeping(world, world.boxes["box"], "1005"), timeout_secs=10)


# -- the SSH key rules ---------------------------------------------------------------------------------


def _sk_ed25519_line(world: World) -> str:
    blob = base64.b64decode(public_line(world.ids["spare"]).split()[1])
    raw = blob[-32:]

    def string(b: bytes) -> bytes:
        return struct.pack(">I", len(b)) + b

    return (
        "sk-ssh-ed25519@openssh.com "
        + base64.b64encode(string(b"sk-ssh-ed25519@openssh.com") + string(raw) + string(b"ssh:")).decode()
    )


def _sk_ecdsa_line(world: World) -> str:
    ecdsa = keygen(world.workdir / "keys", f"ecsk{time.monotonic_ns()}", "ecdsa", 256)
    blob = base64.b64decode(public_line(ecdsa).split()[1])

    def strings(data: bytes) -> list[bytes]:
        out, i = [], 0
        while i < len(data):
            n = struct.unpack(">I", data[i : i + 4])[0]
            out.append(data[i + 4 : i + 4 + n])
            i += 4 + n
        return out

    _, curve, point = strings(blob)
    name = b"sk-ecdsa-sha2-nistp256@openssh.com"
    body = b"".join(struct.pack(">I", len(p)) + p for p in (name, curve, point, b"ssh:"))
    return f"{name.decode()} {base64.b64encode(body).decode()}"


ACCEPTED = [("ed25519", None), ("ecdsa", 256), ("ecdsa", 384), ("ecdsa", 521), ("rsa", 2048), ("rsa", 3072)]
REFUSED = [
    ("rsa", 1024, ("this RSA key has 1024 bits; at least 2048 are needed: make an ed25519 key with ssh-keygen -t "
                  "ed25519 (or ssh-keygen -t rsa -b 3072)")),
    ("dsa", None, ("DSA keys (ssh-dss) are refused: they are 1024 bits at most and OpenSSH has dropped them; make "
                  "an ed25519 key with ssh-keygen -t ed25519")),
]  # fmt: skip


@pytest.mark.parametrize(("key_type", "bits"), ACCEPTED)
def test_key_types_accepted(world: World, key_type: str, bits: int | None) -> None:
    path = world.identity(f"t-{key_type}-{bits}", key_type, bits)
    record = world.register(path.name)
    assert record["id"].startswith("ssh_") and record["key"] == public_line(path)
    listed = subprocess.run(["ssh-keygen", "-lf", f"{path}.pub"], capture_output=True, text=True, check=True)
    assert record["fingerprint"] == listed.stdout.split()[1]
    done = world.ssh.ssh("box", "echo ok", identity=path)
    assert (done.returncode, done.stdout) == (0, b"ok\n"), done.stderr
    assert world.api("DELETE", f"/v1/ssh-keys/{record['id']}").status == 204


@pytest.mark.parametrize("kind", ["sk-ssh-ed25519", "sk-ecdsa"])
def test_security_key_types_accepted(world: World, kind: str) -> None:
    line = _sk_ed25519_line(world) if kind == "sk-ssh-ed25519" else _sk_ecdsa_line(world)
    resp = world.api("POST", "/v1/ssh-keys", {"key": line})
    assert resp.status == 201, resp.body
    assert world.api("DELETE", f"/v1/ssh-keys/{resp.json()['id']}").status == 204


def _refusal_cases(world: World) -> list[tuple[str, str, int, str]]:
    ed = public_line(world.ids["spare"])
    cert = ed.replace("ssh-ed25519 ", "ssh-ed25519-cert-v01@openssh.com ", 1)
    cases = [
        ("empty", "", 400, ("key is empty: send one public key line, e.g. 'ssh-ed25519 AAAAC3Nza... you@laptop' (the "
                          "contents of ~/.ssh/id_ed25519.pub)")),
        ("options", f'command="ls" {ed}', 400, ("authorized_keys options (such as command=, from= or no-pty) are not "
                                                "accepted: send the key alone, TYPE BASE64 [COMMENT]")),
        ("option no-pty", f"no-pty {ed}", 400, ("authorized_keys options (such as command=, from= or no-pty) are not "
                                                "accepted: send the key alone, TYPE BASE64 [COMMENT]")),
        ("two lines", f"{ed}\n{ed}", 400, "key holds 2 lines: register one key per request"),
        ("certificate", cert, 400, ("SSH certificates (ssh-ed25519-cert-v01@openssh.com) are not accepted: register "
                                   "the plain public key it certifies")),
        ("unknown type", "ssh-foo AAAA", 400, ("unknown key type 'ssh-foo': send an ssh-ed25519, ecdsa-sha2-nistp256, "
                                              "ecdsa-sha2-nistp384, ecdsa-sha2-nistp521, sk-ssh-ed25519@openssh.com, "
                                              "sk-ecdsa-sha2-nistp256@openssh.com or ssh-rsa of 2048 bits or more key, "
                                              "e.g. 'ssh-ed25519 AAAAC3Nza... you@laptop' (the contents of "
                                              "~/.ssh/id_ed25519.pub)")),
        ("no data", "ssh-ed25519", 400, ("key has a type but no key data: e.g. 'ssh-ed25519 AAAAC3Nza... you@laptop' "
                                        "(the contents of ~/.ssh/id_ed25519.pub)")),
        ("bad base64", "ssh-ed25519 !!!!", 400, "the key data is not valid base64: copy the whole line of the .pub file"),
        ("type mismatch", "ssh-rsa " + ed.split()[1], 400, ("the key data is of type 'ssh-ed25519' but the line says "
                                                           "'ssh-rsa': copy the line unchanged")),
        ("truncated", "ssh-ed25519 " + ed.split()[1][:40], 400, "the key data is not a valid ssh-ed25519 public key"),
        ("private key", world.ids["spare"].read_text(), 400, ("this is a private key: send the public key (the .pub "
                                                             "file) and keep the private one to yourself")),
    ]  # fmt: skip
    for key_type, bits, message in REFUSED:
        path = keygen(world.workdir / "keys", f"r-{key_type}-{bits}-{time.monotonic_ns()}", key_type, bits)
        cases.append((f"{key_type} {bits}", public_line(path), 400, message))
    return cases


def test_key_lines_refused_with_their_reason_and_nothing_registered(world: World) -> None:
    before = world.api("GET", "/v1/ssh-keys").json()
    for name, line, status, message in _refusal_cases(world):
        resp = world.api("POST", "/v1/ssh-keys", {"key": line})
        assert (resp.status, resp.error) == (status, ("invalid_request", message)), name
    assert world.api("GET", "/v1/ssh-keys").json() == before


def test_key_conflicts_and_sandbox_resolution(world: World) -> None:
    before = world.api("GET", "/v1/ssh-keys").json()
    alice = public_line(world.ids["alice"])
    fp = next(k["fingerprint"] for k in before["keys"] if k["key"] == alice)
    again = world.api("POST", "/v1/ssh-keys", {"key": alice})
    assert (again.status, again.error[0]) == (409, "conflict")
    assert again.error[1].startswith(
        f"the key {fp} is already registered for every sandbox of yours in this tenant (as ssh_"
    )
    bobs = world.api("POST", "/v1/ssh-keys", {"key": alice}, key="bob")
    assert (bobs.status, bobs.error) == (409, ("conflict", (f"the key {fp} is registered by another user: each key "
                                               "belongs to one user; make a key of your own (ssh-keygen -t ed25519)")))  # fmt: skip
    missing = world.api("POST", "/v1/ssh-keys", {"key": alice, "sandbox": "bobs"})
    assert (missing.status, missing.error) == (404, ("not_found", "no sandbox 'bobs' among yours"))
    unknown = world.api("POST", "/v1/ssh-keys", {"key": alice, "kind": "x"})
    assert (unknown.status, unknown.error[0]) == (400, "invalid_request")
    assert world.api("GET", "/v1/ssh-keys").json() == before
    limited = world.register("alice", sandbox="other")  # the same key for one sandbox: a record of its own
    assert limited["sandbox"] == world.boxes["other"]
    dup = world.api("POST", "/v1/ssh-keys", {"key": alice, "sandbox": world.boxes["other"]})
    assert (dup.status, dup.error[0]) == (409, "conflict")
    assert world.api("DELETE", f"/v1/ssh-keys/{limited['id']}").status == 204
    assert world.api("DELETE", f"/v1/ssh-keys/{limited['id']}").status == 404


def test_admin_ssh_keys(world: World) -> None:
    bobs = world.api("GET", "/v1/admin/ssh-keys?user=bob", key="admin").json()["keys"]
    assert [k["fingerprint"] for k in bobs] == [
        world.api("GET", "/v1/ssh-keys", key="bob").json()["keys"][0]["fingerprint"]
    ]
    missing = world.api("GET", "/v1/admin/ssh-keys", key="admin")
    assert (missing.status, missing.error) == (400, ("invalid_request", "query parameter 'user' is required"))
    bad = world.api("GET", "/v1/admin/ssh-keys?user=no%20such", key="admin")
    assert (bad.status, bad.error[0]) == (400, "invalid_request") and bad.error[1].startswith(
        "user must be 1 to 64"
    )
    assert world.api("GET", "/v1/admin/ssh-keys?user=bob", key="alice").status == 403
    other = world.api("DELETE", f"/v1/ssh-keys/{bobs[0]['id']}")  # alice cannot delete bob's
    assert (other.status, other.error) == (
        404,
        ("not_found", f"no SSH key '{bobs[0]['id']}' among yours: see GET /v1/ssh-keys"),
    )
    assert world.api("GET", "/v1/admin/ssh-keys?user=bob", key="admin").json()["keys"] == bobs
    gone = world.api("DELETE", "/v1/admin/ssh-keys/ssh_nope", key="admin")
    assert (gone.status, gone.error) == (
        404,
        ("not_found", "no SSH key 'ssh_nope': see GET /v1/admin/ssh-keys?user=USER"),
    )


# -- audit, metrics, hostile clients ---------------------------------------------------------------------


def test_audit_and_metrics(world: World) -> None:
    """The audit and metrics of this module's logins and sessions so far: it reads what the tests above did in
    the module's one world (a token login, an expired token, shell, sftp and forward sessions), so it runs after
    them, as scripts/test.sh runs a file (``--dist loadfile --no-loadscope-reorder``: in order, on one worker)."""
    assert world.ssh.ssh("box", "true", identity=world.ids["alice"]).returncode == 0
    world.ssh.ssh("box", "true", identity=world.ids["stranger"])  # refused: unknown key
    entries = world.audit()
    logins = [e for e in entries if e["type"] == "ssh.login" and e.get("result") == "accepted"]
    assert logins and all(e["kind"] == "ssh" for e in logins)
    key_login = [e for e in logins if e.get("fingerprint")][-1]
    assert (
        key_login["user"] == "alice"
        and key_login["tenant"] == "acme"
        and key_login["target"] == world.boxes["box"]
    )
    assert key_login["key_id"].startswith("ssh_") and key_login["node"] == "n1"
    assert any(e["key_id"] == "token" and "fingerprint" not in e for e in logins)
    sessions = {e["session"] for e in entries if e["type"] == "ssh.session"}
    assert {"exec", "shell", "sftp", "forward"} <= sessions, sessions
    text = (world.gw.workdir / "audit" / "gateway.jsonl").read_text()
    assert '"box"' not in text and "sgt_" not in text  # never an SSH user name
    metrics = world.metrics()
    assert re.search(
        r'^sandbox_gateway_ssh_auth_failures_total\{reason="unknown_key"\} [1-9]', metrics, re.MULTILINE
    )
    assert re.search(
        r'^sandbox_gateway_ssh_auth_failures_total\{reason="expired_token"\} [1-9]', metrics, re.MULTILINE
    )
    session = _open_session(world, "box", "alice", "1006")
    metrics = world.metrics()
    assert re.search(r"^sandbox_gateway_ssh_connections_open [1-9]", metrics, re.MULTILINE), metrics
    assert re.search(r"^sandbox_gateway_ssh_sessions_open [1-9]", metrics, re.MULTILINE)
    session.terminate()
    session.wait(timeout=30)
    wait_for(lambda: re.search(r"^sandbox_gateway_ssh_connections_open 0", world.metrics(), re.MULTILINE))


def test_connections_that_never_log_in_are_bounded(world: World) -> None:
    import socket

    held = []
    try:
        for _ in range(80):  # more than the 64 allowed to be logging in at once
            sock = socket.create_connection(("127.0.0.1", world.ssh.port), timeout=10)
            held.append(sock)
        time.sleep(1)
        closed = 0
        for sock in held[:16]:
            sock.settimeout(5)
            try:
                data = sock.recv(4096)
                while data:
                    data = sock.recv(4096)
                closed += 1
            except (TimeoutError, OSError):
                pass
        assert closed == 16  # the oldest were closed to make room
        ok = world.ssh.ssh("box", "echo still", identity=world.ids["alice"])
        assert ok.stdout == b"still\n"
    finally:
        for sock in held:
            sock.close()
