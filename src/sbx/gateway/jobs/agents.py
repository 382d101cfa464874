"""Agents a gateway runs for ``POST /v1/agent-runs``: ``sandbox-gateway serve --agents-file FILE`` (TOML).

    [[agent]]
    name = "claude-code"                       # what a request's "agent" names: 1-63 of a-z 0-9 - _ .
    image = "registry.example.com/agents/claude-code:1"   # optional: the node's default image otherwise
    argv = ["sh", "-c", "claude -p \\"$(cat {prompt_file})\\" --output-format json"]
    secrets = ["ANTHROPIC_API_KEY"]           # tenant secrets every run gets (the tenant must have them)
    env = { CI = "1" }                         # optional
    timeout_secs = 3600                        # optional default; a request may give its own
    network = { mode = "allowlist", allow = ["api.anthropic.com"] }   # optional default
    resources = { cpus = 2, memory_mb = 4096 }                       # optional default

``{prompt_file}`` in ``argv`` is replaced by the path of the file the prompt is written to before the command
starts (:data:`PROMPT_PATH`): a prompt never appears on a command line (where the node's audit log would hash it
and ``ps`` would show it). Unknown keys, a missing ``{prompt_file}`` or a name given twice stop the gateway at
start with a message naming the agent. docs/jobs.md has definitions for several coding-agent CLIs.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Final

import msgspec
from msgspec import UNSET, UnsetType

from sbx.api.errors import SandboxError
from sbx.api.network_policy import NetworkRequest
from sbx.api.services import ResourceRequest
from sbx.api.validation import validate_env, validate_volume_name

#: Where the prompt is written in the run's sandbox; ``{prompt_file}`` in an agent's argv names it.
PROMPT_PATH: Final = "/tmp/sbx-agent/prompt.txt"
PLACEHOLDER: Final = "{prompt_file}"


class AgentDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One ``[[agent]]`` table."""

    name: str
    argv: list[str]
    image: str | UnsetType = UNSET
    secrets: list[str] = msgspec.field(default_factory=list)
    env: dict[str, str] = msgspec.field(default_factory=dict)
    timeout_secs: int | UnsetType = UNSET
    network: NetworkRequest | UnsetType = UNSET
    resources: ResourceRequest | UnsetType = UNSET

    def command(self) -> list[str]:
        """``argv`` with ``{prompt_file}`` replaced."""
        return [arg.replace(PLACEHOLDER, PROMPT_PATH) for arg in self.argv]


class _File(msgspec.Struct, forbid_unknown_fields=True):
    agent: list[AgentDef] = msgspec.field(default_factory=list)


class AgentsFileError(Exception):
    """The agents file cannot be used; the message names the file, the agent and what to change."""


def load_agents(path: Path) -> dict[str, AgentDef]:
    """The agents of ``path`` by name (see the module docstring)."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        parsed = msgspec.convert(data, _File)
    except (OSError, tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        raise AgentsFileError(f"{path}: {exc}") from None
    agents: dict[str, AgentDef] = {}
    for agent in parsed.agent:
        where = f"{path}: agent {agent.name!r}"
        try:
            validate_volume_name(agent.name, "name")
            validate_env(agent.env)
        except SandboxError as exc:
            raise AgentsFileError(f"{where}: {exc.message}") from None
        if agent.name in agents:
            raise AgentsFileError(f"{where} is defined twice")
        if not agent.argv or not any(PLACEHOLDER in arg for arg in agent.argv):
            raise AgentsFileError(f"{where}: argv must name {PLACEHOLDER}, the file the prompt is written to")
        agents[agent.name] = agent
    return agents
