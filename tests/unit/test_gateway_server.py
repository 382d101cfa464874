"""The gateway against small aiohttp stand-ins for nodes: capacity retry, 503, health states, revocation of a
request the node has not answered, the admin endpoints' error rules, plus the pure helpers (capabilities
intersection, route shapes, scopes, audit log rotation)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict

from sbx.api.codec import decode_request, encode, to_builtins
from sbx.api.network_policy import NetworkConfig, NetworkPolicy
from sbx.api.node import Capabilities, CordonRequest, Defaults, Limits, NodeStatus, Resources
from sbx.api.sandboxes import CreateRequest, Sandbox, SandboxList
from sbx.gateway import keys
from sbx.gateway.audit import GatewayAudit
from sbx.gateway.capabilities import intersect_capabilities
from sbx.gateway.jobs.controller import JobOptions
from sbx.gateway.middlewares import install_cors, make_middlewares
from sbx.gateway.nodes import Registry
from sbx.gateway.routes import install
from sbx.gateway.server import Gateway, GatewayOptions
from sbx.gateway.state import MemberRecord, NodeDef, OrgRecord
from sbx.gateway.store.sqlite import SqliteStore

CAPABILITIES = Capabilities(
    api_version="v1",
    backend="gvisor",
    capabilities={"tunnel": True},
    limits=Limits(),
    network=NetworkConfig(),
)
#: What a create gets for what it omits on every stand-in.
DEFAULTS = Defaults(cpus=1, memory_mb=512, disk_mb=2048)


def node_answer(body: object, status: int = 200) -> web.Response:
    return web.Response(body=encode(body), status=status, content_type="application/json")


@dataclass
class StandIn:
    """A node stand-in: reports ``free_cpus`` and answers creates with ``create_status``."""

    name: str
    free_cpus: int
    create_status: int = 201
    capabilities: dict[str, bool] = field(default_factory=lambda: dict(CAPABILITIES.capabilities))
    creates: int = 0
    uploaded: int = -1
    cordoned: bool = False
    #: How many times it was asked for its status (each gateway poll).
    polls: int = 0
    sandboxes: list[Sandbox] = field(default_factory=list)
    requests: list[CreateRequest] = field(default_factory=list)
    server: TestServer | None = None

    def app(self) -> web.Application:
        def status() -> web.Response:
            caps = msgspec.structs.replace(CAPABILITIES, capabilities=self.capabilities)
            return node_answer(NodeStatus(
                name=self.name, version="test", capabilities=caps, capacity=Resources(8, 8192, 10000),
                free=Resources(self.free_cpus, 8192, 10000), running=0, pooled={}, images=[], labels={},
                cordoned=self.cordoned, defaults=DEFAULTS,
            ))  # fmt: skip

        async def node(request: web.Request) -> web.Response:
            self.polls += 1
            return status()

        async def cordon(request: web.Request) -> web.Response:
            self.cordoned = decode_request(await request.read(), CordonRequest).cordoned
            return status()

        async def create(request: web.Request) -> web.Response:
            self.creates += 1
            req = decode_request(await request.read(), CreateRequest)
            self.requests.append(req)
            if self.create_status != 201:
                code = {409: "conflict", 503: "unavailable"}[self.create_status]
                return node_answer({"error": {"code": code, "message": "not enough free capacity"}},
                                   status=self.create_status)  # fmt: skip
            wire = Sandbox(
                id=f"sbx_{self.name}_{self.creates:016x}", name=req.name or None, state="running",
                image="default", cpus=req.cpus or 1, memory_mb=req.memory_mb or 512, disk_mb=req.disk_mb or 2048,
                env_names=[], network=NetworkPolicy("none"), labels=req.labels or {}, idle_timeout_secs=600,
                snapshot_every_secs=0, snapshot_keep=0, created_at="2030-01-01T00:00:00Z",
            )  # fmt: skip
            self.sandboxes.append(wire)
            return node_answer(wire, status=201)

        async def listing(request: web.Request) -> web.Response:
            return node_answer(SandboxList(self.sandboxes))

        async def put_file(request: web.Request) -> web.Response:
            self.uploaded = len(await request.read())
            return web.Response(status=204)

        async def get_file(request: web.Request) -> web.Response:
            return web.Response(body=b"file bytes", content_type="application/octet-stream")

        async def echo_path(request: web.Request) -> web.Response:
            return web.json_response({"pid": request.match_info["pid"], "query": dict(request.query)})

        async def slow_run(request: web.Request) -> web.Response:
            await asyncio.sleep(30)
            return web.json_response({})

        app = web.Application(client_max_size=128 << 20)
        app.add_routes([
            web.get("/v1/node", node), web.post("/v1/node/cordon", cordon), web.post("/v1/sandboxes", create), web.get("/v1/sandboxes", listing),
            web.post("/v1/sandboxes/{id}/run", slow_run), web.put("/v1/sandboxes/{id}/files", put_file),
            web.get("/v1/sandboxes/{id}/processes/{pid}", echo_path), web.get("/v1/sandboxes/{id}/files", get_file),
        ])  # fmt: skip
        return app


#: Seconds a test waits for something the gateway does on its own (a poll, a request seen open): generous, so a
#: loaded machine never fails a test that would pass.
DEADLINE_SECS = 30.0


async def until(check: Callable[[], bool], what: str = "the condition") -> None:
    """Return once ``check()`` holds; fail after DEADLINE_SECS."""
    deadline = time.monotonic() + DEADLINE_SECS
    while not check():
        assert time.monotonic() < deadline, f"{what} did not come within {DEADLINE_SECS:g} s"
        await asyncio.sleep(0.01)


@dataclass
class Setup:
    client: TestClient  # type: ignore[type-arg]
    gateway: Gateway
    nodes: dict[str, StandIn]
    admin: str
    user: str
    user_key_id: str


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    stand_ins = {"n1": StandIn("n1", free_cpus=8, create_status=503), "n2": StandIn("n2", free_cpus=4)}
    for s in stand_ins.values():
        s.server = TestServer(s.app())
        await s.server.start_server()
    store = SqliteStore.open(tmp_path / "gw.db")
    admin_key, admin = keys.new_key("root", "", {"admin"})
    user_key, user = keys.new_key("alice", "acme", {"sandbox:read", "sandbox:create", "sandbox:delete"})
    store.add_key(admin_key)
    store.add_key(user_key)
    registry = Registry(poll_interval_secs=0.05, failures_unhealthy=3, lost_after_secs=0.3)
    nodes = [NodeDef(n, f"http://127.0.0.1:{s.server.port}", from_file=True) for n, s in stand_ins.items()]  # type: ignore[union-attr]
    gateway = Gateway(
        store,
        registry,
        GatewayAudit(tmp_path / "audit.jsonl"),
        GatewayOptions(file_nodes=nodes, jobs=JobOptions(tmp_path / "jobs")),
    )
    await gateway.start()
    # The first poll of a node may time out on a loaded machine (1 s): the tests start from both nodes known.
    await until(lambda: all(n.healthy and n.status is not None for n in registry.nodes.values()))
    app = web.Application(middlewares=make_middlewares(gateway))
    install_cors(app, gateway)
    install(app, gateway)
    client = TestClient(TestServer(app))
    await client.start_server()
    try:
        yield Setup(client, gateway, stand_ins, admin, user, user_key.id)
    finally:
        await client.close()
        await gateway.close()
        for s in stand_ins.values():
            assert s.server is not None
            await s.server.close()
        store.close()


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


#: The answer to a request ended by revocation before its node answered (spec: Revocation 1).
ENDED = {
    "error": {
        "code": "unauthorized",
        "message": "this request was ended because its API key was revoked or lost the scope it needs",
    }
}


async def waiting_run(
    setup: Setup, sandbox_id: str, headers: dict[str, str], open_requests: int = 1
) -> asyncio.Future[ClientResponse]:
    """A run the stand-in holds for 30 s, sent and seen open at the gateway (``open_requests`` open in all)."""
    run = asyncio.ensure_future(
        setup.client.post(f"/v1/sandboxes/{sandbox_id}/run", json={"argv": ["x"]}, headers=headers)
    )
    await until(lambda: len(setup.gateway.open) == open_requests, "the request seen open")
    return run


async def test_a_node_refusing_for_capacity_is_skipped(setup: Setup) -> None:
    resp = await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))
    assert resp.status == 201, await resp.text()
    created = await resp.json()
    assert created["id"].startswith("sbx_n2_")
    assert created["labels"] == {"gateway.owner": "alice", "gateway.tenant": "acme"}
    assert setup.nodes["n1"].creates == 1  # tried first (emptiest), refused, then n2
    assert setup.gateway.store.sandboxes[created["id"]].node == "n2"
    # What the gateway counted against the quota is what the node was told to give: its defaults, explicit.
    sent = setup.nodes["n2"].requests[0]
    assert (sent.cpus, sent.memory_mb, sent.disk_mb) == (1, 512, 2048)


async def test_every_node_refusing_is_503(setup: Setup) -> None:
    setup.nodes["n2"].create_status = 503
    resp = await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))
    body = await resp.json()
    assert resp.status == 503 and body["error"]["code"] == "unavailable"
    # Each node's own refusal is in the answer: what is short where.
    assert body["error"]["message"] == (
        "no node can take this now (any node: none answering with free capacity and not cordoned; "
        "n1: not enough free capacity; n2: not enough free capacity); try again later or ask for fewer resources"
    )
    assert setup.gateway.store.sandboxes == {}


async def test_a_node_409_on_create_is_relayed_not_retried(setup: Setup) -> None:
    # A node scopes names by gateway.owner, so its 409 is the caller's own clash: placing the sandbox on
    # another node would give the user two live sandboxes of one name.
    setup.nodes["n1"].create_status = 409
    resp = await setup.client.post("/v1/sandboxes", json={"name": "web"}, headers=bearer(setup.user))
    assert resp.status == 409
    assert await resp.json() == {
        "error": {"code": "conflict", "message": "not enough free capacity"}
    }  # as sent
    assert (setup.nodes["n1"].creates, setup.nodes["n2"].creates) == (1, 0)
    assert setup.gateway.store.sandboxes == {}


async def test_secret_env_goes_only_to_a_node_that_keeps_it_off_its_disk(setup: Setup) -> None:
    # n1 is the emptiest (tried first) but older: it would write secret environment into its sandbox record.
    setup.nodes["n2"].capabilities = {**CAPABILITIES.capabilities, "secret_env": True}
    await until(lambda: setup.gateway.registry.nodes["n2"].offers("secret_env"), "n2's new status")
    resp = await setup.client.post(
        "/v1/sandboxes", json={"secret_env": {"TOKEN": "v"}}, headers=bearer(setup.user)
    )
    assert resp.status == 201, await resp.text()
    assert (setup.nodes["n1"].creates, setup.nodes["n2"].creates) == (0, 1)
    assert setup.nodes["n2"].requests[0].secret_env == {"TOKEN": "v"}


async def test_secret_env_with_no_node_that_keeps_it_off_its_disk_is_503(setup: Setup) -> None:
    resp = await setup.client.post(
        "/v1/sandboxes", json={"secret_env": {"TOKEN": "v"}}, headers=bearer(setup.user)
    )
    assert (resp.status, await resp.json()) == (503, {"error": {"code": "unavailable", "message": (
        "no node can take secret environment now: n1, n2 cannot keep it off their disk (capability secret_env); "
        "upgrade sandboxd there")}})  # fmt: skip
    assert (setup.nodes["n1"].creates, setup.nodes["n2"].creates) == (0, 0)
    assert setup.gateway.store.sandboxes == {}


async def test_a_silent_node_goes_unhealthy_then_lost(setup: Setup) -> None:
    registry = setup.gateway.registry
    # Lost 3 s after the first failed poll: far more than the three failed polls (50 ms apart) to unhealthy take,
    # even on a loaded machine.
    registry.lost_after_secs = 3.0
    node = registry.nodes["n1"]
    assert node.healthy
    server = setup.nodes["n1"].server
    assert server is not None
    await server.close()
    await until(lambda: not node.healthy, "unhealthy")
    assert node.failures >= 3
    assert not node.is_lost(registry.lost_after_secs)
    await until(lambda: node.is_lost(registry.lost_after_secs), "lost")
    assert node.down_since is not None
    candidates = {c.name: c.taking_new for c in setup.gateway.registry.candidates()}
    assert candidates == {"n1": False, "n2": True}


async def test_revoking_a_key_ends_its_waiting_request_with_401(setup: Setup) -> None:
    created = await (await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))).json()
    run = await waiting_run(setup, created["id"], bearer(setup.user))
    deleted = await setup.client.delete(f"/v1/admin/keys/{setup.user_key_id}", headers=bearer(setup.admin))
    assert deleted.status == 204
    assert run.done() or len(setup.gateway.open) == 0  # ended before DELETE returned
    resp = await run
    assert (resp.status, await resp.json()) == (401, ENDED)
    again = await setup.client.get("/v1/sandboxes", headers=bearer(setup.user))
    assert (again.status, await again.json()) == (
        401,
        {"error": {"code": "unauthorized", "message": "unknown or revoked API key"}},
    )


def test_capabilities_are_the_intersection() -> None:
    a = Capabilities(
        api_version="v1",
        backend="gvisor",
        capabilities={"tunnel": True, "metrics": True, "images": True},
        limits=Limits(max_cpus=8, max_memory_mb=4096),
        network=NetworkConfig(NetworkPolicy("allowlist", ("a.com",)), "open", ("*.a.com", "b.com")),
    )
    b = Capabilities(
        api_version="v1", backend="gvisor", capabilities={"tunnel": True, "metrics": False},
        limits=Limits(max_cpus=4, max_memory_mb=8192), network=NetworkConfig(NetworkPolicy("none"), "allowlist", ("b.com",)),
    )  # fmt: skip
    merged = intersect_capabilities([a, b])
    # The WebSocket attach is the gateway's own (over each node's plain attach), whatever the nodes say.
    assert merged.capabilities == {
        "tunnel": True,
        "metrics": False,
        "images": False,
        "websocket_attach": True,
        "exposed_ports": False,
    }
    # Exposed ports are the gateway's own (--ports-domain), whatever a node says.
    a.capabilities["exposed_ports"] = True
    assert intersect_capabilities([a, b], exposed_ports=True).capabilities["exposed_ports"] is True
    assert intersect_capabilities([a], exposed_ports=False).capabilities["exposed_ports"] is False
    assert (merged.limits.max_cpus, merged.limits.max_memory_mb) == (4, 4096)
    assert to_builtins(merged.network) == {
        "default": {"mode": "none", "deny": []},
        "ceiling": "allowlist",
        "may_allow": ["b.com"],
    }
    assert merged.backend == "gvisor"


def test_audit_rotates_keeps_five_and_reads_since(tmp_path: Path) -> None:
    log = GatewayAudit(tmp_path / "gateway.jsonl", max_bytes=400, keep=5)
    for i in range(60):
        log.record(kind="api", type="api.request", route=f"/v1/x/{i}", status=200, body="never")  # type: ignore[arg-type]
    log.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["gateway.jsonl", *(f"gateway.jsonl.{n}" for n in range(1, 6))]
    assert all((tmp_path / n).stat().st_mode & 0o777 == 0o600 for n in names)
    assert all(os.path.getsize(tmp_path / n) <= 400 for n in names)
    text = "".join((tmp_path / n).read_text() for n in names)
    assert "never" not in text and "body" not in text
    entries, truncated = log.read(None, 1000)
    routes_read = [e["route"] for e in entries]
    assert (
        routes_read == sorted(routes_read, key=lambda r: int(r.rsplit("/", 1)[1]))
        and routes_read[-1] == "/v1/x/59"
    )
    assert not truncated
    first_two, more = log.read(None, 2)
    assert len(first_two) == 2 and more
    assert log.read(datetime.now(UTC) + timedelta(seconds=5), 10) == ([], False)
    assert json.loads((tmp_path / "gateway.jsonl").read_text().splitlines()[-1])["route"] == "/v1/x/59"


async def test_audit_in_a_loop_is_written_in_its_next_turn_and_still_rotates(tmp_path: Path) -> None:
    path = tmp_path / "gateway.jsonl"
    log = GatewayAudit(path, max_bytes=400, keep=5)
    for i in range(12):
        log.record(kind="api", type="api.request", route=f"/v1/x/{i}", status=200)
    assert not path.exists()  # queued: the answer goes out first
    await asyncio.sleep(0)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) > 1 and all(os.path.getsize(tmp_path / n) <= 400 for n in names)
    log.record(kind="api", type="api.request", route="/v1/x/12", status=200)
    entries, _ = await asyncio.to_thread(log.read, None, 1000)  # a read writes what is queued first
    assert [e["route"] for e in entries] == [f"/v1/x/{i}" for i in range(13)]
    log.record(kind="api", type="api.request", route="/v1/x/13", status=200)
    log.close()  # and so does a close
    assert json.loads(path.read_text().splitlines()[-1])["route"] == "/v1/x/13"


async def test_recheck_ends_a_request_whose_key_lost_its_scope(setup: Setup) -> None:
    created = await (await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))).json()
    run = await waiting_run(setup, created["id"], bearer(setup.user))
    await setup.gateway.recheck()
    assert len(setup.gateway.open) == 1  # still good: nothing ended
    store = setup.gateway.store
    key = store.keys[setup.user_key_id]
    # The state changed under the open request (as an offline edit would): the key lost sandbox:create.
    weaker = replace(key, scopes=frozenset({"sandbox:read"}))
    store.keys[key.id] = weaker
    store.keys_by_hash[key.secret_sha256] = weaker
    await setup.gateway.recheck()
    resp = await run
    assert (resp.status, await resp.json()) == (401, ENDED)
    assert len(setup.gateway.open) == 0


async def test_made_up_paths_do_not_grow_the_route_label(setup: Setup) -> None:
    for i in range(3):
        await setup.client.get(f"/v1/sandboxes/x/made-up-{i}", headers=bearer(setup.user))
        await setup.client.get(f"/v1/nothing-{i}/here", headers=bearer(setup.user))
    await setup.client.get("/v1/sandboxes/x/run", headers=bearer(setup.user))
    text = setup.gateway.metrics.render()[0].decode()
    assert "made-up" not in text and "nothing-" not in text
    assert 'route="unmatched"' in text
    # A known path with another method is no route either: 405, counted as unmatched too.
    assert 'route="/v1/sandboxes/{ref}/run"' not in text


async def test_cors_preflight(tmp_path: Path, setup: Setup) -> None:
    setup.gateway.options.cors_origins = frozenset({"https://console.example"})
    ok = await setup.client.options("/v1/sandboxes", headers={"Origin": "https://console.example"})
    assert ok.status == 204 and ok.headers["Access-Control-Allow-Origin"] == "https://console.example"
    assert "X-Sandbox-Org" in ok.headers["Access-Control-Allow-Headers"]
    denied = await setup.client.options("/v1/sandboxes", headers={"Origin": "https://evil.example"})
    assert denied.status == 403 and (await denied.json())["error"]["code"] == "forbidden_origin"
    error = await setup.client.get("/v1/sandboxes", headers={"Origin": "https://console.example"})
    assert error.status == 401 and error.headers["Access-Control-Allow-Origin"] == "https://console.example"
    # A streamed answer (a file relayed from the node) says it too: a browser reads nothing without it.
    created = await (await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))).json()
    streamed = await setup.client.get(
        f"/v1/sandboxes/{created['id']}/files?path=/tmp/x",
        headers={**bearer(setup.user), "Origin": "https://console.example"},
    )
    assert (streamed.status, await streamed.read()) == (200, b"file bytes")
    assert streamed.headers["Access-Control-Allow-Origin"] == "https://console.example"
    plain = await setup.client.get(
        f"/v1/sandboxes/{created['id']}/files?path=/tmp/x", headers=bearer(setup.user)
    )
    assert "Access-Control-Allow-Origin" not in plain.headers


async def test_file_uploads_are_streamed_and_capped(setup: Setup) -> None:
    created = await (await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))).json()
    path = f"/v1/sandboxes/{created['id']}/files?path=/tmp/x"
    ok = await setup.client.put(path, data=b"x" * (3 << 20), headers=bearer(setup.user))
    assert ok.status == 204 and setup.nodes["n2"].uploaded == 3 << 20
    setup.nodes["n2"].uploaded = -1
    too_big = await setup.client.put(path, data=b"x" * ((64 << 20) + 1), headers=bearer(setup.user))
    body = await too_big.json()
    assert too_big.status == 413 and body["error"]["code"] == "invalid_request"
    assert "over the 67108864-byte limit" in body["error"]["message"]
    assert setup.nodes["n2"].uploaded == -1  # the node got nothing


async def test_chunked_upload_over_the_cap_is_cut(setup: Setup) -> None:
    created = await (await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))).json()

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(65):
            yield b"x" * (1 << 20)

    resp = await setup.client.put(f"/v1/sandboxes/{created['id']}/files?path=/tmp/x", data=chunks(),
                                  headers=bearer(setup.user))  # fmt: skip
    assert resp.status == 413
    assert setup.nodes["n2"].uploaded == -1


async def test_removing_a_member_ends_their_requests_in_the_org_only(setup: Setup) -> None:
    store = setup.gateway.store
    store.add_org(OrgRecord("rocket", "2030-01-01T00:00:00Z", "alice", "acme"),
                  MemberRecord("rocket", "alice", "acme", "owner", "2030-01-01T00:00:00Z"))  # fmt: skip
    store.put_member(MemberRecord("rocket", "bob", "beta", "member", "2030-01-01T00:00:00Z"))
    bob_key, bob = keys.new_key("bob", "beta", {"sandbox:read", "sandbox:create"})
    store.add_key(bob_key)
    in_org = {**bearer(bob), "X-Sandbox-Org": "rocket"}
    org_sandbox = await (await setup.client.post("/v1/sandboxes", json={}, headers=in_org)).json()
    own_sandbox = await (await setup.client.post("/v1/sandboxes", json={}, headers=bearer(bob))).json()
    in_org_run = await waiting_run(setup, org_sandbox["id"], in_org)
    own_run = await waiting_run(setup, own_sandbox["id"], bearer(bob), open_requests=2)
    removed = await setup.client.delete("/v1/orgs/rocket/members/bob", headers=bearer(setup.user))
    assert removed.status == 204
    ended = await in_org_run
    assert (ended.status, await ended.json()) == (401, ENDED)
    assert not own_run.done() and len(setup.gateway.open) == 1  # their own tenant is untouched
    own_run.cancel()
    entries, _ = setup.gateway.audit.read(None, 100) if setup.gateway.audit else ([], False)
    assert [e["type"] for e in entries if e.get("kind") in ("org", "revocation")] == [
        "api.revoked",
        "org.member_removed",
    ]


async def test_audit_call_is_501_without_a_log(setup: Setup) -> None:
    setup.gateway.audit = None
    resp = await setup.client.get("/v1/admin/audit", headers=bearer(setup.admin))
    body = await resp.json()
    assert resp.status == 501 and body["error"] == {
        "code": "unsupported", "message": "this gateway keeps no audit log (started with --audit-log none)"}  # fmt: skip


@pytest.mark.parametrize(
    ("headers", "status", "message"),
    [
        ({"X-Sandbox-Org": "nowhere"}, 404, "no such organization"),
        (CIMultiDict([("X-Sandbox-Org", "a"), ("X-Sandbox-Org", "b")]), 400, "X-Sandbox-Org given more than once: send it once"),
    ],
    ids=["non-member", "twice"],
)  # fmt: skip
async def test_a_refused_organisation_header_is_audited(
    setup: Setup, headers: CIMultiDict[str] | dict[str, str], status: int, message: str
) -> None:
    """The spec asks for one audit line per authenticated request: a valid key refused by the organisation check
    is one (acting in its own tenant, as nothing else was granted)."""
    all_headers = CIMultiDict(headers)
    all_headers.update(bearer(setup.user))
    resp = await setup.client.get("/v1/sandboxes", headers=all_headers)
    assert (resp.status, (await resp.json())["error"]["message"]) == (status, message)
    audit = setup.gateway.audit
    assert audit is not None
    entries, _ = await asyncio.to_thread(audit.read, None, 1000)
    last = entries[-1]
    assert (last["type"], last["key_id"], last["user"], last["tenant"], last["status"], last["route"]) == (
        "api.request",
        setup.user_key_id,
        "alice",
        "acme",
        status,
        "/v1/sandboxes",
    )
    assert "org" not in last  # the organisation asked for was not granted


# Admin endpoint rules (spec: Admin endpoints): each bad call answers its code and message and changes nothing.
ADMIN_ERRORS: list[tuple[str, str, str, Any, int, str, str]] = [
    ("not an admin key", "GET", "/v1/admin/keys", None, 403, "refused", "this API key lacks the scope admin: ask an admin for a key with admin"),
    ("key: bad user", "POST", "/v1/admin/keys", {"user": "", "scopes": ["sandbox:read"]}, 400, "invalid_request", "user must be 1 to 64 characters of letters, digits and . _ @ -, starting with a letter or digit"),
    ("key: bad tenant", "POST", "/v1/admin/keys", {"user": "x", "tenant": "Bad!", "scopes": ["sandbox:read"]}, 400, "invalid_request", "tenant must be a-z 0-9 and -, start with a letter, not end with - and not contain --"),
    ("key: unknown scope", "POST", "/v1/admin/keys", {"user": "x", "scopes": ["root"]}, 400, "invalid_request", "unknown scope 'root': use admin, org:create, sandbox:create, sandbox:delete, sandbox:read, sandbox:ssh, secrets:write"),
    ("key: no scopes", "POST", "/v1/admin/keys", {"user": "x", "scopes": []}, 400, "invalid_request", "scopes must be a non-empty array of: admin, org:create, sandbox:create, sandbox:delete, sandbox:read, sandbox:ssh, secrets:write"),
    ("key: unknown field", "POST", "/v1/admin/keys", {"user": "x", "scopes": ["admin"], "secret": "s"}, 400, "invalid_request", "unknown field 'secret'; the fields are user, tenant, scopes"),
    ("key: unknown id", "DELETE", "/v1/admin/keys/key_nope", None, 404, "not_found", "no API key 'key_nope'"),
    ("node: bad name", "POST", "/v1/admin/nodes", {"name": "Bad Name", "endpoint": "unix:///tmp/x.sock"}, 400, "invalid_request", "node name must be 1 to 63 of a-z 0-9 and -, starting with a letter or digit"),
    ("node: no endpoint", "POST", "/v1/admin/nodes", {"name": "x"}, 400, "invalid_request", "endpoint is required: https://HOST:PORT, unix:///PATH or http://127.0.0.1:PORT"),
    ("node: http off loopback", "POST", "/v1/admin/nodes", {"name": "x", "endpoint": "http://10.1.2.3:80"}, 400, "invalid_request", "node endpoint 'http://10.1.2.3:80': plain http is allowed on loopback only (the token would travel in clear); use https"),
    ("node: bad scheme", "POST", "/v1/admin/nodes", {"name": "x", "endpoint": "ftp://localhost"}, 400, "invalid_request", "node endpoint 'ftp://localhost' is not accepted: use https://HOST:PORT, unix:///PATH, or http://HOST:PORT on loopback"),
    ("node: file outside the files dir", "POST", "/v1/admin/nodes", {"name": "x", "endpoint": "unix:///tmp/x.sock", "token_file": "/etc/passwd"}, 403, "refused", "token_file '/etc/passwd' is outside the node files directory: nodes added through the API may name files only under the gateway's --node-files-dir"),
    ("node: named in the node file", "POST", "/v1/admin/nodes", {"name": "n1", "endpoint": "unix:///tmp/x.sock"}, 409, "conflict", "node 'n1' is defined in the node file: edit the file and restart"),
    ("remove: unknown node", "DELETE", "/v1/admin/nodes/zz", None, 404, "not_found", "no node 'zz': see GET /v1/admin/nodes"),
    ("remove: node-file node", "DELETE", "/v1/admin/nodes/n1", None, 409, "conflict", "node 'n1' is defined in the node file: edit the file and restart to remove it"),
    ("cordon: unknown node", "POST", "/v1/admin/nodes/zz/cordon", {"cordoned": True}, 404, "not_found", "no node 'zz': see GET /v1/admin/nodes"),
    ("cordon: not a bool", "POST", "/v1/admin/nodes/n1/cordon", {"cordoned": "yes"}, 400, "invalid_request", "cordoned: expected a boolean, got a string"),
    ("drain: unknown node", "POST", "/v1/admin/nodes/zz/drain", {"terminate": True}, 404, "not_found", "no node 'zz': see GET /v1/admin/nodes"),
    ("drain: not a bool", "POST", "/v1/admin/nodes/n1/drain", {"terminate": "yes"}, 400, "invalid_request", "terminate: expected a boolean, got a string"),
    ("audit: limit 0", "GET", "/v1/admin/audit?limit=0", None, 400, "invalid_request", "limit must be a whole number from 1 to 1000"),
    ("audit: limit 1001", "GET", "/v1/admin/audit?limit=1001", None, 400, "invalid_request", "limit must be a whole number from 1 to 1000"),
    ("audit: since not a time", "GET", "/v1/admin/audit?since=yesterday", None, 400, "invalid_request", "since must be an RFC 3339 time, e.g. 2024-05-01T12:00:00Z"),
]  # fmt: skip


def _admin_state(gateway: Gateway) -> tuple[Any, ...]:
    store = gateway.store
    return dict(store.keys), dict(store.nodes), dict(store.node_flags), sorted(gateway.registry.nodes)


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code", "message"),
    [c[1:] for c in ADMIN_ERRORS],
    ids=[c[0] for c in ADMIN_ERRORS],
)
async def test_admin_errors_change_nothing(
    setup: Setup, method: str, path: str, body: Any, status: int, code: str, message: str
) -> None:
    before = _admin_state(setup.gateway)
    key = setup.user if path == "/v1/admin/keys" and method == "GET" else setup.admin  # the one non-admin row
    resp = await setup.client.request(method, path, json=body, headers=bearer(key))
    assert (resp.status, await resp.json()) == (status, {"error": {"code": code, "message": message}})
    assert _admin_state(setup.gateway) == before


async def test_cordon_and_drain_of_a_silent_node_change_nothing(setup: Setup) -> None:
    server = setup.nodes["n2"].server
    assert server is not None
    await server.close()
    node = setup.gateway.registry.nodes["n2"]
    await until(lambda: not node.healthy, "unhealthy")
    before = _admin_state(setup.gateway)
    cordon = await setup.client.post(
        "/v1/admin/nodes/n2/cordon", json={"cordoned": True}, headers=bearer(setup.admin)
    )
    error = (await cordon.json())["error"]
    assert (cordon.status, error["code"]) == (502, "internal")
    assert error["message"].startswith("node n2 did not answer: cannot connect")
    drain = await setup.client.post(
        "/v1/admin/nodes/n2/drain", json={"terminate": True}, headers=bearer(setup.admin)
    )
    assert (drain.status, await drain.json()) == (
        503,
        {"error": {"code": "unavailable", "message": "node 'n2' is not answering: it cannot be drained now"}},
    )
    assert _admin_state(setup.gateway) == before


async def test_a_poll_during_an_uncordon_does_not_cordon_the_node_again(setup: Setup) -> None:
    # The race CI once met: an uncordon told the node, a poll then read it uncordoned while the store still
    # wanted the cordon, and restored it; nothing lifts a cordon the gateway does not want, so the node took no
    # sandbox again. Here the store write of the uncordon waits for a poll (1 s at most) to force that order.
    gateway, n2 = setup.gateway, setup.nodes["n2"]
    real_write = gateway.write

    async def write_after_a_poll(fn: Callable[..., Any], *args: Any) -> Any:
        polls = n2.polls
        deadline = time.monotonic() + 1.0
        while n2.polls == polls and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return await real_write(fn, *args)

    async def cordon(wanted: bool) -> None:
        resp = await setup.client.post(
            "/v1/admin/nodes/n2/cordon", json={"cordoned": wanted}, headers=bearer(setup.admin)
        )
        assert resp.status == 200, await resp.text()
        assert n2.cordoned is wanted

    await cordon(True)
    gateway.write = write_after_a_poll  # type: ignore[method-assign]
    await cordon(False)
    gateway.write = real_write  # type: ignore[method-assign]
    polls = n2.polls
    await until(lambda: n2.polls >= polls + 3, "three polls")
    assert n2.cordoned is False
    node = gateway.registry.nodes["n2"]
    assert node.status is not None and node.status.cordoned is False
    assert gateway.wanted_cordon("n2") is False
    created = await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))
    assert created.status == 201, await created.text()


# Organisation rules (spec: Organisations, Organisation header), with alice/acme owning rocket, bob/beta a
# member of it, carol/acme not one, and --max-orgs-per-user 1. Each answers code and message, changes nothing.
ORG_ERRORS: list[tuple[str, str, str, str, Any, list[str], int, str, str]] = [
    ("name: upper case", "alice", "POST", "/v1/orgs", {"name": "Upper"}, [], 400, "invalid_request", "organisation name must be a-z 0-9 and -, start with a letter, not end with - and not contain --"),
    ("name: reserved", "alice", "POST", "/v1/orgs", {"name": "default"}, [], 400, "invalid_request", "organisation name 'default' is reserved"),
    ("name: ends with -", "alice", "POST", "/v1/orgs", {"name": "ab-"}, [], 400, "invalid_request", "organisation name must be a-z 0-9 and -, start with a letter, not end with - and not contain --"),
    ("name: an organisation", "alice", "POST", "/v1/orgs", {"name": "rocket"}, [], 409, "conflict", "'rocket' is already an organisation or a tenant in use: pick another name"),
    ("name: a tenant in use", "alice", "POST", "/v1/orgs", {"name": "beta"}, [], 409, "conflict", "'beta' is already an organisation or a tenant in use: pick another name"),
    ("past --max-orgs-per-user", "alice", "POST", "/v1/orgs", {"name": "third"}, [], 403, "refused", "you already made or own 1 organisations, the most this gateway allows (--max-orgs-per-user 1)"),
    ("members: not a member", "carol", "GET", "/v1/orgs/rocket/members", None, [], 404, "not_found", "no such organization"),
    ("members: no such org", "carol", "GET", "/v1/orgs/ghost/members", None, [], 404, "not_found", "no such organization"),
    ("members: own tenant", "alice", "GET", "/v1/orgs/acme/members", None, [], 404, "not_found", "no such organization"),
    ("add: not an owner", "bob", "POST", "/v1/orgs/rocket/members", {"user": "carol"}, [], 403, "refused", "only an owner of rocket may change its members"),
    ("add: bad role", "alice", "POST", "/v1/orgs/rocket/members", {"user": "carol", "role": "boss"}, [], 400, "invalid_request", "role must be owner or member"),
    ("add: name from another tenant", "alice", "POST", "/v1/orgs/rocket/members", {"user": "bob", "tenant": "acme"}, [], 409, "conflict", "a member named 'bob' from another tenant is already in rocket"),
    ("demote the last owner", "alice", "POST", "/v1/orgs/rocket/members", {"user": "alice", "role": "member"}, [], 409, "conflict", "alice is the last owner of rocket: make another member owner first"),
    ("remove the last owner", "alice", "DELETE", "/v1/orgs/rocket/members/alice", None, [], 409, "conflict", "alice is the last owner of rocket: make another member owner first"),
    ("remove: no such member", "alice", "DELETE", "/v1/orgs/rocket/members/zed", None, [], 404, "not_found", "no member 'zed' in rocket"),
    ("remove: other tenant", "alice", "DELETE", "/v1/orgs/rocket/members/bob?tenant=acme", None, [], 404, "not_found", "no member 'bob' in rocket"),
    ("header: not a member", "carol", "GET", "/v1/whoami", None, ["rocket"], 404, "not_found", "no such organization"),
    ("header: no such org", "carol", "GET", "/v1/whoami", None, ["ghost"], 404, "not_found", "no such organization"),
    ("header: twice", "alice", "GET", "/v1/whoami", None, ["rocket", "rocket"], 400, "invalid_request", "X-Sandbox-Org given more than once: send it once"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("who", "method", "path", "body", "orgs", "status", "code", "message"),
    [c[1:] for c in ORG_ERRORS],
    ids=[c[0] for c in ORG_ERRORS],
)
async def test_org_errors_change_nothing(
    setup: Setup, who: str, method: str, path: str, body: Any, orgs: list[str], status: int, code: str,
    message: str,
) -> None:  # fmt: skip
    store = setup.gateway.store
    setup.gateway.options.max_orgs_per_user = 1
    store.add_org(OrgRecord("rocket", "2030-01-01T00:00:00Z", "alice", "acme"),
                  MemberRecord("rocket", "alice", "acme", "owner", "2030-01-01T00:00:00Z"))  # fmt: skip
    store.put_member(MemberRecord("rocket", "bob", "beta", "member", "2030-01-01T00:00:00Z"))
    secrets = {}
    for user, tenant, scopes in (("alice", "acme", {"org:create"}), ("bob", "beta", {"sandbox:read"}),
                                 ("carol", "acme", {"sandbox:read"})):  # fmt: skip
        key, secrets[user] = keys.new_key(user, tenant, scopes)
        store.add_key(key)
    before = (dict(store.orgs), dict(store.members), dict(store.keys))
    headers = CIMultiDict([*bearer(secrets[who]).items(), *(("X-Sandbox-Org", o) for o in orgs)])
    resp = await setup.client.request(method, path, json=body, headers=headers)
    assert (resp.status, await resp.json()) == (status, {"error": {"code": code, "message": message}})
    assert (dict(store.orgs), dict(store.members), dict(store.keys)) == before


# Every route through the gateway with keys of each scope (spec: Authentication, Gateway 4; issue: a path no
# scope rule matches was open to any valid key). A key lacking the route's scope is 403 before anything is looked
# up; one holding it is never refused for scope; a path no route serves is 404 once the key is good.
def _concrete(path: str) -> str:
    return path.replace("{ref}", "nobody").replace("{pid}", "1").replace("{port}", "8000").replace("{n}", "1").replace("{id}", "x_1") \
        .replace("{name}", "nothing").replace("{user}", "nobody").replace("{tenant}", "acme")  # fmt: skip


async def test_every_route_with_each_scope(setup: Setup) -> None:
    from sbx.api.endpoints import served_by
    from sbx.gateway.keys import SCOPES, has_scope

    secrets: dict[str, str] = {}
    for scope in sorted(SCOPES):
        key, secret = keys.new_key(f"u-{scope.replace(':', '-')}", "", {scope})
        setup.gateway.store.add_key(key)
        secrets[scope] = secret
    checked = 0
    for ep in served_by("gateway"):
        if ep.scope is None:
            continue
        for scope, secret in secrets.items():
            resp = await setup.client.request(
                ep.method, _concrete(ep.path), headers=bearer(secret), data=b"{}"
            )
            body = await resp.json()
            missing = [s for s in ep.scope if not has_scope(frozenset({scope}), s)]
            if missing:
                assert (resp.status, body["error"]["code"]) == (403, "refused"), (ep.key, scope, body)
                assert body["error"]["message"].startswith(f"this API key lacks the scope {missing[0]}")
            else:
                assert not (resp.status == 403 and "lacks the scope" in body["error"]["message"]), (
                    ep.key,
                    scope,
                )
            checked += 1
    assert checked > 300
    for method, path in [
        ("GET", "/v1/nothing"),
        ("POST", "/v1/sandboxes/x/made-up"),
        ("GET", "/v2/sandboxes"),
    ]:
        resp = await setup.client.request(method, path, headers=bearer(secrets["sandbox:read"]))
        assert (resp.status, (await resp.json())["error"]["code"]) == (404, "not_found")
        resp = await setup.client.request(method, path)
        assert resp.status == 401  # the key first, even for a path no route serves


@pytest.mark.parametrize(
    ("pid", "decoded"),
    [("0%3Fclose%3D1", "0?close=1"), ("0%2F..%2F..%2Fevents", "0/../../events"), ("1%23x", "1#x")],
    ids=["encoded-question-mark", "encoded-slashes", "encoded-hash"],
)
async def test_a_relayed_path_stays_as_the_client_encoded_it(setup: Setup, pid: str, decoded: str) -> None:
    """Found by fuzzing: a segment relayed as it decodes turned ``processes/0%3F...`` into another route of the
    node. The node gets the path as sent: the same route, the same segment, the same query."""
    created = await (await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))).json()
    resp = await setup.client.get(
        f"/v1/sandboxes/{created['id']}/processes/{pid}?a=%26b", headers=bearer(setup.user)
    )
    assert resp.status == 200, await resp.text()
    assert await resp.json() == {"pid": decoded, "query": {"a": "&b"}}


async def test_quotas_are_listed_with_usage_and_set_while_serving(setup: Setup) -> None:
    created = await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))
    assert created.status == 201
    listed = await (await setup.client.get("/v1/admin/quotas", headers=bearer(setup.admin))).json()
    assert listed == {"quotas": [{"tenant": "acme", "cpus": None, "memory_mb": None, "sandboxes": None,
                                  "used": {"sandboxes": 1, "cpus": 1, "memory_mb": 512}}]}  # fmt: skip
    resp = await setup.client.put("/v1/admin/quotas/acme", json={"sandboxes": 1}, headers=bearer(setup.admin))
    assert resp.status == 200
    assert (await resp.json())["sandboxes"] == 1
    over = await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))
    assert over.status == 403 and (await over.json())["error"]["code"] == "refused"
    # All amounts null removes the quota; the state file keeps what was set.
    assert (
        await setup.client.put("/v1/admin/quotas/acme", json={}, headers=bearer(setup.admin))
    ).status == 200
    assert "acme" not in setup.gateway.store.quotas
    again = await setup.client.post("/v1/sandboxes", json={}, headers=bearer(setup.user))
    assert again.status == 201


@pytest.mark.parametrize(
    ("tenant", "body", "message"),
    [
        ("acme", {"cpus": -1}, "cpus must be 0 to 1000000000 (null: no limit), not -1"),
        ("acme", {"sandboxes": 10**12}, "sandboxes must be 0 to 1000000000 (null: no limit), not 1000000000000"),
        ("Not_A_Tenant", {"cpus": 1},
         "tenant must be a-z 0-9 and -, start with a letter, not end with - and not contain --"),
        ("acme", {"gpus": 1}, None),
    ],
)  # fmt: skip
async def test_a_bad_quota_is_400_and_changes_nothing(
    setup: Setup, tenant: str, body: dict[str, int], message: str | None
) -> None:
    resp = await setup.client.put(f"/v1/admin/quotas/{tenant}", json=body, headers=bearer(setup.admin))
    answer = await resp.json()
    assert resp.status == 400 and answer["error"]["code"] == "invalid_request"
    if message is not None:
        assert answer["error"]["message"] == message
    assert setup.gateway.store.quotas == {}
    refused = await setup.client.put("/v1/admin/quotas/acme", json={"cpus": 1}, headers=bearer(setup.user))
    assert refused.status == 403 and setup.gateway.store.quotas == {}
