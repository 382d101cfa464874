"""One attempt of a job, from its sandbox's creation to its end (docs/jobs.md, "An attempt").

1. **Queued**: the owner must still hold an active key in the tenant (else the job is cancelled as revoked); the
   sandbox is made through the sandbox service's ``create`` for ``Principal.owner(user, tenant)``, labelled
   ``gateway.job`` and ``gateway.job.run``, with the secrets' values in its environment. While no node can take
   it (no room, the tenant's quota) the run stays queued, its ``error`` saying why, and tries again (1 s
   doubling to 30 s); any other refusal fails the attempt.
2. **Running**: an agent run's prompt is written to its file; the command starts as a background process
   (``pid`` recorded); its output is followed from the start, each stream kept up to 8 MiB (``outputs``). At
   ``timeout_secs`` the process is killed: exit code -1, error ``timed out``. A node that stops answering fails
   the attempt (``the node running it stopped answering``).
3. **End**: the ``keep.files`` are read (each up to 64 MiB), the sandbox is terminated, and the run's end is
   written with its ``run.finished`` notification in one transaction.

A gateway restarted meanwhile takes an attempt up where it was: a sandbox made but not recorded is found by its
labels, a command started but not recorded is found among the sandbox's processes, and a running command's
output is followed again from its start: an attempt is never started twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from msgspec import UNSET

from sbx.api.errors import NotFound, SandboxError, Unavailable
from sbx.api.jobs import JobNotification, KeptFile, RunState
from sbx.api.processes import OutputExit, ProcessRequest
from sbx.api.validation import validate_guest_path
from sbx.gateway import auth
from sbx.gateway.auth import Principal
from sbx.gateway.jobs.agents import PROMPT_PATH
from sbx.gateway.jobs.interfaces import RunSandboxes
from sbx.gateway.jobs.outputs import AnyOutputs, Spool, StoreSpool
from sbx.gateway.jobs.spec import MAX_KEPT_FILE_BYTES
from sbx.gateway.jobs.store import JobRecord, JobStore, RunRecord
from sbx.gateway.nodeclient import NodeClient
from sbx.gateway.nodes import Registry
from sbx.gateway.quotas import OverQuota
from sbx.gateway.secrets import Secrets
from sbx.gateway.specs import create_request
from sbx.gateway.state import now_rfc3339
from sbx.gateway.store import Store

if TYPE_CHECKING:
    from sbx.gateway.jobs.notify import Notifier

log = logging.getLogger(__name__)

JOB_LABEL = "gateway.job"
RUN_LABEL = "gateway.job.run"
REVOKED = "cancelled: the owner's access was revoked"
BACKOFF_FIRST_SECS = 1.0
BACKOFF_MAX_SECS = 30.0
#: Seconds between tries to follow the output again after the node's stream broke while it answers polls.
REFOLLOW_SECS = 1.0


class AttemptFailed(Exception):
    """The attempt cannot go on; the message is its ``error``."""


class JobCancelled(Exception):
    """The job must end cancelled, for ``reason`` (the owner's access was revoked)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Runner:
    """Runs attempts; the controller decides how many. ``store`` answers whether the owner still has access and
    holds the sandboxes' records; ``registry`` the nodes running them; ``sandboxes`` makes and ends them;
    ``secrets`` gives their secret environment."""

    def __init__(self, db: JobStore, outputs: AnyOutputs, notifier: Notifier, count_run: Callable[[str], None], *,
                 store: Store, registry: Registry, sandboxes: RunSandboxes, secrets: Secrets) -> None:  # fmt: skip
        self.store = store
        self.registry = registry
        self.sandboxes = sandboxes
        self.secrets = secrets
        self._count_run = count_run
        self.db = db
        self.outputs = outputs
        self.notifier = notifier
        #: Sandboxes found by their labels at start-up for runs recorded without one: (job, n) -> (id, node).
        self.orphans: dict[tuple[str, int], tuple[str, str, str]] = {}

    async def attempt(self, job: JobRecord, run: RunRecord) -> RunRecord:
        """Take ``run`` from where it is to its end (see the module docstring); returns it finished."""
        if run.sandbox is None:
            run = await self._make_sandbox(job, run)
            if run.state != "running":
                return run
        assert run.sandbox is not None and run.node is not None
        node = self.registry.get(run.node)
        if node is None:
            return await self.finish(
                job, run, "failed", error="the node running it was removed from the gateway"
            )
        try:
            if run.pid is None:
                run = await self._start(job, run, node.client)
            exit_code, error, truncated = await self._wait(job, run, node.client)
        except SandboxError as exc:
            return await self.finish(job, run, "failed", error=exc.message)
        except AttemptFailed as exc:
            return await self.finish(job, run, "failed", error=str(exc))
        files = await self._keep(job, run, node.client) if error is None or exit_code == -1 else None
        await self.end_sandbox(run)
        state: RunState = "succeeded" if exit_code == 0 and error is None else "failed"
        if error is None and exit_code != 0:
            error = f"exit code {exit_code}"
        return await self.finish(
            job, run, state, exit_code=exit_code, error=error, files=files, truncated=truncated
        )

    async def finish(
        self, job: JobRecord, run: RunRecord, state: RunState, *, exit_code: int | None = None, error: str | None = None,
        files: tuple[KeptFile, ...] | None = None, truncated: bool | None = None,
    ) -> RunRecord:  # fmt: skip
        """Write the run's end and its notification."""
        done = dataclasses.replace(
            run, state=state, exit_code=exit_code, error=error, files=files, finished=_now_ms(),
            truncated=run.truncated if truncated is None else truncated,
        )  # fmt: skip
        extra = []
        if job.spec.notify is not UNSET:
            current = self.db.jobs.get(job.id, job)
            note = JobNotification(
                event="run.finished", job=job.id, name=job.spec.name, job_state=current.state, run=run.n, state=state,
                exit_code=exit_code if exit_code is not None else UNSET,
            )  # fmt: skip
            extra.append(self.notifier.statement(job.id, job.spec.notify, note))
        await self.db.put(run=done, extra=extra)
        if extra:
            self.notifier.wake()
        log.info("job run ended", extra={"job": job.id, "run": run.n, "state": state, "exit_code": exit_code})
        self._count_run(state)
        return done

    # -- 1. the sandbox ----------------------------------------------------------------------------------

    async def _make_sandbox(self, job: JobRecord, run: RunRecord) -> RunRecord:
        found = self.orphans.pop((job.id, run.n), None)
        if found is not None:
            sandbox_id, node_name, created = found
            log.info(
                "job run's sandbox adopted from its labels", extra={"job": job.id, "sandbox": sandbox_id}
            )
            return await self._running(
                job, dataclasses.replace(run, sandbox=sandbox_id, node=node_name, started=created)
            )
        backoff = BACKOFF_FIRST_SECS
        spec = job.spec
        while True:
            if not auth.has_access(self.store, job.user, job.tenant):
                raise JobCancelled(REVOKED)
            try:
                secret_env = self.secrets.values(job.tenant, spec.secrets or ())
                sandbox, node = await self.sandboxes.create(
                    Principal.owner(job.user, job.tenant),
                    create_request(spec.image, spec.resources, spec.env or {}, spec.network, spec.from_snapshot,
                                   secret_env),
                    gateway_labels={JOB_LABEL: job.id, RUN_LABEL: str(run.n)},
                )  # fmt: skip
            except (Unavailable, OverQuota) as exc:
                waiting = f"waiting for room: {exc.message}"
                if run.error != waiting:
                    run = dataclasses.replace(run, error=waiting)
                    await self.db.put(run=run, full=False)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_SECS)
                continue
            except SandboxError as exc:
                return await self.finish(
                    job, run, "failed", error=f"the sandbox could not be made: {exc.message}"
                )
            return await self._running(job, dataclasses.replace(run, sandbox=sandbox.id, node=node,
                                                                started=sandbox.created_at))  # fmt: skip

    async def _running(self, job: JobRecord, run: RunRecord) -> RunRecord:
        run = dataclasses.replace(run, state="running", error=None)
        current = self.db.jobs.get(job.id, job)
        update = dataclasses.replace(current, state="running", updated=now_rfc3339())
        await self.db.put(job=update if current.state == "queued" else None, run=run, full=False)
        return run

    # -- 2. the command ----------------------------------------------------------------------------------

    async def _start(self, job: JobRecord, run: RunRecord, client: NodeClient) -> RunRecord:
        assert run.sandbox is not None
        command = job.spec.command
        started = [p for p in await client.processes(run.sandbox) if p.argv == command]
        if started:
            pid = started[0].pid  # a gateway stopped after starting it, before recording it
        else:
            if job.prompt is not None:
                await client.write_file(run.sandbox, PROMPT_PATH, job.prompt.encode("utf-8", "surrogatepass"))
            # The secrets go with the command too: the node holds the sandbox's secret environment in memory only,
            # and one restarted since the create would start the command without it.
            secret_env = self.secrets.values(job.tenant, job.spec.secrets or ())
            request = ProcessRequest(argv=command, env=secret_env or UNSET)
            pid = (await client.start_process(run.sandbox, request)).pid
        run = dataclasses.replace(run, pid=pid)
        await self.db.put(run=run, full=False)
        return run

    def _deadline(self, job: JobRecord, run: RunRecord) -> float | None:
        """Unix time the attempt times out at (None: no timeout)."""
        if job.spec.timeout_secs is UNSET or run.started is None:
            return None
        try:
            started = datetime.fromisoformat(run.started).timestamp()
        except ValueError:
            started = time.time()
        return started + job.spec.timeout_secs

    async def _wait(self, job: JobRecord, run: RunRecord, client: NodeClient) -> tuple[int, str | None, bool]:
        """Follow the command's output until it exits: ``(exit code, error, whether output was cut)``."""
        assert run.sandbox is not None and run.pid is not None and run.node is not None
        sandbox, pid, node_name = run.sandbox, run.pid, run.node
        deadline = self._deadline(job, run)
        timed_out = False
        spool: Spool | StoreSpool = await asyncio.to_thread(self.outputs.spool, job.id, run.n)
        try:
            while True:
                await asyncio.to_thread(spool.restart)
                remaining = None if deadline is None or timed_out else deadline - time.time()
                try:
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError
                    async with asyncio.timeout(remaining):
                        async for event in client.follow_output(sandbox, pid):
                            if isinstance(event, OutputExit):
                                truncated = spool.truncated or event.truncated is True
                                if timed_out:
                                    assert job.spec.timeout_secs is not UNSET
                                    return -1, f"timed out after {job.spec.timeout_secs} s", truncated
                                return event.exit_code, None, truncated
                            await asyncio.to_thread(spool.add, event)
                except TimeoutError:
                    timed_out = True
                    with contextlib.suppress(SandboxError):
                        await client.signal(sandbox, pid, "KILL")
                    continue
                except NotFound:
                    raise AttemptFailed("the run's sandbox or its command is gone") from None
                except SandboxError as exc:
                    node = self.registry.get(node_name)
                    if node is None or (
                        not node.healthy and node.failures >= self.registry.failures_unhealthy
                    ):
                        raise AttemptFailed("the node running it stopped answering") from None
                    log.info("following a run's output again", extra={"job": job.id, "error": exc.message})
                    await asyncio.sleep(REFOLLOW_SECS)
        finally:
            await asyncio.to_thread(spool.close)

    # -- 3. the end --------------------------------------------------------------------------------------

    async def _keep(self, job: JobRecord, run: RunRecord, client: NodeClient) -> tuple[KeptFile, ...] | None:
        if job.spec.keep is UNSET or not job.spec.keep.files:
            return None
        assert run.sandbox is not None
        kept = []
        for i, path in enumerate(job.spec.keep.files):
            try:
                data = await client.read_small_file(
                    run.sandbox, validate_guest_path(path), MAX_KEPT_FILE_BYTES
                )
            except NotFound:
                kept.append(KeptFile(path=path, error="not found"))
                continue
            except SandboxError as exc:
                kept.append(KeptFile(path=path, error=exc.message))
                continue
            if data is None:
                kept.append(KeptFile(path=path, error=f"larger than {MAX_KEPT_FILE_BYTES} bytes: not kept"))
                continue
            await asyncio.to_thread(self.outputs.keep_file, job.id, run.n, i, data)
            kept.append(KeptFile(path=path, bytes=len(data)))
        return tuple(kept)

    async def end_sandbox(self, run: RunRecord) -> None:
        """Terminate the run's sandbox where its node answers (else the sweep ends it when the node is seen)."""
        if run.sandbox is None or run.node is None:
            return
        node = self.registry.get(run.node)
        if node is None or not node.healthy:
            return
        try:
            await node.client.delete_sandbox(run.sandbox)
        except NotFound:
            pass
        except SandboxError as exc:
            log.warning("run's sandbox not ended", extra={"sandbox": run.sandbox, "error": exc.message})
            return
        record = self.store.sandboxes.get(run.sandbox)
        if record is not None:
            await self.sandboxes.terminated(record)


def _now_ms() -> str:
    """Now, RFC 3339 UTC with milliseconds (as a node stamps a sandbox's start)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
