"""The store interface: the gateway's tables held in memory, written through to a database.

Two implementations (``sqlite.SqliteStore``, ``postgres.PostgresStore``) provide the same four primitives —
:meth:`Store.apply` (writes in one transaction), :meth:`Store.select`, :meth:`Store.schema_version`,
:meth:`Store.close` — and everything else (the in-memory tables, their loading, the record methods) is written
once, here, in terms of them. Nothing outside ``sbx.gateway.store`` names an implementation; ``open_store``
picks one from the location (``--state FILE`` or ``--database URL``).

Every table the request path reads is held in memory: the process that opened the store (and holds its owner
lock) is its only writer, and each write updates memory only after its commit. Methods are synchronous; the
server calls the writing ones through ``asyncio.to_thread`` (a commit waits on a disk or a network) and reads
memory directly.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import replace
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


class Store(ABC):
    """The open store plus its in-memory tables. Open one with ``sbx.gateway.store.open_store``; call
    :meth:`close` at the end (which also lets go of the owner lock)."""

    #: What the store is, for messages and logs: the state file's path or the database URL (never a password).
    location: str

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
    def schema_version(self) -> int:
        """The schema version the database is at (``schema.SCHEMA_VERSION`` once opened)."""

    @abstractmethod
    def close(self) -> None:
        """Close the database and let go of the owner lock."""

    def watch_owner(self, on_lost: Callable[[str], None]) -> None:
        """Call ``on_lost(reason)`` (once, from another thread) if the owner lock is ever lost while open. A
        SQLite lock file cannot be: nothing to watch."""

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

    # -- loading ---------------------------------------------------------------------------------

    def _load(self) -> None:
        for row in self.select(
            "keys", ("id", "user", "tenant", "scopes", "secret_sha256", "created", "revoked")
        ):
            key = KeyRecord(row[0], row[1], row[2], frozenset(json.loads(row[3])), row[4], row[5], row[6])
            self.keys[key.id] = key
            self.keys_by_hash[key.secret_sha256] = key
        for row in self.select(
            "nodes", ("name", "endpoint", "token_file", "ca_file", "cert_file", "key_file")
        ):
            self.nodes[row[0]] = NodeDef(*row)
        for name, cordoned, drained in self.select("node_flags", ("name", "cordoned", "drained")):
            self.node_flags[name] = NodeFlags(bool(cordoned), bool(drained))
        for row in self.select(
            "sandboxes", ("id", "user", "tenant", "node", "name", "cpus", "memory_mb", "created")
        ):
            self.sandboxes[row[0]] = SandboxRecord(*row)
        for row in self.select("volumes", ("name", "user", "tenant", "node", "created")):
            self.volumes[row[0]] = VolumeRecord(*row)
        for row in self.select("snapshots", ("id", "user", "tenant", "node", "sandbox", "created")):
            self.snapshots[row[0]] = SnapshotRecord(*row)
        for row in self.select("orgs", ("name", "created", "created_by", "created_by_tenant")):
            self.orgs[row[0]] = OrgRecord(*row)
        for row in self.select("members", ("org", "user", "tenant", "role", "added")):
            self.members[(row[0], row[1])] = MemberRecord(*row)
        for row in self.select("quotas", ("tenant", "max_cpus", "max_memory_mb", "max_sandboxes")):
            self.quotas[row[0]] = Quota(row[1], row[2], row[3])
        for row in self.select(
            "ssh_keys", ("id", "user", "home_tenant", "tenant", "fingerprint", "key", "sandbox", "created")
        ):
            self.ssh_keys[row[0]] = SshKeyRecord(*row)
        for row in self.select(
            "ssh_tokens", ("token_sha256", "user", "tenant", "sandbox", "expires_at", "created")
        ):
            self.ssh_tokens[row[0]] = SshTokenRecord(*row)

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
