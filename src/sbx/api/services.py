"""Wire types of services and tenant secrets (spec: Service, Services, Jobs/agent runs/secrets).

Choices where the spec is silent are in docs/services.md: the defaults filled into a service's ``spec`` as the
gateway answers it, the replica states, and the address in ``url``.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType

from sbx.api.network_policy import NetworkRequest

RolloutState = Literal["in_progress", "done", "failed"]
ReplicaState = Literal["starting", "healthy", "unhealthy", "lost"]


class ResourceRequest(msgspec.Struct, kw_only=True):
    """``resources`` of a service or job: each amount optional (the node's default when omitted)."""

    cpus: int | UnsetType = UNSET
    memory_mb: int | UnsetType = UNSET
    disk_mb: int | UnsetType = UNSET


class HealthCheck(msgspec.Struct, kw_only=True):
    """``{http: path}`` (a GET to the replica's ``port``, 200 to 399 passes) or ``{command: [...]}`` (exit 0
    passes), checked every ``every_secs`` (10) within ``timeout_secs`` (5); ``failures`` (3) in a row make a
    replica unhealthy."""

    http: str | UnsetType = UNSET
    command: list[str] | UnsetType = UNSET
    every_secs: int | UnsetType = UNSET
    timeout_secs: int | UnsetType = UNSET
    failures: int | UnsetType = UNSET


class Placement(msgspec.Struct):
    """``{spread: "node"}``: replicas on different nodes while nodes allow."""

    spread: Literal["node"]


class ServiceSpec(msgspec.Struct, kw_only=True):
    """A service: ``name`` a DNS label with no ``--``; at most 100 ``replicas`` (default 1); ``command`` runs in
    every replica; ``port`` is where its HTTP server listens (guest loopback), for health checks and traffic;
    ``secrets`` names tenant secrets put in the replicas' environment; ``answer_timeout_secs`` (1 to 3600,
    default 120) is how long a replica may take to begin its answer to a proxied request (504 after; no limit
    once the answer has begun, so server-sent events and long downloads are never cut). The last is an
    addition to the spec's ServiceSpec (docs/services.md)."""

    required_hints: ClassVar[dict[str, str]] = {
        "name": 'name is required: a DNS label such as "web"',
    }

    name: str
    image: str | UnsetType = UNSET
    command: list[str] | UnsetType = UNSET
    replicas: int | UnsetType = UNSET
    resources: ResourceRequest | UnsetType = UNSET
    port: int | UnsetType = UNSET
    health: HealthCheck | UnsetType = UNSET
    env: dict[str, str] | UnsetType = UNSET
    network: NetworkRequest | UnsetType = UNSET
    placement: Placement | UnsetType = UNSET
    public: bool | UnsetType = UNSET
    secrets: list[str] | UnsetType = UNSET
    answer_timeout_secs: int | UnsetType = UNSET


class ScaleRequest(msgspec.Struct):
    """``POST /v1/services/{name}/scale``: 0 to 100 replicas."""

    required_hints: ClassVar[dict[str, str]] = {"replicas": 'replicas is required, e.g. {"replicas": 3}'}

    replicas: int


class Rollout(msgspec.Struct, kw_only=True):
    """The latest rollout: from the revision serving when it began to the one asked for; ``reason`` when it
    failed."""

    state: RolloutState
    from_: int = msgspec.field(name="from")
    to: int
    reason: str | UnsetType = UNSET


class Replica(msgspec.Struct, kw_only=True):
    """One replica: a sandbox of the service's owner running one revision. ``healthy`` is ``state ==
    "healthy"``; ``restarts`` counts the replacements of this replica's slot."""

    sandbox: str
    node: str
    revision: int
    state: ReplicaState
    healthy: bool
    last_check: str | UnsetType = UNSET
    last_error: str | UnsetType = UNSET
    restarts: int
    created_at: str


class Service(msgspec.Struct, kw_only=True):
    """A service: its spec (``env`` left out, defaults filled in), owner, revisions, counts and replicas.

    ``revision`` is the newest revision asked for; ``serving`` the revision the rollout started from until it
    is done; ``ready`` the healthy replicas of any revision; ``url`` where its traffic is served (with a
    ``port``); ``error`` why replicas cannot be made now, while that lasts."""

    spec: ServiceSpec
    env_names: list[str]
    owner: str
    tenant: str | None
    revision: int
    serving: int
    desired: int
    ready: int
    restarts: int
    rollout: Rollout | UnsetType = UNSET
    error: str | UnsetType = UNSET
    url: str | UnsetType = UNSET
    replicas: list[Replica]
    created_at: str
    updated_at: str


class ServiceList(msgspec.Struct):
    services: list[Service]


class SecretRequest(msgspec.Struct):
    """``PUT /v1/secrets/{name}``: at most 64 KiB, no NUL."""

    required_hints: ClassVar[dict[str, str]] = {"value": 'value is required: {"value": "..."}'}

    value: str


class Secret(msgspec.Struct):
    """A listed secret: its name and when it was last set, never its value."""

    name: str
    updated_at: str


class SecretList(msgspec.Struct):
    secrets: list[Secret]
