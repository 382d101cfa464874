"""``client.services``, ``client.jobs``, ``client.secrets``: what a gateway runs for its users (spec: Services;
Jobs, agent runs, secrets). A plain node answers these 404.

    svc = await client.services.create(ServiceSpec(name="web", command=["python3", "-m", "http.server", "8080"],
                                                   port=8080, replicas=2))
    job = await client.jobs.create(JobSpec(command=["make", "test"], retries=1))
    job = await client.jobs.wait(job.id)
    out = await client.jobs.output(job.id, job.runs[-1].n)
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING
from urllib.parse import quote

from sbx.api.errors import Unavailable
from sbx.api.jobs import FINISHED_STATES, Agent, AgentList, AgentRunRequest, Job, JobList, JobSpec, RunOutput
from sbx.api.services import (
    ScaleRequest,
    Secret,
    SecretList,
    SecretRequest,
    Service,
    ServiceList,
    ServiceSpec,
)

if TYPE_CHECKING:
    from sbx.client._client import AsyncClient


def _tenant(tenant: str | None) -> dict[str, str] | None:
    return {"tenant": tenant} if tenant is not None else None


class Services:
    """Services: a sandbox spec with a replica count the gateway keeps true (docs/services.md)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, spec: ServiceSpec) -> Service:
        """``POST /v1/services``."""
        return await self._client.call("POST", "/v1/services", Service, json=spec)

    async def list(self) -> list[Service]:
        """``GET /v1/services``: the caller's own (admin: every one)."""
        return (await self._client.call("GET", "/v1/services", ServiceList)).services

    async def get(self, name: str, tenant: str | None = None) -> Service:
        """``GET /v1/services/{name}`` (``tenant``: an admin naming another tenant's)."""
        path = f"/v1/services/{quote(name, safe='')}"
        return await self._client.call("GET", path, Service, params=_tenant(tenant))

    async def update(self, spec: ServiceSpec, tenant: str | None = None) -> Service:
        """``PUT /v1/services/{spec.name}``: a changed image, command, resources, port, health, env, network or
        secrets starts a rollout."""
        path = f"/v1/services/{quote(spec.name, safe='')}"
        return await self._client.call("PUT", path, Service, json=spec, params=_tenant(tenant))

    async def scale(self, name: str, replicas: int, tenant: str | None = None) -> Service:
        """``POST /v1/services/{name}/scale``."""
        path = f"/v1/services/{quote(name, safe='')}/scale"
        return await self._client.call(
            "POST", path, Service, json=ScaleRequest(replicas), params=_tenant(tenant)
        )

    async def delete(self, name: str, tenant: str | None = None) -> None:
        """``DELETE /v1/services/{name}``: its replicas are terminated."""
        await self._client.request("DELETE", f"/v1/services/{quote(name, safe='')}", params=_tenant(tenant))


class Jobs:
    """Jobs and agent runs: commands run to completion in sandboxes of their own (docs/jobs.md)."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, spec: JobSpec) -> Job:
        """``POST /v1/jobs``."""
        return await self._client.call("POST", "/v1/jobs", Job, json=spec)

    async def agent_run(self, request: AgentRunRequest) -> Job:
        """``POST /v1/agent-runs``: one run of an agent the gateway defines."""
        return await self._client.call("POST", "/v1/agent-runs", Job, json=request)

    async def agents(self) -> list[Agent]:
        """``GET /v1/agents``: the agents the gateway defines (its ``--agents-file``), by name."""
        return (await self._client.call("GET", "/v1/agents", AgentList)).agents

    async def list(self) -> list[Job]:
        """``GET /v1/jobs``: newest first, without runs."""
        return (await self._client.call("GET", "/v1/jobs", JobList)).jobs

    async def get(self, job_id: str) -> Job:
        """``GET /v1/jobs/{id}``, with its runs."""
        return await self._client.call("GET", f"/v1/jobs/{quote(job_id, safe='')}", Job)

    async def cancel(self, job_id: str) -> Job:
        """``DELETE /v1/jobs/{id}``: answers once its runs have stopped."""
        return await self._client.call("DELETE", f"/v1/jobs/{quote(job_id, safe='')}", Job)

    async def output(self, job_id: str, n: int) -> RunOutput:
        """``GET /v1/jobs/{id}/runs/{n}/output``: a finished run's output (bytes)."""
        return await self._client.call("GET", f"/v1/jobs/{quote(job_id, safe='')}/runs/{n}/output", RunOutput)

    async def file(self, job_id: str, n: int, path: str) -> bytes:
        """``GET /v1/jobs/{id}/runs/{n}/files?path=``: a file kept from a finished run."""
        data: bytes = await self._client.request(
            "GET", f"/v1/jobs/{quote(job_id, safe='')}/runs/{n}/files", params={"path": path}, raw=True
        )
        return data

    async def wait(self, job_id: str, timeout_secs: float | None = None, poll_secs: float = 1.0) -> Job:
        """The job once it has ended (succeeded, failed or cancelled), asked every ``poll_secs``; raises
        ``Unavailable`` when ``timeout_secs`` passes first (None: wait as long as it takes)."""
        deadline = None if timeout_secs is None else time.monotonic() + timeout_secs
        while True:
            job = await self.get(job_id)
            if job.state in FINISHED_STATES:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise Unavailable(f"job {job_id} is still {job.state} after {timeout_secs:g} s")
            await asyncio.sleep(poll_secs)


class Secrets:
    """The tenant's secrets: set and delete need ``secrets:write``; values are never read back."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def set(self, name: str, value: str) -> None:
        """``PUT /v1/secrets/{name}``."""
        await self._client.request("PUT", f"/v1/secrets/{quote(name, safe='')}", json=SecretRequest(value))

    async def list(self) -> list[Secret]:
        """``GET /v1/secrets``: names and times, never a value."""
        return (await self._client.call("GET", "/v1/secrets", SecretList)).secrets

    async def delete(self, name: str) -> None:
        """``DELETE /v1/secrets/{name}``."""
        await self._client.request("DELETE", f"/v1/secrets/{quote(name, safe='')}")
