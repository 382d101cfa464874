"""Organisations and their members (spec: Organisations, Organisation header).

An organisation is a tenant users share: a request with ``X-Sandbox-Org: NAME`` acts in it. Members are
``(user, tenant)`` pairs; a user name appears once per organisation. A non-member is told ``no such organization``
(404) whether or not it exists; a member who is not an owner gets 403 for a change; the last owner cannot be
demoted or removed (409). Removing a member ends what they had open in the organisation, as revocation does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from aiohttp import web
from msgspec import UNSET

from sbx.api.codec import decode_request
from sbx.api.errors import Conflict, InvalidRequest, NotFound, Refused
from sbx.api.orgs import (
    AdminOrg,
    AdminOrgList,
    MemberList,
    MemberRequest,
    OrgCreated,
    OrgCreateRequest,
    OwnOrg,
    OwnOrgList,
    Role,
)
from sbx.gateway import auth, keys
from sbx.gateway.http import principal_of
from sbx.gateway.interfaces import AuditSink, Reservations, Writes
from sbx.gateway.state import MemberRecord, OrgRecord, now_rfc3339
from sbx.gateway.store import Store
from sbx.web.http import json_response, read_json_body

ROLES = ("owner", "member")


class TenantHolder(Protocol):
    """Something that holds things of tenants besides the store's tables (the secrets, services and jobs): an
    organisation may not take the name of a tenant in use."""

    def tenants(self) -> set[str]:
        """The tenants holding at least one."""


class AccessChanges(Protocol):
    """What must follow a member's removal: everything they had open in the organisation ends (as revocation
    does), before the removal answers."""

    async def access_changed(self) -> None: ...


class OrgLimits(Protocol):
    """The organisations' limit, read at each create (``--max-orgs-per-user``; the gateway's options)."""

    @property
    def max_orgs_per_user(self) -> int: ...


def tenant_in_use(store: Store, holders: Iterable[TenantHolder], name: str) -> bool:
    """Whether ``name`` is a tenant in use by a key, sandbox, volume, snapshot, or anything of ``holders`` (a
    secret, job or service), compared without case."""
    lowered = name.lower()
    tenants = {k.tenant for k in list(store.keys.values())}
    tenants |= {r.tenant for r in list(store.sandboxes.values())}
    tenants |= {r.tenant for r in list(store.volumes.values())}
    tenants |= {r.tenant for r in list(store.snapshots.values())}
    for holder in holders:
        tenants |= holder.tenants()
    return any(t.lower() == lowered for t in tenants if t)


def membership(store: Store, principal: auth.Principal, name: str) -> tuple[OrgRecord, MemberRecord | None]:
    """The organisation and the caller's membership; 404 ``no such organization`` for a non-member."""
    org = store.orgs.get(name)
    member = store.members.get((name, principal.user)) if org is not None else None
    if member is not None and member.tenant != principal.key_tenant:
        member = None
    if org is None or (member is None and not principal.admin):
        raise NotFound("no such organization")
    return org, member


def owners_of(store: Store, name: str) -> list[MemberRecord]:
    return [m for (org, _), m in list(store.members.items()) if org == name and m.role == "owner"]


class OrgRoutes:
    """``/v1/orgs`` and ``GET /v1/admin/orgs``. Given the store and its ``Writes``, the locks a name's check and
    its write are held under, the audit log, what ends access after a member's removal, the ``holders`` of
    tenants besides the store (secrets, services, jobs) and the ``limits``."""

    def __init__(
        self,
        store: Store,
        *,
        writes: Writes,
        locks: Reservations,
        audit: AuditSink,
        access: AccessChanges,
        holders: Sequence[TenantHolder],
        limits: OrgLimits,
    ) -> None:
        self.store = store
        self.writes = writes
        self.locks = locks
        self.audit = audit
        self.access = access
        self.holders = tuple(holders)
        self.limits = limits

    async def list(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        own = principal.key_tenant or "default"
        found = [OwnOrg(name=own, role="owner", current=principal.org is None)]
        for (org_name, user), member in sorted(self.store.members.items()):
            if user != principal.user or member.tenant != principal.key_tenant or org_name == own:
                continue
            org = self.store.orgs.get(org_name)
            role: Role = "owner" if member.role == "owner" else "member"
            found.append(OwnOrg(name=org_name, role=role, created=org.created if org else None,
                                current=principal.org == org_name))  # fmt: skip
        return json_response(OwnOrgList(found))

    async def create(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        name = decode_request(await read_json_body(request), OrgCreateRequest).name
        problem = keys.org_name_problem(name)
        if problem is not None:
            raise InvalidRequest(f"organisation name {problem}")
        # The name's check and the org's write under its lock shared by the replicas (names differing in case
        # only are one name).
        async with self.locks.reservation(self.locks.name_lock("org", name.lower())):
            return await self._create(request, principal, name)

    async def _create(self, request: web.Request, principal: auth.Principal, name: str) -> web.Response:
        store = self.store
        if any(o.lower() == name.lower() for o in store.orgs) or tenant_in_use(store, self.holders, name):
            raise Conflict(f"{name!r} is already an organisation or a tenant in use: pick another name")
        made = {
            o.name for o in store.orgs.values()
            if o.created_by == principal.user and o.created_by_tenant == principal.key_tenant
        }  # fmt: skip
        made |= {
            m.org for m in store.members.values()
            if m.user == principal.user and m.tenant == principal.key_tenant and m.role == "owner"
        }  # fmt: skip
        limit = self.limits.max_orgs_per_user
        if len(made) >= limit:
            raise Refused(
                f"you already made or own {len(made)} organisations, the most this gateway allows "
                f"(--max-orgs-per-user {limit})"
            )
        now = now_rfc3339()
        org = OrgRecord(name, now, principal.user, principal.key_tenant)
        await self.writes.write(
            store.add_org, org, MemberRecord(name, principal.user, principal.key_tenant, "owner", now)
        )
        request[auth.TARGET_KEY] = name
        self.audit.record_audit(kind="org", type="org.created", key_id=principal.key_id, user=principal.user,
                                target=name, result="owner")  # fmt: skip
        return json_response(OrgCreated(name, now, principal.user), status=201)

    async def list_members(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        membership(self.store, principal_of(request), name)
        return json_response(
            MemberList([m.wire() for (org, _), m in sorted(self.store.members.items()) if org == name])
        )

    def _require_owner(self, principal: auth.Principal, name: str) -> None:
        _, me = membership(self.store, principal, name)
        if not principal.admin and (me is None or me.role != "owner"):
            raise Refused(f"only an owner of {name} may change its members")

    async def put_member(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        name = request.match_info["name"]
        self._require_owner(principal, name)
        req = decode_request(await read_json_body(request), MemberRequest)
        store, writes, audit = self.store, self.writes, self.audit
        user = keys.check_user(req.user)
        tenant = keys.check_tenant(req.tenant) if req.tenant is not UNSET else principal.key_tenant
        role = req.role if req.role is not UNSET else "member"
        if role not in ROLES:
            raise InvalidRequest("role must be owner or member")
        existing = store.members.get((name, user))
        target = f"{tenant or 'default'}/{user}"
        if existing is not None and existing.tenant != tenant:
            raise Conflict(f"a member named {user!r} from another tenant is already in {name}")
        if existing is not None:
            if existing.role == "owner" and role != "owner" and len(owners_of(store, name)) <= 1:
                raise Conflict(f"{user} is the last owner of {name}: make another member owner first")
            member = MemberRecord(name, user, tenant, role, existing.added)
            await writes.write(store.put_member, member)
            audit.record_audit(kind="org", type="org.member_role", key_id=principal.key_id,
                               user=principal.user, org=name, target=target, result=role)  # fmt: skip
            return json_response(member.wire(), status=200)
        member = MemberRecord(name, user, tenant, role, now_rfc3339())
        await writes.write(store.put_member, member)
        audit.record_audit(kind="org", type="org.member_added", key_id=principal.key_id, user=principal.user,
                           org=name, target=target, result=role)  # fmt: skip
        return json_response(member.wire(), status=201)

    async def remove_member(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        name = request.match_info["name"]
        user = request.match_info["user"]
        self._require_owner(principal, name)
        store = self.store
        member = store.members.get((name, user))
        if "tenant" in request.query and member is not None:
            wanted = keys.check_tenant(request.query["tenant"])
            if member.tenant != wanted:
                member = None
        if member is None:
            raise NotFound(f"no member {user!r} in {name}")
        if member.role == "owner" and len(owners_of(store, name)) <= 1:
            raise Conflict(f"{user} is the last owner of {name}: make another member owner first")
        await self.writes.write(store.remove_member, name, user)
        await self.access.access_changed()  # what they had open in the organisation ends before this answers
        self.audit.record_audit(kind="org", type="org.member_removed", key_id=principal.key_id,
                                user=principal.user, org=name, target=f"{member.tenant or 'default'}/{user}",
                                result="removed")  # fmt: skip
        return web.Response(status=204)

    async def admin_list(self, request: web.Request) -> web.Response:
        found = []
        for org in sorted(self.store.orgs.values(), key=lambda o: o.name):
            members = [m for (name, _), m in self.store.members.items() if name == org.name]
            found.append(AdminOrg(
                name=org.name, created=org.created, created_by=org.created_by,
                created_by_tenant=org.created_by_tenant or UNSET, members=len(members),
                owners=sorted(m.user for m in members if m.role == "owner"),
            ))  # fmt: skip
        return json_response(AdminOrgList(found))
