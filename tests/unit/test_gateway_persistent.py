"""Persistent sandboxes through the gateway (issue 32) against stand-in nodes that keep them as sandboxd does:
capability intersection, placement only on nodes offering ``persistent``, ``POST .../stop`` relayed, the quota
counting a sleeping one as a sandbox but not its cpus and memory, the check before a request wakes one (403 and
nothing asked of the node), the records following the node (reconcile), and a drain suspending them."""

from __future__ import annotations

import base64
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sbx.api.codec import decode_request, encode
from sbx.api.frames import WEBSOCKET_PROTOCOL
from sbx.api.network_policy import NetworkConfig, NetworkPolicy
from sbx.api.node import PERSISTENT, Capabilities, CordonRequest, Defaults, Limits, NodeStatus, Resources
from sbx.api.processes import RunResult
from sbx.api.sandboxes import CreateRequest, Sandbox, SandboxList
from sbx.gateway import keys
from sbx.gateway.audit import GatewayAudit
from sbx.gateway.capabilities import intersect_capabilities
from sbx.gateway.jobs.controller import JobOptions
from sbx.gateway.middlewares import make_middlewares
from sbx.gateway.nodes import Registry
from sbx.gateway.persistent import WAKING_ROUTES
from sbx.gateway.routes import install
from sbx.gateway.server import Gateway, GatewayOptions
from sbx.gateway.state import NodeDef, Quota
from sbx.gateway.store.sqlite import SqliteStore

#: Polls of ``/v1/node`` are the gateway's own; every other call a stand-in gets is recorded.
POLL = ("GET", "/v1/node")


def answer(body: object, status: int = 200) -> web.Response:
    return web.Response(body=encode(body), status=status, content_type="application/json")


def error(status: int, code: str, message: str) -> web.Response:
    return answer({"error": {"code": code, "message": message}}, status)


@dataclass
class Node:
    """A node stand-in keeping persistent sandboxes as docs/node-api.md says sandboxd does: a request that needs
    the guest wakes a sleeping one (503 when ``room`` is False, nothing changed), stop only for persistent ones."""

    name: str
    offers_persistent: bool = True
    room: bool = True
    sandboxes: dict[str, Sandbox] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    server: TestServer | None = None

    def capabilities(self) -> Capabilities:
        flags = {"suspend": True, PERSISTENT: True} if self.offers_persistent else {"suspend": True}
        return Capabilities(api_version="v1", backend="gvisor", capabilities=flags, limits=Limits(),
                            network=NetworkConfig())  # fmt: skip

    def _wake(self, sid: str) -> web.Response | None:
        """What a request needing the guest does first; a refusal to answer instead, or None."""
        sb = self.sandboxes[sid]
        if sb.state in ("suspended", "stopped"):
            if not sb.persistent:
                return error(409, "conflict", f"sandbox {sid} is {sb.state}: resume it first")
            if not self.room:
                return error(503, "unavailable", "no room on this node for its cpus and memory")
            self.sandboxes[sid] = msgspec.structs.replace(sb, state="running", stopped_reason=msgspec.UNSET)
        return None

    def app(self) -> web.Application:
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            if (request.method, request.path) != POLL:
                self.calls.append((request.method, re.sub(r"^/v1/sandboxes/[^/]+", "", request.path)))
            response: web.StreamResponse = await handler(request)
            return response

        async def status(request: web.Request) -> web.Response:
            return answer(NodeStatus(
                name=self.name, version="test", capabilities=self.capabilities(), capacity=Resources(8, 8192, 10000),
                free=Resources(8, 8192, 10000), running=0, pooled={}, images=[], labels={}, cordoned=False,
                defaults=Defaults(cpus=1, memory_mb=512, disk_mb=1024),
            ))  # fmt: skip

        async def cordon(request: web.Request) -> web.Response:
            decode_request(await request.read(), CordonRequest)
            return await status(request)

        async def create(request: web.Request) -> web.Response:
            req = decode_request(await request.read(), CreateRequest)
            sid = f"sbx_{self.name}_{len(self.sandboxes):016x}"
            self.sandboxes[sid] = Sandbox(
                id=sid, name=req.name or None, state="running", image="default", cpus=req.cpus or 1,
                memory_mb=req.memory_mb or 512, disk_mb=req.disk_mb or 1024, env_names=[],
                network=NetworkPolicy("none"), labels=req.labels or {}, idle_timeout_secs=600,
                snapshot_every_secs=0, snapshot_keep=0, created_at="2030-01-01T00:00:00Z",
                persistent=req.persistent is True,
            )  # fmt: skip
            return answer(self.sandboxes[sid], 201)

        async def listing(request: web.Request) -> web.Response:
            return answer(SandboxList(list(self.sandboxes.values())))

        async def one(request: web.Request) -> web.Response:
            return answer(self.sandboxes[request.match_info["id"]])

        async def delete(request: web.Request) -> web.Response:
            sid = request.match_info["id"]
            self.sandboxes[sid] = msgspec.structs.replace(self.sandboxes[sid], state="terminated")
            return web.Response(status=204)

        async def run(request: web.Request) -> web.Response:
            refused = self._wake(request.match_info["id"])
            return refused or answer(RunResult(0, b"hi\n", b"", False, False))

        async def patch(request: web.Request) -> web.Response:
            sid = request.match_info["id"]
            refused = self._wake(sid) if "network" in msgspec.json.decode(await request.read()) else None
            return refused or answer(self.sandboxes[sid])

        async def suspend(request: web.Request) -> web.Response:
            sid = request.match_info["id"]
            if self.sandboxes[sid].state != "running":
                return error(409, "conflict", "not running")
            self.sandboxes[sid] = msgspec.structs.replace(self.sandboxes[sid], state="suspended")
            return answer(self.sandboxes[sid])

        async def resume(request: web.Request) -> web.Response:
            sid = request.match_info["id"]
            if self.sandboxes[sid].state == "running":
                return error(409, "conflict", "already running")
            return self._wake(sid) or answer(self.sandboxes[sid])

        async def stop(request: web.Request) -> web.Response:
            sid = request.match_info["id"]
            sb = self.sandboxes[sid]
            if not sb.persistent:
                return error(409, "conflict", f"sandbox {sid} is not persistent: only a persistent one stops")
            self.sandboxes[sid] = msgspec.structs.replace(sb, state="stopped", stopped_reason="request")
            return answer(self.sandboxes[sid])

        app = web.Application(middlewares=[web.middleware(record)])
        sbx = "/v1/sandboxes/{id}"
        app.add_routes([
            web.get("/v1/node", status), web.post("/v1/node/cordon", cordon), web.post("/v1/sandboxes", create),
            web.get("/v1/sandboxes", listing), web.get(sbx, one), web.delete(sbx, delete), web.patch(sbx, patch),
            web.post(sbx + "/run", run), web.post(sbx + "/suspend", suspend), web.post(sbx + "/resume", resume),
            web.post(sbx + "/stop", stop),
        ])  # fmt: skip
        return app

    def state(self, sid: str) -> str:
        return self.sandboxes[sid].state


def made(node: Node) -> bool:
    """Whether ``node`` was asked to make a sandbox (its listings are the gateway's reconcile)."""
    return ("POST", "/v1/sandboxes") in node.calls


@dataclass
class World:
    client: TestClient  # type: ignore[type-arg]
    gateway: Gateway
    nodes: dict[str, Node]
    admin: str
    alice: str
    bob: str

    async def call(self, method: str, path: str, key: str, **kwargs: Any) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {key}", **kwargs.pop("headers", {})}
        resp = await self.client.request(method, path, headers=headers, **kwargs)
        body = await resp.read()
        return resp.status, (
            msgspec.json.decode(body) if body and resp.content_type.endswith("json") else body
        )

    async def persistent(self, name: str = "keep", cpus: int = 2, memory_mb: int = 1024) -> str:
        status, body = await self.call("POST", "/v1/sandboxes", self.alice, json={
            "name": name, "persistent": True, "cpus": cpus, "memory_mb": memory_mb,
        })  # fmt: skip
        assert status == 201, body
        assert body["persistent"] is True
        return str(body["id"])

    def node_of(self, sid: str) -> Node:
        return self.nodes[self.gateway.store.sandboxes[sid].node]


async def start_world(tmp_path: Path, nodes: list[Node]) -> tuple[World, Any]:
    for node in nodes:
        node.server = TestServer(node.app())
        await node.server.start_server()
    store = SqliteStore.open(tmp_path / "gw.db")
    admin_key, admin = keys.new_key("root", "", {"admin"})
    alice_key, alice = keys.new_key("alice", "acme", {"sandbox:read", "sandbox:create", "sandbox:delete"})
    bob_key, bob = keys.new_key("bob", "acme", {"sandbox:read", "sandbox:create", "sandbox:delete"})
    for key in (admin_key, alice_key, bob_key):
        store.add_key(key)
    registry = Registry(poll_interval_secs=0.05, failures_unhealthy=3, lost_after_secs=30)
    defs = [NodeDef(n.name, f"http://127.0.0.1:{n.server.port}", from_file=True) for n in nodes]  # type: ignore[union-attr]
    gateway = Gateway(store, registry, GatewayAudit(tmp_path / "audit.jsonl"),
                      GatewayOptions(file_nodes=defs, jobs=JobOptions(tmp_path / "jobs")))  # fmt: skip
    await gateway.start()
    for node in registry.nodes.values():
        await registry.poll(node)
    assert all(n.healthy and n.status is not None for n in registry.nodes.values())
    app = web.Application(middlewares=make_middlewares(gateway))
    install(app, gateway)
    client = TestClient(TestServer(app))
    await client.start_server()

    async def close() -> None:
        await client.close()
        await gateway.close()
        for node in nodes:
            assert node.server is not None
            await node.server.close()
        store.close()

    return World(client, gateway, {n.name: n for n in nodes}, admin, alice, bob), close


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w, close = await start_world(tmp_path, [Node("n1")])
    try:
        yield w
    finally:
        await close()


# -- capability and create ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "offered"),
    [([True, True], True), ([True, False], False), ([False, True], False), ([True], True), ([False], False)],
)
def test_persistent_is_offered_only_when_every_node_has_it(flags: list[bool], offered: bool) -> None:
    caps = [Node(f"n{i}", offers_persistent=f).capabilities() for i, f in enumerate(flags)]
    assert intersect_capabilities(caps).capabilities.get(PERSISTENT, False) is offered


async def test_the_gateways_capabilities_lack_persistent_while_one_node_does(tmp_path: Path) -> None:
    w, close = await start_world(tmp_path, [Node("n1"), Node("n2", offers_persistent=False)])
    try:
        status, body = await w.call("GET", "/v1/capabilities", w.alice)
        assert status == 200 and body["capabilities"][PERSISTENT] is False
        w.nodes["n2"].offers_persistent = True
        await w.gateway.registry.poll(w.gateway.registry.nodes["n2"])
        status, body = await w.call("GET", "/v1/capabilities", w.alice)
        assert status == 200 and body["capabilities"][PERSISTENT] is True
    finally:
        await close()


async def test_a_persistent_create_without_a_name_is_400_and_makes_nothing(world: World) -> None:
    status, body = await world.call("POST", "/v1/sandboxes", world.alice, json={"persistent": True})
    assert (status, body) == (400, {"error": {"code": "invalid_request", "message": (
        "persistent: a persistent sandbox needs a name (it is found again by it after every sleep); add name")}})  # fmt: skip
    assert not made(world.nodes["n1"]) and world.gateway.store.sandboxes == {}


async def test_a_persistent_sandbox_goes_only_to_a_node_that_offers_it(tmp_path: Path) -> None:
    # n1 sorts first (the same load, the name breaks the tie) but cannot keep a sandbox asleep.
    w, close = await start_world(tmp_path, [Node("n1", offers_persistent=False), Node("n2")])
    try:
        sid = await w.persistent()
        assert w.gateway.store.sandboxes[sid].node == "n2"
        assert ("POST", "/v1/sandboxes") not in w.nodes["n1"].calls
        record = w.gateway.store.sandboxes[sid]
        assert (record.persistent, record.asleep) == (True, False)
        # A plain sandbox still goes anywhere.
        status, body = await w.call("POST", "/v1/sandboxes", w.alice, json={})
        assert status == 201 and body["id"].startswith("sbx_n1_")
    finally:
        await close()


async def test_a_persistent_create_with_no_node_offering_it_is_503_naming_it(tmp_path: Path) -> None:
    old = [Node("n1", offers_persistent=False), Node("n2", offers_persistent=False)]
    w, close = await start_world(tmp_path, old)
    try:
        req = {"name": "keep", "persistent": True}
        status, body = await w.call("POST", "/v1/sandboxes", w.alice, json=req)
        assert (status, body) == (503, {"error": {"code": "unavailable", "message": (
            "no node can take a persistent sandbox now: n1, n2 lack the capability persistent; upgrade sandboxd "
            "there, or create it without persistent")}})  # fmt: skip
        assert not made(w.nodes["n1"]) and not made(w.nodes["n2"]) and w.gateway.store.sandboxes == {}
    finally:
        await close()


# -- stop, and the quota ---------------------------------------------------------------------------------


async def test_stop_is_relayed_and_the_quota_then_counts_only_the_sandbox(world: World) -> None:
    sid = await world.persistent(cpus=2, memory_mb=1024)
    used = {"sandboxes": 1, "cpus": 2, "memory_mb": 1024}
    world.gateway.store.set_quota("acme", Quota(max_cpus=8))
    assert (await world.call("GET", "/v1/admin/quotas", world.admin))[1]["quotas"][0]["used"] == used
    status, body = await world.call("POST", "/v1/sandboxes/keep/stop", world.alice)
    assert status == 200 and (body["state"], body["stopped_reason"]) == ("stopped", "request")
    assert world.gateway.store.sandboxes[sid].asleep
    used = {"sandboxes": 1, "cpus": 0, "memory_mb": 0}
    assert (await world.call("GET", "/v1/admin/quotas", world.admin))[1]["quotas"][0]["used"] == used
    # Again: idempotent, as the node answers.
    assert (await world.call("POST", f"/v1/sandboxes/{sid}/stop", world.alice))[0] == 200


async def test_stop_of_a_plain_sandbox_is_the_nodes_409(world: World) -> None:
    status, body = await world.call("POST", "/v1/sandboxes", world.alice, json={"name": "plain"})
    assert status == 201
    status, body = await world.call("POST", "/v1/sandboxes/plain/stop", world.alice)
    assert status == 409 and body["error"]["code"] == "conflict"
    assert body["error"]["message"].endswith("is not persistent: only a persistent one stops")
    assert not world.gateway.store.sandboxes[next(iter(world.gateway.store.sandboxes))].asleep


async def test_a_sleeping_sandbox_counts_for_the_sandbox_quota_not_for_cpus(world: World) -> None:
    await world.persistent("a", cpus=4)
    assert (await world.call("POST", "/v1/sandboxes/a/stop", world.alice))[0] == 200
    world.gateway.store.set_quota("acme", Quota(max_cpus=4, max_sandboxes=2))
    # Its 4 cpus are free for another...
    status, body = await world.call("POST", "/v1/sandboxes", world.alice, json={"cpus": 4})
    assert status == 201, body
    # ...but it still holds one of the two sandboxes.
    status, body = await world.call("POST", "/v1/sandboxes", world.alice, json={})
    assert status == 403
    assert body["error"]["message"].startswith("over the quota of tenant acme: 3 sandboxes of 2")


# -- waking: the quota check, and who may ----------------------------------------------------------------


#: What each waking call sends besides its method and path; ``WAKING`` holds one case per waking route.
# fmt: off
_SENT: dict[tuple[str, str], dict[str, Any]] = {
    ("POST", "/run"): {"json": {"argv": ["true"]}},
    ("POST", "/processes"): {"json": {"argv": ["true"]}},
    ("POST", "/processes/1/signal"): {"json": {"signal": "TERM"}},
    ("POST", "/processes/1/stdin"): {"data": b"x"},
    ("GET", "/processes/1/attach/websocket"): {"headers": {
        "Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Protocol": WEBSOCKET_PROTOCOL,
        "Sec-WebSocket-Key": base64.b64encode(b"0123456789abcdef").decode(),
    }},
    ("GET", "/files"): {"params": {"path": "/tmp/x"}},
    ("PUT", "/files"): {"params": {"path": "/tmp/x"}, "data": b"x"},
    ("DELETE", "/files"): {"params": {"path": "/tmp/x"}},
    ("GET", "/dirs"): {"params": {"path": "/tmp"}},
    ("GET", "/tunnel"): {"params": {"port": "80"}},
    ("POST", "/snapshots"): {"json": {"kind": "disk"}},
    ("PUT", "/snapshot-schedule"): {"json": {"every_secs": 60}},
    ("POST", "/resume"): {},
    ("PATCH", ""): {"json": {"network": {"mode": "none"}}},
}
# fmt: on


def _waking_calls() -> list[tuple[str, str, dict[str, Any]]]:
    """(method, path under the sandbox, what it sends) of every route that wakes: the table's, resume, and a
    PATCH of the network."""
    tails = [
        (m, p.removeprefix("/v1/sandboxes/{ref}").replace("{pid}", "1")) for m, p in sorted(WAKING_ROUTES)
    ]
    tails += [("POST", "/resume"), ("PATCH", "")]
    return [(m, t, _SENT.get((m, t), {})) for m, t in tails]


WAKING = _waking_calls()


@pytest.mark.parametrize(("method", "tail", "kwargs"), WAKING, ids=[f"{m} {t or '/'}" for m, t, _ in WAKING])
@pytest.mark.parametrize("sleep", ["stop", "suspend"])
async def test_a_wake_over_the_quota_is_403_and_asks_the_node_nothing(
    world: World, method: str, tail: str, kwargs: dict[str, Any], sleep: str
) -> None:
    sid = await world.persistent("keep", cpus=2, memory_mb=1024)
    assert (await world.call("POST", f"/v1/sandboxes/keep/{sleep}", world.alice))[0] == 200
    # Its cpus went to another sandbox meanwhile: 3 of 4 in use.
    world.gateway.store.set_quota("acme", Quota(max_cpus=4, max_memory_mb=2048))
    other = {"cpus": 3, "memory_mb": 512}
    assert (await world.call("POST", "/v1/sandboxes", world.alice, json=other))[0] == 201
    node = world.nodes["n1"]
    node.calls.clear()
    status, body = await world.call(method, f"/v1/sandboxes/keep{tail}", world.alice, **kwargs)
    assert (status, body) == (403, {"error": {"code": "refused", "message": (
        f"waking sandbox {sid} (2 cpus, 1024 memory_mb) would take tenant acme over its quota: 5 cpus of 4; stop "
        "other persistent sandboxes of the tenant, delete some, or ask an admin for a larger quota")}})  # fmt: skip
    # The node was asked its state, nothing else; the sandbox sleeps on, still not counted.
    assert node.calls == [("GET", "")]
    assert node.state(sid) == ("stopped" if sleep == "stop" else "suspended")
    assert world.gateway.store.sandboxes[sid].asleep


async def test_a_wake_names_memory_when_memory_is_short(world: World) -> None:
    sid = await world.persistent("keep", cpus=1, memory_mb=2048)
    assert (await world.call("POST", "/v1/sandboxes/keep/stop", world.alice))[0] == 200
    world.gateway.store.set_quota("acme", Quota(max_memory_mb=1024))
    status, body = await world.call("POST", "/v1/sandboxes/keep/run", world.alice, json={"argv": ["true"]})
    assert status == 403 and f"waking sandbox {sid} (1 cpus, 2048 memory_mb)" in body["error"]["message"]
    assert ": 2048 memory_mb of 1024;" in body["error"]["message"]


async def test_a_wake_within_the_quota_resumes_first_then_passes_the_request_on(world: World) -> None:
    sid = await world.persistent("keep", cpus=2)
    assert (await world.call("POST", "/v1/sandboxes/keep/stop", world.alice))[0] == 200
    world.gateway.store.set_quota("acme", Quota(max_cpus=2))
    node = world.nodes["n1"]
    node.calls.clear()
    status, body = await world.call("POST", "/v1/sandboxes/keep/run", world.alice, json={"argv": ["echo"]})
    assert status == 200 and base64.b64decode(body["stdout"]) == b"hi\n"
    assert node.calls == [("GET", ""), ("POST", "/resume"), ("POST", "/run")]
    assert not world.gateway.store.sandboxes[sid].asleep
    # Awake, it counts again: another sandbox's cpu is over.
    status, body = await world.call("POST", "/v1/sandboxes", world.alice, json={"cpus": 1})
    assert status == 403 and "3 cpus of 2" in body["error"]["message"]


async def test_resume_of_a_sleeping_sandbox_is_answered_by_the_wake(world: World) -> None:
    sid = await world.persistent("keep")
    assert (await world.call("POST", "/v1/sandboxes/keep/stop", world.alice))[0] == 200
    node = world.nodes["n1"]
    node.calls.clear()
    status, body = await world.call("POST", "/v1/sandboxes/keep/resume", world.alice)
    assert status == 200 and body["state"] == "running"
    assert node.calls == [("GET", ""), ("POST", "/resume")]  # resumed once, not twice
    assert not world.gateway.store.sandboxes[sid].asleep
    # Running: relayed to the node, which says so.
    status, body = await world.call("POST", "/v1/sandboxes/keep/resume", world.alice)
    assert status == 409


async def test_a_wake_the_node_has_no_room_for_is_its_503_and_changes_nothing(world: World) -> None:
    sid = await world.persistent("keep")
    assert (await world.call("POST", "/v1/sandboxes/keep/stop", world.alice))[0] == 200
    world.nodes["n1"].room = False
    status, body = await world.call("POST", "/v1/sandboxes/keep/run", world.alice, json={"argv": ["true"]})
    assert (status, body) == (
        503,
        {"error": {"code": "unavailable", "message": "no room on this node for its cpus and memory"}},
    )
    assert world.nodes["n1"].state(sid) == "stopped" and world.gateway.store.sandboxes[sid].asleep


@pytest.mark.parametrize(
    ("method", "tail"),
    [("GET", ""), ("GET", "/processes"), ("GET", "/events"), ("GET", "/metrics"), ("PATCH", "")],
)
async def test_reads_and_other_changes_never_wake(world: World, method: str, tail: str) -> None:
    sid = await world.persistent("keep", cpus=2)
    assert (await world.call("POST", "/v1/sandboxes/keep/stop", world.alice))[0] == 200
    world.gateway.store.set_quota("acme", Quota(max_cpus=1))  # a wake would be refused
    node = world.nodes["n1"]
    node.calls.clear()
    kwargs = {"json": {"labels": {"a": "b"}}} if method == "PATCH" else {}
    status, _ = await world.call(method, f"/v1/sandboxes/keep{tail}", world.alice, **kwargs)
    assert status != 403
    assert ("POST", "/resume") not in node.calls and node.calls[-1] == (method, tail)
    assert world.gateway.store.sandboxes[sid].asleep


@pytest.mark.parametrize(("method", "tail", "kwargs"), WAKING, ids=[f"{m} {t or '/'}" for m, t, _ in WAKING])
async def test_another_users_wake_is_404_and_asks_the_node_nothing(
    world: World, method: str, tail: str, kwargs: dict[str, Any]
) -> None:
    sid = await world.persistent("keep")
    assert (await world.call("POST", "/v1/sandboxes/keep/stop", world.alice))[0] == 200
    node = world.nodes["n1"]
    node.calls.clear()
    for ref in (sid, "keep"):
        status, body = await world.call(method, f"/v1/sandboxes/{ref}{tail}", world.bob, **kwargs)
        missing = {"error": {"code": "not_found", "message": f"no sandbox {ref!r} among yours"}}
        assert (status, body) == (404, missing)
    status, body = await world.call("POST", f"/v1/sandboxes/{sid}/stop", world.bob)
    assert status == 404
    assert node.calls == [] and node.state(sid) == "stopped"


# -- the records follow the node -------------------------------------------------------------------------


async def test_reconcile_learns_an_idle_suspension_and_a_wake(world: World) -> None:
    sid = await world.persistent("keep", cpus=2)
    node = world.nodes["n1"]
    gw_node = world.gateway.registry.nodes["n1"]
    node.sandboxes[sid] = msgspec.structs.replace(node.sandboxes[sid], state="suspended")  # its idle timeout
    assert not world.gateway.store.sandboxes[sid].asleep  # not yet known: counted, which only refuses early
    await world.gateway.reconcile(gw_node)
    assert world.gateway.store.sandboxes[sid].asleep
    assert world.gateway.tenant_usage("acme") == (1, 0, 0)
    node.sandboxes[sid] = msgspec.structs.replace(node.sandboxes[sid], state="running")  # woken (SSH)
    await world.gateway.reconcile(gw_node)
    assert not world.gateway.store.sandboxes[sid].asleep
    assert world.gateway.tenant_usage("acme") == (1, 2, 1024)


async def test_a_record_asleep_for_a_running_sandbox_is_not_checked_as_a_wake(world: World) -> None:
    sid = await world.persistent("keep", cpus=2)
    assert (await world.call("POST", "/v1/sandboxes/keep/stop", world.alice))[0] == 200
    node = world.nodes["n1"]
    # Woken past the gateway (an SSH login).
    node.sandboxes[sid] = msgspec.structs.replace(node.sandboxes[sid], state="running")
    world.gateway.store.set_quota("acme", Quota(max_cpus=1))
    node.calls.clear()
    status, _ = await world.call("POST", "/v1/sandboxes/keep/run", world.alice, json={"argv": ["true"]})
    assert status == 200 and node.calls == [("GET", ""), ("POST", "/run")]
    assert not world.gateway.store.sandboxes[sid].asleep


# -- drain -------------------------------------------------------------------------------------------------


async def test_a_drain_suspends_running_persistent_sandboxes_and_they_do_not_remain(world: World) -> None:
    keep = await world.persistent("keep")
    asleep = await world.persistent("asleep")
    assert (await world.call("POST", "/v1/sandboxes/asleep/stop", world.alice))[0] == 200
    status, plain = await world.call("POST", "/v1/sandboxes", world.alice, json={})
    assert status == 201
    status, body = await world.call("POST", "/v1/admin/nodes/n1/drain", world.admin, json={})
    assert (status, body) == (200, {"node": "n1", "cordoned": True, "remaining": 1, "terminated": [],
                                    "suspended": [keep]})  # fmt: skip
    node = world.nodes["n1"]
    states = (node.state(keep), node.state(asleep), node.state(plain["id"]))
    assert states == ("suspended", "stopped", "running")
    assert world.gateway.store.sandboxes[keep].asleep
    # Again: nothing more to suspend.
    status, body = await world.call("POST", "/v1/admin/nodes/n1/drain", world.admin, json={})
    assert (body["remaining"], body["suspended"]) == (1, [])


async def test_a_drain_with_terminate_terminates_persistent_sandboxes_too(world: World) -> None:
    keep = await world.persistent("keep")
    asleep = await world.persistent("asleep")
    assert (await world.call("POST", "/v1/sandboxes/asleep/stop", world.alice))[0] == 200
    status, body = await world.call("POST", "/v1/admin/nodes/n1/drain", world.admin, json={"terminate": True})
    assert status == 200 and (body["remaining"], body["suspended"]) == (0, [])
    assert sorted(body["terminated"]) == sorted([keep, asleep])
    assert {world.nodes["n1"].state(s) for s in (keep, asleep)} == {"terminated"}
