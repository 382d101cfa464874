"""What the specs of services and jobs share: the sandbox part (image, resources, environment, secrets, network),
checked when the spec is given, and the create request each replica or run is made from.

Order of the checks (as a sandbox create has it): every malformed field (400) first; then secrets (501 on a
gateway without a secrets key, 400 for one the tenant lacks); then what policy refuses (403: a reserved
environment name, a network looser than the nodes permit). Resources and the network are checked against what
every answering node offers (``GET /v1/capabilities``); with no node answering they are left to the node that
makes each sandbox, whose refusal then shows in the service's or job's ``error``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from msgspec import UNSET, UnsetType

from sbx.api import validation as v
from sbx.api.errors import InvalidRequest
from sbx.api.network_policy import NetworkRequest, resolve_policy
from sbx.api.node import Capabilities
from sbx.api.sandboxes import CreateRequest
from sbx.api.services import ResourceRequest
from sbx.gateway.capabilities import intersect_capabilities

if TYPE_CHECKING:
    from sbx.gateway.nodes import Registry


def offered_by(registry: Registry) -> Capabilities | None:
    """What every answering node of ``registry`` offers now; None when none answers."""
    caps = [n.status.capabilities for n in registry.healthy() if n.status is not None]
    return intersect_capabilities(caps) if caps else None


def check_command(argv: Sequence[str], field: str) -> list[str]:
    """A command: a non-empty argv with a program name and no NUL (400)."""
    try:
        return list(v.validate_argv(argv))
    except InvalidRequest as exc:
        raise InvalidRequest(f"{field}: {exc.message}") from None


def check_shape(
    image: str | UnsetType,
    resources: ResourceRequest | UnsetType,
    env: Mapping[str, str] | UnsetType,
    secrets: Sequence[str] | UnsetType,
    caps: Capabilities | None,
) -> None:
    """The 400 rules of the sandbox part: image, resources (positive; within the nodes' limits when known), env
    names and values, and no name both in ``env`` and ``secrets``."""
    if image is not UNSET:
        v.validate_image_ref(image)
    if resources is not UNSET:
        for field in ("cpus", "memory_mb", "disk_mb"):
            amount = getattr(resources, field)
            if amount is not UNSET and amount < 1:
                raise InvalidRequest(f"resources.{field} = {amount}: expected a positive integer")
        if caps is not None:
            v.validate_resources(_opt(resources.cpus), _opt(resources.memory_mb), _opt(resources.disk_mb),
                                 caps.limits)  # fmt: skip
    for name, value in (env or {}).items():
        v.validate_env_name(name)
        v.validate_env_value(name, value)
    both = sorted(set(env or {}) & set(secrets or ()))
    if both:
        raise InvalidRequest(
            f"{both[0]} is named both in env and in secrets: a secret sets the variable of its name; drop one"
        )


def check_policy(env: Mapping[str, str] | UnsetType, network: NetworkRequest | UnsetType,
                 caps: Capabilities | None) -> None:  # fmt: skip
    """The 403 rules: a reserved env name; a network policy the nodes would refuse (400 for a malformed one)."""
    for name in env or {}:
        v.check_env_not_reserved(name)
    if network is not UNSET and caps is not None:
        resolve_policy(network, caps.network)


def create_request(
    image: str | UnsetType,
    resources: ResourceRequest | UnsetType,
    env: Mapping[str, str],
    network: NetworkRequest | UnsetType,
    snapshot_id: str | UnsetType = UNSET,
    secret_env: Mapping[str, str] | None = None,
) -> CreateRequest:
    """The create request of one replica or run: the spec's ``env``, and the secrets' values as ``secret_env``,
    which the node keeps in memory only (docs/node-api.md, "Secret environment")."""
    res = resources if resources is not UNSET else ResourceRequest()
    return CreateRequest(
        image=image, cpus=res.cpus, memory_mb=res.memory_mb, disk_mb=res.disk_mb,
        env=dict(env) if env else UNSET, network=network, snapshot_id=snapshot_id,
        secret_env=dict(secret_env) if secret_env else UNSET,
    )  # fmt: skip


def _opt(value: int | UnsetType) -> int | None:
    return None if value is UNSET else value
