"""Wire types of organisations and their members (spec: Organisations, Gateway records)."""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

Role = Literal["owner", "member"]


class OrgCreateRequest(msgspec.Struct):
    """``POST /v1/orgs``: 1 to 30 of ``a-z 0-9 -``, starting with a letter."""

    name: str


class OrgCreated(msgspec.Struct):
    name: str
    created: str
    created_by: str


class OwnOrg(msgspec.Struct, kw_only=True):
    """An entry of ``GET /v1/orgs``: the key's own tenant first, then each organisation of its user;
    ``current`` marks the one the request acts in."""

    name: str
    role: Role
    created: str | None | UnsetType = UNSET
    current: bool


class OwnOrgList(msgspec.Struct):
    orgs: list[OwnOrg]


class AdminOrg(msgspec.Struct, kw_only=True):
    """An entry of ``GET /v1/admin/orgs``: how many members, and the owners' user names."""

    name: str
    created: str
    created_by: str
    created_by_tenant: str | UnsetType = UNSET
    members: int
    owners: list[str]


class AdminOrgList(msgspec.Struct):
    orgs: list[AdminOrg]


class MemberRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/orgs/{name}/members``: ``tenant`` defaults to the caller's own (``default`` names the
    default tenant); ``role`` defaults to ``member``."""

    user: str
    tenant: str | None | UnsetType = UNSET
    role: str | UnsetType = UNSET


class Member(msgspec.Struct, kw_only=True):
    """A member; ``tenant`` is left out for the default tenant."""

    user: str
    tenant: str | UnsetType = UNSET
    role: Role
    added: str


class MemberList(msgspec.Struct):
    members: list[Member]
