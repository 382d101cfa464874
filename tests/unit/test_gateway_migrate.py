"""``sandbox-gateway migrate --from FILE --to URL``: a stopped gateway's SQLite state, every table filled, copied
into PostgreSQL (a private cluster) row for row; refused while the SQLite gateway serves, while a gateway owns the
database, or when the database already holds state — and then nothing changes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner
from pg_cluster import PgCluster

from sbx.api.jobs import JobSpec, KeptFile
from sbx.api.services import ServiceSpec
from sbx.gateway import keys
from sbx.gateway.jobs.store import JobRecord, JobStore, RunRecord
from sbx.gateway.main import main
from sbx.gateway.ports.store import PortStore, PortTokenRecord
from sbx.gateway.services.store import ReplicaRecord, ServiceRecord, ServiceStore
from sbx.gateway.state import (
    MemberRecord,
    NodeDef,
    NodeFlags,
    OrgRecord,
    Quota,
    SandboxRecord,
    SnapshotRecord,
    SshKeyRecord,
    SshTokenRecord,
    VolumeRecord,
)
from sbx.gateway.store import TABLES, Delete, Insert, Store, StoreLocation, Upsert, open_store
from sbx.gateway.store.sqlite import acquire_lock

T0 = "2026-01-02T03:04:05Z"


async def _write(fn: Any, *args: Any) -> Any:
    return fn(*args)


def fill(store: Store) -> None:
    """A row (or a few) in every table, through the same calls the gateway makes."""
    for user in ("admin", "alice"):
        store.add_key(keys.new_key(user, "acme" if user == "alice" else "", {"admin"})[0])
    store.revoke_key(next(iter(store.keys)))
    store.add_node(NodeDef("n1", "https://10.0.0.1:7070", "/etc/sbx/n1.token", "/etc/sbx/ca.pem"))
    store.set_node_flags("n1", NodeFlags(cordoned=True))
    store.put_sandbox(SandboxRecord("sbx_1", "alice", "acme", "n1", "web", 2, 2048, T0))
    store.put_volume(VolumeRecord("data", "alice", "acme", "n1", T0))
    store.put_snapshot(SnapshotRecord("snap_1", "alice", "acme", "n1", "sbx_1", T0))
    store.add_org(OrgRecord("acme", T0, "alice", ""), MemberRecord("acme", "alice", "", "owner", T0))
    store.put_member(MemberRecord("acme", "bob", "", "member", T0))
    store.set_quota("acme", Quota(8, 2**40, 10))
    store.add_ssh_key(SshKeyRecord("sshk_1", "alice", "", "acme", "SHA256:x", "ssh-ed25519 AAAA", None, T0))
    store.add_ssh_token(SshTokenRecord("a" * 64, "alice", "acme", "sbx_1", 1767225600.5, T0))
    spec = msgspec.convert({"name": "web", "image": "debian", "command": ["sleep", "1d"]}, ServiceSpec)
    services = ServiceStore(store, _write)
    svc = ServiceRecord("svc_1", "acme", "web", "alice", spec, 1, 1, 1, 0, None, T0, T0)
    asyncio.run(services.put_service(svc, new_revision=spec))
    asyncio.run(services.put_replica(ReplicaRecord("sbx_1", "svc_1", "n1", 1, 42, 0, True, T0)))
    jobs = JobStore(store, _write)
    job = JobRecord("job_1", "alice", "acme", None, msgspec.convert({"command": ["true"]}, JobSpec), None,
                    "succeeded", None, T0, T0)  # fmt: skip
    run = RunRecord("job_1", 1, "succeeded", "sbx_2", "n1", 7, 0, T0, T0, None, False,
                    (KeptFile(path="out.txt", bytes=2),))  # fmt: skip
    asyncio.run(jobs.put(job=job, run=run))
    store.execute([Upsert("secrets", {"tenant": "acme", "name": "TOKEN", "nonce": os.urandom(12),
                                      "ciphertext": os.urandom(40), "updated": T0})])  # fmt: skip
    # Three notifications, the first delivered (deleted): ids are copied as they were, gaps included.
    for _ in range(3):
        store.execute([Insert("notifications", {"job": "job_1", "url": "https://hooks.example/x", "body": "{}",
                                                "attempts": 1, "first_try": 1.5, "next_try": 2.5})])  # fmt: skip
    first = store.query("notifications", ("id",), "id")[0][0]
    store.execute([Delete("notifications", {"id": first})])
    # The tables shared by replicas (a SQLite gateway writes only gateway_files; the others as a PostgreSQL one).
    store.audit_append(
        [(1767225600000 + i, f'{{"time":"2026-01-01T00:00:00.00{i}Z","kind":"api"}}') for i in range(3)]
    )
    store.output_put("job_1", 1, "stdout", 0, b"out")
    store.output_replace("job_1", 1, "file/0", [b"ke", b"pt"])
    store.file_put_new("ssh_host_ed25519_key", os.urandom(12), os.urandom(40))
    ports = PortStore(store, _write)
    asyncio.run(ports.set_public("sbx_1", 8080, True, T0))
    asyncio.run(
        ports.add_token(PortTokenRecord("b" * 64, "sbx_1", 8080, "key_1", "alice", "acme", 1767225600.5, T0))
    )


def dump(store: Store) -> dict[str, list[tuple[Any, ...]]]:
    return {name: sorted(tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
                         for row in store.select(name, t.columns))
            for name, t in TABLES.items()}  # fmt: skip


@pytest.fixture
def world(
    tmp_path: Path, pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, str]]:
    for name, value in pg_cluster.env().items():
        monkeypatch.setenv(name, value)
    state = tmp_path / "gw.db"
    store = open_store(StoreLocation(state=state))
    fill(store)
    store.close()
    yield state, pg_cluster.create_database()


def migrate(state: Path, url: str) -> Any:
    return CliRunner().invoke(main, ["migrate", "--from", str(state), "--to", url])


def test_every_table_is_copied_row_for_row(world: tuple[Path, str]) -> None:
    state, url = world
    source = open_store(StoreLocation(state=state))
    before = dump(source)
    source.close()
    assert all(before[name] for name in TABLES), [n for n in TABLES if not before[n]]  # every table filled
    result = migrate(state, url)
    assert result.exit_code == 0, result.output
    assert f"copied {sum(len(rows) for rows in before.values())} rows" in result.output
    target = open_store(StoreLocation(database=url))
    assert dump(target) == before
    source = open_store(StoreLocation(state=state))
    assert dump(source) == before  # the source is left as it was
    for table in ("keys", "keys_by_hash", "nodes", "node_flags", "sandboxes", "volumes", "snapshots", "orgs",
                  "members", "quotas", "ssh_keys", "ssh_tokens"):  # fmt: skip
        assert getattr(target, table) == getattr(source, table), table
    # The next notification id follows the highest copied one.
    highest = max(row[0] for row in before["notifications"])
    target.execute([Insert("notifications", {"job": "job_1", "url": "https://hooks.example/x", "body": "{}",
                                             "attempts": 0, "first_try": 1.0, "next_try": 1.0})])  # fmt: skip
    assert max(row[0] for row in target.query("notifications", ("id",))) == highest + 1
    # And the next audit line goes after the copied ones.
    target.audit_append([(1767225700000, '{"kind":"api","after":true}')])
    assert target.audit_read(None, 10)[-1] == '{"kind":"api","after":true}'
    assert max(row[0] for row in target.select("audit", ("id",))) == max(r[0] for r in before["audit"]) + 1
    source.close()
    target.close()


def test_refused_while_the_sqlite_gateway_serves(world: tuple[Path, str]) -> None:
    state, url = world
    fd = acquire_lock(state)
    try:
        result = migrate(state, url)
    finally:
        os.close(fd)
    assert result.exit_code == 1 and "another process holds the state file lock" in result.output
    target = open_store(StoreLocation(database=url))
    assert target.holds_state() is False
    target.close()


def test_refused_when_the_database_holds_state(world: tuple[Path, str]) -> None:
    state, url = world
    target = open_store(StoreLocation(database=url))
    target.add_key(keys.new_key("someone", "", {"admin"})[0])
    before = dump(target)
    target.close()
    result = migrate(state, url)
    assert result.exit_code == 1 and "already holds a gateway's state" in result.output
    assert "nothing was changed" in result.output
    target = open_store(StoreLocation(database=url))
    assert dump(target) == before
    target.close()


def test_a_second_migrate_is_refused(world: tuple[Path, str]) -> None:
    state, url = world
    assert migrate(state, url).exit_code == 0
    again = migrate(state, url)
    assert again.exit_code == 1 and "already holds a gateway's state" in again.output


def test_refused_while_a_gateway_owns_the_database(world: tuple[Path, str]) -> None:
    state, url = world
    owner = open_store(StoreLocation(database=url))
    try:
        result = migrate(state, url)
    finally:
        owner.close()
    assert result.exit_code == 1 and "another sandbox-gateway holds the database" in result.output
    target = open_store(StoreLocation(database=url))
    assert target.holds_state() is False
    target.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--to", "postgresql://gw:hunter2@db.example/gw"], "the database URL carries a password"),
        (["--to", "sqlite:///x.db"], "is not a PostgreSQL URL"),
    ],
)
def test_bad_targets_are_refused(tmp_path: Path, args: list[str], message: str) -> None:
    state = tmp_path / "gw.db"
    open_store(StoreLocation(state=state)).close()
    result = CliRunner().invoke(main, ["migrate", "--from", str(state), *args])
    assert result.exit_code == 2 and message in result.output and "hunter2" not in result.output


def test_a_missing_source_is_refused_and_not_made(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["migrate", "--from", str(tmp_path / "nope.db"), "--to", "postgresql://gw@db/gw"]
    )
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not (tmp_path / "nope.db").exists()
