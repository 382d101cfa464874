"""Wire types of jobs, agent runs and job notifications (spec: Jobs, agent runs, secrets; Job notifications).

The spec shows Job and JobSpec fields only through the endpoint table and the notification body; the rest is
chosen and written down in docs/jobs.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType

from sbx.api.network_policy import NetworkRequest
from sbx.api.services import ResourceRequest

JobState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
RunState = Literal["queued", "running", "succeeded", "failed", "cancelled"]
#: Job and run states that no longer change.
FINISHED_STATES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


class KeepSpec(msgspec.Struct, kw_only=True):
    """``keep``: guest files the gateway keeps from each attempt, read after the command exits."""

    files: list[str] = msgspec.field(default_factory=list)


class JobSpec(msgspec.Struct, kw_only=True):
    """A job: ``command`` run once in a sandbox of its own, again up to ``retries`` times after a failed attempt;
    ``timeout_secs`` bounds each attempt (none when omitted); ``notify`` an https URL told when each attempt
    and the job end."""

    required_hints: ClassVar[dict[str, str]] = {
        "command": 'command is required: the argv to run, e.g. {"command": ["make", "test"]}',
    }

    name: str | UnsetType = UNSET
    image: str | UnsetType = UNSET
    command: list[str]
    env: dict[str, str] | UnsetType = UNSET
    secrets: list[str] | UnsetType = UNSET
    resources: ResourceRequest | UnsetType = UNSET
    network: NetworkRequest | UnsetType = UNSET
    timeout_secs: int | UnsetType = UNSET
    retries: int | UnsetType = UNSET
    keep: KeepSpec | UnsetType = UNSET
    from_snapshot: str | UnsetType = UNSET
    notify: str | UnsetType = UNSET


class AgentRunRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/agent-runs``: one run of an agent the gateway defines (``--agents-file``); ``prompt`` is written
    to a file in the sandbox, never put on its command line."""

    required_hints: ClassVar[dict[str, str]] = {
        "agent": "agent is required: the name of an agent this gateway defines",
        "prompt": "prompt is required: the text the agent is given",
    }

    agent: str
    prompt: str
    name: str | UnsetType = UNSET
    image: str | UnsetType = UNSET
    retries: int | UnsetType = UNSET
    timeout_secs: int | UnsetType = UNSET
    env: dict[str, str] | UnsetType = UNSET
    secrets: list[str] | UnsetType = UNSET
    network: NetworkRequest | UnsetType = UNSET
    resources: ResourceRequest | UnsetType = UNSET
    from_snapshot: str | UnsetType = UNSET
    keep: KeepSpec | UnsetType = UNSET
    notify: str | UnsetType = UNSET


class KeptFile(msgspec.Struct, kw_only=True):
    """A ``keep.files`` entry after an attempt: ``bytes`` when kept, else ``error`` (absent, too large)."""

    path: str
    bytes: int | UnsetType = UNSET
    error: str | UnsetType = UNSET


class Run(msgspec.Struct, kw_only=True):
    """One attempt, numbered from 1, in a sandbox of its own (``sandbox`` and ``node`` null until made)."""

    n: int
    state: RunState
    sandbox: str | None
    node: str | None
    exit_code: int | None
    started_at: str | None
    finished_at: str | None
    error: str | UnsetType = UNSET
    files: list[KeptFile] | UnsetType = UNSET
    #: The command's process id in ``sandbox`` once started (an addition to the spec, docs/jobs.md): while the
    #: run lasts, ``GET /v1/sandboxes/{sandbox}/processes/{pid}/output`` follows its output live.
    pid: int | UnsetType = UNSET


class Agent(msgspec.Struct, kw_only=True):
    """An agent of the gateway's agents file as ``GET /v1/agents`` lists it (an addition to the spec,
    docs/jobs.md): its argv (``{prompt_file}`` as written), defaults and the names of its secrets and
    environment; never an environment value."""

    name: str
    argv: list[str]
    image: str | UnsetType = UNSET
    secrets: list[str]
    env_names: list[str]
    timeout_secs: int | UnsetType = UNSET
    network: NetworkRequest | UnsetType = UNSET
    resources: ResourceRequest | UnsetType = UNSET


class AgentList(msgspec.Struct):
    agents: list[Agent]


class Job(msgspec.Struct, kw_only=True):
    """A job: its spec (``env`` left out), owner, state and attempts (``runs`` left out in listings);
    ``agent`` names the agent of an agent run; ``error`` says why it failed or was cancelled."""

    id: str
    name: str | UnsetType = UNSET
    agent: str | UnsetType = UNSET
    spec: JobSpec
    env_names: list[str]
    owner: str
    tenant: str | None
    state: JobState
    error: str | None
    created_at: str
    updated_at: str
    runs: list[Run] | UnsetType = UNSET


class JobList(msgspec.Struct):
    jobs: list[Job]


class RunOutput(msgspec.Struct):
    """A finished attempt's output (base64 on the wire), each stream kept up to 8 MiB."""

    stdout: bytes
    stderr: bytes
    truncated: bool


class JobNotification(msgspec.Struct, kw_only=True):
    """What a job's ``notify`` URL receives: never output or a value."""

    event: Literal["run.finished", "job.finished"]
    job: str
    name: str | UnsetType = UNSET
    job_state: str
    run: int | UnsetType = UNSET
    state: str | UnsetType = UNSET
    exit_code: int | UnsetType = UNSET
