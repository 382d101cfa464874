"""Tenant secrets never at rest on a node (docs/jobs.md, Secrets; docs/node-api.md, "Secret environment"): a job
and a service naming a secret, through a real gateway in front of two real sandboxd nodes. Their processes see
the value; nothing under the nodes' directories (records, process records, audit logs, the servers' logs, the
sandboxes' disks) holds it, nor under the gateway's (sealed there); the node lists the names only; the commands
the gateway starts are given the value in their own request too (a node restarted since the create would start
them without it)."""

from __future__ import annotations

import base64
import hashlib
import secrets
from collections.abc import Iterator

import pytest
from sandboxd_harness import files_holding
from services_world import SERVE, World, world

HEALTH = {"http": "/", "every_secs": 1, "failures": 2}
#: Prints the SHA-256 of $TOKEN: process output is kept on the node's disk, so never the value itself.
DIGEST = ["sh", "-c", 'printf %s "$TOKEN" | sha256sum']


def digest(value: str) -> bytes:
    return hashlib.sha256(value.encode()).hexdigest().encode() + b"  -\n"


@pytest.fixture(scope="module")
def w() -> Iterator[World]:
    with world(prefix="sbxsec-") as started:
        yield started


def started_with(w: World, node: str, sandbox: str) -> list[list[str]]:
    """The env names each process of ``sandbox`` was started with by its request (the node's audit log)."""
    events = w.nodes[node].request("GET", f"/v1/sandboxes/{sandbox}/events").json()["events"]
    return [e["env_names"] for e in events if e["type"] == "process.started"]


def test_a_jobs_secret_reaches_its_command_and_never_a_nodes_disk(w: World) -> None:
    token = "sbx-secret-" + secrets.token_hex(16)
    w.ok("PUT", "/v1/secrets/TOKEN", {"value": token}, status=204)
    job = w.ok(
        "POST", "/v1/jobs", {"command": DIGEST, "env": {"GREETING": "hi"}, "secrets": ["TOKEN"]}, status=201
    )
    done = w.wait_job(job["id"])
    assert (done["state"], done["error"]) == ("succeeded", None)
    assert w.output(job["id"], 1)[0] == digest(token)
    assert files_holding(w.workdir, token) == []
    [run] = done["runs"]
    assert started_with(w, run["node"], run["sandbox"]) == [["TOKEN"]]  # given with the command too
    created = next(e for e in w.nodes[run["node"]].request("GET", f"/v1/sandboxes/{run['sandbox']}/events")
                   .json()["events"] if e["type"] == "sandbox.created")  # fmt: skip
    assert (created["env_names"], created["secret_env_names"]) == (["GREETING"], ["TOKEN"])


def test_a_services_secret_reaches_its_replicas_and_never_a_nodes_disk(w: World) -> None:
    token = "sbx-secret-" + secrets.token_hex(16)
    w.ok("PUT", "/v1/secrets/TOKEN", {"value": token}, status=204)
    spec = {"name": "web", "command": SERVE, "port": 8080, "health": HEALTH, "secrets": ["TOKEN"]}
    w.ok("POST", "/v1/services", spec, status=201)
    try:
        [replica] = w.wait_ready("web", 1)["replicas"]
        assert files_holding(w.workdir, token) == []
        # The replica's command has it (it answers the value's length), and so does any process of its sandbox.
        assert w.traffic("/svc/web--acme/").body.decode().split()[2] == str(len(token))
        ran = w.ok("POST", f"/v1/sandboxes/{replica['sandbox']}/run", {"argv": DIGEST})
        assert base64.b64decode(ran["stdout"]) == digest(token)
        assert started_with(w, replica["node"], replica["sandbox"])[0] == ["TOKEN"]
        listed = w.ok("GET", f"/v1/sandboxes/{replica['sandbox']}")
        assert (listed["secret_env_names"], listed["secret_env_lost"], listed["env_names"]) == (
            ["TOKEN"],
            False,
            [],
        )
    finally:
        assert w.call("DELETE", "/v1/services/web").status == 204
