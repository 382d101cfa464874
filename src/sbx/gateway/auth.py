"""Who is asking: the bearer key, the organisation header, and the scope each route needs.

Order on every request (spec: Authentication, Gateway): Origin, then the key (``GET /v1/health`` needs none),
then ``X-Sandbox-Org``, then the scope the route table names for the endpoint, all before any lookup.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aiohttp import web

from sbx.api.errors import ForbiddenOrigin, InvalidRequest, NotFound, Refused, Unauthorized
from sbx.api.gateway import Whoami
from sbx.gateway.keys import SECRET_PREFIX, has_scope, hash_secret
from sbx.gateway.state import DEFAULT_TENANT, KeyRecord
from sbx.gateway.store import Store

ORG_HEADER = "X-Sandbox-Org"


@dataclass(frozen=True)
class Principal:
    """Who acts: a user, the tenant the request acts in (``''`` = default; an organisation through
    ``X-Sandbox-Org``), the user's own tenant (the key's), whether it holds ``admin``, and the key (absent when
    the gateway acts for an owner itself: a service's controller, a job)."""

    user: str
    tenant: str
    key_tenant: str
    admin: bool = False
    key_id: str | None = None
    scopes: frozenset[str] = frozenset()
    org: str | None = None

    @classmethod
    def of_key(cls, key: KeyRecord, tenant: str | None = None, org: str | None = None) -> Principal:
        """The holder of ``key`` acting in ``tenant`` (default: the key's own)."""
        return cls(
            user=key.user, tenant=key.tenant if tenant is None else tenant, key_tenant=key.tenant,
            admin="admin" in key.scopes, key_id=key.id, scopes=key.scopes, org=org,
        )  # fmt: skip

    @classmethod
    def owner(cls, user: str, tenant: str) -> Principal:
        """An owner the gateway acts for by itself (no key, no admin rights)."""
        return cls(user=user, tenant=tenant, key_tenant=tenant)

    def owns(self, user: str, tenant: str) -> bool:
        return self.admin or (user == self.user and tenant == self.tenant)

    def whoami(self) -> Whoami:
        return Whoami(
            user=self.user, tenant=self.key_tenant or None, key_id=self.key_id or "", scopes=sorted(self.scopes),
            org=self.org,
        )  # fmt: skip


#: Where the pipeline keeps the caller and the audit target on a request.
PRINCIPAL_KEY: web.RequestKey[Principal] = web.RequestKey("principal", Principal)
TARGET_KEY: web.RequestKey[str] = web.RequestKey("target", str)


def check_origin(origin: str | None, host: str, allowed: frozenset[str]) -> None:
    """An Origin other than the gateway's own host (``http(s)://<Host>``) or a ``--cors-origin`` is refused."""
    if origin is None:
        return
    if origin in allowed or origin in (f"http://{host}", f"https://{host}"):
        return
    raise ForbiddenOrigin(f"Origin {origin!r} is not allowed: start the gateway with --cors-origin {origin}")


#: ``Authorization: <scheme> <credential>``: spaces and tabs around and between (RFC 9110, 11.4 and 5.6.3).
_CREDENTIALS = re.compile(r"[ \t]*([^ \t]+)[ \t]+(.*?)[ \t]*", re.DOTALL)


def bearer_credential(authorization: str | None) -> str | None:
    """The credential of an ``Authorization: Bearer <credential>`` header as the gateway reads it: the scheme
    ``Bearer`` in any case (RFC 9110, 11.1), then one or more spaces or tabs, then the credential, without the
    spaces and tabs around it; None for no header, another scheme, or no credential.

    The one parse of the header: authentication (:func:`key_from_header`) and what the services' proxy keeps
    from a replica (:func:`carries_gateway_key`) both read it, so a spelling that authenticates is one the
    proxy drops."""
    found = _CREDENTIALS.fullmatch(authorization) if authorization is not None else None
    if found is None:
        return None
    scheme, credential = found.group(1), found.group(2)
    if not scheme.isascii() or scheme.lower() != "bearer" or not credential:
        return None
    return credential


def carries_gateway_key(authorization: str) -> bool:
    """Whether an ``Authorization`` value must not reach a service's replica: one whose Bearer credential is a
    gateway key (the spelling :func:`key_from_header` reads), or that holds ``sgk_`` anywhere at all (a key
    sent under another scheme, or misspelled, is still a key)."""
    credential = bearer_credential(authorization)
    return (credential is not None and credential.startswith(SECRET_PREFIX)) or SECRET_PREFIX in authorization


def key_from_header(store: Store, authorization: str | None) -> KeyRecord:
    """The active key the ``Authorization: Bearer sgk_...`` header names (read by :func:`bearer_credential`);
    401 otherwise."""
    secret = bearer_credential(authorization)
    if secret is None:
        raise Unauthorized("missing API key: send Authorization: Bearer sgk_...")
    if not secret.startswith(SECRET_PREFIX):
        raise Unauthorized("unknown or revoked API key")
    key = store.keys_by_hash.get(hash_secret(secret))
    if key is None or key.revoked is not None:
        raise Unauthorized("unknown or revoked API key")
    return key


def names_unknown_key(store: Store, authorization: str | None) -> bool:
    """Whether ``authorization`` carries a key's secret (``sgk_...``) that no key of memory has."""
    secret = bearer_credential(authorization)
    return (
        secret is not None
        and secret.startswith(SECRET_PREFIX)
        and hash_secret(secret) not in store.keys_by_hash
    )


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


def check_scopes(principal: Principal, needed: tuple[str, ...]) -> None:
    """403 naming the first scope of ``needed`` the caller's key lacks, before anything is looked up."""
    for scope in needed:
        if not has_scope(principal.scopes, scope):
            raise Refused(f"this API key lacks the scope {scope}: ask an admin for a key with {scope}")


def has_access(store: Store, user: str, tenant: str, scope: str | None = None) -> bool:
    """Whether ``user`` still holds an active key that acts in ``tenant`` with ``scope`` (``admin`` holds every
    scope; None: any scope at all). A key acts in its own tenant, in an organisation its user is a member of
    (through a key of the member's tenant), and, for an admin key, anywhere. What services, jobs and SSH hold
    their owners to (spec: Revocation 2-4)."""
    member = store.members.get((tenant, user))
    for key in list(store.keys.values()):
        if key.user != user or key.revoked is not None:
            continue
        if scope is not None and not has_scope(key.scopes, scope):
            continue
        if (
            key.tenant == tenant
            or "admin" in key.scopes
            or (member is not None and member.tenant == key.tenant)
        ):
            return True
    return False


def is_key_still_good(store: Store, key_id: str, needed: tuple[str, ...]) -> bool:
    """Whether the key is still present, active and holds ``needed`` (the revocation recheck)."""
    key = store.keys.get(key_id)
    return key is not None and key.revoked is None and all(has_scope(key.scopes, s) for s in needed)


__all__ = [
    "DEFAULT_TENANT",
    "ORG_HEADER",
    "PRINCIPAL_KEY",
    "TARGET_KEY",
    "Principal",
    "acting_tenant",
    "bearer_credential",
    "carries_gateway_key",
    "check_origin",
    "check_scopes",
    "has_access",
    "is_key_still_good",
    "key_from_header",
]
