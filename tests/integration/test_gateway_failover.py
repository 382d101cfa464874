"""Three real sandbox-gateway replicas on one PostgreSQL database (a private cluster) in front of one real
sandboxd, clients switching between them, and the leader SIGKILLed under load (issue 23, item 5): sandbox creates,
runs and deletes through every replica, an open SSH session on a survivor (Debian's OpenSSH client), a service's
traffic through the survivors, and a queue of jobs.

Afterwards: no acknowledged write is lost (every acknowledged create exists, every acknowledged delete is gone), no
sandbox, service replica or job run is duplicated or orphaned (the node's listing against the database's records;
each job ran exactly one attempt), and the survivors' clients never noticed (no failed request on a survivor, the
SSH session still answers). The takeover time and the longest gap the survivors' clients saw are printed
(docs/ha.md has the figures); the assertions are on outcomes, with generous deadlines for a loaded machine.
"""

from __future__ import annotations

import itertools
import select
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from pg_cluster import PgCluster
from replicas_harness import DOMAIN, FAST_HEALTH, SERVE_ID, Load, shown
from sandboxd_harness import Sandboxd, free_port
from ssh_client import SshClient, keygen, public_line

ALL = ("sandbox:read", "sandbox:create", "sandbox:delete", "sandbox:ssh")
LEADS = "this replica leads"
#: The issue's bound for another replica to take over the work done once.
TAKEOVER_BOUND_SECS = 15.0
JOBS = 4
#: Sandboxes a load worker keeps (the others it deletes once their run answered).
KEPT_PER_WORKER = 3
#: Each job's command: long enough to be running on the leader when it is killed.
JOB_COMMAND = ["sh", "-c", "sleep 6; echo done"]


@dataclass
class Trio:
    gws: list[GatewayProcess]
    node: Sandboxd
    admin: str
    pg: PgCluster
    dbname: str
    workdir: Path

    def leader(self) -> GatewayProcess:
        leading: list[GatewayProcess] = wait_for(
            lambda: [g for g in self.gws if LEADS in g.log_text()] or None, 30
        )
        assert len(leading) == 1, "more than one replica leads"
        return leading[0]

    def records(self, table: str, column: str) -> list[str]:
        """A column of a table as the database has it (the tests' own connection)."""
        with self.pg.connect(self.dbname) as conn:
            return sorted(str(r[0]) for r in conn.execute(f"SELECT {column} FROM {table}").fetchall())

    def live(self) -> list[dict[str, Any]]:
        """The node's sandboxes that are not terminated."""
        listing = self.node.request("GET", "/v1/sandboxes").json()["sandboxes"]
        return [s for s in listing if s["state"] != "terminated"]


@pytest.fixture(scope="module")
def trio(pg_cluster: PgCluster) -> Iterator[Trio]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxgw-failover-", dir="/var/tmp"))
    for d in ("n1", "a", "b", "c", "keys"):
        (workdir / d).mkdir()
    node = Sandboxd(workdir / "n1", args=["--node-id", "f"]).start()
    url = pg_cluster.create_database()
    env = pg_cluster.env()
    gws = [
        GatewayProcess(workdir / name, [("n1", node)], [
            *FAST_ARGS, "--ssh-listen", f"127.0.0.1:{free_port()}", "--services-domain", DOMAIN,
        ], database=url, database_env=env)
        for name in ("a", "b", "c")
    ]  # fmt: skip
    admin = gws[0].create_key("root", "admin")
    try:
        for gw in gws:
            gw.start()
        yield Trio(gws, node, admin, pg_cluster, url.split("?")[0].rsplit("/", 1)[-1], workdir)
    finally:
        for gw in gws:
            gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass
class Worker:
    """Sandbox creates, runs and deletes through one replica, in a loop on a thread, until stopped. Every
    acknowledged create and delete is kept, and every failed request (with its time)."""

    gw: GatewayProcess
    key: str
    name: str
    created: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    #: Deletes sent without an answer (the replica killed while it served one): they may have been done.
    unanswered_deletes: list[str] = field(default_factory=list)
    failures: list[tuple[float, str]] = field(default_factory=list)
    #: When each request was answered with success (monotonic seconds).
    answered: list[float] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.stop.set()
        assert self.thread is not None
        self.thread.join(300)

    def _call(self, method: str, path: str, body: Any, ok: tuple[int, ...]) -> Any:
        try:
            resp = self.gw.request(method, path, body, key=self.key, timeout=120)
        except OSError as exc:
            self.failures.append((time.monotonic(), f"{method} {path}: {type(exc).__name__}"))
            return None
        if resp.status not in ok:
            self.failures.append((time.monotonic(), f"{method} {path}: {resp.status} {resp.body[:200]!r}"))
            return None
        self.answered.append(time.monotonic())
        return resp

    def _run(self) -> None:
        for i in itertools.count():
            if self.stop.is_set():
                return
            made = self._call("POST", "/v1/sandboxes", {"name": f"{self.name}-{i}", "cpus": 1}, (201,))
            if made is None:
                time.sleep(0.2)
                continue
            sandbox = made.json()["id"]
            self.created.append(sandbox)
            ran = self._call("POST", f"/v1/sandboxes/{sandbox}/run", {"argv": ["echo", "hi"]}, (200,))
            if ran is not None and ran.json()["exit_code"] != 0:
                self.failures.append((time.monotonic(), f"run exited {ran.json()['exit_code']}"))
            # A few are kept (the node's capacity is bounded: 32 CPUs given out on this 2-core machine).
            kept = len(self.created) - len(self.deleted) - 1
            if i % 4 != 0 or kept >= KEPT_PER_WORKER:
                if self._call("DELETE", f"/v1/sandboxes/{sandbox}", None, (200, 202, 204)):
                    self.deleted.append(sandbox)
                else:
                    self.unanswered_deletes.append(sandbox)

    def longest_gap(self) -> float:
        return max((b - a for a, b in itertools.pairwise(self.answered)), default=0.0)


class Session:
    """An SSH session (a shell reading commands from stdin) held open through one replica's SSH server."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.lock = threading.Lock()
        self.asked = 0

    def ask(self, timeout_secs: float = 60) -> bool:
        """Send ``echo ping-N`` and wait for its line back; False when it did not come."""
        with self.lock:
            self.asked += 1
            line = f"ping-{self.asked}\n".encode()
            assert self.proc.stdin is not None and self.proc.stdout is not None
            try:
                self.proc.stdin.write(b"echo " + line)
                self.proc.stdin.flush()
            except OSError:
                return False
            deadline = time.monotonic() + timeout_secs
            while time.monotonic() < deadline:
                ready, _, _ = select.select([self.proc.stdout], [], [], deadline - time.monotonic())
                if not ready:
                    return False
                got = self.proc.stdout.readline()
                if got == line:
                    return True
                if got == b"":
                    return False
            return False


def test_sigkill_of_the_leader_under_load_loses_nothing_and_the_survivors_clients_never_notice(
    trio: Trio,
) -> None:
    leader = trio.leader()
    survivors = [g for g in trio.gws if g is not leader]
    s1, s2 = survivors
    made = s1.request("POST", "/v1/admin/keys", {"user": "alice", "tenant": "acme", "scopes": list(ALL)},
                      key=trio.admin)  # fmt: skip
    assert made.status == 201, made.body
    alice = made.json()["secret"]

    # An SSH session on a survivor, into a sandbox made through the other one, with a key registered on the leader.
    identity = keygen(trio.workdir / "keys", "alice", "ed25519")
    registered = leader.request("POST", "/v1/ssh-keys", {"key": public_line(identity)}, key=alice)
    assert registered.status == 201, registered.body
    assert s2.request("POST", "/v1/sandboxes", {"name": "sshbox"}, key=alice).status == 201
    info = s1.request("GET", "/v1/ssh", key=alice).json()
    ssh = SshClient(trio.workdir, "127.0.0.1", info["port"], info["host_keys"])
    session = Session(ssh.popen("sshbox", "sh", identity=identity, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    # A service of two replicas made through a survivor, shown ready alike by all three.
    body = {"name": "web", "command": SERVE_ID, "port": 8080, "replicas": 2, "health": FAST_HEALTH}
    assert s2.request("POST", "/v1/services", body, key=alice).status == 201
    try:
        assert session.ask(), "the SSH session did not answer"
        wait_for(lambda: shown(leader, alice, "web")[0] == 2, 180)
        for gw in survivors:
            wait_for(lambda g=gw: shown(g, alice, "web") == shown(leader, alice, "web"), 20)
        # A queue of jobs, submitted through every replica; the leader runs them.
        jobs = []
        for gw in itertools.islice(itertools.cycle(trio.gws), JOBS):
            job = gw.request("POST", "/v1/jobs", {"command": JOB_COMMAND, "retries": 1}, key=alice)
            assert job.status == 201, job.body
            jobs.append(job.json()["id"])

        def job_runs(job_id: str) -> list[dict[str, Any]]:
            return s1.request("GET", f"/v1/jobs/{job_id}", key=alice).json()["runs"]  # type: ignore[no-any-return]

        wait_for(lambda: any(r["state"] == "running" for j in jobs for r in job_runs(j)), 120)

        # The load: creates, runs and deletes through all three replicas, the service's traffic through both
        # survivors, and the SSH session asked every half second.
        workers = [Worker(gw, alice, f"w{i}") for i, gw in enumerate(trio.gws)]
        pings: list[tuple[float, bool]] = []
        pinging = threading.Event()

        def pinger() -> None:
            while not pinging.is_set():
                pings.append((time.monotonic(), session.ask()))
                time.sleep(0.5)

        ping_thread = threading.Thread(target=pinger, daemon=True)
        with Load(s1, alice, "web--acme") as load1, Load(s2, alice, "web--acme") as load2:
            for worker in workers:
                worker.start()
            ping_thread.start()
            time.sleep(4)
            leader.kill()
            killed = time.monotonic()
            new_leader = wait_for(lambda: [g for g in survivors if LEADS in g.log_text()] or None, 30, 0.05)
            took = time.monotonic() - killed
            assert len(new_leader) == 1, "both survivors lead"
            time.sleep(8)  # the load goes on under the new leader
            for worker in workers:
                worker.join()
            pinging.set()
            ping_thread.join(120)
        survivor_workers = [w for w in workers if w.gw is not leader]
        service_gap, gap_began = max(load1.gap_at(), load2.gap_at())
        api_gap = max(w.longest_gap() for w in survivor_workers)
        print(
            f"takeover after the leader's SIGKILL: {took:.2f} s; survivors' clients: "
            f"{sum(len(w.created) for w in survivor_workers)} creates, "
            f"{len(load1.answers) + len(load2.answers)} service requests, {len(pings)} SSH pings; "
            f"failed: {sum(len(w.failures) for w in survivor_workers)} API, "
            f"{len(load1.failures()) + len(load2.failures())} service, {sum(not ok for _, ok in pings)} SSH; "
            f"longest gap between two answers: service {service_gap:.2f} s (from {gap_began - killed:+.2f} s of "
            f"the kill), API {api_gap:.2f} s (a create's own time included); per survivor, the new leader first: "
            + ", ".join(
                f"service {load.gap_at()[0]:.2f} s from {load.gap_at()[1] - killed:+.2f} s"
                for load in sorted((load1, load2), key=lambda x: x.gw is not new_leader[0])
            )
        )
        leaders_client = [w for w in workers if w.gw is leader]
        print(
            "the killed replica's client: "
            f"{[f for w in leaders_client for f in w.failures][:5]}, unanswered deletes "
            f"{[s for w in leaders_client for s in w.unanswered_deletes]}"
        )
        # The survivors' clients never noticed; the work done once was taken over within the bound.
        assert took < TAKEOVER_BOUND_SECS
        for worker in survivor_workers:
            assert worker.failures == [], (worker.name, worker.failures[:5])
            assert any(t > killed for t in worker.answered), f"{worker.name} made nothing after the kill"
        assert load1.failures() == [] and load2.failures() == [], (load1.failures()[:5], load2.failures()[:5])
        assert [t for t, ok in pings if not ok] == [], "the SSH session stopped answering"
        assert any(t > killed for t, _ in pings) and session.ask(), "the SSH session is not usable"

        # No acknowledged write lost: every acknowledged create (on any replica, the killed one's included) is
        # there unless an acknowledged delete ended it, and every acknowledged delete is ended (its record stays,
        # terminated, until the node forgets the sandbox). A delete the killed replica never answered may have
        # been done before it died, or not: either is right (the node ended the sandbox and the new leader forgot
        # its record, 404), so that sandbox is not checked; the survivors' clients had none (no failures above).
        created = {s for w in workers for s in w.created}
        deleted = {s for w in workers for s in w.deleted}
        unanswered = {s for w in workers for s in w.unanswered_deletes}
        for sandbox in sorted(created - unanswered):
            got = s2.request("GET", f"/v1/sandboxes/{sandbox}", key=alice)
            if sandbox in deleted:
                assert got.status == 404 or got.json()["state"] == "terminated", (
                    sandbox,
                    got.status,
                    got.body,
                )
            else:
                assert got.status == 200 and got.json()["state"] != "terminated", (
                    sandbox,
                    got.status,
                    got.body,
                )

        # Nothing duplicated or orphaned: every sandbox the node runs for the gateway has its record (an
        # unacknowledged create cut by the kill is taken back from its labels by the new leader's sweep), every
        # acknowledged create runs (but one with an unanswered delete, which may have ended it: seen, the killed
        # replica's DELETE cut off with the node's sandbox already ended), no acknowledged delete does, and no
        # record names a sandbox the node does not know.
        def node_matches_records() -> bool | tuple[list[str], list[str]]:
            listing = trio.node.request("GET", "/v1/sandboxes").json()["sandboxes"]
            owned = {s["id"] for s in listing if "gateway.owner" in s.get("labels", {})}
            live = {s["id"] for s in listing if s["state"] != "terminated" and s["id"] in owned}
            recorded = set(trio.records("sandboxes", "id"))
            good = live <= recorded <= owned
            return good or (sorted(live - recorded), sorted(recorded - owned))

        wait_for(node_matches_records, 120)
        live = {s["id"] for s in trio.live()}
        assert (created - deleted - unanswered) <= live, sorted((created - deleted - unanswered) - live)
        assert not deleted & live, sorted(deleted & live)

        def jobs_done() -> bool:
            return all(
                s1.request("GET", f"/v1/jobs/{j}", key=alice).json()["state"] == "succeeded" for j in jobs
            )

        wait_for(jobs_done, 180)
        for job_id in jobs:
            assert [(r["n"], r["state"]) for r in job_runs(job_id)] == [(1, "succeeded")], job_id
        assert trio.records("job_runs", "job") == sorted(jobs)
        wait_for(lambda: not [s for s in trio.live() if "gateway.job" in s.get("labels", {})], 120)

        def service_matches() -> bool | tuple[list[str], list[str]]:
            on_node = sorted(s["id"] for s in trio.live() if "gateway.service.id" in s.get("labels", {}))
            recorded = trio.records("service_replicas", "sandbox")
            return (len(on_node) == 2 and on_node == recorded) or (on_node, recorded)

        wait_for(service_matches, 120)
        for gw in survivors:
            assert shown(gw, alice, "web")[0] == 2
    finally:
        if session.proc.stdin is not None:
            session.proc.stdin.close()
        session.proc.terminate()
        session.proc.wait(30)
        serving = [g for g in trio.gws if g.proc is not None and g.proc.poll() is None]
        if serving:
            serving[0].request("DELETE", "/v1/services/web", key=alice)
