"""Handlers of ``/v1/jobs`` and ``/v1/agent-runs``: a job belongs to the user and tenant that started it (admin: any);
the work is the controller's (``sbx.gateway.jobs``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web

from sbx.api.codec import decode_request
from sbx.api.errors import InvalidRequest
from sbx.api.jobs import Agent, AgentList, AgentRunRequest, JobList, JobSpec
from sbx.gateway import auth
from sbx.gateway.http import principal_of
from sbx.gateway.jobs.outputs import StoredFile
from sbx.gateway.jobs.spec import agent_job
from sbx.gateway.jobs.store import JobRecord
from sbx.web.http import json_response, read_json_body

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


class JobRoutes:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def _target(self, request: web.Request) -> JobRecord:
        principal, job_id = principal_of(request), request.match_info["id"]
        job = await self.gw.fresh(lambda: self.gw.jobs.find(principal, job_id))
        request[auth.TARGET_KEY] = job.id
        return job

    def _answer(self, request: web.Request, job: JobRecord, status: int = 200) -> web.Response:
        request[auth.TARGET_KEY] = job.id
        return json_response(self.gw.jobs.wire(job, with_runs=True), status=status)

    async def create(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        spec = decode_request(await read_json_body(request), JobSpec)
        spec = self.gw.jobs.check(principal, spec)
        return self._answer(request, await self.gw.jobs.submit(principal, spec), 201)

    async def agents(self, request: web.Request) -> web.Response:
        """The agents file's agents by name (what the console offers for an agent run); never an env value."""
        listed = [
            Agent(
                name=a.name, argv=list(a.argv), image=a.image, secrets=list(a.secrets), env_names=sorted(a.env),
                timeout_secs=a.timeout_secs, network=a.network, resources=a.resources,
            )
            for a in sorted(self.gw.jobs.options.agents.values(), key=lambda a: a.name)
        ]  # fmt: skip
        return json_response(AgentList(listed))

    async def agent_run(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        req = decode_request(await read_json_body(request), AgentRunRequest)
        agents = self.gw.jobs.options.agents
        agent = agents.get(req.agent)
        if agent is None:
            known = ", ".join(sorted(agents)) if agents else "none (start the gateway with --agents-file)"
            raise InvalidRequest(f"agent: this gateway defines no agent {req.agent!r}; it defines {known}")
        if "\x00" in req.prompt:
            # Text for an agent never holds one, and PostgreSQL's text columns cannot (the same answer on SQLite).
            raise InvalidRequest("prompt: holds a NUL character (U+0000); give the prompt as text without it")
        spec = self.gw.jobs.check(principal, agent_job(agent, req))
        job = await self.gw.jobs.submit(principal, spec, agent=agent.name, prompt=req.prompt)
        return self._answer(request, job, 201)

    async def list(self, request: web.Request) -> web.Response:
        jobs = self.gw.jobs.listing(principal_of(request))
        return json_response(JobList([self.gw.jobs.wire(j, with_runs=False) for j in jobs]))

    async def get(self, request: web.Request) -> web.Response:
        return self._answer(request, await self._target(request))

    async def delete(self, request: web.Request) -> web.Response:
        return self._answer(request, await self.gw.jobs.cancel(await self._target(request)))

    async def output(self, request: web.Request) -> web.Response:
        job = await self._target(request)
        return json_response(await self.gw.jobs.output(job, request.match_info["n"]))

    async def file(self, request: web.Request) -> web.StreamResponse:
        job = await self._target(request)
        paths = request.query.getall("path", [])
        if len(paths) != 1:
            raise InvalidRequest(
                "path: give one path of the job's keep.files, e.g. ?path=/sandbox/home/out.txt"
            )
        found = await self.gw.jobs.kept_file(job, request.match_info["n"], paths[0])
        if isinstance(found, bytes):
            return web.Response(body=found, headers={"Content-Type": "application/octet-stream"})
        if isinstance(found, StoredFile):
            return await _stream(request, found)
        return web.FileResponse(found, headers={"Content-Type": "application/octet-stream"})


async def _stream(request: web.Request, found: StoredFile) -> web.StreamResponse:
    """A kept file from the store, a chunk at a time: one chunk in memory however large the file (64 MiB at most)
    and however many are being answered. A chunk gone meanwhile (the job removed) cuts the answer short, which
    the client sees as a body shorter than its ``Content-Length``."""
    response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    response.content_length = found.size
    await response.prepare(request)
    for i in range(len(found.seqs)):
        try:
            data = await asyncio.to_thread(found.chunk, i)
        except LookupError:
            raise ConnectionResetError("the kept file was removed while it was sent") from None
        await response.write(data)
    await response.write_eof()
    return response
