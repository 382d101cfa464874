"""API keys: ``sgk_`` secrets (only their SHA-256 is stored), ids, scopes, and the user and tenant name rules."""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable

from sbx.api.errors import InvalidRequest
from sbx.api.gateway import KeyCreated
from sbx.gateway.state import DEFAULT_TENANT, KeyRecord, now_rfc3339

SECRET_PREFIX = "sgk_"
KEY_ID_PREFIX = "key_"

#: Every scope the spec names (Authentication, Scopes); ``admin`` includes all of them.
SCOPES = frozenset(
    {
        "sandbox:read",
        "sandbox:create",
        "sandbox:delete",
        "sandbox:ssh",
        "secrets:write",
        "org:create",
        "admin",
    }
)

_USER = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")
#: Tenants and organisations share one namespace and one name rule (spec: Organisations).
_ORG_NAME = re.compile(r"^[a-z](?:[a-z0-9]|-(?!-)){0,29}$")
RESERVED_NAMES = frozenset({"default", "admin"})


def hash_secret(secret: str) -> str:
    """SHA-256 hex of a secret. Secrets carry 256 random bits, so a fast hash is enough: the stored
    hash cannot be reversed nor guessed."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def check_user(user: object) -> str:
    if not isinstance(user, str) or not _USER.match(user):
        raise InvalidRequest(
            "user must be 1 to 64 characters of letters, digits and . _ @ -, starting with a letter or digit"
        )
    return user


def org_name_problem(name: object) -> str | None:
    """Why ``name`` is not a valid organisation or tenant name, or None."""
    if not isinstance(name, str) or not 1 <= len(name) <= 30:
        return "must be 1 to 30 characters"
    if not _ORG_NAME.match(name) or name.endswith("-"):
        return "must be a-z 0-9 and -, start with a letter, not end with - and not contain --"
    if name in RESERVED_NAMES:
        return f"{name!r} is reserved"
    return None


def check_tenant(tenant: object) -> str:
    """A key's tenant as stored: absent, null or ``default`` is the default tenant (``''``)."""
    if tenant is None or tenant == "default":
        return DEFAULT_TENANT
    problem = org_name_problem(tenant)
    if problem is not None:
        raise InvalidRequest(f"tenant {problem}")
    assert isinstance(tenant, str)
    return tenant


def check_scopes(scopes: object) -> frozenset[str]:
    if not isinstance(scopes, list) or not scopes or not all(isinstance(s, str) for s in scopes):
        raise InvalidRequest(f"scopes must be a non-empty array of: {', '.join(sorted(SCOPES))}")
    unknown = sorted(set(scopes) - SCOPES)
    if unknown:
        raise InvalidRequest(f"unknown scope {unknown[0]!r}: use {', '.join(sorted(SCOPES))}")
    return frozenset(scopes)


def new_key(user: str, tenant: str, scopes: Iterable[str]) -> tuple[KeyRecord, str]:
    """A fresh key record and its secret (shown once, never stored)."""
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    key = KeyRecord(
        id=KEY_ID_PREFIX + secrets.token_hex(8),
        user=user,
        tenant=tenant,
        scopes=frozenset(scopes),
        secret_sha256=hash_secret(secret),
        created=now_rfc3339(),
    )
    return key, secret


def created_wire(key: KeyRecord, secret: str) -> KeyCreated:
    """The spec's "API key (created)" record, the only place a secret appears."""
    return KeyCreated(key.id, key.user, key.tenant or None, sorted(key.scopes), key.created, secret)


def has_scope(scopes: frozenset[str], needed: str) -> bool:
    return "admin" in scopes or needed in scopes
