"""Jobs, agent runs, secrets and notifications through a real gateway in front of two real sandboxd nodes: spec
checks, output and kept files, retries, timeouts, cancel, revocation, an agent that is a script of the image, the
secrets endpoints (never a value anywhere), notifications to a local receiver (retried), and the notify rules of
gateways without --notify-allow-private and with --no-notify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import GatewayProcess, wait_for
from sandboxd_harness import free_port
from services_world import Receiver, World, world

#: A job writing a file, both streams, more stdout than is kept, and what it knows of its env and secret.
JOB_SCRIPT = (
    'echo "greeting=$GREETING token_len=${#TOKEN}"; echo to-stderr >&2; echo kept > /sandbox/home/out.txt; '
    "head -c 9000000 /dev/zero; exit 0"
)


@pytest.fixture(scope="module")
def w() -> Iterator[World]:
    with world() as started:
        started.ok("PUT", "/v1/secrets/TOKEN", {"value": "s3cret-value"}, status=204)
        yield started


BAD_JOBS = [
    ({}, 400, "command is required"),
    ({"command": []}, 400, "command: missing command"),
    ({"command": ["x"], "retries": 11}, 400, "retries = 11"),
    ({"command": ["x"], "timeout_secs": 0}, 400, "timeout_secs = 0"),
    ({"command": ["x"], "keep": {"files": ["rel/path"]}}, 400, "is relative"),
    ({"command": ["x"], "keep": {"files": [f"/f{i}" for i in range(17)]}}, 400, "keep at most 16"),
    ({"command": ["x"], "from_snapshot": "snap_nope"}, 400, "no snapshot 'snap_nope' among yours"),
    ({"command": ["x"], "notify": "ftp://example.com/x"}, 400, "give an https URL"),
    ({"command": ["x"], "notify": "https://u:p@example.com/x"}, 400, "user or password"),
    ({"command": ["x"], "notify": "https://169.254.169.254/x"}, 400, "link-local, metadata"),
    ({"command": ["x"], "notify": "http://10.0.0.1/x"}, 400, "use https"),
    ({"command": ["x"], "secrets": ["NOPE"]}, 400, "this tenant has no secret 'NOPE'"),
    ({"command": ["x"], "env": {"BASH_ENV": "/x"}}, 403, "BASH_ENV is reserved"),
    ({"command": ["x"], "bind": "/"}, 400, "bind"),
    ({"command": ["x"], "name": "j" * 64}, 400, "name: the job name is 64 characters long; use at most 63"),
    ({"command": ["x"], "name": "Build!"}, 400, "name: 'Build!' is not a valid job name"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "status", "words"), BAD_JOBS)
def test_a_bad_job_is_refused_and_starts_nothing(
    w: World, spec: dict[str, Any], status: int, words: str
) -> None:
    resp = w.call("POST", "/v1/jobs", spec)
    assert resp.status == status, resp.body
    assert words in resp.error[1], resp.error
    assert w.ok("GET", "/v1/jobs")["jobs"] == []


def test_a_job_keeps_its_output_and_files_and_notifies(w: World) -> None:
    receiver = Receiver(statuses=[503])  # the first delivery fails: it is tried again
    try:
        job = w.ok("POST", "/v1/jobs", {
            "name": "build", "command": ["bash", "-c", JOB_SCRIPT], "env": {"GREETING": "hi"}, "secrets": ["TOKEN"],
            "keep": {"files": ["/sandbox/home/out.txt", "/sandbox/home/absent"]}, "notify": receiver.url,
        }, status=201)  # fmt: skip
        assert (job["state"], job["env_names"], job["name"]) == ("queued", ["GREETING"], "build")
        assert "env" not in job["spec"] and job["spec"]["secrets"] == ["TOKEN"]
        done = w.wait_job(job["id"])
        assert (done["state"], done["error"]) == ("succeeded", None)
        [run] = done["runs"]
        assert (run["n"], run["state"], run["exit_code"]) == (1, "succeeded", 0)
        assert run["files"] == [{"path": "/sandbox/home/out.txt", "bytes": 5},
                                {"path": "/sandbox/home/absent", "error": "not found"}]  # fmt: skip
        stdout, stderr, truncated = w.output(job["id"], 1)
        assert (
            stdout.startswith(b"greeting=hi token_len=12\n") and len(stdout) == 8 * 1024 * 1024 and truncated
        )
        assert stderr == b"to-stderr\n"
        kept = w.call("GET", f"/v1/jobs/{job['id']}/runs/1/files?path=/sandbox/home/out.txt")
        assert (kept.status, kept.body) == (200, b"kept\n")
        assert w.call("GET", f"/v1/jobs/{job['id']}/runs/1/files?path=/sandbox/home/absent").status == 404
        assert w.call("GET", f"/v1/jobs/{job['id']}/runs/2/output").status == 404
        # The sandbox went with the attempt.
        node = w.nodes[run["node"]]
        assert node.request("GET", f"/v1/sandboxes/{run['sandbox']}").json().get("state") in (
            None,
            "terminated",
        )
        wait_for(lambda: len(receiver.bodies) == 2, 30)
        assert receiver.bodies == [
            {"event": "run.finished", "job": job["id"], "name": "build", "job_state": "running", "run": 1,
             "state": "succeeded", "exit_code": 0},
            {"event": "job.finished", "job": job["id"], "name": "build", "job_state": "succeeded"},
        ]  # fmt: skip
        assert len(receiver.raw) == 3 and b"s3cret" not in b"".join(receiver.raw)
        # Listings leave runs out; another tenant's user does not see it; an admin does.
        listed = w.ok("GET", "/v1/jobs")["jobs"]
        assert [j["id"] for j in listed] == [job["id"]] and "runs" not in listed[0]
        assert w.call("GET", f"/v1/jobs/{job['id']}", key="bob").status == 404
        assert w.ok("GET", "/v1/jobs", key="bob")["jobs"] == []
        assert w.ok("GET", f"/v1/jobs/{job['id']}", key="admin")["owner"] == "alice"
    finally:
        receiver.close()


def test_retries_a_timeout_and_a_cancel(w: World) -> None:
    failing = w.ok(
        "POST", "/v1/jobs", {"command": ["sh", "-c", "echo try; exit 4"], "retries": 2}, status=201
    )
    slow = w.ok("POST", "/v1/jobs", {"command": ["sleep", "60"], "timeout_secs": 2}, status=201)
    cancelled = w.ok("POST", "/v1/jobs", {"command": ["sleep", "60"]}, status=201)
    failed = w.wait_job(failing["id"])
    assert (failed["state"], failed["error"]) == ("failed", "exit code 4")
    assert [(r["n"], r["state"], r["exit_code"]) for r in failed["runs"]] == [(1, "failed", 4), (2, "failed", 4),
                                                                             (3, "failed", 4)]  # fmt: skip
    assert len({r["sandbox"] for r in failed["runs"]}) == 3  # each attempt in a sandbox of its own
    timed_out = w.wait_job(slow["id"])
    assert (timed_out["state"], timed_out["runs"][0]["exit_code"], timed_out["error"]) == (
        "failed", -1, "timed out after 2 s")  # fmt: skip
    running = wait_for(lambda: (j := w.job(cancelled["id"]))["state"] == "running" and j, 60)
    answer = w.ok("DELETE", f"/v1/jobs/{cancelled['id']}")
    assert (answer["state"], answer["runs"][0]["state"]) == ("cancelled", "cancelled")
    sandbox, node = running["runs"][0]["sandbox"], w.nodes[running["runs"][0]["node"]]
    assert node.request("GET", f"/v1/sandboxes/{sandbox}").json().get("state") in (None, "terminated")
    assert w.ok("DELETE", f"/v1/jobs/{cancelled['id']}")["state"] == "cancelled"  # again: as it is
    assert w.call("DELETE", f"/v1/jobs/{cancelled['id']}", key="bob").status == 404


def test_an_agent_run_writes_its_prompt_to_a_file(w: World) -> None:
    unknown = w.call("POST", "/v1/agent-runs", {"agent": "nope", "prompt": "x"})
    assert (unknown.status, unknown.error[0]) == (400, "invalid_request") and "shouter" in unknown.error[1]
    before = len(w.ok("GET", "/v1/jobs")["jobs"])
    nul = w.call("POST", "/v1/agent-runs", {"agent": "shouter", "prompt": "fix\u0000it"})
    assert (nul.status, nul.error[0]) == (
        400,
        "invalid_request",
    ) and "prompt: holds a NUL character" in nul.error[1]
    assert len(w.ok("GET", "/v1/jobs")["jobs"]) == before
    missing = w.call("POST", "/v1/agent-runs", {"agent": "shouter", "prompt": "x"})
    assert missing.status == 400 and "no secret 'AGENT_KEY'" in missing.error[1]
    w.ok("PUT", "/v1/secrets/AGENT_KEY", {"value": "k"}, status=204)
    prompt = "fix the tests; don't touch main --force"
    job = w.ok("POST", "/v1/agent-runs", {"agent": "shouter", "prompt": prompt, "name": "fixer",
                                          "keep": {"files": ["/sandbox/home/result.txt"]}}, status=201)  # fmt: skip
    assert job["agent"] == "shouter" and prompt not in str(job["spec"]["command"])
    assert job["spec"]["timeout_secs"] == 120 and job["spec"]["secrets"] == ["AGENT_KEY"]
    done = w.wait_job(job["id"])
    assert done["state"] == "succeeded", done
    stdout, _, _ = w.output(job["id"], 1)
    assert stdout == f"agent read {len(prompt)} chars; key present\n".encode()
    kept = w.call("GET", f"/v1/jobs/{job['id']}/runs/1/files?path=/sandbox/home/result.txt")
    assert kept.body == prompt.upper().encode()


def test_revoking_the_owner_cancels_running_jobs(w: World) -> None:
    key = w.ok("POST", "/v1/admin/keys", {"user": "olga", "tenant": "acme",
                                          "scopes": ["sandbox:read", "sandbox:create"]}, key="admin", status=201)  # fmt: skip
    w.keys["olga"] = key["secret"]
    job = w.ok("POST", "/v1/jobs", {"command": ["sleep", "60"], "retries": 3}, key="olga", status=201)
    running = wait_for(lambda: (j := w.job(job["id"], "olga"))["state"] == "running" and j, 60)
    assert w.call("DELETE", f"/v1/admin/keys/{key['id']}", key="admin").status == 204
    # Before the revocation answered, the job was cancelled and its sandbox ended; no further run started.
    ended = w.job(job["id"], "admin")
    reason = "cancelled: the owner's access was revoked"
    assert (ended["state"], ended["error"], len(ended["runs"])) == ("cancelled", reason, 1)
    assert (ended["runs"][0]["state"], ended["runs"][0]["error"]) == ("cancelled", reason)
    run = running["runs"][0]
    assert w.nodes[run["node"]].request("GET", f"/v1/sandboxes/{run['sandbox']}").json().get("state") in (
        None, "terminated")  # fmt: skip
    entries = w.ok("GET", "/v1/admin/audit?limit=1000", key="admin")["entries"]
    assert [e["result"] for e in entries if e["type"] == "job.revoked" and e["target"] == job["id"]] == [
        "cancelled"
    ]


def test_secrets_are_names_only_and_sealed_at_rest(w: World) -> None:
    w.ok("PUT", "/v1/secrets/DB_PASSWORD", {"value": "hunter2-unique-value"}, status=204)
    listed = w.ok("GET", "/v1/secrets")["secrets"]
    assert {s["name"] for s in listed} >= {"DB_PASSWORD", "TOKEN"} and all(
        set(s) == {"name", "updated_at"} for s in listed
    )
    assert w.ok("GET", "/v1/secrets", key="reader")["secrets"] == listed  # sandbox:read lists names
    assert w.call("PUT", "/v1/secrets/X", {"value": "v"}, key="reader").error[0] == "refused"
    assert w.ok("GET", "/v1/secrets", key="bob")["secrets"] == []  # another tenant's
    cases = [
        ("/v1/secrets/1BAD", {"value": "v"}, "not a valid environment variable name"),
        ("/v1/secrets/LD_PRELOAD", {"value": "v"}, "reserved environment variable name"),
        ("/v1/secrets/NUL", {"value": "a\u0000b"}, "NUL"),
        ("/v1/secrets/BIG", {"value": "x" * (64 * 1024 + 1)}, "at most 65536 bytes"),
        ("/v1/secrets/EXTRA", {"value": "v", "x": 1}, "x"),
    ]
    for path, body, words in cases:
        resp = w.call("PUT", path, body)
        assert (resp.status, words in resp.error[1]) == (400, True), (path, resp.body)
        assert "hunter2" not in resp.error[1]
    assert {s["name"] for s in w.ok("GET", "/v1/secrets")["secrets"]} == {
        s["name"] for s in listed
    }  # none made
    assert w.call("DELETE", "/v1/secrets/ABSENT").status == 404
    assert w.call("DELETE", "/v1/secrets/DB_PASSWORD").status == 204
    assert "DB_PASSWORD" not in {s["name"] for s in w.ok("GET", "/v1/secrets")["secrets"]}
    stored = b"".join(p.read_bytes() for p in w.gw.workdir.glob("gateway.db*"))
    logs = w.gw.log_text() + "".join(p.read_text() for p in (w.gw.workdir / "audit").glob("*"))
    assert b"hunter2-unique-value" not in stored and b"s3cret-value" not in stored
    assert "hunter2" not in logs and "s3cret" not in logs


def test_notify_rules_without_allow_private_and_with_no_notify(w: World) -> None:
    (w.workdir / "gw-plain").mkdir()
    metrics = free_port()
    plain = GatewayProcess(
        w.workdir / "gw-plain", list(w.nodes.items()), ["--metrics-listen", f"127.0.0.1:{metrics}"]
    )
    key = plain.create_key("alice", "sandbox:read", "sandbox:create", tenant="acme")
    plain.start()
    receiver = Receiver()
    try:
        for url, words in [
            (receiver.url, "use https"),
            (f"https://127.0.0.1:{receiver.port}/x", "private or loopback"),
        ]:
            resp = plain.request("POST", "/v1/jobs", {"command": ["true"], "notify": url}, key=key)
            assert (resp.status, words in resp.error[1]) == (400, True), resp.body
        # A name is judged when connecting, by the address it resolves to: localhost is refused then.
        wait_for(lambda: plain.request("GET", "/v1/capabilities", key=key).status == 200)
        resp = plain.request("POST", "/v1/jobs", {"command": ["true"], "notify": f"https://localhost:{receiver.port}/x"},
                             key=key)  # fmt: skip
        assert resp.status == 201, resp.body
        wait_for(
            lambda: (
                plain.request("GET", f"/v1/jobs/{resp.json()['id']}", key=key).json()["state"] == "succeeded"
            ),
            60,
        )

        def failed_count() -> float:
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics").read().decode()
            line = [
                x
                for x in text.splitlines()
                if x.startswith('sandbox_gateway_job_notifications_total{result="failed"}')
            ]
            return float(line[0].split()[1]) if line else 0.0

        wait_for(lambda: failed_count() == 2, 30)  # run.finished and job.finished, both given up at connect
        assert receiver.raw == [] and "private or loopback" in plain.log_text()
        # Secrets without a secrets key: 501 for the endpoints and for a job naming one.
        assert plain.request("GET", "/v1/secrets", key=key).error[0] == "unsupported"
        resp = plain.request("POST", "/v1/jobs", {"command": ["true"], "secrets": ["TOKEN"]}, key=key)
        assert (resp.status, resp.error[0]) == (501, "unsupported")
    finally:
        plain.stop()
        receiver.close()
    (w.workdir / "gw-off").mkdir()
    off = GatewayProcess(w.workdir / "gw-off", [], ["--no-notify"])
    key = off.create_key("alice", "sandbox:create", tenant="acme")
    off.start()
    try:
        resp = off.request(
            "POST", "/v1/jobs", {"command": ["true"], "notify": "https://hooks.example.com/x"}, key=key
        )
        assert (resp.status, resp.error[0]) == (501, "unsupported") and "--no-notify" in resp.error[1]
    finally:
        off.stop()


def test_the_cli_and_the_sdk(w: World, tmp_path: Path) -> None:
    env = {**os.environ, "SANDBOX_URL": f"http://127.0.0.1:{w.gw.port}", "SANDBOX_TOKEN": w.keys["carol"]}

    def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sbx.cli.main", *args], env=env, input=stdin,
                              capture_output=True, text=True, check=False)  # fmt: skip

    assert cli("secrets", "set", "CLI_SECRET", stdin="from-stdin\n").stdout == "set CLI_SECRET\n"
    assert "CLI_SECRET" in cli("secrets", "list").stdout and "from-stdin" not in cli("secrets", "list").stdout
    ran = cli("jobs", "run", "--name", "hello", "--secret", "CLI_SECRET", "--env", "A=1", "--wait", "--",
              "sh", "-c", 'echo "$A ${#CLI_SECRET}"')  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    job_id = ran.stdout.split()[1]
    assert "succeeded" in ran.stdout
    assert cli("jobs", "output", job_id).stdout == "1 10\n"
    agents = cli("jobs", "agents")
    assert agents.returncode == 0, agents
    assert [line.split() for line in agents.stdout.splitlines()] == [
        ["NAME", "IMAGE", "PROGRAM", "SECRETS", "ENV"],
        ["shouter", "python3", "AGENT_KEY"],
    ]
    assert [a["name"] for a in json.loads(cli("--json", "jobs", "agents").stdout)["agents"]] == ["shouter"]
    failing = cli("jobs", "run", "--wait", "--", "false")
    assert failing.returncode == 1 and "exit code 1" in failing.stdout
    spec = tmp_path / "api.toml"
    spec.write_text('name = "api"\ncommand = ["sleep", "infinity"]\nreplicas = 1\n')
    applied = cli("services", "apply", str(spec))
    assert applied.returncode == 0 and applied.stdout.split("\n")[1].split()[:2] == ["api", "acme"], applied
    wait_for(lambda: "1/1" in cli("services", "list").stdout, 60)
    assert cli("services", "scale", "api", "2").returncode == 0
    assert cli("services", "delete", "api").stdout == "deleted api\n"
    bad = cli("services", "get", "api")
    assert (bad.returncode, bad.stderr) == (1, "not_found: no service 'api' among yours\n")
    # The blocking SDK, over the same calls.
    from sbx.api.jobs import JobSpec, KeepSpec
    from sbx.client.sync import Client

    with Client(f"http://127.0.0.1:{w.gw.port}", w.keys["carol"]) as client:
        job = client.jobs.create(JobSpec(command=["sh", "-c", "echo sdk > /sandbox/home/f"],
                                         keep=KeepSpec(files=["/sandbox/home/f"])))  # fmt: skip
        done = client.jobs.wait(job.id, timeout_secs=60, poll_secs=0.2)
        assert done.state == "succeeded" and client.jobs.file(job.id, 1, "/sandbox/home/f") == b"sdk\n"
        assert [s.name for s in client.secrets.list()][:1] and client.services.list() == []
