"""The agents file (``--agents-file``) and what an agent run becomes (sbx.gateway.jobs.agents, .spec)."""

from __future__ import annotations

from pathlib import Path

import pytest
from msgspec import UNSET

from sbx.api.jobs import AgentRunRequest, KeepSpec
from sbx.gateway.jobs.agents import PROMPT_PATH, AgentsFileError, load_agents
from sbx.gateway.jobs.spec import agent_job

GOOD = """
[[agent]]
name = "coder"
image = "agents/coder:1"
argv = ["sh", "-c", "coder --prompt-file {prompt_file}"]
secrets = ["API_KEY"]
env = { MODE = "ci" }
timeout_secs = 600
network = { mode = "allowlist", allow = ["api.example.com"] }
"""


def test_a_good_file_and_what_a_run_becomes(tmp_path: Path) -> None:
    path = tmp_path / "agents.toml"
    path.write_text(GOOD)
    agent = load_agents(path)["coder"]
    assert agent.command() == ["sh", "-c", f"coder --prompt-file {PROMPT_PATH}"]
    job = agent_job(agent, AgentRunRequest(agent="coder", prompt="p", env={"MODE": "dev", "X": "1"},
                                           secrets=["API_KEY", "OTHER"], timeout_secs=30,
                                           keep=KeepSpec(files=["/out"])))  # fmt: skip
    assert (job.image, job.command, job.env, job.secrets) == (
        "agents/coder:1", agent.command(), {"MODE": "dev", "X": "1"}, ["API_KEY", "OTHER"])  # fmt: skip
    assert (job.timeout_secs, job.keep, job.network) == (30, KeepSpec(files=["/out"]), agent.network)
    plain = agent_job(agent, AgentRunRequest(agent="coder", prompt="p"))
    assert (plain.timeout_secs, plain.secrets, plain.notify, plain.retries) == (
        600,
        ["API_KEY"],
        UNSET,
        UNSET,
    )


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[[agent]]\nname = "a"\nargv = ["x"]\n', "must name {prompt_file}"),
        ('[[agent]]\nname = "a"\nargv = []\n', "must name {prompt_file}"),
        ('[[agent]]\nname = "A b"\nargv = ["{prompt_file}"]\n', "not a valid"),
        ('[[agent]]\nname = "a"\nargv = ["{prompt_file}"]\nbogus = 1\n', "bogus"),
        ('[[agent]]\nname = "a"\nargv = ["{prompt_file}"]\n[[agent]]\nname = "a"\nargv = ["{prompt_file}"]\n',
         "defined twice"),
        ('[[agent]]\nname = "a"\nargv = ["{prompt_file}"]\nenv = { LD_PRELOAD = "x" }\n', "reserved"),
        ("[[agent]\n", "agents.toml"),
        ('agent = "x"\n', "Expected `array`"),
    ],
)  # fmt: skip
def test_bad_files_stop_the_gateway_with_a_message(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "agents.toml"
    path.write_text(text)
    with pytest.raises(AgentsFileError, match=words.replace("{", r"\{").replace("[", r"\[")):
        load_agents(path)
