"""The store's shared tables (schema v4, docs/ha.md "Shared by the replicas") over both stores: the audit log
(append, read with since/limit in order, trimmed to its byte budget), the jobs' kept output and files (chunks,
caps, removal with the job), the gateway's own files (kept once: the first writer wins), the secrets key's check
and the SSH host keys every replica loads alike. The audit and output tests run on PostgreSQL what the file
versions' tests check on files (tests/unit/test_gateway_server.py, test_gateway_jobs*)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncssh
import msgspec
import pytest
from pg_cluster import PgCluster

from sbx.api.jobs import JobSpec
from sbx.api.processes import OutputChunk
from sbx.gateway.audit import STORE_TRIM_EVERY_BYTES, StoreAudit
from sbx.gateway.jobs.controller import JobOptions
from sbx.gateway.jobs.outputs import CHUNK_BYTES, STREAM_CAP_BYTES, Outputs, StoredFile, StoreOutputs
from sbx.gateway.jobs.store import JobRecord, RunRecord
from sbx.gateway.nodes import Registry
from sbx.gateway.secrets import KEY_CHECK, SecretBox, SecretsKeyError, check_key
from sbx.gateway.server import Gateway, GatewayOptions
from sbx.gateway.ssh.hostkeys import HostKeyError, load_shared
from sbx.gateway.state import now_rfc3339
from sbx.gateway.store import Store, StoreLocation, Upsert, open_store


@pytest.fixture(params=["sqlite", "postgres"])
def location(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> StoreLocation:
    if request.param == "sqlite":
        return StoreLocation(state=tmp_path / "gw.db")
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    for name, value in cluster.env().items():
        monkeypatch.setenv(name, value)
    return StoreLocation(database=cluster.create_database())


@pytest.fixture
def store(location: StoreLocation) -> Iterator[Store]:
    s = open_store(location, serving=True)
    yield s
    s.close()


def _replica(location: StoreLocation, first: Store) -> Store:
    """A second replica of the same store (PostgreSQL), or the same store again (SQLite has one process)."""
    return open_store(location, serving=True) if location.database is not None else first


# -- the audit log ---------------------------------------------------------------------------------------------


def test_audit_lines_round_trip_in_order_with_since_and_limit(store: Store) -> None:
    store.audit_append([(1000 + i, json.dumps({"i": i})) for i in range(1200)])  # more than one INSERT
    assert [json.loads(line)["i"] for line in store.audit_read(None, 5000)] == list(range(1200))
    assert [json.loads(line)["i"] for line in store.audit_read(1100, 3)] == [100, 101, 102]
    assert store.audit_read(10**15, 10) == []


def test_audit_trim_keeps_the_newest_bytes_of_the_budget(store: Store) -> None:
    store.audit_append([(i, f"{i:02d}" + "x" * 98) for i in range(50)])
    assert store.audit_trim(1000) == 40
    assert [line[:2] for line in store.audit_read(None, 100)] == [f"{i:02d}" for i in range(40, 50)]
    assert store.audit_trim(1000) == 0  # within the budget: nothing goes


def test_store_audit_reads_as_the_file_does_and_drops_what_may_not_be_logged(store: Store) -> None:
    audit = StoreAudit(store)
    try:
        for i in range(60):
            audit.record(kind="api", type="api.request", route=f"/v1/x/{i}", status=200, body="never")  # type: ignore[arg-type]
        entries, truncated = audit.read(None, 1000)  # a read writes what is queued first
        assert [e["route"] for e in entries] == [f"/v1/x/{i}" for i in range(60)] and not truncated
        assert all("body" not in e and e["time"].endswith("Z") for e in entries)
        first_two, more = audit.read(None, 2)
        assert len(first_two) == 2 and more
        assert audit.read(datetime.now(UTC) + timedelta(seconds=5), 10) == ([], False)
        # since: an entry's own time (milliseconds) includes it
        since = datetime.fromisoformat(entries[30]["time"])
        later, _ = audit.read(since, 1000)
        assert later[0]["time"] >= entries[30]["time"] and entries[30] in later
    finally:
        audit.close()


def test_store_audit_trims_to_its_budget_written_by_two_replicas(
    location: StoreLocation, store: Store
) -> None:
    other = _replica(location, store)
    budget_of = {"max_bytes": 20_000, "keep": 4}  # 100 KB of lines, like 5 generations of 20 KB
    a, b = StoreAudit(store, **budget_of), StoreAudit(other, **budget_of)
    count = 2 * STORE_TRIM_EVERY_BYTES // 450 + 200  # each writer writes more than its trim step

    def lines() -> list[str]:
        return store.audit_read(None, 10 * count)

    try:
        padding = "p" * 400
        for i in range(count):
            (a if i % 2 else b).record(kind="api", type="api.request", route=f"/v1/{i}/{padding}")
        assert a.flush() and b.flush()
        kept = lines()
        size = sum(len(line.encode()) for line in kept)
        # each writer trimmed once: the budget, exceeded by at most what each wrote since its trim
        assert len(kept) < count and size <= 100_000 + 2 * STORE_TRIM_EVERY_BYTES
        # (which lines are newest is the order they reached the database: one writer may finish before the other)
        assert a.read(None, 1000) == b.read(None, 1000)  # the same answer from either replica
        store.audit_trim(100_000)
        size = sum(len(line.encode()) for line in lines())
        assert 100_000 - 500 < size <= 100_000  # the newest lines of the budget, whole lines
    finally:
        a.close()
        b.close()
        if other is not store:
            other.close()


def test_store_audit_keeps_entries_while_the_store_fails_and_writes_them_after(store: Store) -> None:
    """A write that fails (the database away) keeps the entries queued and never raises to the recorder."""
    real = store.audit_append
    failing = threading.Event()
    failing.set()

    def append(entries: list[tuple[int, str]]) -> None:
        if failing.is_set():
            raise OSError("database away")
        real(entries)

    store.audit_append = append  # type: ignore[method-assign]
    audit = StoreAudit(store)
    try:
        audit.record(kind="api", type="api.request", route="/v1/kept")
        assert audit.flush(timeout_secs=1.5) is False  # not written yet, still queued
        failing.clear()
        assert audit.flush()
        assert [e["route"] for e in audit.read(None, 10)[0]] == ["/v1/kept"]
    finally:
        audit.close()


# -- the jobs' kept output and files -----------------------------------------------------------------------------


def test_output_is_kept_in_chunks_cut_at_the_cap_and_read_by_another_replica(
    location: StoreLocation, store: Store
) -> None:
    outputs = StoreOutputs(store)
    spool = outputs.spool("job_1", 1)
    big = b"a" * (CHUNK_BYTES - 1) + b"b"
    for _ in range(STREAM_CAP_BYTES // CHUNK_BYTES + 3):  # past the cap
        spool.add(OutputChunk("stdout", big))
    spool.add(OutputChunk("stderr", b"oops"))
    spool.close()
    assert spool.truncated
    other = _replica(location, store)
    try:
        seen = StoreOutputs(other)
        stdout = seen.read_stream("job_1", 1, "stdout")
        assert len(stdout) == STREAM_CAP_BYTES and stdout == big * (STREAM_CAP_BYTES // CHUNK_BYTES)
        assert seen.read_stream("job_1", 1, "stderr") == b"oops"
        assert seen.read_stream("job_1", 2, "stdout") == b""
    finally:
        if other is not store:
            other.close()


def test_a_spool_started_again_keeps_only_the_new_output(store: Store) -> None:
    outputs = StoreOutputs(store)
    spool = outputs.spool("job_1", 1)
    spool.add(OutputChunk("stdout", b"first " * 100_000))
    spool.close()
    spool.restart()
    spool.add(OutputChunk("stdout", b"second"))
    spool.close()
    assert outputs.read_stream("job_1", 1, "stdout") == b"second" and not spool.truncated


def test_a_running_spool_writes_what_it_holds_after_a_second(store: Store) -> None:
    outputs = StoreOutputs(store)
    spool = outputs.spool("job_1", 1)
    spool.add(OutputChunk("stdout", b"so far"))
    time.sleep(1.1)
    spool.add(OutputChunk("stdout", b", more"))
    assert outputs.read_stream("job_1", 1, "stdout") == b"so far, more"  # before the close


def test_kept_files_round_trip_and_go_with_their_job(store: Store, tmp_path: Path) -> None:
    outputs = StoreOutputs(store, tmp_path / "jobs")
    data = bytes(range(256)) * (CHUNK_BYTES // 256 * 2 + 5)
    outputs.keep_file("job_1", 1, 0, data)
    outputs.keep_file("job_1", 1, 1, b"")
    outputs.keep_file("job_2", 1, 0, b"other")
    outputs.spool("job_1", 1).close()
    assert outputs.read_file("job_1", 1, 0) == data and outputs.read_file("job_1", 1, 1) == b""
    outputs.keep_file("job_1", 1, 0, b"smaller")  # replaced whole
    assert outputs.read_file("job_1", 1, 0) == b"smaller"
    assert outputs.read_file("job_1", 1, 2) is None
    outputs.remove("job_1")
    assert outputs.read_file("job_1", 1, 0) is None and outputs.read_file("job_2", 1, 0) == b"other"


def test_a_kept_file_is_answered_a_chunk_at_a_time(store: Store, tmp_path: Path) -> None:
    """What the route streams: the chunks in order, their total as the length, one chunk per read; a chunk gone
    meanwhile (the job removed) is an error, never a short file taken for whole."""
    outputs = StoreOutputs(store, tmp_path / "jobs")
    data = bytes(range(256)) * (CHUNK_BYTES // 256 * 3 + 7)  # three whole chunks and a part
    outputs.keep_file("job_1", 1, 0, data)
    outputs.keep_file("job_1", 1, 1, b"")
    found = outputs.stored_file("job_1", 1, 0)
    assert isinstance(found, StoredFile) and found.size == len(data) and len(found.seqs) == 4
    chunks = [found.chunk(i) for i in range(len(found.seqs))]
    assert [len(c) for c in chunks] == [CHUNK_BYTES] * 3 + [len(data) - 3 * CHUNK_BYTES]
    assert b"".join(chunks) == data
    empty = outputs.stored_file("job_1", 1, 1)
    assert isinstance(empty, StoredFile) and empty.size == 0 and b"".join(map(empty.chunk, range(1))) == b""
    assert outputs.stored_file("job_1", 1, 2) is None
    outputs.remove("job_1")
    with pytest.raises(LookupError):
        found.chunk(0)
    files = Outputs(tmp_path / "jobs")
    files.keep_file("job_old", 1, 0, b"kept before")  # a run kept as a file before a migrate: its bytes
    assert outputs.stored_file("job_old", 1, 0) == b"kept before"


def test_runs_kept_as_files_before_are_read_when_the_store_has_nothing(store: Store, tmp_path: Path) -> None:
    """A gateway moved to PostgreSQL (``migrate``) still answers for the runs it kept as files."""
    files = Outputs(tmp_path / "jobs")
    spool = files.spool("job_old", 1)
    spool.add(OutputChunk("stdout", b"from before"))
    spool.close()
    files.keep_file("job_old", 1, 0, b"kept before")
    outputs = StoreOutputs(store, tmp_path / "jobs")
    assert outputs.read_stream("job_old", 1, "stdout") == b"from before"
    assert outputs.read_file("job_old", 1, 0) == b"kept before"
    outputs.remove("job_old")
    assert not (tmp_path / "jobs" / "job_old").exists()


# -- the gateway's files: the secrets key's check and the SSH host keys ------------------------------------------


def test_a_gateway_file_is_kept_once(store: Store) -> None:
    assert store.file_get("f") is None
    assert store.file_put_new("f", None, b"first") is True
    assert store.file_put_new("f", b"n" * 12, b"second") is False
    assert store.file_get("f") == (None, b"first")


def test_the_secrets_key_check_refuses_another_key_and_changes_nothing(store: Store, tmp_path: Path) -> None:
    right, wrong = SecretBox(b"k" * 32), SecretBox(b"w" * 32)
    check_key(store, right, tmp_path / "right.key")
    kept = store.file_get(KEY_CHECK)
    check_key(store, right, tmp_path / "right.key")  # again: fine
    with pytest.raises(SecretsKeyError) as caught:
        check_key(store, wrong, tmp_path / "wrong.key")
    assert str(caught.value).startswith(
        f"the secrets key file {tmp_path / 'wrong.key'} does not open the secrets sealed in {store.location}"
    )
    assert "give every replica the same --secrets-key-file" in str(caught.value)
    assert store.file_get(KEY_CHECK) == kept


def test_the_secrets_key_check_of_a_store_from_before_reads_its_secrets(store: Store, tmp_path: Path) -> None:
    nonce, ciphertext = SecretBox(b"k" * 32).seal("acme", "TOKEN", b"v")
    store.execute([Upsert("secrets", {"tenant": "acme", "name": "TOKEN", "nonce": nonce, "ciphertext": ciphertext,
                                      "updated": "2026-01-01T00:00:00Z"})])  # fmt: skip
    with pytest.raises(SecretsKeyError, match="does not open the secrets sealed in"):
        check_key(store, SecretBox(b"w" * 32), tmp_path / "wrong.key")
    assert store.file_get(KEY_CHECK) is None  # nothing written for the wrong key
    check_key(store, SecretBox(b"k" * 32), tmp_path / "right.key")
    assert store.file_get(KEY_CHECK) is not None


@pytest.mark.parametrize("sealed", [True, False])
def test_every_replica_loads_the_same_host_keys(
    location: StoreLocation, store: Store, tmp_path: Path, sealed: bool
) -> None:
    box = SecretBox(b"k" * 32) if sealed else None
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = load_shared(store, tmp_path / "a" / "gateway", box)
    other = _replica(location, store)
    try:
        second = load_shared(other, tmp_path / "b" / "gateway", box)
        assert second.public_lines == first.public_lines and second.fingerprint == first.fingerprint
        assert not list((tmp_path / "a").iterdir())  # nothing on the replicas' disks
        nonce, data = store.file_get("ssh_host_ed25519_key") or (None, b"")
        assert (nonce is not None) == sealed and (b"OPENSSH PRIVATE KEY" in data) != sealed
        if sealed:
            with pytest.raises(HostKeyError, match="is sealed with a secrets key: start this replica with"):
                load_shared(other, tmp_path / "b" / "gateway", None)
            with pytest.raises(HostKeyError, match="cannot be opened with this replica's secrets key"):
                load_shared(other, tmp_path / "b" / "gateway", SecretBox(b"w" * 32))
    finally:
        if other is not store:
            other.close()


def test_a_host_key_file_wins_and_is_put_into_a_store_that_has_none(store: Store, tmp_path: Path) -> None:
    key = asyncssh.generate_private_key("ssh-ed25519")
    path = tmp_path / "gateway.ssh_host_ed25519_key"
    path.write_bytes(key.export_private_key("openssh"))
    path.chmod(0o600)
    loaded = load_shared(store, tmp_path / "gateway", None)
    line = " ".join(key.export_public_key("openssh").decode().split()[:2])
    assert loaded.public_lines[0] == line
    (tmp_path / "elsewhere").mkdir()
    assert load_shared(store, tmp_path / "elsewhere" / "gateway", None).public_lines == loaded.public_lines


async def test_a_job_past_its_retention_takes_its_kept_output_with_it(store: Store, tmp_path: Path) -> None:
    """The leader's sweep forgets a finished job older than ``--job-retention`` and what it kept in the store; a
    newer one keeps its output (the file version's rule, on the store)."""
    options = GatewayOptions(jobs=JobOptions(tmp_path / "jobs", retention_secs=3600, shared_outputs=True))
    gateway = Gateway(store, Registry(), None, options)
    jobs = gateway.jobs
    assert isinstance(jobs.outputs, StoreOutputs)
    spec = msgspec.convert({"command": ["true"]}, JobSpec)
    old, new = "2020-01-01T00:00:00Z", now_rfc3339()
    for job_id, updated in (("job_old", old), ("job_new", new)):
        await jobs.db.put(job=JobRecord(job_id, "alice", "", None, spec, None, "succeeded", None, old, updated),
                          run=RunRecord(job_id, 1, "succeeded"))  # fmt: skip
        spool = jobs.outputs.spool(job_id, 1)
        spool.add(OutputChunk("stdout", b"out"))
        spool.close()
        jobs.outputs.keep_file(job_id, 1, 0, b"kept")
    await jobs._forget_old()
    assert set(jobs.db.jobs) == {"job_new"}
    assert (
        jobs.outputs.read_stream("job_old", 1, "stdout") == b""
        and jobs.outputs.read_file("job_old", 1, 0) is None
    )
    assert jobs.outputs.read_stream("job_new", 1, "stdout") == b"out"
    assert jobs.outputs.read_file("job_new", 1, 0) == b"kept"


def test_serve_on_a_database_takes_no_audit_log_file(tmp_path: Path) -> None:
    """The replicas' audit log is the database's: a file given with --database is refused before anything starts
    (nothing connects: the host does not exist), and ``none`` is taken."""
    from click.testing import CliRunner

    from sbx.gateway.main import main

    args = ["serve", "--database", "postgresql://gw@db.invalid/gw", "--data-dir", str(tmp_path)]
    result = CliRunner().invoke(main, [*args, "--audit-log", str(tmp_path / "audit.jsonl")])
    assert result.exit_code == 2 and (
        "with --database the audit log is kept in the database, shared by the replicas: --audit-log takes only "
        "'none' there"
    ) in " ".join(result.output.split())
    assert list(tmp_path.iterdir()) == []
    result = CliRunner().invoke(main, [*args, "--audit-log", "none"])
    assert (
        result.exit_code == 1 and "cannot use the database" in result.output
    )  # past the check, to connecting
