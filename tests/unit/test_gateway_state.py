"""The gateway state file: schema, hashes only, durability across SIGKILL, the lock, and the offline commands."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sbx.gateway import keys
from sbx.gateway.main import main
from sbx.gateway.state import NodeDef, NodeFlags, Quota, SandboxRecord, StateError, StateLocked
from sbx.gateway.store.schema import SQLITE_MIGRATIONS as MIGRATIONS
from sbx.gateway.store.sqlite import SqliteStore as Store
from sbx.gateway.store.sqlite import acquire_lock


def test_fresh_store_is_migrated_and_private(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "gw.db")
    assert store.schema_version() == len(MIGRATIONS)
    store.close()
    assert (tmp_path / "gw.db").stat().st_mode & 0o777 == 0o600
    # Opening again applies nothing twice.
    again = Store.open(tmp_path / "gw.db")
    assert again.schema_version() == len(MIGRATIONS)
    again.close()


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    Store.open(tmp_path / "gw.db").close()
    conn = sqlite3.connect(tmp_path / "gw.db")
    conn.execute("INSERT INTO schema_version (version) VALUES (?)", (len(MIGRATIONS) + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(StateError, match="newer than this sandbox-gateway knows"):
        Store.open(tmp_path / "gw.db")


def test_only_the_hash_of_a_secret_is_stored(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "gw.db")
    key, secret = keys.new_key("alice", "", {"sandbox:read"})
    store.add_key(key)
    store.close()
    assert secret.startswith("sgk_") and key.id.startswith("key_")
    raw = (tmp_path / "gw.db").read_bytes() + b"".join(p.read_bytes() for p in tmp_path.glob("gw.db-*"))
    assert secret.encode() not in raw
    assert keys.hash_secret(secret).encode() in raw
    reopened = Store.open(tmp_path / "gw.db")
    assert reopened.keys_by_hash[keys.hash_secret(secret)].user == "alice"
    reopened.close()


def test_records_survive_reopen(tmp_path: Path) -> None:
    store = Store.open(tmp_path / "gw.db")
    store.put_sandbox(SandboxRecord("sbx_1", "alice", "acme", "n1", "web", 1, 512, "2024-01-01T00:00:00Z"))
    store.add_node(NodeDef("n2", "unix:///run/n2.sock"))
    store.set_node_flags("n2", NodeFlags(cordoned=True, drained=True))
    store.set_quota("acme", Quota(max_sandboxes=2))
    store.close()
    again = Store.open(tmp_path / "gw.db")
    assert again.sandboxes["sbx_1"].name == "web"
    assert again.nodes["n2"].endpoint == "unix:///run/n2.sock"
    assert again.node_flags["n2"] == NodeFlags(True, True)
    assert again.quotas["acme"] == Quota(None, None, 2)
    again.forget_sandboxes(["sbx_1"])
    again.close()
    assert "sbx_1" not in Store.open(tmp_path / "gw.db").sandboxes


_WRITER = """
import sys
from pathlib import Path
from sbx.gateway import keys
from sbx.gateway.store.sqlite import SqliteStore
store = SqliteStore.open(Path(sys.argv[1]))
while True:
    key, secret = keys.new_key("u", "", {"sandbox:read"})
    store.add_key(key)
    print(key.id, flush=True)
"""


def test_sigkill_loses_nothing_acknowledged(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path / "gw.db")], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    acknowledged = [proc.stdout.readline().strip() for _ in range(40)]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = Store.open(tmp_path / "gw.db")
    assert set(acknowledged) <= set(store.keys)
    store.close()


def test_lock_is_exclusive(tmp_path: Path) -> None:
    fd = acquire_lock(tmp_path / "gw.db")
    try:
        with pytest.raises(StateLocked, match="another process holds the state file lock"):
            acquire_lock(tmp_path / "gw.db")
    finally:
        os.close(fd)
    os.close(acquire_lock(tmp_path / "gw.db"))


def test_offline_first_admin_key_then_list_and_revoke(tmp_path: Path) -> None:
    state = str(tmp_path / "gw.db")
    runner = CliRunner()
    made = runner.invoke(
        main, ["keys", "create", "--state", state, "--user", "admin", "--scope", "admin", "--json"]
    )
    assert made.exit_code == 0, made.output
    created = json.loads(made.output)
    assert created["secret"].startswith("sgk_") and created["scopes"] == ["admin"]
    listed = runner.invoke(main, ["keys", "list", "--state", state, "--json"])
    assert listed.exit_code == 0
    assert created["secret"] not in listed.output
    assert json.loads(listed.output)["keys"][0]["id"] == created["id"]
    assert runner.invoke(main, ["keys", "revoke", "--state", state, created["id"]]).exit_code == 0
    assert (
        "revoked"
        in json.loads(runner.invoke(main, ["keys", "list", "--state", state, "--json"]).output)["keys"][0]
    )
    unknown = runner.invoke(main, ["keys", "revoke", "--state", state, "key_nope"])
    assert unknown.exit_code == 1 and "no key 'key_nope'" in unknown.output


@pytest.mark.parametrize(
    "args",
    [
        ["keys", "create", "--user", "a", "--scope", "admin"],
        ["keys", "list"],
        ["keys", "revoke", "key_x"],
        ["nodes", "add", "n1", "unix:///run/x.sock"],
        ["nodes", "list"],
        ["nodes", "remove", "n1"],
        ["quotas", "set", "acme", "--cpus", "2"],
    ],
)
def test_offline_commands_refuse_while_locked(tmp_path: Path, args: list[str]) -> None:
    state = tmp_path / "gw.db"
    Store.open(state).close()
    before = state.read_bytes()
    fd = acquire_lock(state)
    try:
        result = CliRunner().invoke(main, [*args, "--state", str(state)])
    finally:
        os.close(fd)
    assert result.exit_code == 1
    assert "another process holds the state file lock" in result.output
    assert state.read_bytes() == before


def test_offline_nodes_and_quotas(tmp_path: Path) -> None:
    state = str(tmp_path / "gw.db")
    runner = CliRunner()
    assert runner.invoke(main, ["nodes", "add", "--state", state, "n1", "unix:///run/n1.sock"]).exit_code == 0
    bad = runner.invoke(main, ["nodes", "add", "--state", state, "n2", "http://10.0.0.1:80"])
    assert bad.exit_code == 2 and "loopback only" in bad.output
    listed = json.loads(runner.invoke(main, ["nodes", "list", "--state", state, "--json"]).output)
    assert listed == {"nodes": [{"name": "n1", "endpoint": "unix:///run/n1.sock", "cordoned": False}]}
    assert runner.invoke(main, ["quotas", "set", "--state", state, "acme", "--sandboxes", "3"]).exit_code == 0
    assert (
        "acme  cpus=None memory_mb=None sandboxes=3"
        in runner.invoke(main, ["quotas", "list", "--state", state]).output
    )
    assert runner.invoke(main, ["nodes", "remove", "--state", state, "n1"]).exit_code == 0
    assert runner.invoke(main, ["nodes", "remove", "--state", state, "n1"]).exit_code == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--listen", "0.0.0.0:7443"], "without TLS"),
        (["--metrics-listen", "0.0.0.0:9464"], "--metrics-listen must be loopback"),
        (["--tls-cert", __file__], "--tls-cert and --tls-key go together"),
        (["--node-lost-after", "soon"], "is not a duration"),
        (["--ssh-listen", "nowhere"], "--ssh-listen"),
        (["--ssh-advertise", "gw.example:22"], "--ssh-advertise needs --ssh-listen"),
    ],
)
def test_serve_refuses_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["serve", "--state", str(tmp_path / "gw.db"), *args])
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "gw.db").exists()


def test_serve_refuses_a_locked_state(tmp_path: Path) -> None:
    state = tmp_path / "gw.db"
    fd = acquire_lock(state)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "sbx.gateway.main", "serve", "--state", str(state), "--listen", "127.0.0.1:1"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    finally:
        os.close(fd)
    assert result.returncode == 1 and "another process holds the state file lock" in result.stderr


def test_node_file(tmp_path: Path) -> None:
    from sbx.gateway.main import load_node_file

    (tmp_path / "t").write_text("x")
    path = tmp_path / "nodes.toml"
    path.write_text('[[node]]\nname = "n1"\nendpoint = "unix:///run/a.sock"\ntoken_file = "t"\n')
    [node] = load_node_file(path)
    assert node == NodeDef("n1", "unix:///run/a.sock", token_file=str(tmp_path / "t"), from_file=True)
    path.write_text('[[node]]\nname = "n1"\nendpoint = "http://192.0.2.1:80"\n')
    with pytest.raises(click.BadParameter, match="loopback only"):
        load_node_file(path)
    path.write_text(
        '[[node]]\nname = "n1"\nendpoint = "unix:///a"\n[[node]]\nname = "n1"\nendpoint = "unix:///b"\n'
    )
    with pytest.raises(click.BadParameter, match="appears twice"):
        load_node_file(path)
