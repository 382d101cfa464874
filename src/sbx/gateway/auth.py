"""Who is asking: the bearer key, the organisation header, and the scope each route needs.

Order on every request (spec: Authentication, Gateway): Origin, then the key (``GET /v1/health`` needs none),
then ``X-Sandbox-Org``, then the scope, all before any lookup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from sbx.api.errors import ForbiddenOrigin, InvalidRequest, NotFound, Refused, Unauthorized
from sbx.gateway.keys import SECRET_PREFIX, has_scope, hash_secret
from sbx.gateway.state import DEFAULT_TENANT, KeyRecord, Store

ORG_HEADER = "X-Sandbox-Org"

_READ, _CREATE, _DELETE = "sandbox:read", "sandbox:create", "sandbox:delete"
_SBX = r"/v1/sandboxes/[^/]+"

#: (methods, path pattern, scopes needed), first match wins; no match means "any valid key".
SCOPE_RULES: tuple[tuple[frozenset[str], re.Pattern[str], tuple[str, ...]], ...] = tuple(
    (frozenset(methods.split()), re.compile(pattern), scopes)
    for methods, pattern, scopes in (
        ("GET", _SBX + r"/processes/[^/]+/attach", (_CREATE,)),  # GETs that write
        ("GET", _SBX + r"/tunnel", (_CREATE,)),
        ("GET POST PUT PATCH DELETE", _SBX + r"/ssh-access", ("sandbox:ssh",)),
        ("GET", r"/v1/sandboxes(/.*)?", (_READ,)),
        ("DELETE", _SBX, (_DELETE,)),
        ("POST PUT PATCH DELETE", r"/v1/sandboxes(/.*)?", (_CREATE,)),
        ("GET", r"/v1/(volumes|snapshots)(/.*)?", (_READ,)),
        ("POST PUT PATCH", r"/v1/volumes(/.*)?", (_CREATE,)),
        ("DELETE", r"/v1/(volumes|snapshots)/[^/]+", (_DELETE,)),
        ("GET POST PUT PATCH DELETE", r"/v1/ssh-keys(/.*)?", ("sandbox:ssh",)),
        ("PUT DELETE", r"/v1/secrets/[^/]+", ("secrets:write",)),
        ("GET", r"/v1/(secrets|jobs|services)(/.*)?", (_READ,)),
        ("DELETE", r"/v1/services/[^/]+", (_CREATE, _DELETE)),
        ("POST PUT DELETE", r"/v1/(jobs|services)(/.*)?", (_CREATE,)),
        ("POST", r"/v1/agent-runs", (_CREATE,)),
        ("POST", r"/v1/orgs", ("org:create",)),
        ("GET POST PUT PATCH DELETE", r"/v1/admin(/.*)?", ("admin",)),
    )
)


def scopes_for(method: str, path: str) -> tuple[str, ...]:
    """The scopes a call needs (all of them); ``()`` means any valid key."""
    for methods, pattern, scopes in SCOPE_RULES:
        if method in methods and pattern.fullmatch(path):
            return scopes
    return ()


@dataclass(frozen=True)
class Principal:
    """The caller: the key, and the tenant the request acts in (``''`` = default)."""

    key: KeyRecord
    tenant: str
    org: str | None

    @property
    def user(self) -> str:
        return self.key.user

    @property
    def admin(self) -> bool:
        return "admin" in self.key.scopes

    def owns(self, user: str, tenant: str) -> bool:
        return self.admin or (user == self.key.user and tenant == self.tenant)

    def whoami(self) -> dict[str, Any]:
        return {
            "user": self.key.user,
            "tenant": self.key.tenant or None,
            "key_id": self.key.id,
            "scopes": sorted(self.key.scopes),
            "org": self.org,
        }


#: Where the pipeline keeps the caller, the scopes the route needs, and the audit target on a request.
PRINCIPAL_KEY: web.RequestKey[Principal] = web.RequestKey("principal", Principal)
SCOPES_KEY: web.RequestKey[tuple[str, ...]] = web.RequestKey("scopes", tuple)
TARGET_KEY: web.RequestKey[str] = web.RequestKey("target", str)
#: The path's shape (``route_shape``), kept once computed.
ROUTE_KEY: web.RequestKey[str] = web.RequestKey("route", str)


def check_origin(origin: str | None, host: str, allowed: frozenset[str]) -> None:
    """An Origin other than the gateway's own host (``http(s)://<Host>``) or a ``--cors-origin`` is refused."""
    if origin is None:
        return
    if origin in allowed or origin in (f"http://{host}", f"https://{host}"):
        return
    raise ForbiddenOrigin(f"Origin {origin!r} is not allowed: start the gateway with --cors-origin {origin}")


def key_from_header(store: Store, authorization: str | None) -> KeyRecord:
    """The active key the ``Authorization: Bearer sgk_...`` header names; 401 otherwise."""
    if not authorization or not authorization.startswith("Bearer "):
        raise Unauthorized("missing API key: send Authorization: Bearer sgk_...")
    secret = authorization[len("Bearer ") :].strip()
    if not secret.startswith(SECRET_PREFIX):
        raise Unauthorized("unknown or revoked API key")
    key = store.keys_by_hash.get(hash_secret(secret))
    if key is None or key.revoked is not None:
        raise Unauthorized("unknown or revoked API key")
    return key


def acting_tenant(store: Store, key: KeyRecord, org_headers: list[str]) -> tuple[str, str | None]:
    """``(tenant, org)`` the request acts in, from ``X-Sandbox-Org`` (spec: Organisation header)."""
    if len(org_headers) > 1:
        raise InvalidRequest(f"{ORG_HEADER} given more than once: send it once")
    if not org_headers:
        return key.tenant, None
    name = org_headers[0].strip()
    own = key.tenant or "default"
    if name == own:
        return key.tenant, None
    if name in store.orgs:
        if "admin" in key.scopes:
            return name, name
        member = store.members.get((name, key.user))
        if member is not None and member.tenant == key.tenant:
            return name, name
    raise NotFound("no such organization")


def check_scopes(key: KeyRecord, needed: tuple[str, ...]) -> None:
    for scope in needed:
        if not has_scope(key.scopes, scope):
            raise Refused(f"this API key lacks the scope {scope}: ask an admin for a key with {scope}")


def is_key_still_good(store: Store, key_id: str, needed: tuple[str, ...]) -> bool:
    """Whether the key is still present, active and holds ``needed`` (the revocation recheck)."""
    key = store.keys.get(key_id)
    return key is not None and key.revoked is None and all(has_scope(key.scopes, s) for s in needed)


__all__ = [
    "DEFAULT_TENANT",
    "ORG_HEADER",
    "PRINCIPAL_KEY",
    "ROUTE_KEY",
    "SCOPES_KEY",
    "TARGET_KEY",
    "Principal",
    "acting_tenant",
    "check_origin",
    "check_scopes",
    "is_key_still_good",
    "key_from_header",
    "scopes_for",
]
