"""``sandbox-cli services|jobs|secrets``: what a gateway runs for its users (docs/services.md, docs/jobs.md).

sandbox-cli services apply web.toml         # create, or PUT (a rollout when the replicas change)
sandbox-cli services list | get web | scale web 3 | delete web
sandbox-cli jobs run --retries 1 --keep /sandbox/home/report.txt --wait -- make test
sandbox-cli jobs agent claude-code --prompt-file task.md --wait
sandbox-cli jobs list | get ID | cancel ID | output ID [N] | file ID N PATH
sandbox-cli jobs agents                     # the agents `jobs agent NAME` can run
printf %s "$TOKEN" | sandbox-cli secrets set API_TOKEN   # the value from stdin, never the command line
sandbox-cli secrets list | delete API_TOKEN
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import Any

import click

from sbx.api.codec import convert_request
from sbx.api.errors import SandboxError
from sbx.api.jobs import AgentRunRequest, Job, JobSpec, KeepSpec
from sbx.api.services import ResourceRequest, Service, ServiceSpec
from sbx.cli._common import (
    Options,
    call,
    cell,
    fail,
    pairs,
    pass_options,
    print_fields,
    print_json,
    print_table,
)


def _load_spec(path: str) -> dict[str, Any]:
    """A spec file: TOML (``.toml``) or JSON; ``-`` reads JSON from stdin."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        data = tomllib.loads(text) if path.endswith(".toml") else json.loads(text)
    except (OSError, ValueError) as exc:
        raise click.BadParameter(f"cannot read {path}: {exc}", param_hint="'SPEC'") from None
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path} must hold one object (the spec)", param_hint="'SPEC'")
    return data


# -- services -------------------------------------------------------------------------------------------


@click.group()
def services() -> None:
    """Services: replicas of a sandbox spec the gateway keeps healthy, with a traffic address."""


def _service_rows(listed: list[Service]) -> None:
    rows = [[s.spec.name, s.tenant or "default", f"{s.ready}/{s.desired}", str(s.revision), str(s.serving),
             s.rollout.state if s.rollout else "", str(s.restarts), cell(s.url or None), cell(s.error or None)]
            for s in listed]  # fmt: skip
    print_table(
        ["name", "tenant", "ready", "revision", "serving", "rollout", "restarts", "url", "error"], rows
    )


def _show_service(opts: Options, svc: Service) -> None:
    if opts.as_json:
        print_json(svc)
        return
    _service_rows([svc])
    if svc.rollout and svc.rollout.reason:
        click.echo(f"rollout {svc.rollout.from_} -> {svc.rollout.to} failed: {svc.rollout.reason}")
    rows = [[r.sandbox, r.node, str(r.revision), r.state, str(r.restarts), cell(r.last_error or None)]
            for r in svc.replicas]  # fmt: skip
    if rows:
        click.echo()
        print_table(["replica", "node", "revision", "state", "restarts", "last error"], rows)


@services.command("list")
@pass_options
def services_list(opts: Options) -> None:
    """The services of the tenant acted in (admin: every one)."""
    listed = call(opts, lambda c: c.services.list())
    print_json({"services": listed}) if opts.as_json else _service_rows(listed)


@services.command("get")
@click.argument("name")
@click.option("--tenant", default=None, help="Admin: another tenant's service.")
@pass_options
def services_get(opts: Options, name: str, tenant: str | None) -> None:
    """A service, its rollout and its replicas."""
    _show_service(opts, call(opts, lambda c: c.services.get(name, tenant)))


@services.command("apply")
@click.argument("spec_file", metavar="SPEC")
@click.option("--tenant", default=None, help="Admin: another tenant's service (update only).")
@pass_options
def services_apply(opts: Options, spec_file: str, tenant: str | None) -> None:
    """Create the service SPEC (a TOML or JSON ServiceSpec file, - for JSON on stdin) or update it."""
    try:
        spec = convert_request(_load_spec(spec_file), ServiceSpec)
    except SandboxError as exc:
        fail(exc)

    async def apply(c: Any) -> Service:
        try:
            await c.services.get(spec.name, tenant)
        except SandboxError as exc:
            if exc.status != 404 or tenant is not None:
                raise
            created: Service = await c.services.create(spec)
            return created
        updated: Service = await c.services.update(spec, tenant)
        return updated

    _show_service(opts, call(opts, apply))


@services.command("scale")
@click.argument("name")
@click.argument("replicas", type=click.IntRange(0, 100))
@click.option("--tenant", default=None, help="Admin: another tenant's service.")
@pass_options
def services_scale(opts: Options, name: str, replicas: int, tenant: str | None) -> None:
    """Change how many replicas NAME keeps (no rollout)."""
    _show_service(opts, call(opts, lambda c: c.services.scale(name, replicas, tenant)))


@services.command("delete")
@click.argument("name")
@click.option("--tenant", default=None, help="Admin: another tenant's service.")
@pass_options
def services_delete(opts: Options, name: str, tenant: str | None) -> None:
    """Delete NAME and terminate its replicas."""
    call(opts, lambda c: c.services.delete(name, tenant))
    if not opts.as_json:
        click.echo(f"deleted {name}")


# -- jobs -----------------------------------------------------------------------------------------------


@click.group()
def jobs() -> None:
    """Jobs and agent runs: commands run to completion in sandboxes of their own."""


def _show_job(opts: Options, job: Job) -> None:
    if opts.as_json:
        print_json(job)
        return
    print_fields({"id": job.id, "name": job.spec.name or None, "agent": job.agent or None, "state": job.state,
                  "error": job.error, "created_at": job.created_at})  # fmt: skip
    rows = [[str(r.n), r.state, cell(r.exit_code), cell(r.sandbox), cell(r.node), cell(r.started_at),
             cell(r.finished_at), cell(r.error or None)] for r in job.runs or []]  # fmt: skip
    if rows:
        click.echo()
        print_table(["run", "state", "exit", "sandbox", "node", "started", "finished", "error"], rows)


def _job_options(fn: Any) -> Any:
    for decorator in reversed([
        click.option("--name", default=None, help="A label for people."),
        click.option("--image", default=None),
        click.option("--env", "env", multiple=True, metavar="KEY=VALUE", help="Repeatable."),
        click.option("--secret", "secrets", multiple=True, metavar="NAME", help="A tenant secret (repeatable)."),
        click.option("--cpus", type=click.IntRange(min=1), default=None),
        click.option("--memory-mb", type=click.IntRange(min=1), default=None),
        click.option("--timeout", "timeout_secs", type=click.IntRange(min=1), default=None,
                     help="Seconds each attempt may run."),
        click.option("--retries", type=click.IntRange(0, 10), default=None, help="Further attempts after a failed one."),
        click.option("--keep", "keep", multiple=True, metavar="PATH", help="A guest file kept from each attempt."),
        click.option("--from-snapshot", default=None),
        click.option("--notify", default=None, metavar="URL", help="https URL told when runs and the job end."),
        click.option("--wait", is_flag=True, help="Wait for the job to end; exit 1 unless it succeeded."),
    ]):  # fmt: skip
        fn = decorator(fn)
    return fn


def _common(name: str | None, image: str | None, env: tuple[str, ...], secrets: tuple[str, ...], cpus: int | None,
            memory_mb: int | None, timeout_secs: int | None, retries: int | None, keep: tuple[str, ...],
            from_snapshot: str | None, notify: str | None) -> dict[str, Any]:  # fmt: skip
    fields: dict[str, Any] = {
        "name": name, "image": image, "env": pairs(env, "--env") or None, "secrets": list(secrets) or None,
        "timeout_secs": timeout_secs, "retries": retries, "keep": KeepSpec(files=list(keep)) if keep else None,
        "from_snapshot": from_snapshot, "notify": notify,
    }  # fmt: skip
    if cpus is not None or memory_mb is not None:
        fields["resources"] = {k: v for k, v in (("cpus", cpus), ("memory_mb", memory_mb)) if v is not None}
    return {k: v for k, v in fields.items() if v is not None}


def _submitted(opts: Options, job: Job, wait: bool) -> None:
    if not wait:
        _show_job(opts, job)
        return
    done = call(opts, lambda c: c.jobs.wait(job.id))
    _show_job(opts, done)
    if done.state != "succeeded":
        raise click.exceptions.Exit(1)


@jobs.command("run", context_settings={"ignore_unknown_options": True})
@_job_options
@click.argument("command", nargs=-1, required=True)
@pass_options
def jobs_run(opts: Options, /, command: tuple[str, ...], wait: bool, **fields: Any) -> None:
    """Start a job running COMMAND (after --) in a sandbox of its own."""
    spec = JobSpec(command=list(command), **{k: _typed(k, v) for k, v in _common(**fields).items()})
    _submitted(opts, call(opts, lambda c: c.jobs.create(spec)), wait)


@jobs.command("agent")
@click.argument("agent")
@click.option("--prompt", default=None, help="The prompt (or --prompt-file).")
@click.option(
    "--prompt-file", type=click.File("r"), default=None, help="Read the prompt from a file (- stdin)."
)
@_job_options
@pass_options
def jobs_agent(
    opts: Options, /, agent: str, prompt: str | None, prompt_file: Any, wait: bool, **fields: Any
) -> None:
    """Start one run of AGENT, an agent the gateway defines, with a prompt."""
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give the prompt with --prompt or --prompt-file (one of them)")
    text = prompt if prompt is not None else prompt_file.read()
    request = AgentRunRequest(
        agent=agent, prompt=text, **{k: _typed(k, v) for k, v in _common(**fields).items()}
    )
    _submitted(opts, call(opts, lambda c: c.jobs.agent_run(request)), wait)


def _typed(name: str, value: Any) -> Any:
    return ResourceRequest(**value) if name == "resources" else value


@jobs.command("list")
@pass_options
def jobs_list(opts: Options) -> None:
    """Your jobs, newest first."""
    listed = call(opts, lambda c: c.jobs.list())
    if opts.as_json:
        print_json({"jobs": listed})
        return
    rows = [[j.id, cell(j.spec.name or None), cell(j.agent or None), j.state, j.created_at, cell(j.error)]
            for j in listed]  # fmt: skip
    print_table(["id", "name", "agent", "state", "created", "error"], rows)


@jobs.command("agents")
@pass_options
def jobs_agents(opts: Options) -> None:
    """The agents the gateway defines (its --agents-file): what `jobs agent NAME` can run.

    The names of their secrets and environment variables are shown, never a value."""
    listed = call(opts, lambda c: c.jobs.agents())
    if opts.as_json:
        print_json({"agents": listed})
        return
    # The program alone: an agent's argv often holds a whole script (the full argv is in --json).
    rows = [[a.name, cell(a.image or None), a.argv[0] if a.argv else "", cell(a.secrets or None),
             cell(a.env_names or None)] for a in listed]  # fmt: skip
    print_table(["name", "image", "program", "secrets", "env"], rows)


@jobs.command("get")
@click.argument("job_id")
@pass_options
def jobs_get(opts: Options, job_id: str) -> None:
    """A job and its runs."""
    _show_job(opts, call(opts, lambda c: c.jobs.get(job_id)))


@jobs.command("cancel")
@click.argument("job_id")
@pass_options
def jobs_cancel(opts: Options, job_id: str) -> None:
    """Cancel a job (its running sandbox is ended; no further run starts)."""
    _show_job(opts, call(opts, lambda c: c.jobs.cancel(job_id)))


@jobs.command("output")
@click.argument("job_id")
@click.argument("n", type=click.IntRange(min=1), required=False)
@pass_options
def jobs_output(opts: Options, job_id: str, n: int | None) -> None:
    """A finished run's stdout and stderr (the last run when N is omitted)."""

    async def fetch(c: Any) -> Any:
        run = n if n is not None else max((r.n for r in (await c.jobs.get(job_id)).runs or []), default=1)
        return await c.jobs.output(job_id, run)

    out = call(opts, fetch)
    if opts.as_json:
        print_json(out)
        return
    sys.stdout.buffer.write(out.stdout)
    sys.stderr.buffer.write(out.stderr)
    if out.truncated:
        click.echo("(output truncated at 8 MiB per stream)", err=True)


@jobs.command("file")
@click.argument("job_id")
@click.argument("n", type=click.IntRange(min=1))
@click.argument("path")
@click.option("-o", "--output", "dest", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write it here instead of stdout.")  # fmt: skip
@pass_options
def jobs_file(opts: Options, job_id: str, n: int, path: str, dest: Path | None) -> None:
    """A file kept from run N (one of the job's keep.files)."""
    data = call(opts, lambda c: c.jobs.file(job_id, n, path))
    if dest is None:
        sys.stdout.buffer.write(data)
    else:
        dest.write_bytes(data)


# -- secrets --------------------------------------------------------------------------------------------


@click.group()
def secrets() -> None:
    """The tenant's secrets: names a job or service puts in its sandboxes' environment."""


@secrets.command("set")
@click.argument("name")
@click.option("--from-file", "source", type=click.File("r"), default="-", show_default="stdin",
              help="Read the value from this file (a trailing newline is dropped).")  # fmt: skip
@pass_options
def secrets_set(opts: Options, name: str, source: Any) -> None:
    """Set NAME to the value read from stdin or --from-file (never from the command line)."""
    value = source.read()
    value = value.removesuffix("\n")
    call(opts, lambda c: c.secrets.set(name, value))
    if not opts.as_json:
        click.echo(f"set {name}")


@secrets.command("list")
@pass_options
def secrets_list(opts: Options) -> None:
    """Names and when each was set; never a value."""
    listed = call(opts, lambda c: c.secrets.list())
    if opts.as_json:
        print_json({"secrets": listed})
    else:
        print_table(["name", "updated"], [[s.name, s.updated_at] for s in listed])


@secrets.command("delete")
@click.argument("name")
@pass_options
def secrets_delete(opts: Options, name: str) -> None:
    """Delete NAME."""
    call(opts, lambda c: c.secrets.delete(name))
    if not opts.as_json:
        click.echo(f"deleted {name}")


__all__ = ["jobs", "secrets", "services"]
