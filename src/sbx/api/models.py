"""Typed, validated requests of the sandbox API, parsed from raw JSON bodies.

Each ``parse_*`` takes the raw body bytes and returns a frozen dataclass or raises ``InvalidRequest``
(400) / ``Refused`` (403). Common rules for every body:

- it must be UTF-8 JSON whose top level is an object; NaN/Infinity and duplicate keys are 400;
- an unknown field is 400 naming it (``bind`` says it is no longer supported);
- a wrong type is 400 naming the field and the expected type; ``null`` is a wrong type for every
  field except ``network.allow`` (where it means the default list), so omit a field to leave it unset;
- integers must be JSON integers (``2.0`` and ``true`` are not integers).

Responses are built by the server, not here.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal

from sbx.api import validation as v
from sbx.api.errors import InvalidRequest
from sbx.api.network_policy import NetworkPolicy, resolve_policy

if TYPE_CHECKING:
    from sbx.node.config import NodeConfig

__all__ = [
    "CreateRequest",
    "PatchRequest",
    "ProcessRequest",
    "RunRequest",
    "ScheduleRequest",
    "VolumeCreateRequest",
    "VolumeMount",
    "decode_object",
    "parse_cordon",
    "parse_create",
    "parse_patch",
    "parse_process",
    "parse_run",
    "parse_schedule",
    "parse_signal",
    "parse_volume_create",
]


#: Fields removed from the API, with the message a client gets instead of "unknown field".
_REMOVED_FIELDS: Final[Mapping[str, str]] = {
    "bind": (
        "field 'bind' is not supported: host directory mounts were removed from the API; "
        "use volumes to keep files across sandboxes and the files API to copy files in"
    ),
}


@dataclass(frozen=True)
class VolumeMount:
    """One create-request mount: a volume name, a normalised absolute guest path, read-only or not."""

    name: str
    path: str
    read_only: bool = False


@dataclass(frozen=True)
class CreateRequest:
    """``POST /v1/sandboxes`` with the server defaults applied.

    ``image``, ``cpus``, ``memory_mb``, ``disk_mb`` and ``idle_timeout_secs`` (0 = never) hold the
    request's value or the server default; ``network`` is the resolved policy (the default when
    omitted). ``fields_given`` names the fields the request actually had, for the rules that depend on
    it (a memory fork refuses resources; a disk fork takes the original's for omitted ones).
    ``snapshot_every_secs`` and ``snapshot_keep`` None: not asked for (keep then defaults to 1).
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


@dataclass(frozen=True)
class PatchRequest:
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
class RunRequest:
    """``POST .../run``: ``timeout_secs`` None waits for the exit; ``cwd`` defaults to /sandbox/home."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = v.DEFAULT_CWD
    stdin: bytes = b""
    timeout_secs: float | None = None


@dataclass(frozen=True)
class ProcessRequest:
    """``POST .../processes``: as run without a timeout; ``tty`` gives a ``rows`` x ``cols`` terminal.

    The request fields are ``tty`` (default false), ``rows`` (default 24) and ``cols`` (default 80);
    rows and cols are accepted only with ``tty: true``.
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = v.DEFAULT_CWD
    stdin: bytes = b""
    tty: bool = False
    rows: int = v.DEFAULT_TTY_ROWS
    cols: int = v.DEFAULT_TTY_COLS


@dataclass(frozen=True)
class ScheduleRequest:
    """``PUT .../snapshot-schedule``: ``every_secs`` 0 stops the schedule; ``keep`` defaults to 1."""

    every_secs: int
    keep: int = 1


@dataclass(frozen=True)
class VolumeCreateRequest:
    """``POST /v1/volumes``: ``size_mb`` is resolved (the server's default disk size when omitted)."""

    name: str
    size_mb: int


# --- decoding ----------------------------------------------------------------------------------------


def decode_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be a UTF-8 JSON object; 400 for anything else."""
    if not body.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("the request body is not UTF-8; send UTF-8 JSON") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(
            f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"the request body must be a JSON object, not {_kind(obj)}")
    return obj


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidRequest(f"the field {key!r} appears twice in one JSON object; give it once")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise InvalidRequest(f"the request body is not valid JSON: {name} is not a JSON number")


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _check_fields(obj: Mapping[str, Any], known: tuple[str, ...], where: str = "") -> None:
    unknown = [k for k in obj if k not in known]
    if not unknown:
        return
    for key in unknown:
        if key in _REMOVED_FIELDS and not where:
            raise InvalidRequest(_REMOVED_FIELDS[key])
    names = ", ".join(repr(where + k) for k in unknown)
    plural = "s" if len(unknown) > 1 else ""
    raise InvalidRequest(f"unknown field{plural} {names}; the fields are {', '.join(known)}")


def _wrong(where: str, expected: str, value: object) -> InvalidRequest:
    hint = "; omit the field to leave it unset" if value is None else ""
    return InvalidRequest(f"{where}: expected {expected}, got {_kind(value)}{hint}")


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _wrong(where, "a string", value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(
            f"{where}: contains an unpaired surrogate escape; send valid UTF-8 text"
        ) from None
    return value


def _int(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _wrong(where, "an integer", value)
    return value


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise _wrong(where, "a boolean", value)
    return value


def _number(value: object, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise _wrong(where, "a number", value)
    return value  # an int stays an int so messages echo what was sent


def _object(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _wrong(where, "an object", value)
    return value


def _str_map(value: object, where: str) -> dict[str, str]:
    obj = _object(value, where)
    return {k: _str(item, f"{where}.{k}") for k, item in obj.items()}


def _str_list(value: object, where: str) -> list[str]:
    if not isinstance(value, list):
        raise _wrong(where, "an array of strings", value)
    return [_str(item, f"{where}[{i}]") for i, item in enumerate(value)]


# --- sandboxes ---------------------------------------------------------------------------------------

_CREATE_FIELDS: Final = (
    "name",
    "image",
    "cpus",
    "memory_mb",
    "disk_mb",
    "env",
    "network",
    "labels",
    "idle_timeout_secs",
    "snapshot_every_secs",
    "snapshot_keep",
    "volumes",
    "snapshot_id",
)
_MOUNT_FIELDS: Final = ("name", "path", "read_only")
_PATCH_FIELDS: Final = ("network", "name", "labels", "idle_timeout_secs")


def parse_create(body: bytes, config: NodeConfig) -> CreateRequest:
    """Parse and validate a create request against ``config`` (limits, defaults, network).

    All 400 checks run before any 403 (reserved env name, network policy), so a request with both
    kinds of mistake is told about the malformed one first.
    """
    obj = decode_object(body)
    _check_fields(obj, _CREATE_FIELDS)
    limits = config.limits

    name = v.validate_sandbox_name(_str(obj["name"], "name")) if "name" in obj else None
    image = v.validate_image_ref(_str(obj["image"], "image")) if "image" in obj else None
    cpus = _int(obj["cpus"], "cpus") if "cpus" in obj else None
    memory_mb = _int(obj["memory_mb"], "memory_mb") if "memory_mb" in obj else None
    disk_mb = _int(obj["disk_mb"], "disk_mb") if "disk_mb" in obj else None
    v.validate_resources(cpus, memory_mb, disk_mb, limits)
    env = _str_map(obj["env"], "env") if "env" in obj else {}
    for env_name, env_value in env.items():
        v.validate_env_name(env_name)
        v.validate_env_value(env_name, env_value)
    labels = v.validate_labels(_str_map(obj["labels"], "labels")) if "labels" in obj else {}
    idle = _int(obj["idle_timeout_secs"], "idle_timeout_secs") if "idle_timeout_secs" in obj else None
    idle_timeout_secs = v.resolve_create_idle_timeout(idle, limits, config.defaults)
    every = _int(obj["snapshot_every_secs"], "snapshot_every_secs") if "snapshot_every_secs" in obj else None
    keep = _int(obj["snapshot_keep"], "snapshot_keep") if "snapshot_keep" in obj else None
    v.validate_snapshot_schedule(every, keep, limits, prefix="snapshot_")
    volumes = _parse_mounts(obj["volumes"]) if "volumes" in obj else ()
    snapshot_id = (
        v.validate_snapshot_id(_str(obj["snapshot_id"], "snapshot_id")) if "snapshot_id" in obj else None
    )
    if snapshot_id is not None and volumes:
        raise InvalidRequest(
            "volumes: a sandbox started from a snapshot cannot mount volumes; drop volumes or snapshot_id"
        )
    network_raw = _object(obj["network"], "network") if "network" in obj else None

    # 403s last: the request is well formed by now.
    env = v.validate_env(env)
    network = resolve_policy(network_raw, config.network)
    defaults = config.defaults
    return CreateRequest(
        image=image if image is not None else defaults.image,
        cpus=cpus if cpus is not None else defaults.cpus,
        memory_mb=memory_mb if memory_mb is not None else defaults.memory_mb,
        disk_mb=disk_mb if disk_mb is not None else defaults.disk_mb,
        idle_timeout_secs=idle_timeout_secs,
        network=network,
        name=name,
        env=env,
        labels=labels,
        snapshot_every_secs=every,
        snapshot_keep=keep,
        volumes=volumes,
        snapshot_id=snapshot_id,
        fields_given=frozenset(obj),
    )


def _parse_mounts(value: object) -> tuple[VolumeMount, ...]:
    if not isinstance(value, list):
        raise _wrong("volumes", "an array of {name, path, read_only?}", value)
    mounts: list[VolumeMount] = []
    for i, item in enumerate(value):
        where = f"volumes[{i}]"
        entry = _object(item, where)
        _check_fields(entry, _MOUNT_FIELDS, f"{where}.")
        for required in ("name", "path"):
            if required not in entry:
                raise InvalidRequest(f"{where}.{required} is required")
        name = v.validate_volume_name(_str(entry["name"], f"{where}.name"), f"{where}.name")
        path = v.validate_mount_path(_str(entry["path"], f"{where}.path"), f"{where}.path")
        read_only = _bool(entry["read_only"], f"{where}.read_only") if "read_only" in entry else False
        mounts.append(VolumeMount(name, path, read_only))
    v.validate_mounts([(m.name, m.path) for m in mounts])
    return tuple(mounts)


def parse_patch(body: bytes, config: NodeConfig) -> PatchRequest:
    """Parse a PATCH: any of network, name, labels, idle_timeout_secs; omitted ones are None.

    One bad field fails the whole request (nothing is applied). ``{}`` is valid and changes nothing.
    """
    obj = decode_object(body)
    _check_fields(obj, _PATCH_FIELDS)
    name: str | None = None
    if "name" in obj:
        name = _str(obj["name"], "name")
        if name:  # "" removes the name (PATCH rule 2)
            v.validate_sandbox_name(name)
    labels: dict[str, str] | None = None
    if "labels" in obj:
        labels = v.validate_labels(_str_map(obj["labels"], "labels"))
    idle: int | None = None
    if "idle_timeout_secs" in obj:
        idle = v.validate_patch_idle_timeout(
            _int(obj["idle_timeout_secs"], "idle_timeout_secs"), config.limits
        )
    network: NetworkPolicy | None = None
    if "network" in obj:
        network = resolve_policy(_object(obj["network"], "network"), config.network)
    return PatchRequest(network=network, name=name, labels=labels, idle_timeout_secs=idle)


# --- processes ---------------------------------------------------------------------------------------

_RUN_FIELDS: Final = ("argv", "env", "cwd", "stdin", "timeout_secs")
_PROCESS_FIELDS: Final = ("argv", "env", "cwd", "stdin", "tty", "rows", "cols")


@dataclass(frozen=True)
class _Command:
    argv: tuple[str, ...]
    env: dict[str, str]
    cwd: str
    stdin: bytes


def _parse_command(obj: Mapping[str, Any]) -> _Command:
    if "argv" not in obj:
        raise InvalidRequest('missing command: argv is required, e.g. {"argv": ["ls", "-l"]}')
    argv = v.validate_argv(_str_list(obj["argv"], "argv"))
    env = _str_map(obj["env"], "env") if "env" in obj else {}
    for env_name, env_value in env.items():
        v.validate_env_name(env_name)
        v.validate_env_value(env_name, env_value)
    cwd = v.validate_guest_path(_str(obj["cwd"], "cwd"), "cwd") if "cwd" in obj else v.DEFAULT_CWD
    stdin = _base64(obj["stdin"], "stdin") if "stdin" in obj else b""
    return _Command(argv, env, cwd, stdin)


def _base64(value: object, where: str) -> bytes:
    text = _str(value, where)
    try:
        data = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise InvalidRequest(f"{where}: expected standard base64 (A-Z a-z 0-9 + /, '=' padding)") from None
    v.validate_stdin_size(len(data))
    return data


def parse_run(body: bytes) -> RunRequest:
    """Parse ``{argv, env?, cwd?, stdin? (base64), timeout_secs?}``; reserved env names are 403."""
    obj = decode_object(body)
    _check_fields(obj, _RUN_FIELDS)
    cmd = _parse_command(obj)
    timeout = None
    if "timeout_secs" in obj:
        timeout = v.validate_timeout_secs(_number(obj["timeout_secs"], "timeout_secs"))
    return RunRequest(cmd.argv, v.validate_env(cmd.env), cmd.cwd, cmd.stdin, timeout)


def parse_process(body: bytes) -> ProcessRequest:
    """Parse ``{argv, env?, cwd?, stdin?, tty?, rows?, cols?}``; rows and cols need ``tty: true``."""
    obj = decode_object(body)
    if "timeout_secs" in obj:
        raise InvalidRequest(
            "timeout_secs applies only to run; a background process runs until it exits or is signalled"
        )
    _check_fields(obj, _PROCESS_FIELDS)
    cmd = _parse_command(obj)
    tty = _bool(obj["tty"], "tty") if "tty" in obj else False
    rows = v.validate_tty_size("rows", _int(obj["rows"], "rows")) if "rows" in obj else v.DEFAULT_TTY_ROWS
    cols = v.validate_tty_size("cols", _int(obj["cols"], "cols")) if "cols" in obj else v.DEFAULT_TTY_COLS
    if not tty and ("rows" in obj or "cols" in obj):
        raise InvalidRequest("rows and cols size a terminal; set tty: true or remove them")
    return ProcessRequest(cmd.argv, v.validate_env(cmd.env), cmd.cwd, cmd.stdin, tty, rows, cols)


def parse_signal(body: bytes) -> int:
    """Parse ``{signal}`` (INT, TERM, KILL or HUP) into the signal number."""
    obj = decode_object(body)
    _check_fields(obj, ("signal",))
    if "signal" not in obj:
        raise InvalidRequest("signal is required: one of INT, TERM, KILL, HUP")
    return v.parse_signal_name(_str(obj["signal"], "signal"))


# --- node, schedule, volumes -------------------------------------------------------------------------


def parse_cordon(body: bytes) -> bool:
    """Parse ``{cordoned: bool}``."""
    obj = decode_object(body)
    _check_fields(obj, ("cordoned",))
    if "cordoned" not in obj:
        raise InvalidRequest("cordoned is required: true or false")
    return _bool(obj["cordoned"], "cordoned")


def parse_snapshot_create(body: bytes) -> Literal["memory", "disk"]:
    """Parse ``{kind?}`` of ``POST .../snapshots``: ``memory`` (the default) or ``disk``; an empty body is
    ``{}``."""
    obj = decode_object(body) if body.strip() else {}
    _check_fields(obj, ("kind",))
    kind = _str(obj.get("kind", "memory"), "kind")
    if kind == "memory":
        return "memory"
    if kind == "disk":
        return "disk"
    raise InvalidRequest(f"kind must be memory or disk, not {kind!r}")


def parse_schedule(body: bytes, config: NodeConfig) -> ScheduleRequest:
    """Parse ``{every_secs, keep?}`` within ``limits.min_snapshot_every_secs`` and ``max_snapshot_keep``."""
    obj = decode_object(body)
    _check_fields(obj, ("every_secs", "keep"))
    if "every_secs" not in obj:
        raise InvalidRequest("every_secs is required; give 0 to stop the schedule")
    every = _int(obj["every_secs"], "every_secs")
    keep = _int(obj["keep"], "keep") if "keep" in obj else 1
    v.validate_snapshot_schedule(every, keep, config.limits)
    return ScheduleRequest(every, keep)


def parse_volume_create(body: bytes, config: NodeConfig) -> VolumeCreateRequest:
    """Parse ``{name, size_mb?}``; ``size_mb`` defaults to ``defaults.disk_mb``, bounded by ``max_disk_mb``."""
    obj = decode_object(body)
    _check_fields(obj, ("name", "size_mb"))
    if "name" not in obj:
        raise InvalidRequest("name is required")
    name = v.validate_volume_name(_str(obj["name"], "name"))
    size = config.defaults.disk_mb
    if "size_mb" in obj:
        size = v.validate_resource(
            "size_mb", _int(obj["size_mb"], "size_mb"), config.limits.max_disk_mb, "limits.max_disk_mb"
        )
    return VolumeCreateRequest(name, size)
