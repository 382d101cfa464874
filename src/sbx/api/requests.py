"""Requests of the sandbox API turned into what a server acts on: decoded (``sbx.api.codec``), checked against
the spec's rules (``sbx.api.validation``, ``sbx.api.network_policy``) and resolved against the server's
limits and defaults.

Each ``parse_*`` takes the raw body and returns a frozen spec or raises ``InvalidRequest`` (400) /
``Refused`` (403). All 400 checks of a body run before any 403 (reserved env name, network policy), so a
request with both kinds of mistake is told about the malformed one first. Responses are built by the
servers from the wire types, not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from msgspec import UNSET, UnsetType

from sbx.api import validation as v
from sbx.api.codec import decode_request
from sbx.api.errors import InvalidRequest
from sbx.api.network_policy import NetworkConfig, NetworkPolicy, resolve_policy
from sbx.api.node import CordonRequest, Defaults, Limits
from sbx.api.processes import ProcessRequest, RunRequest, SignalRequest
from sbx.api.sandboxes import CreateRequest, PatchRequest, VolumeMount
from sbx.api.snapshots import ScheduleRequest, SnapshotKind, SnapshotRequest
from sbx.api.volumes import VolumeCreateRequest

T = TypeVar("T")

__all__ = [
    "CreateSpec",
    "PatchSpec",
    "ProcessSpec",
    "Rules",
    "RunSpec",
    "ScheduleSpec",
    "VolumeSpec",
    "check_create",
    "parse_cordon",
    "parse_create",
    "parse_patch",
    "parse_process",
    "parse_run",
    "parse_schedule",
    "parse_signal",
    "parse_snapshot_create",
    "parse_volume_create",
]


class Rules(Protocol):
    """What a server checks requests against: its limits, defaults and network settings (a node's config)."""

    @property
    def limits(self) -> Limits: ...

    @property
    def defaults(self) -> Defaults: ...

    @property
    def network(self) -> NetworkConfig: ...


@dataclass(frozen=True)
class CreateSpec:
    """``POST /v1/sandboxes`` with the server defaults applied.

    ``image``, ``cpus``, ``memory_mb``, ``disk_mb`` and ``idle_timeout_secs`` (0 = never) hold the
    request's value or the server default; ``network`` is the resolved policy (the default when
    omitted). ``fields_given`` names the fields the request actually had, for the rules that depend on
    it (a memory fork refuses resources; a disk fork takes the original's for omitted ones).
    ``snapshot_every_secs`` and ``snapshot_keep`` None: not asked for (keep then defaults to 1).
    ``secret_env``: environment whose values the node keeps in memory only (never on disk).
    ``persistent``: suspended, not terminated, at its idle timeout (then ``name`` is set).
    """

    image: str
    cpus: int
    memory_mb: int
    disk_mb: int
    idle_timeout_secs: int
    network: NetworkPolicy
    name: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    snapshot_every_secs: int | None = None
    snapshot_keep: int | None = None
    volumes: tuple[VolumeMount, ...] = ()
    snapshot_id: str | None = None
    fields_given: frozenset[str] = frozenset()
    secret_env: dict[str, str] = field(default_factory=dict, repr=False)
    persistent: bool = False


@dataclass(frozen=True)
class PatchSpec:
    """``PATCH /v1/sandboxes/{ref}``: None marks an omitted field (left unchanged).

    None is unambiguous because ``null`` is refused for every PATCH field. ``name`` "" removes the
    name; ``labels`` replaces the whole set ({} removes all); ``network`` is a resolved policy (needs
    capability ``network_policy_update``, checked by the handler). ``{}`` changes nothing.
    """

    network: NetworkPolicy | None = None
    name: str | None = None
    labels: dict[str, str] | None = None
    idle_timeout_secs: int | None = None


@dataclass(frozen=True)
class RunSpec:
    """``POST .../run``: ``timeout_secs`` None waits for the exit; ``cwd`` None: the sandbox's default
    (the image's WorkingDir, else ``/sandbox/home``)."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    stdin: bytes = b""
    timeout_secs: float | None = None


@dataclass(frozen=True)
class ProcessSpec:
    """``POST .../processes``: as run without a timeout; ``tty`` gives a ``rows`` x ``cols`` terminal."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    stdin: bytes = b""
    tty: bool = False
    rows: int = v.DEFAULT_TTY_ROWS
    cols: int = v.DEFAULT_TTY_COLS


@dataclass(frozen=True)
class ScheduleSpec:
    """``PUT .../snapshot-schedule``: ``every_secs`` 0 stops the schedule; ``keep`` defaults to 1."""

    every_secs: int
    keep: int = 1


@dataclass(frozen=True)
class VolumeSpec:
    """``POST /v1/volumes``: ``size_mb`` is resolved (the server's default disk size when omitted)."""

    name: str
    size_mb: int


# --- sandboxes ---------------------------------------------------------------------------------------


def check_create(req: CreateRequest, limits: Limits | None = None) -> None:
    """The 400 rules of a create request that need no server defaults: names, labels, env, resources (when
    ``limits`` are known), the schedule's shape, mounts and the snapshot id. A gateway runs these before it
    places the request; the node runs them again with its own limits."""
    if req.name is not UNSET:
        v.validate_sandbox_name(req.name)
    if req.persistent is True and not req.name:
        raise InvalidRequest(
            "persistent: a persistent sandbox needs a name (it is found again by it after every sleep); add name"
        )
    if req.image is not UNSET:
        v.validate_image_ref(req.image)
    if limits is not None:
        v.validate_resources(_opt(req.cpus), _opt(req.memory_mb), _opt(req.disk_mb), limits)
    for env_name, env_value in (req.env or {}).items():
        v.validate_env_name(env_name)
        v.validate_env_value(env_name, env_value)
    for env_name, env_value in (req.secret_env or {}).items():
        v.validate_env_name(env_name, "secret_env")
        v.validate_env_value(env_name, env_value, "secret_env")
    both = sorted(set(req.env or {}) & set(req.secret_env or {}))
    if both:
        raise InvalidRequest(
            f"secret_env: {', '.join(both)} also in env; give each variable in one of env and secret_env"
        )
    if req.labels is not UNSET:
        v.validate_labels(req.labels)
    if req.volumes:
        mounts = [
            VolumeMount(
                v.validate_volume_name(m.name, f"volumes[{i}].name"),
                v.validate_mount_path(m.path, f"volumes[{i}].path"),
                m.read_only,
            )
            for i, m in enumerate(req.volumes)
        ]
        v.validate_mounts([(m.name, m.path) for m in mounts])
    if req.snapshot_id is not UNSET:
        v.validate_snapshot_id(req.snapshot_id)
        if req.volumes:
            raise InvalidRequest(
                "volumes: a sandbox started from a snapshot cannot mount volumes; drop volumes or snapshot_id"
            )


def parse_create(body: bytes, rules: Rules) -> CreateSpec:
    """Parse and validate a create request against ``rules`` (limits, defaults, network)."""
    req = decode_request(body, CreateRequest)
    limits = rules.limits
    check_create(req, limits)
    idle_timeout_secs = v.resolve_create_idle_timeout(_opt(req.idle_timeout_secs), limits, rules.defaults)
    every = _opt(req.snapshot_every_secs)
    keep = _opt(req.snapshot_keep)
    v.validate_snapshot_schedule(every, keep, limits, prefix="snapshot_")
    volumes = tuple(
        VolumeMount(m.name, v.validate_mount_path(m.path, f"volumes[{i}].path"), m.read_only)
        for i, m in enumerate(req.volumes or ())
    )
    # 403s last: the request is well formed by now.
    env = v.validate_env(req.env or {})
    secret_env = v.validate_env(req.secret_env or {}, "secret_env")
    network = resolve_policy(req.network or None, rules.network)
    defaults = rules.defaults
    given = frozenset(name for name in CreateRequest.__struct_fields__ if getattr(req, name) is not UNSET)
    return CreateSpec(
        image=req.image if req.image is not UNSET else defaults.image,
        cpus=req.cpus if req.cpus is not UNSET else defaults.cpus,
        memory_mb=req.memory_mb if req.memory_mb is not UNSET else defaults.memory_mb,
        disk_mb=req.disk_mb if req.disk_mb is not UNSET else defaults.disk_mb,
        idle_timeout_secs=idle_timeout_secs,
        network=network,
        name=_opt(req.name),
        env=env,
        labels=dict(req.labels or {}),
        snapshot_every_secs=every,
        snapshot_keep=keep,
        volumes=volumes,
        snapshot_id=_opt(req.snapshot_id),
        fields_given=given,
        secret_env=secret_env,
        persistent=req.persistent is True,
    )


def parse_patch(body: bytes, rules: Rules) -> PatchSpec:
    """Parse a PATCH: any of network, name, labels, idle_timeout_secs; omitted ones are None.

    One bad field fails the whole request (nothing is applied). ``{}`` is valid and changes nothing.
    """
    req = decode_request(body, PatchRequest)
    name = _opt(req.name)
    if name:  # "" removes the name (PATCH rule 2)
        v.validate_sandbox_name(name)
    labels = v.validate_labels(req.labels) if req.labels is not UNSET else None
    idle = None
    if req.idle_timeout_secs is not UNSET:
        idle = v.validate_patch_idle_timeout(req.idle_timeout_secs, rules.limits)
    network = resolve_policy(req.network, rules.network) if req.network is not UNSET else None
    return PatchSpec(network=network, name=name, labels=labels, idle_timeout_secs=idle)


# --- processes ---------------------------------------------------------------------------------------


def _command(req: RunRequest | ProcessRequest) -> tuple[tuple[str, ...], dict[str, str], str | None, bytes]:
    argv = v.validate_argv(req.argv)
    env = req.env or {}
    for env_name, env_value in env.items():
        v.validate_env_name(env_name)
        v.validate_env_value(env_name, env_value)
    cwd = v.validate_guest_path(req.cwd, "cwd") if req.cwd is not UNSET else None
    stdin = req.stdin or b""
    v.validate_stdin_size(len(stdin))
    return argv, env, cwd, stdin


def parse_run(body: bytes) -> RunSpec:
    """Parse ``{argv, env?, cwd?, stdin? (base64), timeout_secs?}``; reserved env names are 403."""
    req = decode_request(body, RunRequest)
    argv, env, cwd, stdin = _command(req)
    timeout = v.validate_timeout_secs(req.timeout_secs) if req.timeout_secs is not UNSET else None
    return RunSpec(argv, v.validate_env(env), cwd, stdin, timeout)


def parse_process(body: bytes) -> ProcessSpec:
    """Parse ``{argv, env?, cwd?, stdin?, tty?, rows?, cols?}``; rows and cols need ``tty: true``."""
    req = decode_request(body, ProcessRequest)
    argv, env, cwd, stdin = _command(req)
    tty = req.tty is True
    rows = v.validate_tty_size("rows", req.rows) if req.rows is not UNSET else v.DEFAULT_TTY_ROWS
    cols = v.validate_tty_size("cols", req.cols) if req.cols is not UNSET else v.DEFAULT_TTY_COLS
    if not tty and (req.rows is not UNSET or req.cols is not UNSET):
        raise InvalidRequest("rows and cols size a terminal; set tty: true or remove them")
    return ProcessSpec(argv, v.validate_env(env), cwd, stdin, tty, rows, cols)


def parse_signal(body: bytes) -> int:
    """Parse ``{signal}`` (INT, TERM, KILL or HUP) into the signal number."""
    return v.parse_signal_name(decode_request(body, SignalRequest).signal)


# --- node, snapshots, schedule, volumes --------------------------------------------------------------


def parse_cordon(body: bytes) -> bool:
    """Parse ``{cordoned: bool}``."""
    return decode_request(body, CordonRequest).cordoned


def parse_snapshot_create(body: bytes) -> SnapshotKind:
    """Parse ``{kind?}`` of ``POST .../snapshots``: ``memory`` (the default) or ``disk``; an empty body is
    ``{}``."""
    kind = decode_request(body, SnapshotRequest, empty_is_object=True).kind
    if kind is UNSET or kind == "memory":
        return "memory"
    if kind == "disk":
        return "disk"
    raise InvalidRequest(f"kind must be memory or disk, not {kind!r}")


def parse_schedule(body: bytes, rules: Rules) -> ScheduleSpec:
    """Parse ``{every_secs, keep?}`` within ``limits.min_snapshot_every_secs`` and ``max_snapshot_keep``."""
    req = decode_request(body, ScheduleRequest)
    keep = req.keep if req.keep is not UNSET else 1
    v.validate_snapshot_schedule(req.every_secs, keep, rules.limits)
    return ScheduleSpec(req.every_secs, keep)


def parse_volume_create(body: bytes, rules: Rules) -> VolumeSpec:
    """Parse ``{name, size_mb?}``; ``size_mb`` defaults to ``defaults.disk_mb``, bounded by ``max_disk_mb``."""
    req = decode_request(body, VolumeCreateRequest)
    name = v.validate_volume_name(req.name)
    size = rules.defaults.disk_mb
    if req.size_mb is not UNSET:
        size = v.validate_resource("size_mb", req.size_mb, rules.limits.max_disk_mb, "limits.max_disk_mb")
    return VolumeSpec(name, size)


def _opt(value: T | UnsetType) -> T | None:
    """None for an omitted (UNSET) field, else its value."""
    return None if isinstance(value, UnsetType) else value
