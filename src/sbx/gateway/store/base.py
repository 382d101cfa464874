"""The store interface: the gateway's tables held in memory, written through to a database.

Two implementations (``sqlite.SqliteStore``, ``postgres.PostgresStore``) provide the same four primitives —
:meth:`Store.apply` (writes in one transaction), :meth:`Store.select`, :meth:`Store.schema_version`,
:meth:`Store.close` — and everything else (the in-memory tables, their loading, the record methods) is written
once, here, in terms of them. Nothing outside ``sbx.gateway.store`` names an implementation; ``open_store``
picks one from the location (``--state FILE`` or ``--database URL``).

Every table the request path reads is held in memory, and each write updates memory only after its commit.
Several replicas may write one PostgreSQL database: each in-memory table is then a cache kept in step through
:meth:`Store.listen` (every commit announces the rows it changed; each replica reloads them and hands them to
:meth:`Store.refresh`, which puts them into the table's :class:`Mirror`). Methods are synchronous; the server
calls the writing ones through ``asyncio.to_thread`` (a commit waits on a disk or a network) and reads memory
directly.
"""

from __future__ import annotations

import asyncio
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sbx.gateway.state import (
    KeyRecord,
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
    now_rfc3339,
)
from sbx.gateway.store.ops import Delete, Insert, Op, Update, Upsert
from sbx.gateway.store.schema import TABLES

Row = tuple[Any, ...]


@dataclass(frozen=True)
class Result:
    """What one statement of :meth:`Store.run` did: the rows it changed and the rows it returned."""

    count: int
    rows: list[Row]


@dataclass(frozen=True)
class Mirror:
    """How memory holds a table: ``put`` a row (every column of ``schema.TABLES``, in order), ``drop`` the row
    with a primary key (a tuple, in the key's column order; absent is fine), ``clear`` them all."""

    put: Callable[[Row], None]
    drop: Callable[[Row], object]
    clear: Callable[[], None]


@dataclass(frozen=True)
class Change:
    """Rows another writer committed: ``key`` the primary key of the one row changed (``rows`` is then that row,
    or nothing when it is gone), or None for the whole table (``rows`` is every row). ``local``: the change was
    this store's own write (memory already has it; no follow-up to run)."""

    table: str
    key: Row | None
    rows: list[Row]
    local: bool = False


class Store(ABC):
    """The open store plus its in-memory tables. Open one with ``sbx.gateway.store.open_store``; call
    :meth:`close` at the end (which also lets go of the owner lock)."""

    #: What the store is, for messages and logs: the state file's path or the database URL (never a password).
    location: str
    #: Whether several processes serve it, one of them elected to lead (``lead``); else this one leads.
    elects: bool = False

    def __init__(self) -> None:
        self.keys: dict[str, KeyRecord] = {}
        self.keys_by_hash: dict[str, KeyRecord] = {}
        self.nodes: dict[str, NodeDef] = {}
        self.node_flags: dict[str, NodeFlags] = {}
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.volumes: dict[str, VolumeRecord] = {}
        self.snapshots: dict[str, SnapshotRecord] = {}
        self.orgs: dict[str, OrgRecord] = {}
        self.members: dict[tuple[str, str], MemberRecord] = {}
        self.quotas: dict[str, Quota] = {}
        self.ssh_keys: dict[str, SshKeyRecord] = {}
        self.ssh_tokens: dict[str, SshTokenRecord] = {}
        #: Per table: how memory holds it (``mirror``); the store's own tables here, the services', jobs' and
        #: secrets' added by their modules.
        self.mirrors: dict[str, Mirror] = {}
        self._mirror_own_tables()

    # -- the primitives each implementation provides ---------------------------------------------

    @abstractmethod
    def apply(self, ops: Sequence[Op], full: bool = True) -> list[int]:
        """Run ``ops`` in one transaction; the number of rows each changed.

        ``full`` (keys, nodes, orgs, quotas, every state a client was told of) waits until the commit is durable.
        ``full=False`` (ownership records, a job's progress) returns once the database has the commit — a SIGKILL
        of the gateway loses nothing — without waiting for the disk, since a create's latency matters and such a
        record lost to a power cut is taken back from the node's labels at the next reconcile."""

    @abstractmethod
    def select(
        self, table: str, columns: Sequence[str], order_by: str | None = None
    ) -> list[tuple[Any, ...]]:
        """Every row of ``table`` (``columns`` in that order), sorted by ``order_by`` when given."""

    @abstractmethod
    def run(self, statements: Sequence[tuple[str, tuple[Any, ...]]], full: bool = True) -> list[Result]:
        """Run SQL ``statements`` (written with :attr:`mark` as the placeholder) in one transaction, announcing
        nothing to the other replicas: for the tables no replica holds in memory (the audit log, the jobs' kept
        output, the gateway's files), written and read by the methods below only. ``full`` as in :meth:`apply`."""

    #: The placeholder of :meth:`run`'s SQL (``?`` for SQLite, ``%s`` for PostgreSQL).
    mark: str = "?"

    @abstractmethod
    def schema_version(self) -> int:
        """The schema version the database is at (``schema.SCHEMA_VERSION`` once opened)."""

    @abstractmethod
    def close(self) -> None:
        """Close the database and let go of the owner lock."""

    def watch_owner(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(reason)`` (once, from another thread) if the owner lock is ever lost while open. A
        SQLite lock file cannot be: nothing to watch."""

    def not_ready(self) -> str | None:
        """Why this store cannot serve a request now (its database unreachable, its owner lock lost, its change
        notifications not listened to), or None when it can: the readiness check (``GET /v1/ready``). Blocks for
        at most a few seconds (one round trip to the database); the caller caches it. A SQLite file is this
        process's own: always None."""
        return None

    def listen(self, on_changes: Callable[[list[Change]], None]) -> None:
        """Call ``on_changes`` (from another thread, in commit order) with the rows of the mirrored tables that
        any writer of the database committed, this one's included (marked ``local``), until :meth:`close`; a
        table memory does not hold (the notification outbox) is named with no rows. A
        SQLite file has one writer, this process, whose memory is already exact: nothing to listen to."""

    def lead(self, on_change: Callable[[bool], None]) -> None:
        """Run for the leadership of the replicas: ``on_change(True)`` once this process leads (it then runs the
        work done once: sweeps, the services' and jobs' controllers, the notification outbox), ``on_change(False)``
        if it loses it (it must stop: another may lead by then). Called from another thread. A SQLite file has
        one process: it leads at once, on the caller's thread."""
        on_change(True)

    def lock(self, names: Sequence[tuple[str, str]]) -> object:
        """Take the locks shared by every replica named by ``names`` — (kind, name) pairs, kind ``tenant`` (a
        create's quota check, node call and record run under it), ``node`` (a node's cordon, set by one replica
        and restored by another's poll) or ``name`` (a name's check and its create) — waiting for them; a handle
        for :meth:`unlock`. All of them are held together on one database connection from a small pool, so a
        replica holds a bounded number however many creates wait (docs/ha.md). One process (SQLite): its own
        in-process locks are enough, nothing to take."""
        return None

    def unlock(self, handle: object) -> None:
        """Let go of the locks :meth:`lock` took."""

    @property
    def shared(self) -> bool:
        """Whether other processes may write the store now (replicas on one database, listened to)."""
        return False

    def signal(self, name: str, args: Sequence[str]) -> None:
        """Tell every listener (this store's too) ``name`` with ``args``, without a write: it arrives as a
        ``Change`` of table ``signal:NAME``, key ``args``, no rows (a follower asking the leader to cancel a job).
        One process (SQLite) has nobody else to tell: nothing is sent."""

    def caught_up(self, timeout_secs: float) -> bool:
        """Block until every change committed before the call was handed to ``on_changes`` (False after
        ``timeout_secs``). Without other writers (SQLite), at once."""
        return True

    async def caught_up_on_loop(self, timeout_secs: float) -> bool:
        """:meth:`caught_up` awaited on the event loop (PostgreSQL asks its query on the loop itself); here, on a
        thread."""
        return await asyncio.to_thread(self.caught_up, timeout_secs)

    def refresh(self, changes: Sequence[Change]) -> None:
        """Put ``changes`` into memory (on the thread that reads memory: the event loop)."""
        for change in changes:
            mirror = self.mirrors.get(change.table)
            if mirror is None:
                continue
            if change.key is None:
                mirror.clear()
            else:
                mirror.drop(change.key)
            for row in change.rows:
                mirror.put(row)

    def mirror(self, table: str, put: Callable[[Row], None], drop: Callable[[Row], object],
               clear: Callable[[], None]) -> None:  # fmt: skip
        """Register how memory holds ``table`` (a module with its own in-memory copy: services, jobs, secrets)."""
        self.mirrors[table] = Mirror(put, drop, clear)

    def after_copy(self) -> None:
        """Called once ``copy_state`` has written rows with their ids (a back-end with sequences moves them on)."""

    def holds_state(self) -> bool:
        """Whether any table holds a row (``migrate`` refuses such a target)."""
        return any(self.select(name, table.key[:1]) for name, table in TABLES.items())

    # -- tables of other modules (services, jobs, secrets, the notification outbox) ---------------

    def execute(self, ops: Sequence[Op], full: bool = True) -> None:
        """Run ``ops`` in one transaction (``full``: see :meth:`apply`). For modules that keep their own tables
        and in-memory copies (services, jobs, secrets): call it off the event loop."""
        self.apply(ops, full)

    def query(self, table: str, columns: Sequence[str], order_by: str | None = None) -> list[tuple[Any, ...]]:
        """Rows of ``table`` (at start-up, when a module loads its tables; the notification outbox)."""
        return self.select(table, columns, order_by)

    # -- the notification outbox (jobs/notify.py) ----------------------------------------------------

    #: The columns of a claimed notification, in order.
    OUTBOX_COLUMNS = ("id", "url", "body", "attempts", "first_try", "next_try", "job")

    def claim_notifications(self, owner: str, lease_secs: float) -> list[Row]:
        """The outbox's rows up for delivery now — of each job its oldest (a job's notifications go in order), once
        its ``next_try`` (epoch seconds) has come — as ``OUTBOX_COLUMNS``, soonest first, claimed by ``owner``.

        With replicas (PostgreSQL) a claim is a lease of ``lease_secs`` written on the row, and a row another
        worker holds a lease on is not claimed until that lease ends. One process (SQLite): its one notifier ends
        every claim before it claims again, so nothing is written (a restart finds the row due, as before)."""
        now = time.time()
        heads: dict[str, Row] = {}
        for row in self.select("notifications", self.OUTBOX_COLUMNS, "id"):
            heads.setdefault(row[6], row)
        return sorted((r for r in heads.values() if r[5] <= now), key=lambda r: r[5])

    def next_notification(self) -> float | None:
        """When a claim may next find a row (epoch seconds): the soonest ``next_try`` of a job's oldest row, or
        the end of the lease on it when later; None for an empty outbox."""
        heads: dict[str, Row] = {}
        for row in self.select("notifications", ("job", "next_try", "lease_until"), "id"):
            heads.setdefault(row[0], row)
        return min((max(r[1], r[2] or 0.0) for r in heads.values()), default=None)

    def end_claim(self, row_id: int, owner: str, retry: tuple[int, float] | None) -> bool:
        """End ``owner``'s claim of row ``row_id`` in one transaction: the row deleted (``retry`` None: delivered
        or given up), or its attempts and next try set to ``retry`` and the row freed. False when the claim was
        no longer ``owner``'s (its lease ended and another worker claimed the row: that one delivers it)."""
        where: dict[str, Any] = {"id": row_id}
        if self.elects:
            where["lease_owner"] = owner
        if retry is None:
            return self.apply([Delete("notifications", where)])[0] > 0
        attempts, next_try = retry
        values = {"attempts": attempts, "next_try": next_try, "lease_owner": None, "lease_until": None}
        return self.apply([Update("notifications", values, where)])[0] > 0

    # -- loading ---------------------------------------------------------------------------------

    def _load(self) -> None:
        for table, mirror in self.mirrors.items():
            mirror.clear()
            for row in self.select(table, TABLES[table].columns):
                mirror.put(row)

    def _mirror_own_tables(self) -> None:
        def put_key(r: Row) -> None:
            old = self.keys.get(r[0])
            if old is not None:
                self.keys_by_hash.pop(old.secret_sha256, None)
            key = KeyRecord(r[0], r[1], r[2], frozenset(json.loads(r[3])), r[4], r[5], r[6])
            self.keys[key.id] = key
            self.keys_by_hash[key.secret_sha256] = key

        def drop_key(k: Row) -> None:
            old = self.keys.pop(k[0], None)
            if old is not None:
                self.keys_by_hash.pop(old.secret_sha256, None)

        def clear_keys() -> None:
            self.keys.clear()
            self.keys_by_hash.clear()

        self.mirror("keys", put_key, drop_key, clear_keys)
        # Each of the others: a dict keyed by the primary key (one column, or (org, user) for members).
        simple: list[tuple[str, dict[Any, Any], Callable[[Row], Any]]] = [
            ("nodes", self.nodes, lambda r: NodeDef(*r[:6])),
            ("node_flags", self.node_flags, lambda r: NodeFlags(bool(r[1]), bool(r[2]))),
            ("sandboxes", self.sandboxes, _sandbox_record),
            ("volumes", self.volumes, lambda r: VolumeRecord(*r)),
            ("snapshots", self.snapshots, lambda r: SnapshotRecord(*r)),
            ("orgs", self.orgs, lambda r: OrgRecord(*r)),
            ("quotas", self.quotas, lambda r: Quota(r[1], r[2], r[3])),
            ("ssh_keys", self.ssh_keys, lambda r: SshKeyRecord(*r)),
            ("ssh_tokens", self.ssh_tokens, lambda r: SshTokenRecord(*r)),
        ]
        for table, memory, make in simple:
            self.mirror(table, *_dict_mirror(memory, make))

        def put_member(r: Row) -> None:
            self.members[(r[0], r[1])] = MemberRecord(*r)

        def drop_member(k: Row) -> None:
            self.members.pop((k[0], k[1]), None)

        self.mirror("members", put_member, drop_member, self.members.clear)

    def _write(self, op: Op, full: bool = True) -> int:
        """One write in its own transaction; the number of rows it changed."""
        return self.apply([op], full)[0]

    # -- keys ------------------------------------------------------------------------------------

    def add_key(self, key: KeyRecord) -> None:
        self._write(Insert("keys", {
            "id": key.id, "user": key.user, "tenant": key.tenant, "scopes": json.dumps(sorted(key.scopes)),
            "secret_sha256": key.secret_sha256, "created": key.created, "revoked": None,
        }))  # fmt: skip
        self.keys[key.id] = key
        self.keys_by_hash[key.secret_sha256] = key

    def revoke_key(self, key_id: str) -> KeyRecord | None:
        """Mark the key revoked (kept listed with ``revoked``); None for an unknown id. Idempotent."""
        key = self.keys.get(key_id)
        if key is None:
            return None
        if key.revoked is not None:
            return key
        when = now_rfc3339()
        self._write(Update("keys", {"revoked": when}, {"id": key_id}))
        revoked = replace(key, revoked=when)
        self.keys[key_id] = revoked
        self.keys_by_hash[key.secret_sha256] = revoked
        return revoked

    # -- nodes -----------------------------------------------------------------------------------

    def add_node(self, node: NodeDef) -> None:
        self._write(Insert("nodes", {
            "name": node.name, "endpoint": node.endpoint, "token_file": node.token_file, "ca_file": node.ca_file,
            "cert_file": node.cert_file, "key_file": node.key_file, "added": now_rfc3339(),
        }))  # fmt: skip
        self.nodes[node.name] = node

    def remove_node(self, name: str) -> bool:
        changed, _ = self.apply([Delete("nodes", {"name": name}), Delete("node_flags", {"name": name})])
        self.nodes.pop(name, None)
        self.node_flags.pop(name, None)
        return changed > 0

    def set_node_flags(self, name: str, flags: NodeFlags) -> None:
        self._write(Upsert("node_flags", {"name": name, "cordoned": int(flags.cordoned),
                                          "drained": int(flags.drained)}))  # fmt: skip
        self.node_flags[name] = flags

    # -- ownership -------------------------------------------------------------------------------

    def put_sandbox(self, rec: SandboxRecord) -> None:
        self._write(Upsert("sandboxes", {
            "id": rec.id, "user": rec.user, "tenant": rec.tenant, "node": rec.node, "name": rec.name,
            "cpus": rec.cpus, "memory_mb": rec.memory_mb, "created": rec.created,
            "persistent": int(rec.persistent), "asleep": int(rec.asleep),
        }), full=False)  # fmt: skip
        self.sandboxes[rec.id] = rec

    def forget_sandboxes(self, ids: list[str]) -> None:
        if not ids:
            return
        self.apply([Delete("sandboxes", {"id": i}) for i in ids], full=False)
        for i in ids:
            self.sandboxes.pop(i, None)

    def put_volume(self, rec: VolumeRecord) -> None:
        self._write(Insert("volumes", {"name": rec.name, "user": rec.user, "tenant": rec.tenant, "node": rec.node,
                                       "created": rec.created}))  # fmt: skip
        self.volumes[rec.name] = rec

    def forget_volume(self, name: str) -> None:
        self._write(Delete("volumes", {"name": name}))
        self.volumes.pop(name, None)

    def put_snapshot(self, rec: SnapshotRecord) -> None:
        self._write(Upsert("snapshots", {"id": rec.id, "user": rec.user, "tenant": rec.tenant, "node": rec.node,
                                         "sandbox": rec.sandbox, "created": rec.created}))  # fmt: skip
        self.snapshots[rec.id] = rec

    def forget_snapshot(self, snapshot_id: str) -> None:
        self._write(Delete("snapshots", {"id": snapshot_id}))
        self.snapshots.pop(snapshot_id, None)

    # -- orgs ------------------------------------------------------------------------------------

    def add_org(self, org: OrgRecord, owner: MemberRecord) -> None:
        self.apply([
            Insert("orgs", {"name": org.name, "created": org.created, "created_by": org.created_by,
                            "created_by_tenant": org.created_by_tenant}),
            Insert("members", {"org": owner.org, "user": owner.user, "tenant": owner.tenant, "role": owner.role,
                               "added": owner.added}),
        ])  # fmt: skip
        self.orgs[org.name] = org
        self.members[(owner.org, owner.user)] = owner

    def put_member(self, member: MemberRecord) -> None:
        self._write(Upsert("members", {"org": member.org, "user": member.user, "tenant": member.tenant,
                                       "role": member.role, "added": member.added}))  # fmt: skip
        self.members[(member.org, member.user)] = member

    def remove_member(self, org: str, user: str) -> None:
        self._write(Delete("members", {"org": org, "user": user}))
        self.members.pop((org, user), None)

    # -- quotas ----------------------------------------------------------------------------------

    def set_quota(self, tenant: str, quota: Quota) -> None:
        if quota == Quota():
            self._write(Delete("quotas", {"tenant": tenant}))
            self.quotas.pop(tenant, None)
            return
        self._write(Upsert("quotas", {"tenant": tenant, "max_cpus": quota.max_cpus,
                                      "max_memory_mb": quota.max_memory_mb,
                                      "max_sandboxes": quota.max_sandboxes}))  # fmt: skip
        self.quotas[tenant] = quota

    # -- SSH keys and tokens -----------------------------------------------------------------------

    def add_ssh_key(self, key: SshKeyRecord) -> None:
        self._write(Insert("ssh_keys", {
            "id": key.id, "user": key.user, "home_tenant": key.home_tenant, "tenant": key.tenant,
            "fingerprint": key.fingerprint, "key": key.key, "sandbox": key.sandbox, "created": key.created,
        }))  # fmt: skip
        self.ssh_keys[key.id] = key

    def remove_ssh_key(self, key_id: str) -> bool:
        """Forget the key; False when there was none."""
        changed = self._write(Delete("ssh_keys", {"id": key_id}))
        self.ssh_keys.pop(key_id, None)
        return changed > 0

    def add_ssh_token(self, token: SshTokenRecord) -> None:
        self._write(Insert("ssh_tokens", {
            "token_sha256": token.token_sha256, "user": token.user, "tenant": token.tenant,
            "sandbox": token.sandbox, "expires_at": token.expires_at, "created": token.created,
        }))  # fmt: skip
        self.ssh_tokens[token.token_sha256] = token

    def forget_ssh_tokens(self, hashes: list[str]) -> None:
        """Drop tokens (the expired ones); an unknown hash is ignored."""
        if not hashes:
            return
        self.apply([Delete("ssh_tokens", {"token_sha256": h}) for h in hashes])
        for h in hashes:
            self.ssh_tokens.pop(h, None)

    # -- schema v6: shared by the replicas, never held in memory (docs/ha.md, "Shared by the replicas") ------

    def audit_append(self, entries: Sequence[tuple[int, str]]) -> None:
        """Append audit lines ``(time in epoch milliseconds, JSON text)``, in order, in one transaction that is
        durable as a ``full=False`` write (a database crash may lose its last fraction of a second)."""
        m = self.mark
        statements = []
        for start in range(0, len(entries), AUDIT_ROWS_PER_INSERT):
            part = entries[start : start + AUDIT_ROWS_PER_INSERT]
            values = ", ".join(f"({m}, {m}, {m})" for _ in part)
            params = tuple(v for when, line in part for v in (when, len(line.encode()), line))
            statements.append((f"INSERT INTO audit (time_ms, bytes, line) VALUES {values}", params))
        if statements:
            self.run(statements, full=False)

    def audit_read(self, since_ms: int | None, limit: int) -> list[str]:
        """The first ``limit`` lines at or after ``since_ms`` (None: all), oldest first: in the order they reached
        the database."""
        m = self.mark
        sql = f"SELECT line FROM audit ORDER BY id LIMIT {m}"
        params: tuple[int, ...] = (limit,)
        if since_ms is not None:
            sql = f"SELECT line FROM audit WHERE time_ms >= {m} ORDER BY id LIMIT {m}"
            params = (since_ms, limit)
        return [str(r[0]) for r in self.run([(sql, params)])[0].rows]

    def audit_trim(self, budget_bytes: int) -> int:
        """Delete the oldest lines beyond the newest ``budget_bytes`` of them; how many went."""
        m = self.mark
        sql = (
            "DELETE FROM audit WHERE id <= (SELECT id FROM (SELECT id, SUM(bytes) OVER (ORDER BY id DESC) AS newer"
            f" FROM audit) AS t WHERE newer > {m} ORDER BY id DESC LIMIT 1)"
        )
        return self.run([(sql, (budget_bytes,))], full=False)[0].count

    def output_put(self, job: str, n: int, stream: str, seq: int, data: bytes) -> None:
        """Chunk ``seq`` of a run's ``stream`` (``stdout``, ``stderr``, ``file/I``), replacing one kept before."""
        m = self.mark
        sql = (
            f"INSERT INTO job_output (job, n, stream, seq, data) VALUES ({m}, {m}, {m}, {m}, {m}) "
            "ON CONFLICT (job, n, stream, seq) DO UPDATE SET data = excluded.data"
        )
        self.run([(sql, (job, n, stream, seq, data))], full=False)

    def output_replace(self, job: str, n: int, stream: str, chunks: Sequence[bytes]) -> None:
        """A run's ``stream`` (a kept file) as ``chunks``, replacing whatever was kept of it, in one transaction."""
        m = self.mark
        self.run([
            (f"DELETE FROM job_output WHERE job = {m} AND n = {m} AND stream = {m}", (job, n, stream)),
            *((f"INSERT INTO job_output (job, n, stream, seq, data) VALUES ({m}, {m}, {m}, {m}, {m})",
               (job, n, stream, seq, data)) for seq, data in enumerate(chunks)),
        ], full=False)  # fmt: skip

    def output_clear(self, job: str, n: int, streams: Sequence[str]) -> None:
        """Forget what a run kept of ``streams`` (its output followed again from the start)."""
        m = self.mark
        self.run(
            [
                (f"DELETE FROM job_output WHERE job = {m} AND n = {m} AND stream = {m}", (job, n, s))
                for s in streams
            ],
            full=False,
        )

    def output_read(self, job: str, n: int, stream: str) -> bytes | None:
        """A run's ``stream`` as kept, its chunks joined; None when nothing was kept of it."""
        m = self.mark
        rows = self.run([(
            f"SELECT data FROM job_output WHERE job = {m} AND n = {m} AND stream = {m} ORDER BY seq",
            (job, n, stream),
        )])[0].rows  # fmt: skip
        return b"".join(bytes(r[0]) for r in rows) if rows else None

    def output_chunk_sizes(self, job: str, n: int, stream: str) -> list[tuple[int, int]]:
        """``(seq, bytes)`` of each chunk kept of a run's ``stream``, in order (empty when nothing was kept)."""
        m = self.mark
        rows = self.run([(
            f"SELECT seq, length(data) FROM job_output WHERE job = {m} AND n = {m} AND stream = {m} ORDER BY seq",
            (job, n, stream),
        )])[0].rows  # fmt: skip
        return [(int(r[0]), int(r[1])) for r in rows]

    def output_chunk(self, job: str, n: int, stream: str, seq: int) -> bytes | None:
        """Chunk ``seq`` of a run's ``stream``; None when it is not there (the job was removed meanwhile)."""
        m = self.mark
        rows = self.run([(
            f"SELECT data FROM job_output WHERE job = {m} AND n = {m} AND stream = {m} AND seq = {m}",
            (job, n, stream, seq),
        )])[0].rows  # fmt: skip
        return bytes(rows[0][0]) if rows else None

    def output_remove(self, job: str) -> None:
        """Forget everything the runs of ``job`` kept (the job's retention is over)."""
        self.run([(f"DELETE FROM job_output WHERE job = {self.mark}", (job,))], full=False)

    def file_get(self, name: str) -> tuple[bytes | None, bytes] | None:
        """The gateway's file ``name``: ``(nonce or None when not sealed, data)``; None when there is none."""
        rows = self.run([(f"SELECT nonce, data FROM gateway_files WHERE name = {self.mark}", (name,))])[
            0
        ].rows
        if not rows:
            return None
        nonce, data = rows[0]
        return (bytes(nonce) if nonce is not None else None), bytes(data)

    def file_put_new(self, name: str, nonce: bytes | None, data: bytes) -> bool:
        """Keep the gateway's file ``name`` unless one is kept already (then False: of several replicas starting
        together, the first one's is kept and every other reads it)."""
        m = self.mark
        sql = (
            f"INSERT INTO gateway_files (name, nonce, data, created) VALUES ({m}, {m}, {m}, {m}) "
            "ON CONFLICT (name) DO NOTHING"
        )
        return self.run([(sql, (name, nonce, data, now_rfc3339()))])[0].count == 1


#: Audit lines per INSERT statement, 3 parameters each (under SQLite's oldest limit of 999 per statement; a batch
#: of more makes several statements of one transaction).
AUDIT_ROWS_PER_INSERT = 300


def _dict_mirror(
    memory: dict[Any, Any], make: Callable[[Row], Any]
) -> tuple[Callable[[Row], None], Callable[[Row], None], Callable[[], None]]:
    """put/drop/clear of a table held as ``memory[first column] = make(row)``."""

    def put(row: Row) -> None:
        memory[row[0]] = make(row)

    def drop(key: Row) -> None:
        memory.pop(key[0], None)

    return put, drop, memory.clear


def _sandbox_record(r: Row) -> SandboxRecord:
    """A ``sandboxes`` row (booleans kept as 0/1) as its record. A replica of the version before v8 (mid-upgrade)
    notifies rows without ``persistent`` and ``asleep``: neither, as it made them."""
    persistent, asleep = (bool(r[8]), bool(r[9])) if len(r) >= 10 else (False, False)
    return SandboxRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], persistent, asleep)
