"""The sandbox-cli console script against a real sandboxd: create, run, exec, cp both ways, events, rm."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sandboxd_harness import Sandboxd

_SCRIPT = Path(sys.executable).parent / "sandbox-cli"
COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "sbx.cli.main"]


def cli(server: Sandboxd, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "SANDBOX_URL": f"unix://{server.socket_path}", "SANDBOX_TOKEN": ""}
    return subprocess.run(
        [*COMMAND, *args], check=False, input=stdin, capture_output=True, env=env, timeout=120
    )


@pytest.fixture(scope="module")
def ref(sandboxd: Sandboxd) -> str:
    made = cli(sandboxd, "--json", "create", "--name", "cli-test", "--label", "suite=cli")
    assert made.returncode == 0, made.stderr
    return str(json.loads(made.stdout)["id"])


def test_create_ls_get_json(sandboxd: Sandboxd, ref: str) -> None:
    listed = cli(sandboxd, "--json", "ls", "--label", "suite=cli")
    assert [s["id"] for s in json.loads(listed.stdout)["sandboxes"]] == [ref]
    table = cli(sandboxd, "ls", "--label", "suite=cli").stdout.decode().splitlines()
    assert table[0].split()[:3] == ["ID", "NAME", "STATE"]
    assert table[1].split()[:3] == [ref, "cli-test", "running"]
    got = cli(sandboxd, "--json", "get", "cli-test")
    assert json.loads(got.stdout)["id"] == ref


def test_run_exit_code_and_output(sandboxd: Sandboxd, ref: str) -> None:
    done = cli(sandboxd, "run", ref, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (done.returncode, done.stdout, done.stderr) == (7, b"out\n", b"err\n")
    missing = cli(sandboxd, "run", ref, "--", "no-such-command-xyz")
    assert missing.returncode == 1
    assert missing.stderr.startswith(b"invalid_request: ")


def test_exec_streams_and_forwards_stdin(sandboxd: Sandboxd, ref: str) -> None:
    done = cli(sandboxd, "exec", ref, "--", "sh", "-c", "tr a-z A-Z; echo done >&2; exit 5", stdin=b"hello\n")
    assert (done.returncode, done.stdout, done.stderr) == (5, b"HELLO\n", b"done\n")
    as_json = cli(sandboxd, "--json", "exec", "--no-stdin", ref, "--", "echo", "hi")
    lines = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert lines[-1] == {"exit_code": 0}
    assert lines[0]["stream"] == "stdout"


def test_cp_both_ways(sandboxd: Sandboxd, ref: str, tmp_path: Path) -> None:
    data = os.urandom(5 * 1024 * 1024 + 17)
    local = tmp_path / "payload.bin"
    local.write_bytes(data)
    up = cli(sandboxd, "cp", str(local), f"{ref}:/sandbox/home/cli/")
    assert up.returncode == 0, up.stderr
    digest = cli(sandboxd, "run", ref, "--", "sha256sum", "/sandbox/home/cli/payload.bin")
    assert digest.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    down_dir = tmp_path / "down"
    down_dir.mkdir()
    down = cli(sandboxd, "cp", f"{ref}:/sandbox/home/cli/payload.bin", str(down_dir))
    assert down.returncode == 0, down.stderr
    assert hashlib.sha256((down_dir / "payload.bin").read_bytes()).digest() == hashlib.sha256(data).digest()
    to_stdout = cli(sandboxd, "cp", f"{ref}:/sandbox/home/cli/payload.bin", "-")
    assert to_stdout.stdout == data
    absent = cli(sandboxd, "cp", f"{ref}:/sandbox/home/cli/absent", str(tmp_path / "x"))
    assert absent.returncode == 1
    assert absent.stderr.startswith(b"not_found: ")
    assert not (tmp_path / "x").exists()


def test_events(sandboxd: Sandboxd, ref: str) -> None:
    cli(sandboxd, "run", ref, "--", "true")
    found = json.loads(cli(sandboxd, "--json", "events", ref).stdout)
    assert {"sandbox.created", "process.started"} <= {e["type"] for e in found["events"]}
    table = cli(sandboxd, "events", ref).stdout.decode().splitlines()
    assert table[0].split() == ["TIME", "TYPE", "DETAILS"]


def test_rm_and_errors(sandboxd: Sandboxd) -> None:
    made = cli(sandboxd, "create")
    sandbox_id = made.stdout.decode().strip()
    assert cli(sandboxd, "rm", sandbox_id).returncode == 0
    assert json.loads(cli(sandboxd, "--json", "get", sandbox_id).stdout)["state"] == "terminated"
    gone = cli(sandboxd, "get", "no-such-sandbox")
    assert gone.returncode == 1
    assert gone.stderr.startswith(b"not_found: ")
    usage = cli(sandboxd, "cp", "a", "b")
    assert usage.returncode == 2


def test_suspend_resume_snapshot_fork_and_volumes(sandboxd: Sandboxd) -> None:
    def ok(*args: str) -> str:
        done = cli(sandboxd, *args)
        assert done.returncode == 0, (args, done.stderr)
        return done.stdout.decode()

    assert ok("volumes", "create", "cli-vol", "--size-mb", "32").split()[:4] == [
        "name:",
        "cli-vol",
        "size_mb:",
        "32",
    ]
    ref = ok("create", "--volume", "cli-vol:/data").strip()
    assert "cli-vol" in ok("volumes", "ls") and ref in ok("volumes", "ls")
    refused = cli(sandboxd, "snapshot", ref)
    assert refused.returncode == 1 and b"conflict: " in refused.stderr and b"has volumes" in refused.stderr
    assert ok("suspend", ref) == f"{ref}: suspended\n"
    assert ok("resume", ref) == f"{ref}: running\n"
    ok("rm", ref)
    ok("volumes", "rm", "cli-vol")
    source = ok("create").strip()
    ok("run", source, "--", "sh", "-c", "echo forked > /sandbox/home/f")
    snap = ok("snapshot", source, "--disk").strip()
    assert snap.startswith("snap_") and snap in ok("snapshots", "ls")
    fork = ok("create", "--from-snapshot", snap).strip()
    assert ok("run", fork, "--", "cat", "/sandbox/home/f") == "forked\n"
    ok("rm", fork, source)
    assert ok("snapshots", "rm", snap) == f"{snap}\n"
    bad = cli(sandboxd, "create", "--volume", "nopath")
    assert bad.returncode == 2 and b"NAME:PATH" in bad.stderr
