"""The gateway's state: one SQLite database (WAL, durable commits) and the lock that makes one process its owner.

Tables (schema version in ``schema_version``; each migration is applied once, in order, in one transaction)::

    keys        id, user, tenant ('' = default), scopes (JSON), secret_sha256, created, revoked
    nodes       admin-added nodes: name, endpoint, token_file, ca_file, cert_file, key_file, added
    node_flags  name, cordoned, drained   (kept for node-file nodes too; restored on each poll)
    sandboxes   ownership records: id, user, tenant, node, name, cpus, memory_mb, created
    volumes     name (one namespace), user, tenant, node, created
    snapshots   id, user, tenant, node, sandbox, created
    orgs        name, created, created_by, created_by_tenant
    members     org, user, tenant, role, added
    quotas      tenant, max_cpus, max_memory_mb, max_sandboxes   (NULL = no limit)
    ssh_keys    id, user, home_tenant (the user's own: with user, who registered it), tenant (whose sandboxes it
                reaches: the one the registration acted in), fingerprint, key (the OpenSSH line), sandbox (NULL =
                any of that tenant's the user may reach), created
    ssh_tokens  token_sha256, user, tenant, sandbox, expires_at, created   (short-lived SSH logins)

    services, service_revisions, service_replicas     (gateway/services/store.py)
    jobs, job_runs, notifications                     (gateway/jobs/store.py)
    secrets     tenant, name, nonce, ciphertext (AES-GCM), updated   (gateway/secrets.py)

Later issues add tables through new migrations.

Durability: WAL mode; every commit is in the WAL file before a call returns, so a SIGKILL at any moment loses
nothing acknowledged. Keys, nodes, orgs and quotas are also fsynced (``synchronous=FULL``) so a power cut keeps
them; ownership records are not (see ``Store._write``). The whole database is small (keys, records), so every table
the request path reads is also held in memory: the process holding the lock is the only writer, and each
write updates memory only after its commit. Methods are synchronous; the server calls the writing ones through
``asyncio.to_thread`` (a commit is an fsync) and reads memory directly.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from msgspec import UNSET

from sbx.api.gateway import Key
from sbx.api.orgs import Member, Role
from sbx.api.ssh import SshKey
from sbx.statefile import try_lock

#: Tenant of a key issued without one, as stored (the API shows it as absent, or ``default`` in org calls).
DEFAULT_TENANT = ""

MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE keys (
        id TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, scopes TEXT NOT NULL,
        secret_sha256 TEXT NOT NULL UNIQUE, created TEXT NOT NULL, revoked TEXT
    );
    CREATE TABLE nodes (
        name TEXT PRIMARY KEY, endpoint TEXT NOT NULL, token_file TEXT, ca_file TEXT, cert_file TEXT,
        key_file TEXT, added TEXT NOT NULL
    );
    CREATE TABLE node_flags (name TEXT PRIMARY KEY, cordoned INTEGER NOT NULL, drained INTEGER NOT NULL);
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, node TEXT NOT NULL, name TEXT,
        cpus INTEGER, memory_mb INTEGER, created TEXT NOT NULL
    );
    CREATE TABLE volumes (
        name TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, node TEXT NOT NULL, created TEXT NOT NULL
    );
    CREATE TABLE snapshots (
        id TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, node TEXT NOT NULL, sandbox TEXT,
        created TEXT NOT NULL
    );
    CREATE TABLE orgs (
        name TEXT PRIMARY KEY, created TEXT NOT NULL, created_by TEXT NOT NULL, created_by_tenant TEXT NOT NULL
    );
    CREATE TABLE members (
        org TEXT NOT NULL, user TEXT NOT NULL, tenant TEXT NOT NULL, role TEXT NOT NULL, added TEXT NOT NULL,
        PRIMARY KEY (org, user)
    );
    CREATE TABLE quotas (
        tenant TEXT PRIMARY KEY, max_cpus INTEGER, max_memory_mb INTEGER, max_sandboxes INTEGER
    );
    """,
    # Services, jobs and agent runs, tenant secrets, job notifications (gateway/services, gateway/jobs,
    # gateway/secrets.py): each module reads and writes its own tables through Store.execute and Store.query.
    """
    CREATE TABLE services (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL, user TEXT NOT NULL, spec TEXT NOT NULL,
        revision INTEGER NOT NULL, serving INTEGER NOT NULL, desired INTEGER NOT NULL, restarts INTEGER NOT NULL,
        rollout TEXT, created TEXT NOT NULL, updated TEXT NOT NULL, UNIQUE (tenant, name)
    );
    CREATE TABLE service_revisions (
        service TEXT NOT NULL, revision INTEGER NOT NULL, spec TEXT NOT NULL, PRIMARY KEY (service, revision)
    );
    CREATE TABLE service_replicas (
        sandbox TEXT PRIMARY KEY, service TEXT NOT NULL, node TEXT NOT NULL, revision INTEGER NOT NULL,
        pid INTEGER, restarts INTEGER NOT NULL, ever_healthy INTEGER NOT NULL, created TEXT NOT NULL
    );
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, agent TEXT, spec TEXT NOT NULL,
        prompt TEXT, state TEXT NOT NULL, error TEXT, created TEXT NOT NULL, updated TEXT NOT NULL
    );
    CREATE TABLE job_runs (
        job TEXT NOT NULL, n INTEGER NOT NULL, state TEXT NOT NULL, sandbox TEXT, node TEXT, pid INTEGER,
        exit_code INTEGER, started TEXT, finished TEXT, error TEXT, truncated INTEGER NOT NULL, files TEXT,
        PRIMARY KEY (job, n)
    );
    CREATE TABLE secrets (
        tenant TEXT NOT NULL, name TEXT NOT NULL, nonce BLOB NOT NULL, ciphertext BLOB NOT NULL,
        updated TEXT NOT NULL, PRIMARY KEY (tenant, name)
    );
    CREATE TABLE notifications (
        id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL, url TEXT NOT NULL, body TEXT NOT NULL,
        attempts INTEGER NOT NULL, first_try REAL NOT NULL, next_try REAL NOT NULL
    );
    """,
    # SSH keys and access tokens (docs/ssh.md).
    """
    CREATE TABLE ssh_keys (
        id TEXT PRIMARY KEY, user TEXT NOT NULL, home_tenant TEXT NOT NULL, tenant TEXT NOT NULL,
        fingerprint TEXT NOT NULL, key TEXT NOT NULL, sandbox TEXT, created TEXT NOT NULL
    );
    CREATE INDEX ssh_keys_fingerprint ON ssh_keys (fingerprint);
    CREATE TABLE ssh_tokens (
        token_sha256 TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, sandbox TEXT NOT NULL,
        expires_at REAL NOT NULL, created TEXT NOT NULL
    );
    """,
)


class StateLocked(Exception):
    """Another process (a serving gateway) holds the state file's lock."""


class StateError(Exception):
    """The state file cannot be used (unreadable, from a newer version)."""


def now_rfc3339() -> str:
    """Current UTC time, RFC 3339 with seconds and ``Z``."""
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def seconds_since(stamp: str) -> float | None:
    """Seconds from the RFC 3339 time ``stamp`` to now; None when it is not one."""
    try:
        return datetime.now(UTC).timestamp() - datetime.fromisoformat(stamp).timestamp()
    except ValueError:
        return None


def older_than(stamp: str, secs: float) -> bool:
    """Whether the RFC 3339 time ``stamp`` is more than ``secs`` seconds ago (one that is not a time counts as
    old, so a record with a broken stamp is not kept for ever)."""
    age = seconds_since(stamp)
    return age is None or age > secs


@dataclass(frozen=True)
class KeyRecord:
    id: str
    user: str
    tenant: str
    scopes: frozenset[str]
    secret_sha256: str
    created: str
    revoked: str | None = None

    def wire(self) -> Key:
        """The listed form: never a secret nor its hash."""
        return Key(
            id=self.id, user=self.user, tenant=self.tenant or None, scopes=sorted(self.scopes),
            created=self.created, revoked=self.revoked if self.revoked is not None else UNSET,
        )  # fmt: skip


@dataclass(frozen=True)
class NodeDef:
    """A node's definition (from the node file or added by an admin); files are absolute paths."""

    name: str
    endpoint: str
    token_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    from_file: bool = False


@dataclass(frozen=True)
class SandboxRecord:
    """Who owns a sandbox, and where it runs. ``tenant`` is ``''`` for the default tenant."""

    id: str
    user: str
    tenant: str
    node: str
    name: str | None
    cpus: int
    memory_mb: int
    created: str


@dataclass(frozen=True)
class VolumeRecord:
    name: str
    user: str
    tenant: str
    node: str
    created: str


@dataclass(frozen=True)
class SnapshotRecord:
    id: str
    user: str
    tenant: str
    node: str
    sandbox: str | None
    created: str


@dataclass(frozen=True)
class OrgRecord:
    name: str
    created: str
    created_by: str
    created_by_tenant: str


@dataclass(frozen=True)
class MemberRecord:
    org: str
    user: str
    tenant: str
    role: str
    added: str

    def wire(self) -> Member:
        role: Role = "owner" if self.role == "owner" else "member"
        return Member(user=self.user, tenant=self.tenant or UNSET, role=role, added=self.added)


@dataclass(frozen=True)
class Quota:
    """A tenant's quota; ``None`` means no limit on that amount."""

    max_cpus: int | None = None
    max_memory_mb: int | None = None
    max_sandboxes: int | None = None


@dataclass(frozen=True)
class SshKeyRecord:
    """A registered SSH public key: of ``user`` of ``home_tenant`` (a person), reaching the sandboxes of ``tenant``
    (their own, or an organisation's); ``sandbox`` (an id) limits it to that sandbox."""

    id: str
    user: str
    home_tenant: str
    tenant: str
    fingerprint: str
    key: str
    sandbox: str | None
    created: str

    def wire(self) -> SshKey:
        return SshKey(id=self.id, fingerprint=self.fingerprint, key=self.key,
                      sandbox=self.sandbox if self.sandbox is not None else UNSET, created=self.created)  # fmt: skip


@dataclass(frozen=True)
class SshTokenRecord:
    """A short-lived SSH login (only the SHA-256 of its ``sgt_`` token is kept); ``expires_at`` in epoch
    seconds."""

    token_sha256: str
    user: str
    tenant: str
    sandbox: str
    expires_at: float
    created: str


@dataclass(frozen=True)
class NodeFlags:
    cordoned: bool = False
    drained: bool = False


def lock_path_for(state_path: Path) -> Path:
    return state_path.with_name(state_path.name + ".lock")


def acquire_lock(state_path: Path) -> int:
    """Take the state file's exclusive lock (non-blocking) and return its descriptor; held until closed.

    Raises ``StateLocked`` while another process holds it.
    """
    path = lock_path_for(state_path)
    fd = try_lock(path)
    if fd is None:
        raise StateLocked(
            f"another process holds the state file lock {path} (a sandbox-gateway serving {state_path}); "
            "stop that gateway first, or make the change through the admin API while it runs"
        )
    return fd


class Store:
    """The open state database plus its in-memory tables. Use :meth:`open`; call :meth:`close` at the end.

    The caller must hold the state lock (``acquire_lock``) for as long as the store is open.
    """

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn
        self._lock = threading.Lock()
        self._full = True
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
        self._load()

    @classmethod
    def open(cls, path: Path) -> Store:
        """Open (creating if absent, mode 0600) and migrate the database at ``path``."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not path.exists():
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        try:
            conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=5.0)
            conn.execute("PRAGMA journal_mode=WAL")
            # FULL: every commit is fsynced (WAL's NORMAL may lose the last commits on power loss).
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute("PRAGMA foreign_keys=ON")
            _migrate(conn)
        except sqlite3.DatabaseError as exc:
            raise StateError(f"cannot use the state file {path}: {exc}") from exc
        return cls(path, conn)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def schema_version(self) -> int:
        with self._lock:
            return _version(self._conn)

    # -- loading ---------------------------------------------------------------------------------

    def _load(self) -> None:
        c = self._conn
        for row in c.execute("SELECT id, user, tenant, scopes, secret_sha256, created, revoked FROM keys"):
            key = KeyRecord(row[0], row[1], row[2], frozenset(json.loads(row[3])), row[4], row[5], row[6])
            self.keys[key.id] = key
            self.keys_by_hash[key.secret_sha256] = key
        for row in c.execute("SELECT name, endpoint, token_file, ca_file, cert_file, key_file FROM nodes"):
            self.nodes[row[0]] = NodeDef(*row)
        for name, cordoned, drained in c.execute("SELECT name, cordoned, drained FROM node_flags"):
            self.node_flags[name] = NodeFlags(bool(cordoned), bool(drained))
        for row in c.execute("SELECT id, user, tenant, node, name, cpus, memory_mb, created FROM sandboxes"):
            self.sandboxes[row[0]] = SandboxRecord(*row)
        for row in c.execute("SELECT name, user, tenant, node, created FROM volumes"):
            self.volumes[row[0]] = VolumeRecord(*row)
        for row in c.execute("SELECT id, user, tenant, node, sandbox, created FROM snapshots"):
            self.snapshots[row[0]] = SnapshotRecord(*row)
        for row in c.execute("SELECT name, created, created_by, created_by_tenant FROM orgs"):
            self.orgs[row[0]] = OrgRecord(*row)
        for row in c.execute("SELECT org, user, tenant, role, added FROM members"):
            self.members[(row[0], row[1])] = MemberRecord(*row)
        for row in c.execute("SELECT tenant, max_cpus, max_memory_mb, max_sandboxes FROM quotas"):
            self.quotas[row[0]] = Quota(row[1], row[2], row[3])
        for row in c.execute(
            "SELECT id, user, home_tenant, tenant, fingerprint, key, sandbox, created FROM ssh_keys"
        ):
            self.ssh_keys[row[0]] = SshKeyRecord(*row)
        for row in c.execute(
            "SELECT token_sha256, user, tenant, sandbox, expires_at, created FROM ssh_tokens"
        ):
            self.ssh_tokens[row[0]] = SshTokenRecord(*row)

    def _sync(self, full: bool) -> None:
        if full != self._full:
            self._conn.execute(f"PRAGMA synchronous={'FULL' if full else 'NORMAL'}")
            self._full = full

    def _write(self, sql: str, params: tuple[Any, ...] = (), full: bool = True) -> int:
        """One statement in its own transaction; returns the number of rows changed.

        ``full`` (keys, nodes, orgs, quotas) fsyncs the commit. Ownership records use ``full=False``: the
        commit is in the WAL file (the OS has it, so a SIGKILL loses nothing) without waiting for the disk,
        since a create's latency matters and a record lost to a power cut is taken back from the node's
        ``gateway.owner`` label at the next reconcile. A later full commit syncs the earlier ones too.
        """
        with self._lock:
            self._sync(full)
            cur = self._conn.execute(sql, params)
            return cur.rowcount

    def _write_many(self, statements: list[tuple[str, tuple[Any, ...]]], full: bool = True) -> None:
        with self._lock:
            self._sync(full)
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    self._conn.execute(sql, params)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    # -- tables of other modules (services, jobs, secrets) ----------------------------------------

    def execute(self, statements: list[tuple[str, tuple[Any, ...]]], full: bool = True) -> None:
        """Run ``statements`` in one transaction (``full``: fsynced; see ``_write``). For modules that keep
        their own tables and in-memory copies (services, jobs, secrets): call it off the event loop."""
        self._write_many(statements, full)

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Rows of one ``SELECT`` (at start-up, when a module loads its tables)."""
        with self._lock:
            return list(self._conn.execute(sql, params))

    # -- keys ------------------------------------------------------------------------------------

    def add_key(self, key: KeyRecord) -> None:
        self._write(
            "INSERT INTO keys (id, user, tenant, scopes, secret_sha256, created, revoked) VALUES (?,?,?,?,?,?,?)",
            (
                key.id,
                key.user,
                key.tenant,
                json.dumps(sorted(key.scopes)),
                key.secret_sha256,
                key.created,
                None,
            ),
        )
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
        self._write("UPDATE keys SET revoked = ? WHERE id = ?", (when, key_id))
        revoked = replace(key, revoked=when)
        self.keys[key_id] = revoked
        self.keys_by_hash[key.secret_sha256] = revoked
        return revoked

    # -- nodes -----------------------------------------------------------------------------------

    def add_node(self, node: NodeDef) -> None:
        self._write(
            "INSERT INTO nodes (name, endpoint, token_file, ca_file, cert_file, key_file, added) "
            "VALUES (?,?,?,?,?,?,?)",
            (node.name, node.endpoint, node.token_file, node.ca_file, node.cert_file, node.key_file,
             now_rfc3339()),
        )  # fmt: skip
        self.nodes[node.name] = node

    def remove_node(self, name: str) -> bool:
        changed = self._write("DELETE FROM nodes WHERE name = ?", (name,))
        self._write("DELETE FROM node_flags WHERE name = ?", (name,))
        self.nodes.pop(name, None)
        self.node_flags.pop(name, None)
        return changed > 0

    def set_node_flags(self, name: str, flags: NodeFlags) -> None:
        self._write(
            "INSERT INTO node_flags (name, cordoned, drained) VALUES (?,?,?) "
            "ON CONFLICT(name) DO UPDATE SET cordoned = excluded.cordoned, drained = excluded.drained",
            (name, int(flags.cordoned), int(flags.drained)),
        )
        self.node_flags[name] = flags

    # -- ownership -------------------------------------------------------------------------------

    def put_sandbox(self, rec: SandboxRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO sandboxes (id, user, tenant, node, name, cpus, memory_mb, created) "
            "VALUES (?,?,?,?,?,?,?,?)",
            (rec.id, rec.user, rec.tenant, rec.node, rec.name, rec.cpus, rec.memory_mb, rec.created),
            full=False,
        )
        self.sandboxes[rec.id] = rec

    def forget_sandboxes(self, ids: list[str]) -> None:
        if not ids:
            return
        self._write_many([("DELETE FROM sandboxes WHERE id = ?", (i,)) for i in ids], full=False)
        for i in ids:
            self.sandboxes.pop(i, None)

    def put_volume(self, rec: VolumeRecord) -> None:
        self._write(
            "INSERT INTO volumes (name, user, tenant, node, created) VALUES (?,?,?,?,?)",
            (rec.name, rec.user, rec.tenant, rec.node, rec.created),
        )
        self.volumes[rec.name] = rec

    def forget_volume(self, name: str) -> None:
        self._write("DELETE FROM volumes WHERE name = ?", (name,))
        self.volumes.pop(name, None)

    def put_snapshot(self, rec: SnapshotRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO snapshots (id, user, tenant, node, sandbox, created) VALUES (?,?,?,?,?,?)",
            (rec.id, rec.user, rec.tenant, rec.node, rec.sandbox, rec.created),
        )
        self.snapshots[rec.id] = rec

    def forget_snapshot(self, snapshot_id: str) -> None:
        self._write("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))
        self.snapshots.pop(snapshot_id, None)

    # -- orgs ------------------------------------------------------------------------------------

    def add_org(self, org: OrgRecord, owner: MemberRecord) -> None:
        self._write_many([
            ("INSERT INTO orgs (name, created, created_by, created_by_tenant) VALUES (?,?,?,?)",
             (org.name, org.created, org.created_by, org.created_by_tenant)),
            ("INSERT INTO members (org, user, tenant, role, added) VALUES (?,?,?,?,?)",
             (owner.org, owner.user, owner.tenant, owner.role, owner.added)),
        ])  # fmt: skip
        self.orgs[org.name] = org
        self.members[(owner.org, owner.user)] = owner

    def put_member(self, member: MemberRecord) -> None:
        self._write(
            "INSERT OR REPLACE INTO members (org, user, tenant, role, added) VALUES (?,?,?,?,?)",
            (member.org, member.user, member.tenant, member.role, member.added),
        )
        self.members[(member.org, member.user)] = member

    def remove_member(self, org: str, user: str) -> None:
        self._write("DELETE FROM members WHERE org = ? AND user = ?", (org, user))
        self.members.pop((org, user), None)

    # -- quotas ----------------------------------------------------------------------------------

    def set_quota(self, tenant: str, quota: Quota) -> None:
        if quota == Quota():
            self._write("DELETE FROM quotas WHERE tenant = ?", (tenant,))
            self.quotas.pop(tenant, None)
            return
        self._write(
            "INSERT OR REPLACE INTO quotas (tenant, max_cpus, max_memory_mb, max_sandboxes) VALUES (?,?,?,?)",
            (tenant, quota.max_cpus, quota.max_memory_mb, quota.max_sandboxes),
        )
        self.quotas[tenant] = quota

    # -- SSH keys and tokens -----------------------------------------------------------------------

    def add_ssh_key(self, key: SshKeyRecord) -> None:
        self._write(
            "INSERT INTO ssh_keys (id, user, home_tenant, tenant, fingerprint, key, sandbox, created) "
            "VALUES (?,?,?,?,?,?,?,?)",
            (
                key.id,
                key.user,
                key.home_tenant,
                key.tenant,
                key.fingerprint,
                key.key,
                key.sandbox,
                key.created,
            ),
        )
        self.ssh_keys[key.id] = key

    def remove_ssh_key(self, key_id: str) -> bool:
        """Forget the key; False when there was none."""
        changed = self._write("DELETE FROM ssh_keys WHERE id = ?", (key_id,))
        self.ssh_keys.pop(key_id, None)
        return changed > 0

    def add_ssh_token(self, token: SshTokenRecord) -> None:
        self._write(
            "INSERT INTO ssh_tokens (token_sha256, user, tenant, sandbox, expires_at, created) VALUES (?,?,?,?,?,?)",
            (token.token_sha256, token.user, token.tenant, token.sandbox, token.expires_at, token.created),
        )
        self.ssh_tokens[token.token_sha256] = token

    def forget_ssh_tokens(self, hashes: list[str]) -> None:
        """Drop tokens (the expired ones); an unknown hash is ignored."""
        if not hashes:
            return
        self._write_many([("DELETE FROM ssh_tokens WHERE token_sha256 = ?", (h,)) for h in hashes])
        for h in hashes:
            self.ssh_tokens.pop(h, None)


def _version(conn: sqlite3.Connection) -> int:
    conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
    row = conn.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _migrate(conn: sqlite3.Connection) -> None:
    current = _version(conn)
    if current > len(MIGRATIONS):
        raise StateError(
            f"schema version {current} is newer than this sandbox-gateway knows ({len(MIGRATIONS)}): "
            "run a newer sandbox-gateway"
        )
    for version in range(current + 1, len(MIGRATIONS) + 1):
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in MIGRATIONS[version - 1].split(";"):
                if statement.strip():
                    conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
