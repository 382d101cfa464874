"""Wire types of what only a gateway serves: health, whoami, API keys, nodes, drain, lost sandboxes
(spec: Gateway records, Gateway-only endpoints, Admin endpoints)."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType

from sbx.api.node import NodeStatus

Scope = Literal[
    "sandbox:read", "sandbox:create", "sandbox:delete", "sandbox:ssh", "secrets:write", "org:create", "admin"
]


class Health(msgspec.Struct):
    """``GET /v1/health``: ``{status: "ok"}``, no credential needed."""

    status: str


class Readiness(msgspec.Struct):
    """``GET /v1/ready``: ``{status: "ready"}`` when this gateway can serve (its store reachable, the owner lock
    held, other replicas' changes listened to, not stopping); else 503 ``unavailable`` saying why. No credential
    needed: for load balancers (docs/ha.md)."""

    status: str


class Whoami(msgspec.Struct):
    """``GET /v1/whoami``: the key's user, tenant (null: the default one), id and scopes, and the
    organisation this request acts in (null: the key's own tenant)."""

    user: str
    tenant: str | None
    key_id: str
    scopes: list[str]
    org: str | None


class KeyCreateRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/admin/keys``: tenant null, absent or ``default`` is the default tenant."""

    user: str
    tenant: str | None | UnsetType = UNSET
    scopes: list[str]


class KeyCreated(msgspec.Struct):
    """The created key; ``secret`` (``sgk_...``) is shown here only, never again."""

    id: str
    user: str
    tenant: str | None
    scopes: list[str]
    created: str
    secret: str


class Key(msgspec.Struct, kw_only=True):
    """A listed key: never a secret; ``revoked`` (a time) once revoked."""

    id: str
    user: str
    tenant: str | None
    scopes: list[str]
    created: str
    revoked: str | UnsetType = UNSET


class KeyList(msgspec.Struct):
    keys: list[Key]


class GatewayNode(msgspec.Struct, kw_only=True):
    """A node as the gateway sees it: health, when it last answered a poll, cordon (as the gateway keeps
    it), lost (down past ``--node-lost-after``), whether it comes from the node file, the last poll's error
    and the last NodeStatus it answered."""

    name: str
    endpoint: str
    healthy: bool
    last_seen: str | None
    cordoned: bool
    lost: bool
    from_node_file: bool
    error: str | UnsetType = UNSET
    status: NodeStatus | UnsetType = UNSET


class NodeList(msgspec.Struct):
    nodes: list[GatewayNode]


class NodeAddRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/admin/nodes``: files are absolute paths under ``--node-files-dir``."""

    required_hints: ClassVar[dict[str, str]] = {
        "endpoint": "endpoint is required: https://HOST:PORT, unix:///PATH or http://127.0.0.1:PORT"
    }

    name: str
    endpoint: str
    token_file: str | None | UnsetType = UNSET
    ca_file: str | None | UnsetType = UNSET
    cert_file: str | None | UnsetType = UNSET
    key_file: str | None | UnsetType = UNSET


class DrainRequest(msgspec.Struct):
    """``POST /v1/admin/nodes/{name}/drain``: with ``terminate`` its sandboxes are terminated."""

    terminate: bool = False


class DrainFailure(msgspec.Struct):
    id: str
    error: str


class DrainResult(msgspec.Struct, kw_only=True):
    """What a drain left: sandboxes still running, those it terminated, and those it failed to. ``suspended``
    (an addition, capability ``persistent``): the persistent sandboxes it suspended (without ``terminate``); those
    asleep do not count in ``remaining``."""

    node: str
    cordoned: bool
    remaining: int
    terminated: list[str]
    failed: list[DrainFailure] | UnsetType = UNSET
    suspended: list[str] = msgspec.field(default_factory=list)


class LostSandbox(msgspec.Struct, kw_only=True):
    """A sandbox on a node down longer than ``--node-lost-after``."""

    id: str
    user: str
    tenant: str | None
    node: str
    cpus: int | UnsetType = UNSET
    memory_mb: int | UnsetType = UNSET
    node_down_since: str | None


class LostList(msgspec.Struct):
    sandboxes: list[LostSandbox]


class QuotaUsage(msgspec.Struct):
    """What a tenant's sandboxes hold now, as quotas count it (records not on lost nodes)."""

    sandboxes: int
    cpus: int
    memory_mb: int


class TenantQuota(msgspec.Struct, kw_only=True):
    """A tenant's quota (an amount null or absent has no limit) and its usage. ``tenant`` is ``default`` for the
    default tenant."""

    tenant: str
    cpus: int | None = None
    memory_mb: int | None = None
    sandboxes: int | None = None
    used: QuotaUsage


class QuotaList(msgspec.Struct):
    """``GET /v1/admin/quotas``: every tenant with a quota or sandboxes, by name."""

    quotas: list[TenantQuota]


class QuotaRequest(msgspec.Struct, kw_only=True):
    """``PUT /v1/admin/quotas/{tenant}``: the whole quota; an amount null or absent has no limit (all absent
    removes the quota)."""

    cpus: int | None = None
    memory_mb: int | None = None
    sandboxes: int | None = None
