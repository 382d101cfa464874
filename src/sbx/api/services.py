"""Wire types of services, secrets and job notifications (spec: Service, Services, Jobs, agent runs,
secrets, Job notifications). Jobs' own fields are "not shown" by the spec beyond the notification body."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from sbx.api.network_policy import NetworkRequest


class ServiceResources(msgspec.Struct, kw_only=True):
    cpus: int | UnsetType = UNSET
    memory_mb: int | UnsetType = UNSET
    disk_mb: int | UnsetType = UNSET


class HealthCheck(msgspec.Struct, kw_only=True):
    """``{http: path}`` or ``{command: [...]}``, checked every ``every_secs`` (10) within ``timeout_secs``
    (5); ``failures`` (3) in a row make a replica unhealthy."""

    http: str | UnsetType = UNSET
    command: list[str] | UnsetType = UNSET
    every_secs: int | UnsetType = UNSET
    timeout_secs: int | UnsetType = UNSET
    failures: int | UnsetType = UNSET


class Placement(msgspec.Struct):
    spread: Literal["node"]


class ServiceSpec(msgspec.Struct, kw_only=True):
    """A service: ``name`` a DNS label with no ``--``; at most 100 ``replicas``."""

    name: str
    image: str | UnsetType = UNSET
    command: list[str] | UnsetType = UNSET
    replicas: int | UnsetType = UNSET
    resources: ServiceResources | UnsetType = UNSET
    port: int | UnsetType = UNSET
    health: HealthCheck | UnsetType = UNSET
    env: dict[str, str] | UnsetType = UNSET
    network: NetworkRequest | UnsetType = UNSET
    placement: Placement | UnsetType = UNSET
    public: bool | UnsetType = UNSET
    secrets: list[str] | UnsetType = UNSET


class ScaleRequest(msgspec.Struct):
    replicas: int


class Rollout(msgspec.Struct, kw_only=True):
    state: Literal["in_progress", "done", "failed"]
    from_: int = msgspec.field(name="from")
    to: int
    reason: str | UnsetType = UNSET


class Replica(msgspec.Struct, kw_only=True):
    sandbox: str
    node: str
    revision: int
    state: Literal["starting", "healthy", "unhealthy", "lost"]
    healthy: bool
    last_check: str | UnsetType = UNSET
    last_error: str | UnsetType = UNSET
    restarts: int
    created_at: str


class Service(msgspec.Struct, kw_only=True):
    """A service: its spec (``env`` left out), owner, revisions, counts and replicas."""

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

    value: str


class Secret(msgspec.Struct):
    name: str
    updated_at: str


class SecretList(msgspec.Struct):
    secrets: list[Secret]


class JobNotification(msgspec.Struct, kw_only=True):
    """What a job's ``notify`` URL receives: never output or a value."""

    event: Literal["run.finished", "job.finished"]
    job: str
    name: str | UnsetType = UNSET
    job_state: str
    run: int | UnsetType = UNSET
    state: str | UnsetType = UNSET
    exit_code: int | UnsetType = UNSET
