"""The gateway's state: its records (what each table row means) and the store's errors. The store itself —
the interface, SQLite and PostgreSQL, the migrations — is ``sbx.gateway.store``.

Tables (schema version in ``schema_version``; each migration is applied once, in order, in one transaction)::

    keys        id, user, tenant ('' = default), scopes (JSON), secret_sha256, created, revoked
    nodes       admin-added nodes: name, endpoint, token_file, ca_file, cert_file, key_file, added
    node_flags  name, cordoned, drained   (kept for node-file nodes too; restored on each poll)
    sandboxes   ownership records: id, user, tenant, node, name, cpus, memory_mb, created, persistent, asleep
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
    public_ports, port_tokens                         (gateway/ports/store.py)

Later issues add tables through new migrations (``sbx.gateway.store.schema``, one per dialect).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from msgspec import UNSET

from sbx.api.gateway import Key
from sbx.api.orgs import Member, Role
from sbx.api.ssh import SshKey

#: Tenant of a key issued without one, as stored (the API shows it as absent, or ``default`` in org calls).
DEFAULT_TENANT = ""


class StateLocked(Exception):
    """Another process (a serving gateway, an offline command) owns the store."""


class StateError(Exception):
    """The store cannot be used (unreadable, unreachable, from a newer version)."""


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
    """Who owns a sandbox, and where it runs. ``tenant`` is ``''`` for the default tenant.

    ``persistent``: made with ``persistent`` (capability ``persistent``). ``asleep``: such a sandbox is, as the
    gateway last learnt, suspended or stopped; its cpus and memory then do not count against its tenant's quota,
    and a request that would wake it is checked against the quota first (``sbx.gateway.persistent``)."""

    id: str
    user: str
    tenant: str
    node: str
    name: str | None
    cpus: int
    memory_mb: int
    created: str
    persistent: bool = False
    asleep: bool = False


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
