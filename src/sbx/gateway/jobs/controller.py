"""The jobs controller: every job's attempts, cancellation, revocation, and what is kept afterwards (spec: Jobs,
agent runs, secrets; Revocation 3; docs/jobs.md).

A job runs one attempt at a time (``runner``), numbered from 1, up to ``1 + retries`` while they fail; the job
ends ``succeeded`` with the first attempt that exits 0, ``failed`` after the last one fails, or ``cancelled``.
Its state is ``queued`` until its first sandbox is made, then ``running``. ``job.finished`` is written with the
job's end in one transaction, once.

Cancellation (``DELETE /v1/jobs/{id}``, and revocation): the job's task is cancelled, its running sandbox ended,
its current run and the job marked ``cancelled`` with the reason, and no further run starts; the call answers
once this is done (a minute at most). Revocation (spec: Revocation 3) cancels, before the revoking call returns,
every job whose owner holds no active key at all in its tenant, with ``cancelled: the owner's access was
revoked``, audited ``job.revoked``; it is checked again every 30 s and at start.

A restart takes up every unfinished job where it was (see ``runner``). Every minute sandboxes labelled for a run
that is not running in them (a create cancelled half way, a node that came back) are ended, and finished jobs
older than ``--job-retention`` (default 7 days) are forgotten with their kept output and files.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets as random_source
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from msgspec import UNSET
from msgspec.structs import replace
from prometheus_client import CollectorRegistry

from sbx.api.errors import NotFound, SandboxError
from sbx.api.jobs import FINISHED_STATES, Job, JobNotification, JobSpec, JobState, Run, RunOutput
from sbx.gateway import auth
from sbx.gateway.auth import Principal
from sbx.gateway.interfaces import AuditSink, Leadership, Writes
from sbx.gateway.jobs.agents import AgentDef
from sbx.gateway.jobs.interfaces import RunSandboxes
from sbx.gateway.jobs.metrics import JobMetrics
from sbx.gateway.jobs.notify import Notifier, NotifyPolicy
from sbx.gateway.jobs.outputs import STREAM_CAP_BYTES, AnyOutputs, Outputs, StoredFile, StoreOutputs
from sbx.gateway.jobs.runner import JOB_LABEL, REVOKED, RUN_LABEL, JobCancelled, Runner
from sbx.gateway.jobs.spec import check_job
from sbx.gateway.jobs.store import JobRecord, JobStore, RunRecord
from sbx.gateway.nodes import Node, Registry
from sbx.gateway.secrets import Secrets
from sbx.gateway.state import now_rfc3339, older_than
from sbx.gateway.store import Store

log = logging.getLogger(__name__)

DEFAULT_RETENTION_SECS: Final = 7 * 24 * 3600.0
#: Seconds a cancel waits for the job's runs to stop (the spec's "a minute at most").
CANCEL_WAIT_SECS: Final = 60.0
SWEEP_SECS: Final = 60.0
#: A labelled sandbox no running run holds is ended only when older than this (a create may be recording it).
ORPHAN_AGE_SECS: Final = 60.0


@dataclass(eq=False)
class JobRuntime:
    id: str
    task: asyncio.Task[None] | None = None
    #: Why the job is being cancelled (None: not cancelled; a stop of the gateway leaves it as it is).
    cancelling: str | None = None


@dataclass(frozen=True)
class JobOptions:
    """``--jobs-dir``, ``--job-retention``, ``--no-notify``/``--notify-allow-private``, ``--agents-file``."""

    outputs_dir: Path
    retention_secs: float = DEFAULT_RETENTION_SECS
    notify: NotifyPolicy = dataclasses.field(default_factory=NotifyPolicy)
    agents: dict[str, AgentDef] = dataclasses.field(default_factory=dict)
    #: Keep the runs' output and files in the store (PostgreSQL: read alike by every replica), ``outputs_dir``
    #: then only read for runs kept there before (docs/jobs.md).
    shared_outputs: bool = False


#: The signal a follower sends the leader to cancel a job (``Store.signal``; arguments: job id, reason).
CANCEL_SIGNAL = "cancel_job"


class JobController:
    """Every job of the gateway, from what it was given: the store (jobs, runs, the outbox, access), ``writes`` to
    it, the node ``registry``, the sandbox service, the tenants' ``secrets``, whether this replica ``leads`` (asked
    each time: it changes), the ``audit`` log and the metrics registry the jobs' gauges and counters join."""

    def __init__(
        self, options: JobOptions, *, store: Store, writes: Writes, registry: Registry, sandboxes: RunSandboxes,
        secrets: Secrets, leadership: Leadership, audit: AuditSink, metrics: CollectorRegistry,
    ) -> None:  # fmt: skip
        self.options = options
        self.store = store
        self.registry = registry
        self.sandboxes = sandboxes
        self.secrets = secrets
        self.leadership = leadership
        self.audit = audit
        self.db = JobStore(store, writes.write)
        self.outputs: AnyOutputs = (
            StoreOutputs(store, options.outputs_dir)
            if options.shared_outputs
            else Outputs(options.outputs_dir)
        )
        self.metrics = JobMetrics(metrics, self._counts)
        self.notifier = Notifier(writes, store, options.notify, self.metrics.count_notification)
        self.runner = Runner(self.db, self.outputs, self.notifier, self.metrics.count_run, store=store,
                             registry=registry, sandboxes=sandboxes, secrets=secrets)  # fmt: skip
        self.runtimes: dict[str, JobRuntime] = {}
        #: Unfinished jobs already audited ``job.revoked``: a revocation is found by the sweep (``access_changed``)
        #: and by the job's runner between two attempts, often both, and is audited once.
        self._revoked: set[str] = set()
        self._sweeper: asyncio.Task[None] | None = None

    def _counts(self) -> tuple[int, int]:
        """(jobs queued, runs running)."""
        queued = sum(1 for j in list(self.db.jobs.values()) if j.state == "queued")
        running = sum(1 for r in list(self.db.runs.values()) if r.state == "running")
        return queued, running

    def tenants(self) -> set[str]:
        return {job.tenant for job in list(self.db.jobs.values())}

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Take up unfinished jobs (after checking their owners), start the notifier and the sweeper."""
        for node in self.registry.healthy():
            await self._sweep_node(node, adopt=True)
        for job in list(self.db.jobs.values()):
            if job.state not in FINISHED_STATES:
                self._spawn(job.id)
        await self.access_changed()
        await self.notifier.start()
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="job-sweeper")

    async def close(self) -> None:
        tasks = [rt.task for rt in self.runtimes.values() if rt.task is not None]
        if self._sweeper is not None:
            tasks.append(self._sweeper)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.notifier.close()

    def _spawn(self, job_id: str) -> None:
        rt = self.runtimes[job_id] = JobRuntime(job_id)
        rt.task = asyncio.create_task(self._drive(rt), name=f"job-{job_id}")

    # -- the routes' calls ----------------------------------------------------------------------------

    def check(self, principal: Principal, spec: JobSpec) -> JobSpec:
        """``spec`` checked for ``principal`` (``spec.check_job``), against this gateway's nodes and secrets."""
        return check_job(self.store, self.registry, self.secrets, principal, spec, self.options.notify)

    async def submit(
        self, principal: Principal, spec: JobSpec, agent: str | None = None, prompt: str | None = None
    ) -> JobRecord:
        """A new job of ``principal`` (``spec`` already checked), started at once."""
        now = now_rfc3339()
        job = JobRecord(
            id="job_" + random_source.token_hex(8), user=principal.user, tenant=principal.tenant, agent=agent,
            spec=spec, prompt=prompt, state="queued", error=None, created=now, updated=now,
        )  # fmt: skip
        await self.db.put(job=job, run=RunRecord(job.id, 1, "queued"))
        if self.leadership.leading:  # else the leader takes it up from the database (taken_up)
            self._spawn(job.id)
        log.info("job submitted", extra={"job": job.id, "agent": agent})
        return job

    def find(self, principal: Principal, job_id: str) -> JobRecord:
        job = self.db.jobs.get(job_id)
        if job is None or not principal.owns(job.user, job.tenant):
            raise NotFound(f"no job {job_id!r} among yours")
        return job

    def listing(self, principal: Principal) -> list[JobRecord]:
        mine = [j for j in list(self.db.jobs.values()) if principal.owns(j.user, j.tenant)]
        return sorted(mine, key=lambda j: (j.created, j.id), reverse=True)

    async def cancel(self, job: JobRecord, reason: str = "cancelled") -> JobRecord:
        """End ``job`` (see the module docstring) and answer it once its runs have stopped."""
        if not self.leadership.leading:
            # The leader runs the job: ask it (``cancel_asked``), and answer once its end arrives here, or as the
            # job is after the wait (while no replica leads, during a takeover, the request is lost: ask again).
            await asyncio.to_thread(self.store.signal, CANCEL_SIGNAL, (job.id, reason))
            deadline = time.monotonic() + CANCEL_WAIT_SECS
            while time.monotonic() < deadline:
                current = self.db.jobs.get(job.id)
                if current is None or current.state in FINISHED_STATES:
                    break
                await asyncio.sleep(0.05)
            return self.db.jobs.get(job.id, job)
        rt = self.runtimes.get(job.id)
        if rt is not None and rt.task is not None and not rt.task.done():
            if rt.cancelling is None:
                rt.cancelling = reason
                rt.task.cancel()
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                async with asyncio.timeout(CANCEL_WAIT_SECS):
                    await asyncio.shield(rt.task)
        return self.db.jobs.get(job.id, job)

    def wire(self, job: JobRecord, with_runs: bool) -> Job:
        spec = job.spec
        return Job(
            id=job.id, name=spec.name, agent=job.agent if job.agent is not None else UNSET,
            spec=replace(spec, env=UNSET), env_names=sorted(spec.env or {}), owner=job.user, tenant=job.tenant or None,
            state=job.state, error=job.error, created_at=job.created, updated_at=job.updated,
            runs=[_run_wire(r) for r in self.db.runs_of(job.id)] if with_runs else UNSET,
        )  # fmt: skip

    def run_of(self, job: JobRecord, n: str) -> RunRecord:
        run = self.db.runs.get((job.id, int(n))) if n.isdigit() else None
        if run is None:
            raise NotFound(f"job {job.id} has no run {n!r}")
        if run.state not in FINISHED_STATES:
            raise NotFound(f"run {run.n} of job {job.id} has not ended yet: its output is kept when it ends")
        return run

    async def output(self, job: JobRecord, n: str) -> RunOutput:
        run = self.run_of(job, n)
        stdout = await asyncio.to_thread(self.outputs.read_stream, job.id, run.n, "stdout")
        stderr = await asyncio.to_thread(self.outputs.read_stream, job.id, run.n, "stderr")
        return RunOutput(stdout=stdout, stderr=stderr, truncated=run.truncated or max(len(stdout), len(stderr))
                         > STREAM_CAP_BYTES)  # fmt: skip

    async def kept_file(self, job: JobRecord, n: str, path: str) -> Path | StoredFile | bytes:
        """The kept file: its path on this gateway's disk, its chunks in the store, or (kept as a file by this
        gateway before a ``migrate``) its bytes."""
        run = self.run_of(job, n)
        for i, kept in enumerate(run.files or ()):
            if kept.path == path and kept.bytes is not UNSET:
                if isinstance(self.outputs, Outputs):
                    on_disk = self.outputs.file_path(job.id, run.n, i)
                    if on_disk.exists():
                        return on_disk
                    break
                found = await asyncio.to_thread(self.outputs.stored_file, job.id, run.n, i)
                if found is not None:
                    return found
        raise NotFound(f"run {run.n} of job {job.id} kept no file {path!r}")

    # -- a job's task ---------------------------------------------------------------------------------

    async def _drive(self, rt: JobRuntime) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            await self._attempts(rt)
        except asyncio.CancelledError:
            if rt.cancelling is None:
                raise  # the gateway is stopping: the job is taken up at the next start
            task.uncancel()
            await self._cancelled(rt.id, rt.cancelling)
        except JobCancelled as exc:  # the owner's access was found gone before a sandbox was made
            rt.cancelling = exc.reason
            job = self.db.jobs.get(rt.id)
            if job is not None:
                self._audit_revoked(job)
            await self._cancelled(rt.id, exc.reason)
        except Exception:
            log.exception("job task failed", extra={"job": rt.id})
            job = self.db.jobs.get(rt.id)
            if job is not None and job.state not in FINISHED_STATES:
                await self._finish(job, "failed", "the gateway failed running this job; see its log")
        finally:
            if self.runtimes.get(rt.id) is rt:
                self.runtimes.pop(rt.id, None)

    async def _attempts(self, rt: JobRuntime) -> None:
        while True:
            job = self.db.jobs[rt.id]
            runs = self.db.runs_of(job.id)
            last = runs[-1] if runs else None
            if last is not None and last.state in FINISHED_STATES:
                retries = job.spec.retries if job.spec.retries is not UNSET else 0
                if last.state == "succeeded":
                    await self._finish(job, "succeeded", None)
                    return
                if last.state == "cancelled" or last.n > retries:
                    await self._finish(job, "failed" if last.state == "failed" else "cancelled",
                                       last.error or "the run failed")  # fmt: skip
                    return
                last = None
                await self.db.put(run=RunRecord(job.id, runs[-1].n + 1, "queued"))
                continue
            if last is None:
                last = RunRecord(job.id, 1, "queued")
                await self.db.put(run=last)
            await self.runner.attempt(job, last)

    async def _cancelled(self, job_id: str, reason: str) -> None:
        job = self.db.jobs.get(job_id)
        if job is None or job.state in FINISHED_STATES:
            return
        runs = self.db.runs_of(job_id)
        for run in runs:
            if run.state not in FINISHED_STATES:
                await self.runner.end_sandbox(run)
                await self.runner.finish(job, run, "cancelled", error=reason)
        await self._finish(self.db.jobs[job_id], "cancelled", reason)

    async def _finish(self, job: JobRecord, state: JobState, error: str | None) -> None:
        done = dataclasses.replace(job, state=state, error=error, updated=now_rfc3339())
        extra = []
        if job.spec.notify is not UNSET:
            note = JobNotification(event="job.finished", job=job.id, name=job.spec.name, job_state=state)
            extra.append(self.notifier.statement(job.id, job.spec.notify, note))
        await self.db.put(job=done, extra=extra)
        if extra:
            self.notifier.wake()
        log.info("job ended", extra={"job": job.id, "state": state})

    # -- revocation ------------------------------------------------------------------------------------

    async def cancel_asked(self, job_id: str, reason: str) -> None:
        """On the leader: a follower asked for ``job_id`` to be cancelled (see :meth:`cancel`)."""
        job = self.db.jobs.get(job_id)
        if job is not None and job.state not in FINISHED_STATES:
            await self.cancel(job, reason)

    async def taken_up(self) -> None:
        """On the leader, after another replica changed jobs: a job submitted there gets its task here; a job
        ended there (cancelled) has its task here cancelled."""
        if self._sweeper is None:  # not started: this replica does not lead
            return
        for job in list(self.db.jobs.values()):
            rt = self.runtimes.get(job.id)
            if job.state not in FINISHED_STATES and rt is None:
                log.info("job taken up from another replica", extra={"job": job.id})
                self._spawn(job.id)
            elif (
                job.state in FINISHED_STATES and rt is not None and rt.task is not None and not rt.task.done()
                and rt.cancelling is None
            ):  # fmt: skip
                rt.cancelling = job.error or "cancelled"
                rt.task.cancel()

    async def access_changed(self) -> None:
        """Cancel every unfinished job whose owner holds no active key at all in its tenant (spec: Revocation 3).
        The leader does it (every replica is told of a revocation; one cancels)."""
        if not self.leadership.leading:
            return
        unfinished = [job for job in list(self.db.jobs.values()) if job.state not in FINISHED_STATES]
        self._revoked &= {job.id for job in unfinished}  # a finished job is never doomed again
        doomed = [job for job in unfinished if not auth.has_access(self.store, job.user, job.tenant)]
        for job in doomed:
            self._audit_revoked(job)
        await asyncio.gather(*(self._cancel_now(job) for job in doomed))

    def _audit_revoked(self, job: JobRecord) -> None:
        """Audit ``job.revoked`` for ``job``, once however many times its revocation is found."""
        if job.id in self._revoked:
            return
        self._revoked.add(job.id)
        self.audit.record_audit(kind="revocation", type="job.revoked", user=job.user, tenant=job.tenant or None,
                             target=job.id, result="cancelled")  # fmt: skip

    async def _cancel_now(self, job: JobRecord) -> None:
        if job.id in self.runtimes:
            await self.cancel(job, REVOKED)
        else:
            await self._cancelled(job.id, REVOKED)

    # -- sweeps ----------------------------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_SECS)
            try:
                for node in self.registry.healthy():
                    await self._sweep_node(node, adopt=False)
                await self._forget_old()
            except Exception:
                log.exception("job sweep failed")

    async def _sweep_node(self, node: Node, adopt: bool) -> None:
        """End sandboxes labelled for a run not running in them; at start-up, adopt one a run was waiting for."""
        try:
            listing = await node.client.sandboxes()
        except SandboxError as exc:
            log.warning("job sweep skipped a node", extra={"node": node.name, "error": exc.message})
            return
        for sandbox in listing:
            job_id = sandbox.labels.get(JOB_LABEL)
            n_text = sandbox.labels.get(RUN_LABEL, "")
            if job_id is None or sandbox.state == "terminated":
                continue
            run = self.db.runs.get((job_id, int(n_text))) if n_text.isdigit() else None
            if run is not None and run.state == "running" and run.sandbox == sandbox.id:
                continue
            if adopt and run is not None and run.state == "queued" and run.sandbox is None:
                self.runner.orphans[(job_id, run.n)] = (sandbox.id, node.name, sandbox.created_at)
                continue
            if not adopt and not older_than(sandbox.created_at, ORPHAN_AGE_SECS):
                continue
            await self.sandboxes.end_orphan(node, sandbox.id, "ending a sandbox of no running job run")

    async def _forget_old(self) -> None:
        old = [
            j.id for j in list(self.db.jobs.values())
            if j.state in FINISHED_STATES and older_than(j.updated, self.options.retention_secs)
            and j.id not in self.runtimes
        ]  # fmt: skip
        if old:
            await self.db.delete(old)
            for job_id in old:
                await asyncio.to_thread(self.outputs.remove, job_id)
            log.info("old jobs forgotten", extra={"count": len(old)})


def _run_wire(run: RunRecord) -> Run:
    return Run(
        n=run.n, state=run.state, sandbox=run.sandbox, node=run.node, exit_code=run.exit_code,
        started_at=run.started, finished_at=run.finished, error=run.error if run.error else UNSET,
        files=list(run.files) if run.files is not None else UNSET,
        pid=run.pid if run.pid is not None else UNSET,
    )  # fmt: skip
