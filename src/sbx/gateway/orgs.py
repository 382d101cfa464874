"""Organisations and their members (spec: Organisations, Organisation header).

An organisation is a tenant users share: a request with ``X-Sandbox-Org: NAME`` acts in it. Members are
``(user, tenant)`` pairs; a user name appears once per organisation. A non-member is told ``no such organization``
(404) whether or not it exists; a member who is not an owner gets 403 for a change; the last owner cannot be
demoted or removed (409). Removing a member ends what they had open in the organisation, as revocation does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sbx.api.errors import Conflict, InvalidRequest, NotFound, Refused
from sbx.gateway import auth, bodies, keys
from sbx.gateway.http import principal_of
from sbx.gateway.state import DEFAULT_TENANT, MemberRecord, OrgRecord, now_rfc3339
from sbx.node.http import json_response, read_json_body

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway

ROLES = ("owner", "member")


def tenant_in_use(gw: Gateway, name: str) -> bool:
    """Whether ``name`` is a tenant in use by a key, sandbox, volume or snapshot (compared without case)."""
    lowered = name.lower()
    store = gw.store
    tenants = {k.tenant for k in list(store.keys.values())}
    tenants |= {r.tenant for r in list(store.sandboxes.values())}
    tenants |= {r.tenant for r in list(store.volumes.values())}
    tenants |= {r.tenant for r in list(store.snapshots.values())}
    return any(t.lower() == lowered for t in tenants if t)


def membership(gw: Gateway, principal: auth.Principal, name: str) -> tuple[OrgRecord, MemberRecord | None]:
    """The organisation and the caller's membership; 404 ``no such organization`` for a non-member."""
    org = gw.store.orgs.get(name)
    member = gw.store.members.get((name, principal.user)) if org is not None else None
    if member is not None and member.tenant != principal.key.tenant:
        member = None
    if org is None or (member is None and not principal.admin):
        raise NotFound("no such organization")
    return org, member


def owners_of(gw: Gateway, name: str) -> list[MemberRecord]:
    return [m for (org, _), m in list(gw.store.members.items()) if org == name and m.role == "owner"]


def routes(gw: Gateway) -> list[web.RouteDef]:
    store = gw.store

    async def list_orgs(request: web.Request) -> web.Response:
        principal = principal_of(request)
        own = principal.key.tenant or "default"
        found: list[dict[str, Any]] = [{"name": own, "role": "owner", "current": principal.org is None}]
        for (org_name, user), member in sorted(store.members.items()):
            if user != principal.user or member.tenant != principal.key.tenant or org_name == own:
                continue
            org = store.orgs.get(org_name)
            found.append({"name": org_name, "role": member.role, "created": org.created if org else None,
                          "current": principal.org == org_name})  # fmt: skip
        return json_response({"orgs": found})

    async def create_org(request: web.Request) -> web.Response:
        principal = principal_of(request)
        body = bodies.json_object(await read_json_body(request))
        bodies.only_fields(body, ("name",))
        name = body.get("name")
        problem = keys.org_name_problem(name)
        if problem is not None:
            raise InvalidRequest(f"organisation name {problem}")
        assert isinstance(name, str)
        if any(o.lower() == name.lower() for o in store.orgs) or tenant_in_use(gw, name):
            raise Conflict(f"{name!r} is already an organisation or a tenant in use: pick another name")
        made = {
            o.name for o in store.orgs.values()
            if o.created_by == principal.user and o.created_by_tenant == principal.key.tenant
        }  # fmt: skip
        made |= {
            m.org for m in store.members.values()
            if m.user == principal.user and m.tenant == principal.key.tenant and m.role == "owner"
        }  # fmt: skip
        if len(made) >= gw.options.max_orgs_per_user:
            raise Refused(
                f"you already made or own {len(made)} organisations, the most this gateway allows "
                f"(--max-orgs-per-user {gw.options.max_orgs_per_user})"
            )
        now = now_rfc3339()
        org = OrgRecord(name, now, principal.user, principal.key.tenant)
        await gw.write(
            store.add_org, org, MemberRecord(name, principal.user, principal.key.tenant, "owner", now)
        )
        request[auth.TARGET_KEY] = name
        gw.record_audit(kind="org", type="org.created", key_id=principal.key.id, user=principal.user,
                        target=name, result="owner")  # fmt: skip
        return json_response({"name": name, "created": now, "created_by": principal.user}, status=201)

    async def list_members(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        membership(gw, principal_of(request), name)
        members = [m.to_wire() for (org, _), m in sorted(store.members.items()) if org == name]
        return json_response({"members": members})

    def require_owner(principal: auth.Principal, name: str) -> None:
        _, me = membership(gw, principal, name)
        if not principal.admin and (me is None or me.role != "owner"):
            raise Refused(f"only an owner of {name} may change its members")

    async def put_member(request: web.Request) -> web.Response:
        principal = principal_of(request)
        name = request.match_info["name"]
        require_owner(principal, name)
        body = bodies.json_object(await read_json_body(request))
        bodies.only_fields(body, ("user", "tenant", "role"))
        user = keys.check_user(body.get("user"))
        tenant = keys.check_tenant(body["tenant"]) if "tenant" in body else principal.key.tenant
        role = body.get("role", "member")
        if role not in ROLES:
            raise InvalidRequest("role must be owner or member")
        existing = store.members.get((name, user))
        target = f"{tenant or 'default'}/{user}"
        if existing is not None and existing.tenant != tenant:
            raise Conflict(f"a member named {user!r} from another tenant is already in {name}")
        if existing is not None:
            if existing.role == "owner" and role != "owner" and len(owners_of(gw, name)) <= 1:
                raise Conflict(f"{user} is the last owner of {name}: make another member owner first")
            member = MemberRecord(name, user, tenant, role, existing.added)
            await gw.write(store.put_member, member)
            gw.record_audit(kind="org", type="org.member_role", key_id=principal.key.id, user=principal.user,
                            org=name, target=target, result=role)  # fmt: skip
            return json_response(member.to_wire(), status=200)
        member = MemberRecord(name, user, tenant, role, now_rfc3339())
        await gw.write(store.put_member, member)
        gw.record_audit(kind="org", type="org.member_added", key_id=principal.key.id, user=principal.user,
                        org=name, target=target, result=role)  # fmt: skip
        return json_response(member.to_wire(), status=201)

    async def remove_member(request: web.Request) -> web.Response:
        principal = principal_of(request)
        name = request.match_info["name"]
        user = request.match_info["user"]
        require_owner(principal, name)
        member = store.members.get((name, user))
        if "tenant" in request.query and member is not None:
            wanted = keys.check_tenant(request.query["tenant"])
            if member.tenant != wanted:
                member = None
        if member is None:
            raise NotFound(f"no member {user!r} in {name}")
        if member.role == "owner" and len(owners_of(gw, name)) <= 1:
            raise Conflict(f"{user} is the last owner of {name}: make another member owner first")
        await gw.write(store.remove_member, name, user)
        ended = await gw.open.end_where(
            lambda op: op.user == user and op.key_tenant == member.tenant and op.tenant == name
        )
        gw.audit_closed(ended)
        gw.record_audit(kind="org", type="org.member_removed", key_id=principal.key.id, user=principal.user,
                        org=name, target=f"{member.tenant or 'default'}/{user}", result="removed")  # fmt: skip
        return web.Response(status=204)

    return [
        web.get("/v1/orgs", list_orgs),
        web.post("/v1/orgs", create_org),
        web.get("/v1/orgs/{name}/members", list_members),
        web.post("/v1/orgs/{name}/members", put_member),
        web.delete("/v1/orgs/{name}/members/{user}", remove_member),
    ]


def admin_list(gw: Gateway) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        found = []
        for org in sorted(gw.store.orgs.values(), key=lambda o: o.name):
            members = [m for (name, _), m in gw.store.members.items() if name == org.name]
            wire: dict[str, Any] = {
                "name": org.name, "created": org.created, "created_by": org.created_by,
                "members": len(members), "owners": sorted(m.user for m in members if m.role == "owner"),
            }  # fmt: skip
            if org.created_by_tenant != DEFAULT_TENANT:
                wire["created_by_tenant"] = org.created_by_tenant
            found.append(wire)
        return json_response({"orgs": found})

    return handler
