"""Jobs in the state file (tables ``jobs`` and ``job_runs``; see ``sbx.gateway.state``), also held in memory.

A write commits first and changes memory after, through the gateway's writer thread; a run's end, its job's
state and the notifications they cause are one transaction (so a restart neither loses a notification nor
sends one for a change that was not kept).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from sbx.api.jobs import JobSpec, JobState, KeptFile, RunState
from sbx.gateway.store import TABLES, Delete, Op, Store, Upsert

Writer = Callable[..., Awaitable[Any]]
Statement = Op


@dataclass(frozen=True)
class JobRecord:
    """A job as kept: ``spec`` with env values; ``prompt`` of an agent run (written to each run's sandbox)."""

    id: str
    user: str
    tenant: str
    agent: str | None
    spec: JobSpec
    prompt: str | None
    state: JobState
    error: str | None
    created: str
    updated: str


@dataclass(frozen=True)
class RunRecord:
    """One attempt: its sandbox and node once made, ``pid`` once its command started."""

    job: str
    n: int
    state: RunState
    sandbox: str | None = None
    node: str | None = None
    pid: int | None = None
    exit_code: int | None = None
    started: str | None = None
    finished: str | None = None
    error: str | None = None
    truncated: bool = False
    files: tuple[KeptFile, ...] | None = None


_FILES = msgspec.json.Decoder(list[KeptFile])


class JobStore:
    def __init__(self, store: Store, write: Writer) -> None:
        self.store = store
        self._write = write
        self.jobs: dict[str, JobRecord] = {}
        self.runs: dict[tuple[str, int], RunRecord] = {}
        # Memory is a copy of the tables, kept in step with other replicas' writes (``Store.mirror``).
        store.mirror("jobs", self._put_job, lambda k: self.jobs.pop(k[0], None), self.jobs.clear)
        store.mirror("job_runs", self._put_run, lambda k: self.runs.pop((k[0], k[1]), None),
                     self.runs.clear)  # fmt: skip
        for table in ("jobs", "job_runs"):
            for row in store.query(table, TABLES[table].columns):
                store.mirrors[table].put(row)

    def _put_job(self, row: tuple[Any, ...]) -> None:
        self.jobs[row[0]] = JobRecord(
            id=row[0], user=row[1], tenant=row[2], agent=row[3], spec=msgspec.json.decode(row[4], type=JobSpec),
            prompt=row[5], state=row[6], error=row[7], created=row[8], updated=row[9],
        )  # fmt: skip

    def _put_run(self, row: tuple[Any, ...]) -> None:
        self.runs[(row[0], row[1])] = RunRecord(
            job=row[0], n=row[1], state=row[2], sandbox=row[3], node=row[4], pid=row[5], exit_code=row[6],
            started=row[7], finished=row[8], error=row[9], truncated=bool(row[10]),
            files=tuple(_FILES.decode(row[11])) if row[11] else None,
        )  # fmt: skip

    def runs_of(self, job_id: str) -> list[RunRecord]:
        return sorted((r for r in list(self.runs.values()) if r.job == job_id), key=lambda r: r.n)

    @staticmethod
    def job_statement(job: JobRecord) -> Statement:
        return Upsert("jobs", {
            "id": job.id, "user": job.user, "tenant": job.tenant, "agent": job.agent,
            "spec": msgspec.json.encode(job.spec).decode(), "prompt": job.prompt, "state": job.state,
            "error": job.error, "created": job.created, "updated": job.updated,
        })  # fmt: skip

    @staticmethod
    def run_statement(run: RunRecord) -> Statement:
        return Upsert("job_runs", {
            "job": run.job, "n": run.n, "state": run.state, "sandbox": run.sandbox, "node": run.node, "pid": run.pid,
            "exit_code": run.exit_code, "started": run.started, "finished": run.finished, "error": run.error,
            "truncated": int(run.truncated),
            "files": msgspec.json.encode(list(run.files)).decode() if run.files is not None else None,
        })  # fmt: skip

    async def put(
        self, job: JobRecord | None = None, run: RunRecord | None = None, extra: Sequence[Statement] | None = None,
        full: bool = True,
    ) -> None:  # fmt: skip
        """Write ``job`` and/or ``run`` (and ``extra`` statements, e.g. notifications) in one transaction.

        ``full`` fsyncs it. Progress within an attempt (its sandbox, its pid) is written without (a SIGKILL loses
        nothing, a power cut may lose it, and the sandbox is found again by its labels); every state a client was
        told of, or a notification, is fsynced."""
        statements: list[Statement] = [self.job_statement(job)] if job is not None else []
        if run is not None:
            statements.append(self.run_statement(run))
        statements.extend(extra or ())
        await self._write(self.store.execute, statements, full)
        if job is not None:
            self.jobs[job.id] = job
        if run is not None:
            self.runs[(run.job, run.n)] = run

    async def delete(self, job_ids: list[str]) -> None:
        statements: list[Statement] = []
        for job_id in job_ids:
            statements += [
                Delete("jobs", {"id": job_id}),
                Delete("job_runs", {"job": job_id}),
            ]
        await self._write(self.store.execute, statements)
        for job_id in job_ids:
            self.jobs.pop(job_id, None)
            for key in [k for k in list(self.runs) if k[0] == job_id]:
                self.runs.pop(key, None)
