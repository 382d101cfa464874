"""A ServiceSpec checked and completed (spec: Service; docs/services.md).

Rules, in the order they are checked (every 400 before the 501 of secrets, before any 403):

- ``name``: 1 to 30 of ``a-z 0-9 -``, starting with a letter, not ending with ``-``, no ``--`` (a DNS label;
  30 so that ``<name>--<tenant>`` is one too, as a service's host name has it);
- ``command``: required (a sandbox starts no program of its own, so a service without one would run nothing);
- ``replicas``: 0 to 100, default 1; ``port``: 1 to 65535;
- ``answer_timeout_secs``: 1 to 3600, default :data:`DEFAULT_ANSWER_TIMEOUT_SECS` (how long a replica may take
  to begin its answer to a proxied request; see ``proxy.py``);
- ``health``: exactly one of ``http`` (a path starting with ``/``; needs ``port``) and ``command``;
  ``every_secs`` 1 to 3600 (default 10), ``timeout_secs`` 1 to 3600 (default 5), ``failures`` 1 to 100
  (default 3);
- the sandbox part (image, resources, env, secrets, network) as ``sbx.gateway.specs`` checks it.

The spec kept and answered has the defaults filled in (``replicas``, the health timings, ``public``,
``answer_timeout_secs``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Final, TypeVar

import msgspec
from msgspec import UNSET
from msgspec.structs import replace

from sbx.api.errors import InvalidRequest
from sbx.api.services import HealthCheck, ServiceSpec
from sbx.gateway import specs

if TYPE_CHECKING:
    from sbx.api.node import Capabilities
    from sbx.gateway.services.interfaces import SecretValues

T = TypeVar("T")

MAX_REPLICAS: Final = 100
DEFAULT_EVERY_SECS: Final = 10
DEFAULT_TIMEOUT_SECS: Final = 5
DEFAULT_FAILURES: Final = 3
MAX_HEALTH_SECS: Final = 3600
MAX_HTTP_PATH_CHARS: Final = 1024
#: Seconds a replica may take to begin its answer to a proxied request, by default: past the 60 s of common
#: proxies' read timeouts and the 20 to 60 s a long poll usually holds, well short of "forever".
DEFAULT_ANSWER_TIMEOUT_SECS: Final = 120
MAX_ANSWER_TIMEOUT_SECS: Final = 3600
#: A service name: a DNS label of at most 30 characters with no ``--`` (see the module docstring).
_NAME = re.compile(r"^[a-z](?:[a-z0-9]|-(?!-)){0,29}$")
#: What in a spec, when changed, needs new replicas (a rollout to a new revision).
ROLLOUT_FIELDS: Final = ("image", "command", "resources", "port", "health", "env", "network", "secrets")


def check_name(name: str, field: str = "name") -> str:
    """400 unless ``name`` is a service name (see the module docstring)."""
    if not _NAME.match(name) or name.endswith("-"):
        raise InvalidRequest(
            f"{field}: {name!r} is not a service name: use 1 to 30 of a-z, 0-9 and -, starting with a letter, "
            "not ending with - and without --"
        )
    return name


def _in_range(field: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise InvalidRequest(f"{field} = {value}: give {low} to {high}")
    return value


def check_replicas(replicas: int, field: str = "replicas") -> int:
    """0 to 100 replicas (400 otherwise)."""
    return _in_range(field, replicas, 0, MAX_REPLICAS)


def _health(health: HealthCheck, port: int | None) -> HealthCheck:
    if (health.http is UNSET) == (health.command is UNSET):
        raise InvalidRequest('health: give exactly one of "http" (a path) and "command" (an argv)')
    if health.http is not UNSET:
        path = health.http
        if not path.startswith("/") or len(path) > MAX_HTTP_PATH_CHARS:
            raise InvalidRequest(
                f"health.http: {path!r} is not a path: give one starting with / such as /healthz"
            )
        if any(ch.isspace() or not ch.isprintable() or ord(ch) > 126 for ch in path):
            raise InvalidRequest("health.http: the path may hold only printable ASCII without spaces")
        if port is None:
            raise InvalidRequest("health.http needs port: the GET goes to the replica's port")
    if health.command is not UNSET:
        specs.check_command(health.command, "health.command")
    return replace(
        health,
        every_secs=_in_range("health.every_secs", _or(health.every_secs, DEFAULT_EVERY_SECS), 1, MAX_HEALTH_SECS),
        timeout_secs=_in_range("health.timeout_secs", _or(health.timeout_secs, DEFAULT_TIMEOUT_SECS), 1,
                               MAX_HEALTH_SECS),
        failures=_in_range("health.failures", _or(health.failures, DEFAULT_FAILURES), 1, 100),
    )  # fmt: skip


def check_spec(
    caps: Capabilities | None, secrets: SecretValues, tenant: str, spec: ServiceSpec
) -> ServiceSpec:
    """``spec`` checked for ``tenant`` (400, 501, 403 as the module says) and completed with its defaults;
    ``caps`` is what every answering node offers now (``specs.offered_by``; None when none answers: the nodes
    then judge resources and network at each create)."""
    check_name(spec.name)
    if spec.command is UNSET:
        raise InvalidRequest(
            "command is required: a replica runs nothing of its own, e.g. "
            '{"command": ["python3", "-m", "http.server", "8080"]}'
        )
    specs.check_command(spec.command, "command")
    replicas = check_replicas(_or(spec.replicas, 1))
    port = _in_range("port", spec.port, 1, 65535) if spec.port is not UNSET else None
    health = _health(spec.health, port) if spec.health is not UNSET else UNSET
    answer_timeout = _in_range("answer_timeout_secs", answer_timeout_secs(spec), 1, MAX_ANSWER_TIMEOUT_SECS)
    specs.check_shape(spec.image, spec.resources, spec.env, spec.secrets, caps)
    secrets.check_names(tenant, spec.secrets or ())
    specs.check_policy(spec.env, spec.network, caps)
    return replace(spec, replicas=replicas, health=health, public=_or(spec.public, False),
                   answer_timeout_secs=answer_timeout)  # fmt: skip


def answer_timeout_secs(spec: ServiceSpec) -> int:
    """The spec's ``answer_timeout_secs``, or the default (a service kept before the field existed has none)."""
    return _or(spec.answer_timeout_secs, DEFAULT_ANSWER_TIMEOUT_SECS)


def rollout_part(spec: ServiceSpec) -> bytes:
    """What a rollout compares: the fields of :data:`ROLLOUT_FIELDS`, encoded in one canonical form."""
    part = {name: getattr(spec, name) for name in ROLLOUT_FIELDS if getattr(spec, name) is not UNSET}
    return msgspec.json.encode(part, order="sorted")


def _or(value: T | msgspec.UnsetType, default: T) -> T:
    return default if isinstance(value, msgspec.UnsetType) else value
