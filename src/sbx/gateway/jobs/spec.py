"""A JobSpec (or an agent run) checked and completed (docs/jobs.md).

Rules, every 400 before the 501s (secrets without a secrets key, ``notify`` on a gateway started with
``--no-notify``), before any 403 (a reserved env name, a network the nodes refuse):

- ``command``: a non-empty argv; ``name``: 1 to 63 of ``a-z 0-9 - _ .`` (a label for people; not unique);
- ``timeout_secs``: 1 to 604800 (7 days) per attempt, none when omitted; ``retries``: 0 to 10 further attempts
  after a failed one (default 0);
- ``keep.files``: at most 16 absolute guest paths, each kept up to 64 MiB;
- ``from_snapshot``: one of the caller's snapshots (recorded by the gateway);
- ``notify``: see ``notify.check_url``;
- the sandbox part (image, resources, env, secrets, network) as ``sbx.gateway.specs`` checks it.
"""

from __future__ import annotations

from typing import Final

from msgspec import UNSET
from msgspec.structs import replace

from sbx.api import validation as v
from sbx.api.errors import InvalidRequest
from sbx.api.jobs import AgentRunRequest, JobSpec, KeepSpec
from sbx.gateway import specs
from sbx.gateway.auth import Principal
from sbx.gateway.jobs.agents import AgentDef
from sbx.gateway.jobs.notify import NotifyPolicy, check_url
from sbx.gateway.nodes import Registry
from sbx.gateway.secrets import Secrets
from sbx.gateway.store import Store

MAX_TIMEOUT_SECS: Final = 7 * 24 * 3600
MAX_RETRIES: Final = 10
MAX_KEEP_FILES: Final = 16
#: Bytes of one kept file at most.
MAX_KEPT_FILE_BYTES: Final = 64 * 1024 * 1024


def check_job(
    store: Store,
    registry: Registry,
    secrets: Secrets,
    principal: Principal,
    spec: JobSpec,
    policy: NotifyPolicy,
) -> JobSpec:
    """``spec`` checked for ``principal`` (as the module says), with ``retries`` filled in: ``store`` holds the
    snapshots, ``registry`` the nodes whose capabilities bound it, ``secrets`` the tenant's secrets' names."""
    if spec.name is not UNSET:
        v.validate_job_name(spec.name, "name")
    specs.check_command(spec.command, "command")
    if spec.timeout_secs is not UNSET and not 1 <= spec.timeout_secs <= MAX_TIMEOUT_SECS:
        raise InvalidRequest(
            f"timeout_secs = {spec.timeout_secs}: give 1 to {MAX_TIMEOUT_SECS} (7 days), or omit it"
        )
    retries = 0 if spec.retries is UNSET else spec.retries
    if not 0 <= retries <= MAX_RETRIES:
        raise InvalidRequest(f"retries = {retries}: give 0 to {MAX_RETRIES} further attempts")
    if spec.keep is not UNSET:
        _check_keep(spec.keep)
    if spec.from_snapshot is not UNSET:
        v.validate_snapshot_id(spec.from_snapshot, "from_snapshot")
        snap = store.snapshots.get(spec.from_snapshot)
        if snap is None or not principal.owns(snap.user, snap.tenant):
            raise InvalidRequest(f"from_snapshot: no snapshot {spec.from_snapshot!r} among yours")
    caps = specs.offered_by(registry)
    specs.check_shape(spec.image, spec.resources, spec.env, spec.secrets, caps)
    if spec.notify is not UNSET:
        check_url(spec.notify, policy)
    secrets.check_names(principal.tenant, spec.secrets or ())
    specs.check_policy(spec.env, spec.network, caps)
    return replace(spec, retries=retries)


def _check_keep(keep: KeepSpec) -> None:
    if len(keep.files) > MAX_KEEP_FILES:
        raise InvalidRequest(f"keep.files: {len(keep.files)} paths; keep at most {MAX_KEEP_FILES}")
    seen = set()
    for i, path in enumerate(keep.files):
        normal = v.validate_guest_path(path, f"keep.files[{i}]")
        if normal == "/" or normal in seen:
            raise InvalidRequest(f"keep.files[{i}]: {path!r} is a directory or named twice; name files")
        seen.add(normal)


def agent_job(agent: AgentDef, req: AgentRunRequest) -> JobSpec:
    """The job an agent run is: the agent's command and defaults, with the request's fields over them."""
    secrets = list(agent.secrets) + [s for s in (req.secrets or ()) if s not in agent.secrets]
    env = {**agent.env, **(req.env or {})}
    return JobSpec(
        name=req.name, image=req.image if req.image is not UNSET else agent.image, command=agent.command(),
        env=env or UNSET, secrets=secrets or UNSET,
        resources=req.resources if req.resources is not UNSET else agent.resources,
        network=req.network if req.network is not UNSET else agent.network,
        timeout_secs=req.timeout_secs if req.timeout_secs is not UNSET else agent.timeout_secs,
        retries=req.retries, keep=req.keep, from_snapshot=req.from_snapshot, notify=req.notify,
    )  # fmt: skip
