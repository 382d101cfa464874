"""What two real sandbox-gateway replicas on one PostgreSQL database share, so a client cannot tell which one
answered (docs/ha.md, "Shared by the replicas"): the audit log (requests served by either listed alike by both),
a job run's kept output and file read through the follower (also once the leader that ran it was SIGKILLed), the
SSH host keys (a real ``ssh-keyscan`` of each replica), and a replica given another secrets key refused at start.
Real PostgreSQL (a private cluster), a real sandboxd with gVisor."""

from __future__ import annotations

import base64
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from pg_cluster import PgCluster
from sandboxd_harness import Sandboxd, free_port

from sbx.gateway.secrets import new_key_file

ALL = ("sandbox:read", "sandbox:create", "sandbox:delete")
LEADS = "this replica leads"


class Pair:
    def __init__(self, a: GatewayProcess, b: GatewayProcess, node: Sandboxd, admin: str, workdir: Path,
                 url: str, env: dict[str, str]) -> None:  # fmt: skip
        self.a, self.b, self.node, self.admin = a, b, node, admin
        self.workdir, self.url, self.env = workdir, url, env

    def leader(self) -> tuple[GatewayProcess, GatewayProcess]:
        """(leader, follower)."""
        leading = wait_for(lambda: [g for g in (self.a, self.b) if LEADS in _this_run(g)] or None, 20)
        assert len(leading) == 1, "both replicas lead"
        return leading[0], self.b if leading[0] is self.a else self.a


def _this_run(gw: GatewayProcess) -> str:
    """The log since the replica last started."""
    return gw.log_since_start()


def _args(key_file: Path, ssh_port: int) -> list[str]:
    return [*FAST_ARGS, "--secrets-key-file", str(key_file), "--ssh-listen", f"127.0.0.1:{ssh_port}"]


@pytest.fixture(scope="module")
def pair(pg_cluster: PgCluster) -> Iterator[Pair]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxgw-shared-", dir="/var/tmp"))
    for d in ("n1", "a", "b"):
        (workdir / d).mkdir()
    key_file = workdir / "secrets.key"
    new_key_file(key_file)
    node = Sandboxd(workdir / "n1", args=["--node-id", "s"]).start()
    url = pg_cluster.create_database()
    env = pg_cluster.env()
    a, b = (
        GatewayProcess(workdir / name, [("n1", node)], _args(key_file, free_port()), database=url, database_env=env)
        for name in ("a", "b")
    )  # fmt: skip
    admin = a.create_key("root", "admin")
    try:
        a.start()
        b.start()
        yield Pair(a, b, node, admin, workdir, url, env)
    finally:
        a.stop()
        b.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def _audit(gw: GatewayProcess, admin: str) -> list[dict[str, Any]]:
    resp = gw.request("GET", "/v1/admin/audit?limit=1000", key=admin)
    assert resp.status == 200, resp.body
    return resp.json()["entries"]  # type: ignore[no-any-return]


def test_the_audit_log_lists_the_requests_of_both_replicas_alike(pair: Pair) -> None:
    a, b = pair.a, pair.b
    alice = a.request("POST", "/v1/admin/keys", {"user": "alice-audit", "scopes": list(ALL)}, key=pair.admin)
    assert alice.status == 201, alice.body
    secret, key_id = alice.json()["secret"], alice.json()["id"]

    def alices(gw: GatewayProcess, count: int = 2) -> list[dict[str, Any]] | None:
        found = [e for e in _audit(gw, pair.admin) if e.get("key_id") == key_id]
        return found if len(found) == count else None

    assert a.request("GET", "/v1/sandboxes?from=a", key=secret).status == 200
    # A replica writes its entry just after its answer, and the log is in the order entries were committed: wait
    # for a's before b is asked, or b's may be committed first (seen: the 404 listed before the 200).
    wait_for(lambda: alices(a, 1), 20)
    assert b.request("GET", "/v1/sandboxes/sbx_nosuch", key=secret).status == 404

    # Each replica's writer commits within milliseconds; both lists hold both requests, in the same order.
    seen_a = wait_for(lambda: alices(a), 20)
    seen_b = wait_for(lambda: alices(b), 20)
    assert seen_a == seen_b
    assert [(e["route"], e["status"]) for e in seen_a] == [
        ("/v1/sandboxes", 200), ("/v1/sandboxes/{ref}", 404)
    ]  # fmt: skip
    # The whole log (every admin request of both too) reads the same through either, since and limit included.
    whole_a, whole_b = _audit(a, pair.admin), _audit(b, pair.admin)
    assert whole_a[: len(whole_a) - 2] == whole_b[: len(whole_a) - 2]  # each read adds its own entry after
    since = seen_a[1]["time"]
    for gw in (a, b):
        later = gw.request("GET", f"/v1/admin/audit?since={since}&limit=1", key=pair.admin)
        assert later.status == 200 and later.json()["truncated"] is True
        assert later.json()["entries"][0]["time"] >= since
    assert not (a.workdir / "audit").exists() and not (b.workdir / "audit").exists()


def _fingerprints(port: int) -> set[str]:
    scan = subprocess.run(["ssh-keyscan", "-p", str(port), "-t", "ed25519,rsa", "127.0.0.1"],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    lines = sorted(
        " ".join(ln.split()[1:3]) for ln in scan.stdout.splitlines() if ln and not ln.startswith("#")
    )
    assert len(lines) == 2, (scan.stdout, scan.stderr)
    return set(lines)


def _ssh_port(gw: GatewayProcess) -> int:
    return int(gw.args[gw.args.index("--ssh-listen") + 1].rsplit(":", 1)[1])


def test_both_replicas_show_the_same_ssh_host_keys(pair: Pair) -> None:
    a, b = pair.a, pair.b
    scanned_a, scanned_b = _fingerprints(_ssh_port(a)), _fingerprints(_ssh_port(b))
    assert scanned_a == scanned_b
    info_a = a.request("GET", "/v1/ssh", key=pair.admin).json()
    info_b = b.request("GET", "/v1/ssh", key=pair.admin).json()
    assert info_a["fingerprint"] == info_b["fingerprint"] and info_a["host_keys"] == info_b["host_keys"]
    assert set(info_a["host_keys"]) == scanned_a
    assert not list(a.workdir.glob("gateway.ssh_host_*")) and not list(b.workdir.glob("gateway.ssh_host_*"))


def test_a_replica_with_another_secrets_key_is_refused_at_start(pair: Pair) -> None:
    other_key = pair.workdir / "other.key"
    new_key_file(other_key)
    (pair.workdir / "c").mkdir(exist_ok=True)
    c = GatewayProcess(pair.workdir / "c", [("n1", pair.node)], _args(other_key, free_port()), database=pair.url,
                       database_env=pair.env)  # fmt: skip
    with pytest.raises(RuntimeError, match="gateway exited with 1"):
        c.start()
    assert (
        f"sandbox-gateway: the secrets key file {other_key} does not open the secrets sealed in {pair.url}"
        in c.log_text()
    )
    assert "give every replica the same --secrets-key-file" in c.log_text()
    # Nothing changed: the replicas serve on, a secret set before and after opens with their key.
    secrets = pair.a.request("PUT", "/v1/secrets/TOKEN", {"value": "v1"}, key=pair.admin)
    assert secrets.status in (200, 201, 204), secrets.body
    assert pair.b.request("GET", "/v1/secrets", key=pair.admin).status == 200


def test_a_job_run_by_the_leader_is_read_through_the_follower_also_after_the_leader_is_killed(
    pair: Pair,
) -> None:
    leader, follower = pair.leader()
    made = follower.request(
        "POST", "/v1/admin/keys", {"user": "bob-jobs", "scopes": list(ALL)}, key=pair.admin
    )
    bob = made.json()["secret"]
    script = (
        "head -c 300000 /dev/zero | tr '\\0' o; echo; echo to-stderr >&2; "
        "printf 'kept %s' $(hostname) > /sandbox/home/report.txt"
    )
    job = follower.request("POST", "/v1/jobs", {"command": ["sh", "-c", script],
                                                "keep": {"files": ["/sandbox/home/report.txt"]}}, key=bob)  # fmt: skip
    assert job.status == 201, job.body
    job_id = job.json()["id"]

    def done(gw: GatewayProcess) -> dict[str, Any] | None:
        j = gw.request("GET", f"/v1/jobs/{job_id}", key=bob).json()
        return j if j["state"] == "succeeded" else None

    wait_for(lambda: done(follower), 90)

    def read(gw: GatewayProcess) -> tuple[dict[str, Any], bytes]:
        out = gw.request("GET", f"/v1/jobs/{job_id}/runs/1/output", key=bob)
        assert out.status == 200, out.body
        kept = gw.request("GET", f"/v1/jobs/{job_id}/runs/1/files?path=/sandbox/home/report.txt", key=bob)
        assert kept.status == 200, kept.body
        return out.json(), kept.body

    through_follower = read(follower)
    output, kept = through_follower
    assert base64.b64decode(output["stdout"]) == b"o" * 300000 + b"\n" and output["truncated"] is False
    assert base64.b64decode(output["stderr"]) == b"to-stderr\n"
    assert kept.startswith(b"kept ")
    assert read(leader) == through_follower
    assert not list((follower.workdir / "jobs").glob("*/*")) and not list(
        (leader.workdir / "jobs").glob("*/*")
    )
    # The leader that ran it is SIGKILLed: the follower still answers the same. What the leader's audit writer
    # had committed stays: an audit read on the leader writes its queue first, so its reads of the run are kept.
    assert _audit(leader, pair.admin)
    leader.kill()
    leader_reads = [
        e for e in _audit(follower, pair.admin) if e.get("route") == "/v1/jobs/{id}/runs/{n}/output"
    ]
    assert len(leader_reads) == 2, leader_reads  # through the follower, then through the leader
    try:
        assert read(follower) == through_follower
        wait_for(lambda: LEADS in _this_run(follower), 20, 0.1)
        assert read(follower) == through_follower
    finally:
        leader.start()
    assert read(leader) == through_follower
