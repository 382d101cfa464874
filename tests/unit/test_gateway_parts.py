"""The gateway's secrets, organisations, quotas, labels and specs built from the interfaces they are given (issue 34,
docs/architecture.md): a real SQLite store, a stand-in ``Writes`` that records each write, locks, an audit list,
an access watcher, the tenants' holders and the limits. No gateway, no aiohttp application (an org route is called
with a mocked request)."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request
from msgspec import UNSET
from stand_ins import Audit, Locks, Writes

from sbx.api.errors import Conflict, InvalidRequest, NotFound, Refused, SandboxError, Unsupported
from sbx.api.sandboxes import PatchRequest
from sbx.gateway import auth
from sbx.gateway.labels import patch_request
from sbx.gateway.nodes import Registry
from sbx.gateway.orgs import OrgRoutes
from sbx.gateway.quotas import quota_problem, shortfalls, wake_problem
from sbx.gateway.secrets import NO_KEY, SecretBox, Secrets
from sbx.gateway.specs import offered_by
from sbx.gateway.state import MemberRecord, OrgRecord, Quota, SandboxRecord
from sbx.gateway.store.sqlite import SqliteStore

pytestmark = pytest.mark.timeout(60)

T0 = "2030-01-01T00:00:00Z"
KEY = bytes(range(32))
SRC = Path(__file__).resolve().parents[2] / "src" / "sbx" / "gateway"


@pytest.fixture
def store(tmp_path: Path) -> SqliteStore:
    return SqliteStore.open(tmp_path / "gw.db")


# -- secrets ------------------------------------------------------------------------------------


def sealed_rows(store: SqliteStore) -> list[tuple[Any, ...]]:
    return sorted(store.query("secrets", ("tenant", "name", "nonce", "ciphertext", "updated")))


async def test_secrets_put_list_values_and_delete_through_the_store(store: SqliteStore) -> None:
    writes = Writes()
    secrets = Secrets(writes, store, SecretBox(KEY))
    await secrets.put("acme", "TOKEN", "one")
    await secrets.put("acme", "API_KEY", "two")
    await secrets.put("beta", "TOKEN", "three")
    await secrets.put("acme", "TOKEN", "uno")  # replaces the first
    assert [s.name for s in secrets.listing("acme")] == ["API_KEY", "TOKEN"]
    assert secrets.values("acme", ["TOKEN", "API_KEY"]) == {"TOKEN": "uno", "API_KEY": "two"}
    assert secrets.values("beta", ["TOKEN"]) == {"TOKEN": "three"}
    assert secrets.tenants() == {"acme", "beta"}
    assert secrets.check_names("acme", ["TOKEN"]) == ["TOKEN"]
    await secrets.delete("acme", "API_KEY")
    assert [s.name for s in secrets.listing("acme")] == ["TOKEN"]
    assert writes.calls == ["execute"] * 5
    # Another gateway on the same store (a replica, a restart) reads what was written.
    again = Secrets(Writes(), store, SecretBox(KEY))
    assert again.listing("acme") == secrets.listing("acme")
    assert again.values("acme", ["TOKEN"]) == {"TOKEN": "uno"}
    assert again.tenants() == {"acme", "beta"}


async def test_secrets_are_sealed_at_rest_with_the_key_given(store: SqliteStore) -> None:
    secrets = Secrets(Writes(), store, SecretBox(KEY))
    await secrets.put("acme", "TOKEN", "plain value")
    [(_, _, nonce1, sealed1, _)] = sealed_rows(store)
    await secrets.put("acme", "TOKEN", "plain value")
    [(tenant, name, nonce2, sealed2, _)] = sealed_rows(store)
    assert b"plain value" not in bytes(sealed2) and (nonce1, sealed1) != (nonce2, sealed2)  # a fresh nonce
    assert SecretBox(KEY).open(tenant, name, bytes(nonce2), bytes(sealed2)) == b"plain value"
    # Another key: the row is there, it does not open.
    other = Secrets(Writes(), store, SecretBox(b"\x01" * 32))
    assert [s.name for s in other.listing("acme")] == ["TOKEN"]
    with pytest.raises(InvalidRequest) as caught:
        other.values("acme", ["TOKEN"])
    assert caught.value.message == (
        "the secret 'TOKEN' cannot be opened with this gateway's secrets key (was the key file changed?); set it "
        "again"
    )
    assert Secrets(Writes(), store, None).check_names("acme", []) == []  # no secret named: no key needed


# (case, with a key, the call) -> (error, message); each changes nothing and writes nothing
SECRET_ERRORS: list[tuple[str, bool, Callable[[Secrets], Any], type[SandboxError], str]] = [
    ("put without a key", False, lambda s: s.put("acme", "TOKEN", "x"), Unsupported, NO_KEY),
    ("delete without a key", False, lambda s: s.delete("acme", "TOKEN"), Unsupported, NO_KEY),
    ("list without a key", False, lambda s: s.listing("acme"), Unsupported, NO_KEY),
    ("a spec naming one without a key", False, lambda s: s.check_names("acme", ["TOKEN"]), Unsupported, NO_KEY),
    ("values without a key", False, lambda s: s.values("acme", ["TOKEN"]), Unsupported, NO_KEY),
    ("put: a malformed name", True, lambda s: s.put("acme", "1X", "x"), InvalidRequest,
     "name: '1X' is not a valid environment variable name; use letters, digits and '_', not starting with a digit"),
    ("put: a reserved name", True, lambda s: s.put("acme", "LD_PRELOAD", "x"), InvalidRequest,
     ("name: LD_PRELOAD is a reserved environment variable name (it controls sandbox start-up, the loader or the "
      "shell) and cannot name a secret; choose another name")),
    ("put: a NUL in the value", True, lambda s: s.put("acme", "TOKEN", "a\x00b"), InvalidRequest,
     "value: a secret cannot contain a NUL character (no environment can hold one)"),
    ("delete: no such secret", True, lambda s: s.delete("acme", "NOPE"), NotFound, "no secret 'NOPE' in this tenant"),
    ("delete: another tenant's", True, lambda s: s.delete("beta", "TOKEN"), NotFound,
     "no secret 'TOKEN' in this tenant"),
    ("names: one twice", True, lambda s: s.check_names("acme", ["TOKEN", "TOKEN"]), InvalidRequest,
     "secrets[1]: TOKEN is named twice"),
    ("names: not the tenant's", True, lambda s: s.check_names("beta", ["TOKEN"]), InvalidRequest,
     "secrets[0]: this tenant has no secret 'TOKEN'; set it first with PUT /v1/secrets/TOKEN"),
    ("values: one gone", True, lambda s: s.values("acme", ["NOPE"]), InvalidRequest,
     "the secret 'NOPE' no longer exists in this tenant; set it again"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("with_key", "call", "error", "message"),
    [c[1:] for c in SECRET_ERRORS],
    ids=[c[0] for c in SECRET_ERRORS],
)
async def test_secret_errors_change_nothing(
    store: SqliteStore,
    with_key: bool,
    call: Callable[[Secrets], Any],
    error: type[SandboxError],
    message: str,
) -> None:
    await Secrets(Writes(), store, SecretBox(KEY)).put("acme", "TOKEN", "kept")
    writes = Writes()
    secrets = Secrets(writes, store, SecretBox(KEY) if with_key else None)
    before = sealed_rows(store)
    with pytest.raises(error) as caught:
        result = call(secrets)
        if inspect.isawaitable(result):
            await result
    assert (caught.value.code, caught.value.message) == (error.code, message)
    assert "kept" not in caught.value.message
    assert (sealed_rows(store), writes.calls, secrets.tenants()) == (before, [], {"acme"})


# -- organisations ------------------------------------------------------------------------------


@dataclass
class Access:
    """The access watcher: records, at each call, whether the removed member was still in the store."""

    store: SqliteStore
    calls: list[bool] = field(default_factory=list)

    async def access_changed(self) -> None:
        self.calls.append(("rocket", "bob") in self.store.members)


@dataclass
class Holder:
    held: set[str] = field(default_factory=set)

    def tenants(self) -> set[str]:
        return set(self.held)


@dataclass
class Limits:
    max_orgs_per_user: int = 1


@dataclass
class Orgs:
    routes: OrgRoutes
    store: SqliteStore
    writes: Writes
    locks: Locks
    audit: Audit
    access: Access
    limits: Limits


@pytest.fixture
def orgs(store: SqliteStore) -> Orgs:
    """``rocket``, owned by alice (of acme), with bob (of beta) a member; bob has a sandbox; a holder (jobs,
    services, secrets) holds tenant ``Jobbers``."""
    store.add_org(
        OrgRecord("rocket", T0, "alice", "acme"), MemberRecord("rocket", "alice", "acme", "owner", T0)
    )
    store.put_member(MemberRecord("rocket", "bob", "beta", "member", T0))
    store.put_sandbox(SandboxRecord("sbx_2", "bob", "beta", "n1", None, 1, 512, T0))
    writes, locks, audit, access, limits = Writes(), Locks(), Audit(), Access(store), Limits()
    routes = OrgRoutes(store, writes=writes, locks=locks, audit=audit, access=access,
                       holders=(Holder(), Holder({"Jobbers"})), limits=limits)  # fmt: skip
    return Orgs(routes, store, writes, locks, audit, access, limits)


def caller(user: str, tenant: str, *, admin: bool = False) -> auth.Principal:
    return auth.Principal(user=user, tenant=tenant, key_tenant=tenant, admin=admin, key_id=f"key_{user}")


USERS = {"alice": caller("alice", "acme"), "bob": caller("bob", "beta"), "carol": caller("carol", "acme"),
         "root": caller("root", "", admin=True)}  # fmt: skip


def mocked(principal: auth.Principal, method: str, path: str, body: Any = None, **match: str) -> web.Request:
    data = json.dumps(body).encode() if body is not None else b""
    payload = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    payload.feed_data(data)
    payload.feed_eof()
    request = make_mocked_request(method, path, headers={"Content-Length": str(len(data))}, match_info=match,
                                  payload=payload)  # fmt: skip
    request[auth.PRINCIPAL_KEY] = principal
    return request


def answer(response: web.StreamResponse) -> tuple[int, Any]:
    assert isinstance(response, web.Response)
    return response.status, json.loads(response.body) if response.body else None  # type: ignore[arg-type]


def tables(o: Orgs) -> tuple[dict[Any, Any], dict[Any, Any]]:
    return dict(o.store.orgs), dict(o.store.members)


async def test_an_org_is_made_under_its_name_lock_and_audited(orgs: Orgs) -> None:
    orgs.limits.max_orgs_per_user = 2
    status, body = answer(
        await orgs.routes.create(mocked(USERS["alice"], "POST", "/v1/orgs", {"name": "comet"}))
    )
    assert (status, body["name"], body["created_by"]) == (201, "comet", "alice")
    assert orgs.locks.held == [(("org", "comet"),)]
    assert orgs.store.members[("comet", "alice")].role == "owner"
    assert orgs.writes.calls == ["add_org"]
    assert orgs.audit.entries == [{"kind": "org", "type": "org.created", "key_id": "key_alice", "user": "alice",
                                   "target": "comet", "result": "owner"}]  # fmt: skip


# (case, who, name) -> (error, message); the limit is 1 and alice owns rocket already
CREATE_REFUSALS = [
    ("over the limit", "alice", "comet", Refused,
     "you already made or own 1 organisations, the most this gateway allows (--max-orgs-per-user 1)"),
    ("an organisation's name", "carol", "rocket", Conflict,
     "'rocket' is already an organisation or a tenant in use: pick another name"),
    ("a tenant a holder has, in another case", "carol", "jobbers", Conflict,
     "'jobbers' is already an organisation or a tenant in use: pick another name"),
    ("a tenant of the store's sandboxes", "carol", "beta", Conflict,
     "'beta' is already an organisation or a tenant in use: pick another name"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("who", "name", "error", "message"), [c[1:] for c in CREATE_REFUSALS], ids=[c[0] for c in CREATE_REFUSALS]
)
async def test_create_refusals_change_nothing(
    orgs: Orgs, who: str, name: str, error: type[SandboxError], message: str
) -> None:
    before = tables(orgs)
    with pytest.raises(error) as caught:
        await orgs.routes.create(mocked(USERS[who], "POST", "/v1/orgs", {"name": name}))
    assert (caught.value.code, caught.value.message) == (error.code, message)
    assert (tables(orgs), orgs.writes.calls, orgs.audit.entries) == (before, [], [])


async def test_the_limit_is_read_at_each_create(orgs: Orgs) -> None:
    with pytest.raises(Refused):
        await orgs.routes.create(mocked(USERS["alice"], "POST", "/v1/orgs", {"name": "comet"}))
    orgs.limits.max_orgs_per_user = 2  # changed after the routes were made
    status, _ = answer(
        await orgs.routes.create(mocked(USERS["alice"], "POST", "/v1/orgs", {"name": "comet"}))
    )
    assert status == 201


# (case, who, method, user or body, query) -> (error, message); each changes nothing
MEMBER_REFUSALS = [
    ("list: not a member", "carol", "GET", None, "", NotFound, "no such organization"),
    ("add: not an owner", "bob", "PUT", {"user": "carol"}, "", Refused, "only an owner of rocket may change its members"),
    ("add: not a member", "carol", "PUT", {"user": "carol"}, "", NotFound, "no such organization"),
    ("add: a bad role", "alice", "PUT", {"user": "carol", "role": "boss"}, "", InvalidRequest,
     "role must be owner or member"),
    ("add: a name from another tenant", "alice", "PUT", {"user": "bob", "tenant": "acme"}, "", Conflict,
     "a member named 'bob' from another tenant is already in rocket"),
    ("demote the last owner", "alice", "PUT", {"user": "alice", "role": "member"}, "", Conflict,
     "alice is the last owner of rocket: make another member owner first"),
    ("remove the last owner", "alice", "DELETE", "alice", "", Conflict,
     "alice is the last owner of rocket: make another member owner first"),
    ("remove: no such member", "alice", "DELETE", "zed", "", NotFound, "no member 'zed' in rocket"),
    ("remove: of another tenant", "alice", "DELETE", "bob", "?tenant=acme", NotFound, "no member 'bob' in rocket"),
    ("remove: not an owner", "bob", "DELETE", "alice", "", Refused, "only an owner of rocket may change its members"),
]  # fmt: skip


async def member_call(o: Orgs, who: str, method: str, what: Any, query: str = "") -> web.StreamResponse:
    principal = USERS[who]
    if method == "GET":
        return await o.routes.list_members(mocked(principal, "GET", "/v1/orgs/rocket/members", name="rocket"))
    if method == "PUT":
        return await o.routes.put_member(
            mocked(principal, "POST", "/v1/orgs/rocket/members", what, name="rocket")
        )
    path = f"/v1/orgs/rocket/members/{what}{query}"
    return await o.routes.remove_member(mocked(principal, "DELETE", path, name="rocket", user=what))


@pytest.mark.parametrize(
    ("who", "method", "what", "query", "error", "message"),
    [c[1:] for c in MEMBER_REFUSALS],
    ids=[c[0] for c in MEMBER_REFUSALS],
)
async def test_member_refusals_change_nothing(
    orgs: Orgs, who: str, method: str, what: Any, query: str, error: type[SandboxError], message: str
) -> None:
    before = tables(orgs)
    with pytest.raises(error) as caught:
        await member_call(orgs, who, method, what, query)
    assert (caught.value.code, caught.value.message) == (error.code, message)
    assert (tables(orgs), orgs.writes.calls, orgs.audit.entries, orgs.access.calls) == (before, [], [], [])


# (case, who, method, user or body) -> (status, rocket's members after, the write, the audit's type and target)
MEMBER_CHANGES = [
    ("add in the owner's tenant", "alice", "PUT", {"user": "carol"}, 201,
     {"alice": ("acme", "owner"), "bob": ("beta", "member"), "carol": ("acme", "member")},
     "put_member", ("org.member_added", "acme/carol", "member")),
    ("an admin adds, not a member", "root", "PUT", {"user": "carol", "tenant": "acme", "role": "owner"}, 201,
     {"alice": ("acme", "owner"), "bob": ("beta", "member"), "carol": ("acme", "owner")},
     "put_member", ("org.member_added", "acme/carol", "owner")),
    ("promote", "alice", "PUT", {"user": "bob", "tenant": "beta", "role": "owner"}, 200,
     {"alice": ("acme", "owner"), "bob": ("beta", "owner")}, "put_member", ("org.member_role", "beta/bob", "owner")),
    ("remove", "alice", "DELETE", "bob", 204, {"alice": ("acme", "owner")}, "remove_member",
     ("org.member_removed", "beta/bob", "removed")),
]  # fmt: skip


@pytest.mark.parametrize(
    ("who", "method", "what", "status", "members", "write", "audited"),
    [c[1:] for c in MEMBER_CHANGES],
    ids=[c[0] for c in MEMBER_CHANGES],
)
async def test_member_changes(
    orgs: Orgs, who: str, method: str, what: Any, status: int, members: dict[str, tuple[str, str]], write: str,
    audited: tuple[str, str, str],
) -> None:  # fmt: skip
    response = await member_call(orgs, who, method, what)
    assert response.status == status
    assert {u: (m.tenant, m.role) for (org, u), m in orgs.store.members.items() if org == "rocket"} == members
    assert orgs.writes.calls == [write]
    kind, target, result = audited
    assert orgs.audit.entries == [{"kind": "org", "type": kind, "key_id": USERS[who].key_id, "user": who,
                                   "org": "rocket", "target": target, "result": result}]  # fmt: skip
    # Only a removal ends access, once, after the member is gone from the store.
    assert orgs.access.calls == ([False] if method == "DELETE" else [])


async def test_the_members_listed_once_the_last_owner_has_another(orgs: Orgs) -> None:
    await member_call(orgs, "alice", "PUT", {"user": "bob", "tenant": "beta", "role": "owner"})
    await member_call(orgs, "alice", "PUT", {"user": "alice", "role": "member"})  # no longer the last owner
    status, body = answer(await member_call(orgs, "bob", "GET", None))
    assert status == 200
    assert [(m["user"], m["role"]) for m in body["members"]] == [("alice", "member"), ("bob", "owner")]


# -- quotas -------------------------------------------------------------------------------------


@dataclass
class Usage:
    """What a quota check reads: the store's quotas, and each tenant's (sandboxes, cpus, memory_mb)."""

    store: SqliteStore
    used: dict[str, tuple[int, int, int]] = field(default_factory=dict)

    def tenant_usage(self, tenant: str) -> tuple[int, int, int]:
        return self.used.get(tenant, (0, 0, 0))


# (quota, used: sandboxes, cpus, memory_mb; adding sandboxes, cpus, memory_mb) -> what would go past it
SHORTFALLS = [
    (None, (9, 9, 9999), (1, 8, 8192), []),
    (Quota(max_sandboxes=2), (1, 1, 512), (1, 1, 512), []),
    (Quota(max_sandboxes=2), (2, 2, 1024), (1, 1, 512), ["3 sandboxes of 2"]),
    (Quota(max_sandboxes=2), (3, 2, 1024), (0, 1, 512), []),  # a wake adds no sandbox
    (
        Quota(max_cpus=4, max_memory_mb=1024),
        (1, 3, 512),
        (1, 2, 1024),
        ["5 cpus of 4", "1536 memory_mb of 1024"],
    ),
    (Quota(max_cpus=4, max_memory_mb=1024, max_sandboxes=1), (1, 2, 512), (1, 2, 512), ["2 sandboxes of 1"]),
]


@pytest.mark.parametrize(("quota", "used", "adding", "problems"), SHORTFALLS)
def test_quota_shortfalls(
    store: SqliteStore, quota: Quota | None, used: tuple[int, int, int], adding: tuple[int, int, int],
    problems: list[str],
) -> None:  # fmt: skip
    if quota is not None:
        store.set_quota("acme", quota)
    store.set_quota(
        "other", Quota(max_sandboxes=0, max_cpus=0, max_memory_mb=0)
    )  # another tenant's: no matter
    assert shortfalls(Usage(store, {"acme": used}), "acme", *adding) == problems


def test_quota_messages(store: SqliteStore) -> None:
    store.set_quota("", Quota(max_sandboxes=1, max_cpus=2))
    usage = Usage(store, {"": (1, 1, 256)})
    assert quota_problem(usage, "", 1, 1, 256) == (
        "over the quota of tenant default: 2 sandboxes of 1; delete sandboxes or ask an admin for a larger quota"
    )
    assert quota_problem(usage, "", 0, 1, 256) is None
    assert wake_problem(usage, "", "sbx_1", 2, 512) == (
        "waking sandbox sbx_1 (2 cpus, 512 memory_mb) would take tenant default over its quota: 3 cpus of 2; stop "
        "other persistent sandboxes of the tenant, delete some, or ask an admin for a larger quota"
    )
    assert wake_problem(usage, "", "sbx_1", 1, 512) is None
    assert quota_problem(usage, "acme", 5, 50, 50000) is None  # no quota


# -- labels -------------------------------------------------------------------------------------


@dataclass
class Names:
    """The sandbox service's name look-up: ``taken`` names, each question recorded."""

    taken: set[str] = field(default_factory=set)
    asked: list[tuple[str, str, str | None]] = field(default_factory=list)

    def name_taken(self, principal: auth.Principal, name: str, except_id: str | None = None) -> bool:
        self.asked.append((principal.user, name, except_id))
        return name in self.taken


REC = SandboxRecord("sbx_1", "alice", "acme", "n1", "old", 1, 512, T0)
OURS = {"gateway.owner": "alice", "gateway.tenant": "acme"}


def test_a_patch_keeps_the_gateway_labels_and_asks_for_the_name() -> None:
    names = Names()
    sent = PatchRequest(name="web", labels={"team": "a", "gateway.owner": "alice", "gateway.service": "svc"})
    req = patch_request(names, USERS["alice"], REC, sent, {"gateway.service": "svc"})
    assert req.labels == {"team": "a", **OURS, "gateway.service": "svc"} and req.name == "web"
    assert names.asked == [("alice", "web", "sbx_1")]  # the sandbox's own name is not a clash
    assert patch_request(names, USERS["alice"], REC, PatchRequest(labels={})).labels == OURS
    assert len(names.asked) == 1  # no name given: nothing asked
    assert patch_request(names, USERS["alice"], REC, PatchRequest()).labels is UNSET


# (case, the PATCH) -> (error, message)
PATCH_REFUSALS = [
    ("a name taken", PatchRequest(name="taken"), Conflict,
     "you already have a live sandbox named 'taken': pick another name"),
    ("a gateway label changed", PatchRequest(labels={"gateway.owner": "bob"}), InvalidRequest,
     "label 'gateway.owner': gateway. labels are the gateway's; send them back unchanged or leave them out"),
    ("a gateway label added", PatchRequest(labels={"gateway.service": "svc"}), InvalidRequest,
     "label 'gateway.service': gateway. labels are the gateway's; send them back unchanged or leave them out"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("sent", "error", "message"), [c[1:] for c in PATCH_REFUSALS], ids=[c[0] for c in PATCH_REFUSALS]
)
def test_patch_refusals(sent: PatchRequest, error: type[SandboxError], message: str) -> None:
    with pytest.raises(error) as caught:
        patch_request(Names({"taken"}), USERS["alice"], REC, sent)
    assert (caught.value.code, caught.value.message) == (error.code, message)


# -- specs --------------------------------------------------------------------------------------


def test_nothing_is_offered_when_no_node_answers() -> None:
    assert offered_by(Registry()) is None
