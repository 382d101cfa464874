"""The jobs controller, its runner and its notifier built from the interfaces they are given (issue 34): a real
SQLite store, a node registry whose node answers from a stand-in client, a stand-in sandbox service, leadership
that changes after construction, an audit list. No gateway, no aiohttp application."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hook_receiver import Writer, receiver
from prometheus_client import CollectorRegistry
from stand_ins import Audit, Leader

from sbx.api.errors import InvalidRequest, Unsupported
from sbx.api.jobs import JobSpec
from sbx.api.processes import OutputExit, ProcessRequest
from sbx.api.sandboxes import CreateRequest
from sbx.gateway.auth import Principal
from sbx.gateway.jobs.controller import JobController, JobOptions
from sbx.gateway.jobs.notify import NotifyPolicy
from sbx.gateway.jobs.runner import JOB_LABEL, REVOKED, RUN_LABEL
from sbx.gateway.jobs.store import JobRecord
from sbx.gateway.nodes import Node, Registry
from sbx.gateway.secrets import Secrets
from sbx.gateway.state import KeyRecord, NodeDef, SandboxRecord
from sbx.gateway.store import Store, StoreLocation, open_store

pytestmark = pytest.mark.timeout(60)

ALICE = Principal.owner("alice", "acme")


@dataclass
class Listed:
    """A sandbox as a node lists it (what the sweep reads)."""

    id: str
    labels: dict[str, str]
    state: str = "running"
    created_at: str = "2020-01-01T00:00:00Z"


@dataclass
class NodeStandIn:
    """The node client calls a run makes: each started command exits with the next of ``exits``."""

    exits: list[int] = field(default_factory=list)
    listing: list[Listed] = field(default_factory=list)
    started: list[tuple[str, ProcessRequest]] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    async def sandboxes(self) -> list[Listed]:
        return list(self.listing)

    async def processes(self, sandbox: str) -> list[Any]:
        return []

    async def start_process(self, sandbox: str, request: ProcessRequest) -> Any:
        self.started.append((sandbox, request))
        return type("Started", (), {"pid": len(self.started)})()

    async def follow_output(self, sandbox: str, pid: int) -> AsyncIterator[OutputExit]:
        yield OutputExit(exit_code=self.exits[pid - 1])

    async def delete_sandbox(self, sandbox: str) -> None:
        self.deleted.append(sandbox)


@dataclass
class Made:
    id: str
    created_at: str = "2020-01-01T00:00:00Z"


@dataclass
class SandboxesStandIn:
    """The sandbox service as the jobs see it (``RunSandboxes``): makes sandboxes on ``n1``, records what ends."""

    made: list[Mapping[str, str]] = field(default_factory=list)
    orphans_ended: list[str] = field(default_factory=list)

    async def create(
        self, principal: Principal, req: CreateRequest, *, gateway_labels: Mapping[str, str] | None = None
    ) -> tuple[Made, str]:
        self.made.append(dict(gateway_labels or {}))
        return Made(f"sbx_{len(self.made)}"), "n1"

    async def terminated(self, rec: SandboxRecord) -> None:
        raise AssertionError("no record is kept for these sandboxes: nothing to mark terminated")

    async def end_orphan(self, node: Node, sandbox_id: str, why: str) -> None:
        self.orphans_ended.append(sandbox_id)


@dataclass
class Parts:
    controller: JobController
    store: Store
    node: NodeStandIn
    sandboxes: SandboxesStandIn
    leadership: Leader
    audit: Audit


@contextlib.asynccontextmanager
async def parts(
    tmp_path: Path, node: NodeStandIn | None = None, *, leading: bool = True, with_key: bool = True,
    notify: NotifyPolicy | None = None,
) -> AsyncIterator[Parts]:  # fmt: skip
    store = open_store(StoreLocation(state=tmp_path / "gw.db"), serving=True)
    if with_key:
        store.add_key(KeyRecord("key_1", "alice", "acme", frozenset({"sandboxes"}), "0" * 64, "t"))
    node = node or NodeStandIn()
    registry = Registry()
    registry.add(Node(NodeDef("n1", "http://127.0.0.1:1"), node, healthy=True))  # type: ignore[arg-type]
    sandboxes, leadership, audit = SandboxesStandIn(), Leader(leading), Audit()
    options = JobOptions(tmp_path / "jobs", notify=notify or NotifyPolicy())
    controller = JobController(
        options, store=store, writes=Writer(), registry=registry, sandboxes=sandboxes,
        secrets=Secrets(Writer(), store, None),
        leadership=leadership, audit=audit, metrics=CollectorRegistry(),
    )  # fmt: skip
    try:
        yield Parts(controller, store, node, sandboxes, leadership, audit)
    finally:
        await controller.close()
        store.close()


async def ended(controller: JobController, job_id: str, timeout_secs: float = 10.0) -> JobRecord:
    deadline = time.monotonic() + timeout_secs
    while time.monotonic() < deadline:
        job = controller.db.jobs[job_id]
        if job.state in ("succeeded", "failed", "cancelled") and job_id not in controller.runtimes:
            return job
        await asyncio.sleep(0.02)
    raise AssertionError(f"job {job_id} did not end: {controller.db.jobs[job_id]}")


# (exit codes of the attempts in turn, retries) -> (job state, job error, runs made)
ATTEMPTS = [
    ([0], 0, "succeeded", None, 1),
    ([3], 0, "failed", "exit code 3", 1),
    ([1, 0], 2, "succeeded", None, 2),
    ([1, 2], 1, "failed", "exit code 2", 2),
    ([5, 6, 7], 2, "failed", "exit code 7", 3),
]


@pytest.mark.parametrize(("exits", "retries", "state", "error", "runs"), ATTEMPTS)
async def test_attempts_follow_the_exit_codes(
    tmp_path: Path, exits: list[int], retries: int, state: str, error: str | None, runs: int
) -> None:
    async with parts(tmp_path, NodeStandIn(exits=exits)) as p:
        spec = p.controller.check(ALICE, JobSpec(command=["true"], retries=retries))
        job = await ended(p.controller, (await p.controller.submit(ALICE, spec)).id)
        assert (job.state, job.error) == (state, error)
        made = p.controller.db.runs_of(job.id)
        assert [r.n for r in made] == list(range(1, runs + 1))
        assert [r.exit_code for r in made] == exits[:runs]
        # One sandbox per attempt, labelled for its run, ended once the attempt is over.
        assert p.sandboxes.made == [{JOB_LABEL: job.id, RUN_LABEL: str(n)} for n in range(1, runs + 1)]
        assert p.node.deleted == [f"sbx_{n}" for n in range(1, runs + 1)]
        assert [argv.argv for _, argv in p.node.started] == [["true"]] * runs


async def test_a_job_whose_owner_has_no_key_is_cancelled_as_revoked_and_audited(tmp_path: Path) -> None:
    async with parts(tmp_path, NodeStandIn(exits=[0]), with_key=False) as p:
        job = await ended(p.controller, (await p.controller.submit(ALICE, JobSpec(command=["true"]))).id)
        assert (job.state, job.error) == ("cancelled", REVOKED)
        assert p.sandboxes.made == []
        assert p.audit.entries == [{"kind": "revocation", "type": "job.revoked", "user": "alice", "tenant": "acme",
                                    "target": job.id, "result": "cancelled"}]  # fmt: skip


async def test_leadership_is_asked_each_time_not_copied_at_construction(tmp_path: Path) -> None:
    async with parts(tmp_path, NodeStandIn(exits=[0]), leading=False) as p:
        job = await p.controller.submit(ALICE, JobSpec(command=["true"]))
        await asyncio.sleep(0.1)
        assert p.controller.runtimes == {}  # a follower leaves the job to the leader
        assert p.controller.db.jobs[job.id].state == "queued"
        p.leadership.leading = True  # this replica took the lead since
        await p.controller.start()
        assert (await ended(p.controller, job.id)).state == "succeeded"


async def test_access_changed_cancels_only_when_leading(tmp_path: Path) -> None:
    async with parts(tmp_path, NodeStandIn(exits=[0]), leading=False) as p:
        job = await p.controller.submit(ALICE, JobSpec(command=["true"]))
        p.store.revoke_key("key_1")
        await p.controller.access_changed()
        assert p.controller.db.jobs[job.id].state == "queued"
        assert p.audit.entries == []
        p.leadership.leading = True
        await p.controller.access_changed()
        assert (p.controller.db.jobs[job.id].state, p.controller.db.jobs[job.id].error) == (
            "cancelled",
            REVOKED,
        )
        assert [e["type"] for e in p.audit.entries] == ["job.revoked"]


# (labels of a sandbox the node lists, its state) -> whether the start-up sweep ends it
SWEEP = [
    ({JOB_LABEL: "job_gone", RUN_LABEL: "1"}, "running", True),
    ({JOB_LABEL: "job_gone", RUN_LABEL: "x"}, "running", True),
    ({JOB_LABEL: "job_gone", RUN_LABEL: "1"}, "terminated", False),
    ({"team": "a"}, "running", False),
    ({}, "running", False),
]


@pytest.mark.parametrize(("labels", "state", "ends"), SWEEP)
async def test_start_up_sweep_ends_sandboxes_of_no_running_run(
    tmp_path: Path, labels: dict[str, str], state: str, ends: bool
) -> None:
    node = NodeStandIn(listing=[Listed("sbx_old", labels, state)])
    async with parts(tmp_path, node) as p:
        await p.controller.start()
        assert p.sandboxes.orphans_ended == (["sbx_old"] if ends else [])


# a JobSpec -> the error check() raises (None: accepted)
CHECKS: list[tuple[JobSpec, type[Exception] | None, str]] = [
    (JobSpec(command=["true"]), None, ""),
    (JobSpec(command=["true"], from_snapshot="snap_0123456789abcdef"), InvalidRequest, "no snapshot"),
    (JobSpec(command=["true"], secrets=["TOKEN"]), Unsupported, "secrets"),
    (JobSpec(command=["true"], notify="https://hooks.example.com/x"), None, ""),
    (JobSpec(command=["true"], retries=11), InvalidRequest, "retries"),
]


@pytest.mark.parametrize(("spec", "raises", "says"), CHECKS)
async def test_check_uses_the_store_and_secrets_it_was_given(
    tmp_path: Path, spec: JobSpec, raises: type[Exception] | None, says: str
) -> None:
    async with parts(tmp_path) as p:
        if raises is None:
            assert p.controller.check(ALICE, spec).retries == (spec.retries or 0)
        else:
            with pytest.raises(raises, match=says):
                p.controller.check(ALICE, spec)


async def test_the_notifier_posts_each_runs_end_then_the_jobs(tmp_path: Path) -> None:
    got: list[dict[str, Any]] = []
    arrived = asyncio.Event()

    async def hook(request: web.Request) -> web.Response:
        got.append(json.loads(await request.read()))
        if got[-1]["event"] == "job.finished":
            arrived.set()
        return web.Response()

    async with receiver(hook) as url, parts(
        tmp_path, NodeStandIn(exits=[4, 0]), notify=NotifyPolicy(allow_private=True)
    ) as p:  # fmt: skip
        await p.controller.start()
        spec = p.controller.check(ALICE, JobSpec(command=["true"], retries=1, notify=url))
        job = await p.controller.submit(ALICE, spec)
        await asyncio.wait_for(arrived.wait(), 10)
    assert [(g["event"], g.get("run"), g.get("exit_code"), g["job_state"]) for g in got] == [
        ("run.finished", 1, 4, "running"), ("run.finished", 2, 0, "running"), ("job.finished", None, None, "succeeded"),
    ]  # fmt: skip
    assert {g["job"] for g in got} == {job.id}
