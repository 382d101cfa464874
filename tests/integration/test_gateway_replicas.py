"""Two real sandbox-gateway replicas on one PostgreSQL database (a private cluster) in front of one real sandboxd,
with clients switching between them: a write acknowledged by one is seen by the next request on the other (keys,
sandboxes, cordon, quotas, orgs and members; and, case by case, in the very next answer of every read endpoint that
shows what was written: listings and views of secrets, keys, orgs and members, quotas, sandboxes, volumes,
services, jobs, nodes and SSH keys), and a revocation made on one cuts what the key holds open on the other (a
WebSocket attach, a waiting run) within the spec's 2 s. The propagation of a revocation is measured and printed
(docs/ha.md has the figures)."""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from pg_cluster import PgCluster
from replicas_harness import DOMAIN, FAST_HEALTH, SERVE_ID, Load, shown, traffic
from sandboxd_harness import Sandboxd, free_port
from ws_attach import WsAttach

from sbx.api import frames
from sbx.gateway.secrets import new_key_file
from sbx.gateway.server import Gateway
from sbx.gateway.store.postgres import LOCK_POOL_SIZE, LOCK_POOL_WAIT_SECS, NAME_LOCK_CLASS

ALL = ("sandbox:read", "sandbox:create", "sandbox:delete")
#: How soon a follower must stop routing to a replica whose sandbox was ended on its node (docs/ha.md: the
#: leader's check interval, a second here, plus the propagation; generous for a loaded machine).
REPLICA_DOWN_BOUND_SECS = 10.0
#: The spec's bound for a revocation to end what the key holds open, on every replica.
REVOCATION_BOUND_SECS = 2.0


class Pair:
    def __init__(self, a: GatewayProcess, b: GatewayProcess, node: Sandboxd, admin: str, url: str) -> None:
        self.a, self.b, self.node, self.admin, self.url = a, b, node, admin, url

    def base(self, gw: GatewayProcess) -> str:
        return f"http://127.0.0.1:{gw.port}"

    def new_key(
        self, on: GatewayProcess, user: str, *scopes: str, tenant: str | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"user": user, "scopes": list(scopes)}
        if tenant is not None:
            body["tenant"] = tenant
        made = on.request("POST", "/v1/admin/keys", body, key=self.admin)
        assert made.status == 201, made.body
        return made.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def pair(pg_cluster: PgCluster) -> Iterator[Pair]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxgw-ha-", dir="/var/tmp"))
    for d in ("n1", "a", "b"):
        (workdir / d).mkdir()
    node = Sandboxd(workdir / "n1", args=["--node-id", "r"]).start()
    url = pg_cluster.create_database()
    env = pg_cluster.env()
    metrics = {name: free_port() for name in ("a", "b")}
    # One secrets key and an SSH server each: the secrets' and SSH keys' endpoints are served.
    key_file = workdir / "secrets.key"
    new_key_file(key_file)
    a, b = (
        GatewayProcess(workdir / name, [("n1", node)], [*FAST_ARGS, "--metrics-listen", f"127.0.0.1:{port}",
                                                        "--services-domain", DOMAIN, "--secrets-key-file",
                                                        str(key_file), "--ssh-listen", f"127.0.0.1:{free_port()}"],
                       database=url, database_env=env)
        for name, port in metrics.items()
    )  # fmt: skip
    a.metrics_port, b.metrics_port = metrics["a"], metrics["b"]  # type: ignore[attr-defined]
    admin = a.create_key("root", "admin")
    try:
        a.start()
        b.start()
        yield Pair(a, b, node, admin, url)
    finally:
        a.stop()
        b.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_write_on_one_replica_is_seen_by_the_next_request_on_the_other(pair: Pair) -> None:
    a, b = pair.a, pair.b
    # Keys: made on one, used at once on the other (both ways, several times: never a lucky race).
    for maker, user in ((a, b), (b, a)) * 3:
        key = pair.new_key(maker, "carol", *ALL)
        assert user.request("GET", "/v1/whoami", key=key["secret"]).json()["user"] == "carol"
    alice = pair.new_key(a, "alice", *ALL, tenant="acme")["secret"]

    # A sandbox made on A: got, run, listed and deleted on B, each the next request after the create.
    made = a.create(alice, name="from-a")
    got = b.request("GET", f"/v1/sandboxes/{made['id']}", key=alice)
    assert got.status == 200 and got.json()["id"] == made["id"], got.body
    made2 = a.create(alice, name="listed")
    assert made2["id"] in [s["id"] for s in b.request("GET", "/v1/sandboxes", key=alice).json()["sandboxes"]]
    assert b.request("GET", "/v1/sandboxes/listed", key=alice).json()["id"] == made2["id"]
    run = b.request("POST", f"/v1/sandboxes/{made['id']}/run", {"argv": ["true"]}, key=alice)
    assert run.status == 200 and run.json()["exit_code"] == 0, run.body
    for s in (made, made2):
        assert b.request("DELETE", f"/v1/sandboxes/{s['id']}", key=alice).status in (200, 202, 204)
    wait_for(lambda: a.request("GET", "/v1/sandboxes", key=alice).json()["sandboxes"] == [], 60)

    # Cordon on A: B's view of the node follows (and so its placement: a create on B is refused).
    assert a.request("POST", "/v1/admin/nodes/n1/cordon", {"cordoned": True}, key=pair.admin).status == 200
    started = time.monotonic()

    def b_sees_cordon(wanted: bool) -> bool:
        nodes = b.request("GET", "/v1/admin/nodes", key=pair.admin).json()["nodes"]
        return [n["cordoned"] for n in nodes if n["name"] == "n1"] == [wanted]

    wait_for(lambda: b_sees_cordon(True), 10)
    print(f"cordon on A seen on B after {time.monotonic() - started:.3f} s")
    assert time.monotonic() - started < REVOCATION_BOUND_SECS
    refused = b.request("POST", "/v1/sandboxes", {}, key=alice)
    assert refused.status == 503, refused.body
    assert a.request("POST", "/v1/admin/nodes/n1/cordon", {"cordoned": False}, key=pair.admin).status == 200
    wait_for(lambda: b_sees_cordon(False), 10)

    # A quota set on B holds on A (once A has it: within the bound).
    assert b.request("PUT", "/v1/admin/quotas/acme", {"sandboxes": 0}, key=pair.admin).status == 200
    started = time.monotonic()

    def a_quota() -> list[int]:
        quotas = a.request("GET", "/v1/admin/quotas", key=pair.admin).json()["quotas"]
        return [q["sandboxes"] for q in quotas if q["tenant"] == "acme"]

    wait_for(lambda: a_quota() == [0], 10, 0.01)
    assert time.monotonic() - started < REVOCATION_BOUND_SECS
    refused = a.request("POST", "/v1/sandboxes", {}, key=alice)
    assert (refused.status, refused.json()["error"]["code"]) == (403, "refused"), refused.body
    assert b.request("PUT", "/v1/admin/quotas/acme", {}, key=pair.admin).status == 200
    wait_for(lambda: a_quota() == [], 10, 0.01)

    # A job and a service made on one replica are found by the next request on the other (the caught-up rule).
    for maker, reader in ((a, b), (b, a)):
        made_job = maker.request("POST", "/v1/jobs", {"command": ["true"]}, key=alice)
        assert made_job.status == 201, made_job.body
        job_id = made_job.json()["id"]
        got = reader.request("GET", f"/v1/jobs/{job_id}", key=alice)
        assert got.status == 200 and got.json()["id"] == job_id, got.body
        made = maker.request("POST", "/v1/services", {"name": "seen", "command": SERVE, "port": 8080,
                                                      "replicas": 1}, key=alice)  # fmt: skip
        assert made.status == 201, made.body
        got = reader.request("GET", "/v1/services/seen", key=alice)
        assert got.status == 200 and got.json()["created_at"] == made.json()["created_at"], got.body
        # Its replica made by the leader (a delete cutting a create short leaves the sandbox to the sweeper, on
        # one gateway as on several), then deleted through the other replica: the leader ends it.
        leader = leader_of(pair)[0]
        wait_for(
            lambda g=leader: len(g.request("GET", "/v1/services/seen", key=alice).json()["replicas"]) == 1, 60
        )
        assert reader.request("DELETE", "/v1/services/seen", key=alice).status == 204
        wait_for(lambda m=maker: m.request("GET", "/v1/services/seen", key=alice).status == 404, 10)
        wait_for(lambda r=reader, j=job_id: r.request("GET", f"/v1/jobs/{j}", key=alice).json()["state"]
                 == "succeeded", 60)  # fmt: skip
    wait_for(lambda: service_sandboxes(pair) == [], 60)


#: Rounds of each read-your-writes case, each made both ways (written on A and read on B, then the other way).
RYW_ROUNDS = 10
#: Everything a tenant's key of these cases may do.
RYW_SCOPES = (*ALL, "secrets:write", "org:create", "sandbox:ssh")


@dataclass
class Ryw:
    """One round of a read-your-writes case: writes go to ``w``, the read right after each to ``r``; ``key`` is a
    tenant's key (tenant ``ryw``), ``admin`` the admin's, ``n`` a number of this round (for fresh names)."""

    pair: Pair
    w: GatewayProcess
    r: GatewayProcess
    key: str
    admin: str
    n: str

    def ok(self, gw: GatewayProcess, method: str, path: str, body: Any = None, admin: bool = False) -> Any:
        resp = gw.request(method, path, body, key=self.admin if admin else self.key)
        assert resp.status < 300, (method, path, resp.status, resp.body)
        return resp.json() if resp.body else None

    def write(self, method: str, path: str, body: Any = None, admin: bool = False) -> Any:
        return self.ok(self.w, method, path, body, admin)

    def read(self, path: str, admin: bool = False) -> Any:
        return self.ok(self.r, "GET", path, admin=admin)


def ryw_secrets(c: Ryw) -> None:
    name = f"TOKEN_{c.n.upper()}"
    c.write("PUT", f"/v1/secrets/{name}", {"value": "s3cret"})
    assert name in [s["name"] for s in c.read("/v1/secrets")["secrets"]]
    c.write("DELETE", f"/v1/secrets/{name}")
    assert name not in [s["name"] for s in c.read("/v1/secrets")["secrets"]]


def ryw_keys(c: Ryw) -> None:
    made = c.write("POST", "/v1/admin/keys", {"user": f"k{c.n}", "scopes": list(ALL)}, admin=True)
    assert made["id"] in [k["id"] for k in c.read("/v1/admin/keys", admin=True)["keys"]]
    c.write("DELETE", f"/v1/admin/keys/{made['id']}", admin=True)
    [listed] = [k for k in c.read("/v1/admin/keys", admin=True)["keys"] if k["id"] == made["id"]]
    assert "revoked" in listed, listed
    # ... and the revoked key is refused by the next request on the other replica.
    assert c.r.request("GET", "/v1/whoami", key=made["secret"]).status == 401


def ryw_orgs_and_members(c: Ryw) -> None:
    # A user of its own each round (a user makes 10 organisations at most), its key made on the writer too.
    owner = c.write("POST", "/v1/admin/keys", {"user": f"o{c.n}", "tenant": "ryw", "scopes": ["org:create"]},
                    admin=True)["secret"]  # fmt: skip
    o = Ryw(c.pair, c.w, c.r, owner, c.admin, c.n)
    org = f"org-ryw-{c.n}"
    o.write("POST", "/v1/orgs", {"name": org})
    assert org in [x["name"] for x in o.read("/v1/orgs")["orgs"]]
    o.write("POST", f"/v1/orgs/{org}/members", {"user": "mo", "tenant": "motenant"})
    assert "mo" in [m["user"] for m in o.read(f"/v1/orgs/{org}/members")["members"]]
    o.write("DELETE", f"/v1/orgs/{org}/members/mo")
    assert "mo" not in [m["user"] for m in o.read(f"/v1/orgs/{org}/members")["members"]]


def ryw_quotas(c: Ryw) -> None:
    tenant = f"quota-ryw-{c.n}"
    c.write("PUT", f"/v1/admin/quotas/{tenant}", {"sandboxes": 7}, admin=True)
    quotas = c.read("/v1/admin/quotas", admin=True)["quotas"]
    assert [q["sandboxes"] for q in quotas if q["tenant"] == tenant] == [7]
    c.write("PUT", f"/v1/admin/quotas/{tenant}", {}, admin=True)
    assert tenant not in [q["tenant"] for q in c.read("/v1/admin/quotas", admin=True)["quotas"]]


def ryw_sandbox_rename_and_labels(c: Ryw) -> None:
    made = c.write("POST", "/v1/sandboxes", {"name": f"before-{c.n}", "memory_mb": 128})
    try:
        assert c.read(f"/v1/sandboxes/before-{c.n}")["id"] == made["id"]
        c.write("PATCH", f"/v1/sandboxes/{made['id']}", {"name": f"after-{c.n}", "labels": {"ryw": c.n}})
        # The old name is free on the other replica at once, the new one is there, and the labels with it.
        gone = c.r.request("GET", f"/v1/sandboxes/before-{c.n}", key=c.key)
        assert gone.status == 404, gone.body
        got = c.read(f"/v1/sandboxes/after-{c.n}")
        assert (got["id"], got["labels"].get("ryw")) == (made["id"], c.n)
        listed = c.read(f"/v1/sandboxes?label=ryw={c.n}")["sandboxes"]
        assert [s["id"] for s in listed] == [made["id"]]
    finally:
        c.write("DELETE", f"/v1/sandboxes/{made['id']}")


def ryw_volumes(c: Ryw) -> None:
    name = f"vol-ryw-{c.n}"
    c.write("POST", "/v1/volumes", {"name": name, "size_mb": 16})
    assert name in [v["name"] for v in c.read("/v1/volumes")["volumes"]]
    c.write("DELETE", f"/v1/volumes/{name}")
    assert name not in [v["name"] for v in c.read("/v1/volumes")["volumes"]]


def ryw_services(c: Ryw) -> None:
    name = f"svc-ryw-{c.n}"
    spec = {"name": name, "command": SERVE, "port": 8080, "replicas": 0}
    made = c.write("POST", "/v1/services", spec)
    assert name in [s["spec"]["name"] for s in c.read("/v1/services")["services"]]
    # Changed (a new revision) on one, shown as changed by the other: a service it knew already.
    changed = c.write("PUT", f"/v1/services/{name}", {**spec, "command": [*SERVE, "--changed"]})
    assert changed["revision"] == made["revision"] + 1
    got = c.read(f"/v1/services/{name}")
    assert (got["revision"], got["spec"]["command"]) == (changed["revision"], [*SERVE, "--changed"])
    listed = [s for s in c.read("/v1/services")["services"] if s["spec"]["name"] == name]
    assert [s["revision"] for s in listed] == [changed["revision"]]
    c.write("DELETE", f"/v1/services/{name}")
    assert c.r.request("GET", f"/v1/services/{name}", key=c.key).status == 404
    assert name not in [s["spec"]["name"] for s in c.read("/v1/services")["services"]]


def ryw_jobs(c: Ryw) -> None:
    made = c.write("POST", "/v1/jobs", {"command": ["sleep", "600"]})
    assert made["id"] in [j["id"] for j in c.read("/v1/jobs")["jobs"]]
    # Cancelled on one (answered once its runs stopped): the other shows it cancelled, in its view and listing.
    cancelled = c.write("DELETE", f"/v1/jobs/{made['id']}")
    assert cancelled["state"] == "cancelled", cancelled
    assert c.read(f"/v1/jobs/{made['id']}")["state"] == "cancelled"
    [listed] = [j for j in c.read("/v1/jobs")["jobs"] if j["id"] == made["id"]]
    assert listed["state"] == "cancelled"
    # A cancel that cut the leader's create of the run's sandbox short leaves that sandbox to the jobs' sweeper
    # (every minute, docs/jobs.md): end it now, so the node's capacity is there for the next tests.
    for s in c.pair.node.request("GET", "/v1/sandboxes").json()["sandboxes"]:
        if s.get("labels", {}).get("gateway.job") == made["id"] and s["state"] != "terminated":
            c.pair.node.request("DELETE", f"/v1/sandboxes/{s['id']}")


def ryw_nodes(c: Ryw) -> None:
    def shown() -> dict[str, Any]:
        return {n["name"]: n for n in c.read("/v1/admin/nodes", admin=True)["nodes"]}

    # A node that does not answer (its socket is not there): added, listed; removed, not listed.
    extra = f"extra-{c.n}"
    c.write("POST", "/v1/admin/nodes", {"name": extra, "endpoint": f"unix:///nonexistent/{extra}.sock"},
            admin=True)  # fmt: skip
    assert extra in shown()
    c.write("DELETE", f"/v1/admin/nodes/{extra}", admin=True)
    assert extra not in shown()
    c.write("POST", "/v1/admin/nodes/n1/cordon", {"cordoned": True}, admin=True)
    try:
        assert shown()["n1"]["cordoned"] is True
    finally:
        c.write("POST", "/v1/admin/nodes/n1/cordon", {"cordoned": False}, admin=True)
    assert shown()["n1"]["cordoned"] is False


def ryw_ssh_keys(c: Ryw) -> None:
    line = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.OpenSSH, PublicFormat.OpenSSH)
    made = c.write("POST", "/v1/ssh-keys", {"key": line.decode() + f" ryw-{c.n}"})
    assert made["id"] in [k["id"] for k in c.read("/v1/ssh-keys")["keys"]]
    c.write("DELETE", f"/v1/ssh-keys/{made['id']}")
    assert made["id"] not in [k["id"] for k in c.read("/v1/ssh-keys")["keys"]]


RYW_CASES = [ryw_secrets, ryw_keys, ryw_orgs_and_members, ryw_quotas, ryw_sandbox_rename_and_labels, ryw_volumes,
             ryw_services, ryw_jobs, ryw_nodes, ryw_ssh_keys]  # fmt: skip


@pytest.fixture(scope="module")
def ryw_key(pair: Pair) -> str:
    secret: str = pair.new_key(pair.a, "rita", *RYW_SCOPES, tenant="ryw")["secret"]
    wait_for(lambda: pair.b.request("GET", "/v1/whoami", key=secret).status == 200, 10)
    return secret


@pytest.mark.parametrize("case", RYW_CASES, ids=[c.__name__.removeprefix("ryw_") for c in RYW_CASES])
def test_a_write_on_one_replica_is_in_the_next_answer_of_the_other(
    pair: Pair, ryw_key: str, case: Any
) -> None:
    """Read-your-writes across replicas for every read, not only for misses: each write acknowledged by one
    replica, then at once the read on the other that must show it (docs/ha.md, "A write acknowledged by one
    replica is seen by the next request on any other"). Without the catch-up before every read the other replica
    answers from memory that has not had the change yet (a few milliseconds behind)."""
    for i in range(RYW_ROUNDS):
        for w, r in ((pair.a, pair.b), (pair.b, pair.a)):
            n = f"{i}{'a' if w is pair.a else 'b'}{time.monotonic_ns() % 10**8}"
            case(Ryw(pair, w, r, ryw_key, pair.admin, n))


def test_a_revocation_on_one_replica_is_seen_on_the_other_within_the_bound(pair: Pair) -> None:
    """Revoke keys on A; B refuses each within the bound (its next read, which catches up first: the delay printed
    is that read's time; what a key holds open follows the propagation itself, the test below)."""
    delays: list[float] = []
    for _ in range(10):
        key = pair.new_key(pair.a, "dave", *ALL)
        assert pair.b.request("GET", "/v1/whoami", key=key["secret"]).status == 200
        assert pair.a.request("DELETE", f"/v1/admin/keys/{key['id']}", key=pair.admin).status == 204
        answered = time.monotonic()
        wait_for(lambda k=key: pair.b.request("GET", "/v1/whoami", key=k["secret"]).status == 401, 10, 0.005)
        delays.append(time.monotonic() - answered)
    print(f"revocation on A refused on B after: median {statistics.median(delays) * 1000:.1f} ms, "
          f"max {max(delays) * 1000:.1f} ms")  # fmt: skip
    assert max(delays) < REVOCATION_BOUND_SECS


async def test_a_revocation_on_one_replica_cuts_an_attach_and_a_waiting_run_on_the_other(pair: Pair) -> None:
    a, b = pair.a, pair.b
    # The audit entries of this test: those since a second before it (the module's earlier tests made more than
    # the 1000 one read answers).
    since = (datetime.now(UTC) - timedelta(seconds=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    doomed = await asyncio.to_thread(pair.new_key, a, "erin", *ALL)
    secret = doomed["secret"]
    made = await asyncio.to_thread(b.create, secret)
    try:
        resp = await asyncio.to_thread(
            b.request, "POST", f"/v1/sandboxes/{made['id']}/processes", {"argv": ["cat"]}, key=secret
        )
        assert resp.status == 201, resp.body
        pid = resp.json()["pid"]
        run_result: dict[str, Any] = {}

        def waiting_run() -> None:
            run_result["r"] = b.request(
                "POST", f"/v1/sandboxes/{made['id']}/run", {"argv": ["sleep", "60"]}, key=secret
            )
            run_result["at"] = time.monotonic()

        runner = threading.Thread(target=waiting_run, daemon=True)
        path = f"/v1/sandboxes/{made['id']}/processes/{pid}/attach/websocket"
        async with await WsAttach.connect(pair.base(b), path, token=secret) as client:
            await client.send((frames.STDIN, b"ping\n"))
            await client.read(until=b"ping\n")
            runner.start()
            await asyncio.sleep(1.0)  # the run is waiting on the node
            revoked = await asyncio.to_thread(
                a.request, "DELETE", f"/v1/admin/keys/{doomed['id']}", key=pair.admin
            )
            assert revoked.status == 204
            answered = time.monotonic()
            seen = await client.read(timeout_secs=10)
            cut_after = time.monotonic() - answered
        assert seen.exit_code is None and seen.close_code == aiohttp.WSCloseCode.POLICY_VIOLATION
        assert seen.close_reason == (
            "this request was ended because its API key was revoked or lost the scope it needs"
        )
        await asyncio.to_thread(runner.join, 10)
        assert "r" in run_result, "the waiting run on B was not ended"
        assert run_result["r"].status == 401, run_result["r"].body
        run_after = run_result["at"] - answered
        print(
            f"revocation on A cut B's attach after {cut_after:.3f} s, B's waiting run after {run_after:.3f} s"
        )
        assert cut_after < REVOCATION_BOUND_SECS and run_after < REVOCATION_BOUND_SECS
        # B audited the cut; the process lives on (detaching never stops it).
        audit = (
            await asyncio.to_thread(
                b.request, "GET", f"/v1/admin/audit?since={since}&limit=1000", key=pair.admin
            )
        ).json()
        closed = [
            e for e in audit["entries"] if e.get("type") == "api.revoked" and e.get("key_id") == doomed["id"]
        ]
        assert {e["route"] for e in closed} >= {"GET /v1/sandboxes/{ref}/processes/{pid}/attach/websocket"}
        state = pair.node.request("GET", f"/v1/sandboxes/{made['id']}/processes/{pid}").json()["state"]
        assert state == "running"
    finally:
        await asyncio.to_thread(b.request, "DELETE", f"/v1/sandboxes/{made['id']}", key=pair.admin)


def test_a_quota_holds_under_creates_fired_at_both_replicas_at_once(pair: Pair) -> None:
    a, b = pair.a, pair.b
    key = pair.new_key(a, "quinn", *ALL, tenant="quotaco")["secret"]
    assert a.request("PUT", "/v1/admin/quotas/quotaco", {"sandboxes": 3}, key=pair.admin).status == 200

    def has_quota(gw: GatewayProcess) -> bool:
        quotas = gw.request("GET", "/v1/admin/quotas", key=pair.admin).json()["quotas"]
        return [q["sandboxes"] for q in quotas if q["tenant"] == "quotaco"] == [3]

    wait_for(lambda: has_quota(a) and has_quota(b), 10)
    # Three rounds: without a shared reservation each replica counts only what was committed, so two creates in
    # flight on the two replicas pass together (seen: four made of three, in one round of two or three).
    for _ in range(3):
        fire_at_both(pair, key)
    assert a.request("PUT", "/v1/admin/quotas/quotaco", {}, key=pair.admin).status == 200


def fire_at_both(pair: Pair, key: str, fired: int = 10) -> None:
    """``fired`` creates at once, alternately at A and B, for a tenant allowed 3: 3 made, the rest refused."""
    barrier = threading.Barrier(fired)
    answers: list[Any] = []

    def fire(gw: GatewayProcess) -> None:
        barrier.wait()
        answers.append(gw.request("POST", "/v1/sandboxes", {}, key=key))

    threads = [threading.Thread(target=fire, args=(pair.a if i % 2 else pair.b,)) for i in range(fired)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    made = [r.json()["id"] for r in answers if r.status == 201]
    try:
        assert len(answers) == fired
        refused = [r for r in answers if r.status != 201]
        assert len(made) == 3, [(r.status, r.body) for r in answers]
        assert all(r.status == 403 and "over the quota of tenant quotaco" in r.error[1] for r in refused), [
            (r.status, r.body) for r in refused
        ]
        # The node runs exactly what was acknowledged: nothing made and then deleted, nothing more.
        listing = pair.node.request("GET", "/v1/sandboxes").json()["sandboxes"]
        ours = sorted(
            s["id"] for s in listing
            if s.get("labels", {}).get("gateway.tenant") == "quotaco" and s["state"] != "terminated"
        )  # fmt: skip
        assert ours == sorted(made)
    finally:
        for sandbox_id in made:
            pair.a.request("DELETE", f"/v1/sandboxes/{sandbox_id}", key=key)
    # The deletes reach both replicas' records before the next round counts.
    for gw in (pair.a, pair.b):
        wait_for(lambda g=gw: g.request("GET", "/v1/sandboxes", key=key).json()["sandboxes"] == [], 60)


#: A service's replica: a tiny HTTP server on 8080 (health checked on /). Threaded, with a backlog of 128: the
#: single-threaded `HTTPServer` (backlog 5) refused the agent's connection to it (ECONNREFUSED inside the guest,
#: the node's 409 "nothing is listening") around the leader's SIGKILL in 2 of 4 runs on a loaded machine; this
#: server, in none of 5. Why the guest's TCP refused instead of queueing was not found (a full backlog in gVisor
#: queues, as on Linux: measured).
SERVE = [
    "python3",
    "-c",
    (
        "import http.server as h; h.ThreadingHTTPServer.request_queue_size = 128; "
        "h.ThreadingHTTPServer(('', 8080), h.SimpleHTTPRequestHandler).serve_forever()"
    ),
]
LEADS = "this replica leads"


def leader_of(pair: Pair) -> tuple[GatewayProcess, GatewayProcess]:
    """(leader, follower): exactly one of the two has logged that it leads."""
    leading = wait_for(lambda: [g for g in (pair.a, pair.b) if LEADS in g.log_text()] or None, 20)
    assert len(leading) == 1, "both replicas lead"
    leader = leading[0]
    return leader, pair.b if leader is pair.a else pair.a


def leader_gauge(gw: GatewayProcess) -> float:
    """``sandbox_gateway_leader`` as the replica's /metrics says it."""
    port = gw.metrics_port  # type: ignore[attr-defined]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    [line] = [ln for ln in text.splitlines() if ln.startswith("sandbox_gateway_leader ")]
    return float(line.split()[1])


def service_sandboxes(pair: Pair) -> list[str]:
    listing = pair.node.request("GET", "/v1/sandboxes").json()["sandboxes"]
    return sorted(
        s["id"] for s in listing if "gateway.service.id" in s.get("labels", {}) and s["state"] != "terminated"
    )


def test_a_service_is_served_and_shown_alike_by_both_replicas(pair: Pair) -> None:
    leader, follower = leader_of(pair)
    alice = pair.new_key(leader, "alice", *ALL, tenant="acme")["secret"]
    made_on = {"two": leader, "one": follower}
    for name, maker in made_on.items():
        body = {"name": name, "command": SERVE_ID, "port": 8080, "replicas": 2 if name == "two" else 1,
                "health": FAST_HEALTH}  # fmt: skip
        assert maker.request("POST", "/v1/services", body, key=alice).status == 201
    try:
        # Both replicas show the same replicas and ready counts (the follower from the leader's records).
        for name, count in (("two", 2), ("one", 1)):
            wait_for(lambda n=name, c=count: shown(leader, alice, n)[0] == c, 120)
            wait_for(lambda n=name: shown(follower, alice, n) == shown(leader, alice, n), 10)
        # Each service is served by each replica, by path and by Host; the follower spreads over both replicas.
        for gw in (leader, follower):
            for name in made_on:
                seen = set()
                for i in range(8):
                    status, body = traffic(gw, alice, f"{name}--acme", by_host=bool(i % 2))
                    assert status == 200, (gw is leader, name, status, body)
                    seen.add(body)
                assert len(seen) == (2 if name == "two" else 1), seen
        # A replica of "two" ended on its node: the follower stops routing to it within the bound, and its
        # clients never see a failure (a request that cannot reach a replica goes to the other).
        _, reps = shown(follower, alice, "two")
        doomed = reps[0][0]
        with Load(follower, alice, "two--acme") as load:
            time.sleep(1)
            assert pair.node.request("DELETE", f"/v1/sandboxes/{doomed}").status in (200, 202, 204)
            ended = time.monotonic()

            def not_routed() -> bool:
                return all(r[0] != doomed or not r[3] for r in shown(follower, alice, "two")[1])

            wait_for(not_routed, 30, 0.02)
            took = time.monotonic() - ended
            # And it is replaced: two healthy replicas again, shown alike by both.
            wait_for(
                lambda: (
                    shown(follower, alice, "two")[0] == 2 and doomed not in str(shown(follower, alice, "two"))
                ),
                120,
            )
            time.sleep(1)
        print(f"replica ended on its node: no longer routed by the follower after {took:.2f} s; "
              f"{len(load.answers)} requests through the follower meanwhile, {len(load.failures())} failed")  # fmt: skip
        assert took < REPLICA_DOWN_BOUND_SECS
        assert load.answers and load.failures() == [], load.failures()[:5]
        wait_for(lambda: shown(leader, alice, "two") == shown(follower, alice, "two"), 10)
    finally:
        for name in made_on:
            follower.request("DELETE", f"/v1/services/{name}", key=alice)
    wait_for(lambda: service_sandboxes(pair) == [], 60)


def test_the_leader_runs_the_work_done_once_and_another_takes_over_after_a_sigkill(pair: Pair) -> None:
    leader, follower = leader_of(pair)
    assert (leader_gauge(leader), leader_gauge(follower)) == (1.0, 0.0)
    alice = pair.new_key(follower, "alice", *ALL, tenant="acme")["secret"]
    # A job submitted through the follower is run once, by the leader.
    job = follower.request("POST", "/v1/jobs", {"command": ["sh", "-c", "echo ran"]}, key=alice)
    assert job.status == 201, job.body
    job_id = job.json()["id"]

    def job_state(gw: GatewayProcess) -> dict[str, Any]:
        return gw.request("GET", f"/v1/jobs/{job_id}", key=alice).json()  # type: ignore[no-any-return]

    done = wait_for(lambda: (j := job_state(follower))["state"] == "succeeded" and j, 60)
    assert [r["n"] for r in done["runs"]] == [1]
    assert "job taken up from another replica" in leader.log_text()
    # A job running on the leader, cancelled through the follower: ended once, its sandbox with it, and the
    # leader's task for it stops (no second attempt).
    job = follower.request("POST", "/v1/jobs", {"command": ["sleep", "120"], "retries": 2}, key=alice)
    assert job.status == 201, job.body
    job_id = job.json()["id"]
    running = wait_for(
        lambda: (j := job_state(follower))["runs"] and j["runs"][0]["state"] == "running" and j, 60
    )
    cancelled = follower.request("DELETE", f"/v1/jobs/{job_id}", key=alice)
    assert cancelled.status == 200 and cancelled.json()["state"] == "cancelled", cancelled.body
    time.sleep(3)  # the leader had the change; an attempt it would still make would show by now
    after = job_state(leader)
    assert after["state"] == "cancelled" and [(r["n"], r["state"]) for r in after["runs"]] == [
        (1, "cancelled")
    ]
    sandbox = running["runs"][0]["sandbox"]
    assert pair.node.request("GET", f"/v1/sandboxes/{sandbox}").json().get("state") in (None, "terminated")
    # A service created through the follower gets its one replica from the leader, and only one.
    made = follower.request("POST", "/v1/services", {"name": "web", "command": SERVE, "port": 8080,
                                                     "replicas": 1}, key=alice)  # fmt: skip
    assert made.status == 201, made.body
    first = wait_for(lambda: service_sandboxes(pair) or None, 60)
    assert len(first) == 1
    # The follower serves its traffic (the leader's record of the replica's health).
    wait_for(lambda: shown(follower, alice, "web")[0] == 1, 60)

    # SIGKILL the leader under the service's traffic through the follower: the follower takes over within 15 s,
    # and its clients never see a failure (its routing needs no leader alive).
    with Load(follower, alice, "web--acme") as load:
        time.sleep(1)
        leader.kill()
        killed = time.monotonic()
        wait_for(lambda: LEADS in follower.log_text(), 20, 0.05)
        took = time.monotonic() - killed
        assert leader_gauge(follower) == 1.0
        # The new leader keeps the service's replica (no second one) and runs a new job once.
        job = follower.request("POST", "/v1/jobs", {"command": ["sh", "-c", "echo again"]}, key=alice)
        assert job.status == 201, job.body
        job_id = job.json()["id"]
        done = wait_for(lambda: (j := job_state(follower))["state"] == "succeeded" and j, 60)
        assert [r["n"] for r in done["runs"]] == [1]
        time.sleep(3)  # a service step or two of the new leader
    during = [a for a in load.answers if a[0] >= killed]
    print(f"takeover after the leader's SIGKILL: {took:.2f} s; service traffic through the follower: "
          f"{len(during)} requests after the kill, {len(load.failures())} failed, longest gap between answers "
          f"{load.longest_gap():.2f} s")  # fmt: skip
    assert took < 15
    assert during and load.failures() == [], load.failures()[:5]
    assert service_sandboxes(pair) == first
    # The killed replica comes back as a follower; the service goes, its replica with it.
    leader.start()
    assert follower.request("DELETE", "/v1/services/web", key=alice).status == 204
    wait_for(lambda: service_sandboxes(pair) == [], 60)
    assert LEADS not in leader.log_since_start()


def fire_pair(pair: Pair, requests: list[tuple[GatewayProcess, str, str, Any, str]]) -> list[Any]:
    """The requests (replica, method, path, body, key) sent at once; their answers in the same order."""
    barrier = threading.Barrier(len(requests))
    answers: list[Any] = [None] * len(requests)

    def fire(i: int) -> None:
        gw, method, path, body, key = requests[i]
        barrier.wait()
        answers[i] = gw.request(method, path, body, key=key)

    threads = [threading.Thread(target=fire, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return answers


def one_made_one_conflict(answers: list[Any], message: str) -> Any:
    """Exactly one answer 201, the other today's 409 ``conflict`` with ``message``; the 201."""
    statuses = sorted(r.status for r in answers)
    assert statuses == [201, 409], [(r.status, r.body) for r in answers]
    [refused] = [r for r in answers if r.status == 409]
    assert refused.error == ("conflict", message), refused.body
    [made] = [r for r in answers if r.status == 201]
    return made


#: Rounds of each race: without the names' shared lock both creates pass in most rounds (seen: every one of
#: the first three for sandboxes and services).
NAME_ROUNDS = 3


def test_one_name_created_on_both_replicas_at_once_is_made_once(pair: Pair) -> None:
    a, b = pair.a, pair.b
    sam = pair.new_key(a, "sam", *ALL, "org:create", tenant="nameco")["secret"]
    other = pair.new_key(a, "tess", *ALL, "org:create", tenant="nameco")["secret"]
    wait_for(lambda: b.request("GET", "/v1/whoami", key=other).status == 200, 10)

    def live(name: str) -> list[str]:
        listing = pair.node.request("GET", "/v1/sandboxes").json()["sandboxes"]
        return [
            s["id"] for s in listing
            if s.get("name") == name and s["state"] != "terminated"
            and s.get("labels", {}).get("gateway.tenant") == "nameco"
        ]  # fmt: skip

    for n in range(NAME_ROUNDS):
        # A sandbox name of one user: one made (on the node too: nothing orphaned), the other today's 409.
        name = f"race-{n}"
        answers = fire_pair(pair, [(gw, "POST", "/v1/sandboxes", {"name": name}, sam) for gw in (a, b)])
        made = one_made_one_conflict(
            answers, f"you already have a live sandbox named {name!r}: pick another name or delete it"
        )
        assert live(name) == [made.json()["id"]]
        # A rename racing a create of the same name: one of them has it.
        first = a.create(sam, name=f"first-{n}")
        answers = fire_pair(pair, [
            (a, "PATCH", f"/v1/sandboxes/{first['id']}", {"name": f"renamed-{n}"}, sam),
            (b, "POST", "/v1/sandboxes", {"name": f"renamed-{n}"}, sam),
        ])  # fmt: skip
        assert sorted(r.status for r in answers) in ([200, 409], [201, 409]), [
            (r.status, r.body) for r in answers
        ]
        assert len(live(f"renamed-{n}")) == 1
        for sandbox_id in live(name) + live(f"renamed-{n}") + live(f"first-{n}"):
            assert a.request("DELETE", f"/v1/sandboxes/{sandbox_id}", key=sam).status in (200, 202, 204)

        # A service name of one tenant (two users of it).
        svc = f"web-{n}"
        spec = {"name": svc, "command": SERVE, "port": 8080, "replicas": 0}
        answers = fire_pair(
            pair, [(a, "POST", "/v1/services", spec, sam), (b, "POST", "/v1/services", spec, other)]
        )
        made = one_made_one_conflict(
            answers, f"this tenant already has a service named {svc!r}: pick another name or PUT it"
        )
        owner = sam if made is answers[0] else other
        for gw in (a, b):
            listed = gw.request("GET", "/v1/services", key=owner).json()["services"]
            assert [s["spec"]["name"] for s in listed].count(svc) == 1
        assert a.request("DELETE", f"/v1/services/{svc}", key=owner).status in (200, 202, 204)

        # A volume name (one name space across the gateway): one on the node.
        vol = f"vol-{n}"
        answers = fire_pair(pair, [(gw, "POST", "/v1/volumes", {"name": vol, "size_mb": 16}, k)
                                   for gw, k in ((a, sam), (b, other))])  # fmt: skip
        made = one_made_one_conflict(
            answers, f"a volume named {vol!r} exists: volume names are shared across the gateway"
        )
        owner = sam if made is answers[0] else other
        volumes = pair.node.request("GET", "/v1/volumes").json()["volumes"]
        assert [v["name"] for v in volumes].count(vol) == 1
        assert a.request("DELETE", f"/v1/volumes/{vol}", key=owner).status in (200, 202, 204)

        # An organisation's name.
        org = f"org-{n}"
        answers = fire_pair(pair, [(a, "POST", "/v1/orgs", {"name": org}, sam),
                                   (b, "POST", "/v1/orgs", {"name": org}, other)])  # fmt: skip
        one_made_one_conflict(
            answers, f"{org!r} is already an organisation or a tenant in use: pick another name"
        )
        orgs = a.request("GET", "/v1/admin/orgs", key=pair.admin).json()["orgs"]
        assert [o["name"] for o in orgs].count(org) == 1
    for gw in (a, b):
        wait_for(lambda g=gw: g.request("GET", "/v1/sandboxes", key=sam).json()["sandboxes"] == [], 60)


def test_creates_beyond_the_lock_connections_are_a_503_that_makes_nothing(
    pair: Pair, pg_cluster: PgCluster
) -> None:
    """A replica holds at most LOCK_POOL_SIZE lock connections: with that many of its named creates waiting for
    their names' locks (held here, as another replica stuck on a node would), one more waits for a connection and
    is answered 503 with the message, having reached no node; the waiting ones go on once the locks are free."""
    a = pair.a
    fired = LOCK_POOL_SIZE + 1
    users = [f"lk{i}" for i in range(fired)]
    keys = {u: pair.new_key(a, u, *ALL, tenant="lockco")["secret"] for u in users}
    dbname = pair.url.split("/")[3].split("?")[0]
    holder = pg_cluster.connect(dbname)
    for u in users:
        holder.execute(
            "SELECT pg_advisory_lock(%s, hashtext(%s))",
            (NAME_LOCK_CLASS, Gateway.name_lock("sandbox", u, "lockco")[1]),
        )
    answers: dict[str, Any] = {}

    def fire(user: str) -> None:
        answers[user] = a.request(
            "POST", "/v1/sandboxes", {"name": "locked", "memory_mb": 128}, key=keys[user]
        )

    threads = [threading.Thread(target=fire, args=(u,)) for u in users]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: answers or None, 120)  # the one left without a connection, after its 30 s wait
        [(late, refused)] = answers.items()
        assert (refused.status, refused.error) == (503, ("unavailable", (
            f"this gateway replica has all its {LOCK_POOL_SIZE} database lock connections in use (creates under a "
            "quota or naming a sandbox, service, volume, organisation, node or SSH key, and cordons) for "
            f"{LOCK_POOL_WAIT_SECS} s; try again shortly"
        ))), refused.body  # fmt: skip
    finally:
        holder.close()  # the others' locks free: they go on
        for t in threads:
            t.join(180)
    listing = pair.node.request("GET", "/v1/sandboxes").json()["sandboxes"]
    ours = [
        s
        for s in listing
        if s.get("labels", {}).get("gateway.tenant") == "lockco" and s["state"] != "terminated"
    ]
    assert late not in [s["labels"].get("gateway.owner") for s in ours]  # nothing made for the refused one
    made = [(u, r.json()["id"]) for u, r in answers.items() if r.status == 201]
    assert sorted(s["id"] for s in ours) == sorted(i for _, i in made)
    assert all(r.status in (201, 503) for r in answers.values()), [
        (r.status, r.body) for r in answers.values()
    ]
    for user, sandbox_id in made:
        assert a.request("DELETE", f"/v1/sandboxes/{sandbox_id}", key=keys[user]).status in (200, 202, 204)
