"""The sandbox API's field rules, one small function each (spec: Sandbox, Processes, Files, Limits).

Every function takes an already type-checked value (``sbx.api.codec`` checks JSON types) and either
returns it, normalised where stated, or raises ``InvalidRequest`` (400) / ``Refused`` (403) with a
message naming the field and saying what to change. Choices the spec leaves open are documented in
docs/validation.md and in the constants below.
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Mapping, Sequence
from typing import Final

from sbx.api.errors import InvalidRequest, Refused
from sbx.api.node import Defaults, Limits

# --- names -------------------------------------------------------------------------------------------

#: Sandbox and volume names: 1 to 63 of a-z 0-9 - _ . starting with a letter or digit.
NAME_MAX_CHARS: Final = 63
_NAME_RE: Final = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
#: Sandbox ids look like ``sbx_<hex>``; a name starting so would be ambiguous in ``{ref}``.
ID_PREFIX: Final = "sbx_"

IMAGE_REF_MAX_CHARS: Final = 255
SNAPSHOT_ID_MAX_CHARS: Final = 128


def _check_name(value: str, field: str, what: str) -> str:
    if not value:
        raise InvalidRequest(f"{field}: the {what} name is empty; give 1 to {NAME_MAX_CHARS} characters")
    if len(value) > NAME_MAX_CHARS:
        raise InvalidRequest(
            f"{field}: the {what} name is {len(value)} characters long; use at most {NAME_MAX_CHARS}"
        )
    if not _NAME_RE.fullmatch(value):
        hint = "; use lowercase" if _NAME_RE.fullmatch(value.lower()) else ""
        raise InvalidRequest(
            f"{field}: {value!r} is not a valid {what} name: use lowercase letters, digits and '-', '_', '.', "
            f"starting with a letter or digit{hint}"
        )
    return value


def validate_sandbox_name(name: str, field: str = "name") -> str:
    """A sandbox name: 1-63 of ``a-z 0-9 - _ .``, first a letter or digit, not starting ``sbx_``."""
    _check_name(name, field, "sandbox")
    if name.startswith(ID_PREFIX):
        raise InvalidRequest(
            f"{field}: {name!r} starts with {ID_PREFIX!r}, which is how sandbox ids look; a name must not, "
            "so that a reference is never ambiguous; choose another name"
        )
    return name


def validate_volume_name(name: str, field: str = "name") -> str:
    """A volume name: 1-63 of ``a-z 0-9 - _ .``, first a letter or digit (same alphabet as sandboxes)."""
    return _check_name(name, field, "volume")


def validate_job_name(name: str, field: str = "name") -> str:
    """A job's name: the same alphabet and length as a volume's (1-63 of ``a-z 0-9 - _ .``)."""
    return _check_name(name, field, "job")


def validate_image_ref(image: str, field: str = "image") -> str:
    """An image reference: 1-255 printable characters with no whitespace; the image store checks the rest."""
    if not image:
        raise InvalidRequest(f"{field} is empty; give an image reference or omit it for the server default")
    if len(image) > IMAGE_REF_MAX_CHARS:
        raise InvalidRequest(f"{field} is longer than {IMAGE_REF_MAX_CHARS} characters")
    if any(ch.isspace() or not ch.isprintable() for ch in image):
        raise InvalidRequest(f"{field}: {image!r} contains whitespace or control characters")
    return image


def validate_snapshot_id(snapshot_id: str, field: str = "snapshot_id") -> str:
    """A snapshot id: 1-128 printable characters with no whitespace or '/'; existence is checked later."""
    if not snapshot_id:
        raise InvalidRequest(f"{field} is empty; give a snapshot id from GET /v1/snapshots, or omit it")
    if len(snapshot_id) > SNAPSHOT_ID_MAX_CHARS or any(
        ch.isspace() or ch == "/" or not ch.isprintable() for ch in snapshot_id
    ):
        raise InvalidRequest(
            f"{field}: {snapshot_id!r} is not a snapshot id; copy one from GET /v1/snapshots"
        )
    return snapshot_id


# --- labels ------------------------------------------------------------------------------------------

MAX_LABELS: Final = 32
LABEL_KEY_MAX_CHARS: Final = 63
LABEL_VALUE_MAX_BYTES: Final = 256
_LABEL_KEY_RE: Final = re.compile(r"[a-z0-9._/-]+")


def validate_label_key(key: str) -> str:
    """A label key: 1-63 of lowercase letters, digits and ``. _ / -``."""
    if not key:
        raise InvalidRequest("labels: a label key is empty; keys are 1 to 63 characters")
    if len(key) > LABEL_KEY_MAX_CHARS:
        raise InvalidRequest(
            f"labels: key {key[:20]!r}... is {len(key)} characters long; use at most {LABEL_KEY_MAX_CHARS}"
        )
    if not _LABEL_KEY_RE.fullmatch(key):
        raise InvalidRequest(
            f"labels: key {key!r} may contain only lowercase letters, digits and '.', '_', '/', '-'"
        )
    return key


def validate_label_value(key: str, value: str) -> str:
    """A label value: at most 256 bytes of UTF-8, printable (no control or separator characters)."""
    size = len(value.encode("utf-8"))
    if size > LABEL_VALUE_MAX_BYTES:
        raise InvalidRequest(
            f"labels.{key}: the value is {size} bytes of UTF-8; use at most {LABEL_VALUE_MAX_BYTES}"
        )
    if not value.isprintable():
        raise InvalidRequest(
            f"labels.{key}: the value contains a control or non-printable character; use printable text"
        )
    return value


def validate_labels(labels: Mapping[str, str], max_labels: int = MAX_LABELS) -> dict[str, str]:
    """A whole label set: at most ``max_labels`` (32 on a node), each key and value valid."""
    if len(labels) > max_labels:
        raise InvalidRequest(f"labels: {len(labels)} labels given; at most {max_labels} are allowed")
    return {validate_label_key(k): validate_label_value(k, v) for k, v in labels.items()}


# --- environment -------------------------------------------------------------------------------------

_ENV_NAME_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

#: Prefixes of reserved names: the dynamic loader (LD_), the service's own start-up (SBX_), the shell
#: (BASH_: BASH_ENV, BASH_FUNC_* function imports, BASH_XTRACEFD, ...) and glibc's malloc tuning.
RESERVED_ENV_PREFIXES: Final[tuple[str, ...]] = ("LD_", "SBX_", "BASH_", "MALLOC_")

#: Reserved whole names. Shell start-up and parsing: ENV, SHELLOPTS, BASHOPTS, PS4 (expanded under
#: xtrace), IFS, PROMPT_COMMAND, GLOBIGNORE, CDPATH, ZDOTDIR. Loader: glibc's list of variables it
#: strips for set-uid programs (GCONV_PATH ... RES_OPTIONS, GLIBC_TUNABLES), less TMPDIR and TZDIR,
#: which only say where a program keeps temporary files or finds zone data.
RESERVED_ENV_NAMES: Final[frozenset[str]] = frozenset(
    {
        "ENV",
        "SHELLOPTS",
        "BASHOPTS",
        "PS4",
        "IFS",
        "PROMPT_COMMAND",
        "GLOBIGNORE",
        "CDPATH",
        "ZDOTDIR",
        "GCONV_PATH",
        "GETCONF_DIR",
        "GLIBC_TUNABLES",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "LOCPATH",
        "NIS_PATH",
        "NLSPATH",
        "RESOLV_HOST_CONF",
        "RES_OPTIONS",
    }
)


def is_reserved_env_name(name: str) -> bool:
    """True for a name that controls sandbox start-up, the loader or the shell (case-sensitive)."""
    return name in RESERVED_ENV_NAMES or name.startswith(RESERVED_ENV_PREFIXES)


def validate_env_name(name: str, field: str = "env") -> str:
    """An environment variable name: ``[A-Za-z_][A-Za-z0-9_]*``."""
    if not _ENV_NAME_RE.fullmatch(name):
        raise InvalidRequest(
            f"{field}: {name!r} is not a valid environment variable name; use letters, digits and '_', "
            "not starting with a digit"
        )
    return name


def validate_env_value(name: str, value: str, field: str = "env") -> str:
    """An environment value: any text without a NUL byte."""
    if "\x00" in value:
        raise InvalidRequest(
            f"{field}.{name}: the value contains a NUL character, which no environment can hold"
        )
    return value


def check_env_not_reserved(name: str, field: str = "env") -> None:
    """403 for a reserved name (see RESERVED_ENV_NAMES and RESERVED_ENV_PREFIXES)."""
    if is_reserved_env_name(name):
        raise Refused(
            f"{field}: {name} is reserved (it controls sandbox start-up, the loader or the shell); "
            f"remove it from {field}"
        )


def validate_env(env: Mapping[str, str], field: str = "env") -> dict[str, str]:
    """A whole environment: every name and value well formed (400) before any reserved name (403)."""
    for name, value in env.items():
        validate_env_name(name, field)
        validate_env_value(name, value, field)
    for name in env:
        check_env_not_reserved(name, field)
    return dict(env)


# --- resources and timers ----------------------------------------------------------------------------

#: Upper bound for an integer field no configured limit bounds (about 68 years of seconds).
ABSOLUTE_MAX_INT: Final = 2**31 - 1


def validate_resource(field: str, value: int, limit: int, limit_name: str) -> int:
    """A resource amount: a positive integer not above its limit (named as in capabilities)."""
    if value < 1:
        raise InvalidRequest(f"{field} = {value}: expected a positive integer")
    if value > limit:
        raise InvalidRequest(
            f"{field} = {value} is above this server's limit {limit_name} = {limit}; ask for at most {limit}"
        )
    return value


def validate_resources(cpus: int | None, memory_mb: int | None, disk_mb: int | None, limits: Limits) -> None:
    """Check each given resource (None: omitted) against ``limits.max_*``."""
    if cpus is not None:
        validate_resource("cpus", cpus, limits.max_cpus, "limits.max_cpus")
    if memory_mb is not None:
        validate_resource("memory_mb", memory_mb, limits.max_memory_mb, "limits.max_memory_mb")
    if disk_mb is not None:
        validate_resource("disk_mb", disk_mb, limits.max_disk_mb, "limits.max_disk_mb")


def resolve_create_idle_timeout(value: int | None, limits: Limits, defaults: Defaults) -> int:
    """Create's ``idle_timeout_secs``: omitted or 0 is the server default; otherwise 1..limit.

    A limit of 0 means unbounded (up to ABSOLUTE_MAX_INT). A value above the limit is 400, never
    clamped. The result 0 means never idle out (only possible when the limit is 0).
    """
    if value is None or value == 0:
        return defaults.idle_timeout_secs
    return _idle_in_range(value, limits.max_idle_timeout_secs)


def validate_patch_idle_timeout(value: int, limits: Limits) -> int:
    """PATCH's ``idle_timeout_secs`` (rule 4): 1..limit; 0 (never) only where the limit is 0."""
    limit = limits.max_idle_timeout_secs
    if value == 0 and limit != 0:
        raise InvalidRequest(
            f"idle_timeout_secs = 0 (never) is not allowed here: limits.max_idle_timeout_secs is {limit}; "
            f"give 1 to {limit}"
        )
    if value == 0:
        return 0
    return _idle_in_range(value, limit)


def _idle_in_range(value: int, limit: int) -> int:
    if value < 0:
        raise InvalidRequest(f"idle_timeout_secs = {value} is negative; give a number of seconds")
    bound, name = (limit, "limits.max_idle_timeout_secs") if limit else (ABSOLUTE_MAX_INT, "the maximum")
    if value > bound:
        raise InvalidRequest(f"idle_timeout_secs = {value} is above {name} = {bound}; give at most {bound}")
    return value


def validate_snapshot_schedule(
    every_secs: int | None, keep: int | None, limits: Limits, prefix: str = ""
) -> None:
    """A snapshot schedule: ``every_secs`` 0 (no schedule) or at least ``min_snapshot_every_secs``
    (at most ABSOLUTE_MAX_INT); ``keep`` 1..``max_snapshot_keep``. None: omitted. Never narrowed."""
    if every_secs is not None:
        least = limits.min_snapshot_every_secs
        if every_secs < 0 or 0 < every_secs < least:
            raise InvalidRequest(
                f"{prefix}every_secs = {every_secs} is below limits.min_snapshot_every_secs = {least}; "
                f"give 0 (no schedule) or at least {least}"
            )
        if every_secs > ABSOLUTE_MAX_INT:
            raise InvalidRequest(f"{prefix}every_secs = {every_secs} is above {ABSOLUTE_MAX_INT}")
    if keep is not None:
        most = limits.max_snapshot_keep
        if not 1 <= keep <= most:
            raise InvalidRequest(
                f"{prefix}keep = {keep} is outside 1 to limits.max_snapshot_keep = {most}; give 1 to {most}"
            )


# --- guest paths and mounts --------------------------------------------------------------------------

#: Default working directory of a process: the sandbox user's home (there is no /workspace).
DEFAULT_CWD: Final = "/sandbox/home"
GUEST_PATH_MAX_BYTES: Final = 4096
GUEST_NAME_MAX_BYTES: Final = 255

MAX_VOLUME_MOUNTS: Final = 8
_MOUNT_PATH_RE: Final = re.compile(r"[A-Za-z0-9._/-]+")
#: Top-level directories a volume may not cover (any top-level ``lib*`` is included by prefix); ``.sbx``
#: holds the sandbox agent and its control socket, which a volume over it would cut off.
FORBIDDEN_MOUNT_ROOTS: Final = frozenset(
    {"tmp", "proc", "sys", "dev", "run", "etc", "usr", "bin", "sbin", "boot", ".sbx"}
)


def validate_guest_path(path: str, field: str = "path") -> str:
    """An absolute guest path: no NUL, no ``..`` component; ``//``, ``.`` and a trailing ``/`` removed.

    At most 4096 bytes, each component at most 255 bytes (Linux PATH_MAX and NAME_MAX).
    """
    if "\x00" in path:
        raise InvalidRequest(f"{field} contains a NUL character")
    if not path.startswith("/"):
        raise InvalidRequest(
            f"{field}: {path!r} is relative; give an absolute guest path such as /sandbox/home/x"
        )
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise InvalidRequest(f"{field}: {path!r} contains a '..' component; give the path without '..'")
    for part in parts:
        if len(part.encode("utf-8")) > GUEST_NAME_MAX_BYTES:
            raise InvalidRequest(
                f"{field}: a path component is longer than {GUEST_NAME_MAX_BYTES} bytes; shorten it"
            )
    result = "/" + "/".join(parts)
    if len(result.encode("utf-8")) > GUEST_PATH_MAX_BYTES:
        raise InvalidRequest(f"{field} is longer than {GUEST_PATH_MAX_BYTES} bytes")
    return result


def validate_mount_path(path: str, field: str = "path") -> str:
    """A volume mount path (mount rule 2): plain characters, not ``/``, ``/tmp`` or a system directory."""
    normal = validate_guest_path(path, field)
    if not _MOUNT_PATH_RE.fullmatch(normal):
        raise InvalidRequest(f"{field}: {path!r} may contain only letters, digits and '.', '_', '-', '/'")
    top = normal.split("/")[1]
    if not top:
        raise InvalidRequest(f"{field}: a volume cannot be mounted on '/'; choose a directory such as /data")
    if top in FORBIDDEN_MOUNT_ROOTS or top.startswith("lib"):
        raise InvalidRequest(
            f"{field}: {normal!r} is under /{top}, which is temporary or a system directory; "
            "choose another place such as /data or /sandbox/home/<dir>"
        )
    return normal


def validate_mounts(mounts: Sequence[tuple[str, str]]) -> None:
    """A create request's mounts as (volume name, normalised path): at most 8, no volume twice, no nesting."""
    if len(mounts) > MAX_VOLUME_MOUNTS:
        raise InvalidRequest(f"volumes: {len(mounts)} mounts given; at most {MAX_VOLUME_MOUNTS} are allowed")
    seen: dict[str, int] = {}
    for i, (name, _path) in enumerate(mounts):
        if name in seen:
            raise InvalidRequest(f"volumes[{i}]: volume {name!r} is already mounted by volumes[{seen[name]}]")
        seen[name] = i
    for i, (_, a) in enumerate(mounts):
        for j, (_, b) in enumerate(mounts):
            if i < j and (a == b or b.startswith(a + "/") or a.startswith(b + "/")):
                raise InvalidRequest(
                    f"volumes[{j}]: path {b!r} and volumes[{i}] path {a!r} nest or coincide; "
                    "mount volumes on separate directories"
                )


# --- processes ---------------------------------------------------------------------------------------

#: Longest ``timeout_secs`` a run may ask for: 24 hours. Longer work belongs in a background process.
MAX_RUN_TIMEOUT_SECS: Final = 86400
#: Largest decoded ``stdin`` in a run or process body: 768 KiB, what base64 fits in the 1 MiB JSON body.
#: More input goes through POST .../processes/{pid}/stdin as raw bytes.
MAX_STDIN_BYTES: Final = 768 * 1024
#: Terminal size bounds and defaults (rows, cols are uint16 in the attach resize frame).
TTY_MIN: Final = 1
TTY_MAX: Final = 65535
DEFAULT_TTY_ROWS: Final = 24
DEFAULT_TTY_COLS: Final = 80

#: The signals a client may send, by wire name.
SIGNALS: Final[Mapping[str, int]] = {
    "INT": int(signal.SIGINT),
    "TERM": int(signal.SIGTERM),
    "KILL": int(signal.SIGKILL),
    "HUP": int(signal.SIGHUP),
}


def validate_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """A command: a non-empty list whose first element is non-empty; no element contains NUL."""
    if not argv or not argv[0]:
        raise InvalidRequest(
            "missing command: argv must be a non-empty array whose first element names the program"
        )
    for i, arg in enumerate(argv):
        if "\x00" in arg:
            raise InvalidRequest(f"argv[{i}] contains a NUL character, which no argument can hold")
    return tuple(argv)


def validate_timeout_secs(value: float) -> float:
    """A run timeout: a positive finite number of seconds, at most MAX_RUN_TIMEOUT_SECS (24 h)."""
    if not math.isfinite(value) or value <= 0:
        raise InvalidRequest(
            f"timeout_secs = {value}: expected a positive number of seconds; omit it to wait for the exit"
        )
    if value > MAX_RUN_TIMEOUT_SECS:
        raise InvalidRequest(
            f"timeout_secs = {value} is above {MAX_RUN_TIMEOUT_SECS} (24 hours); give less, or start a "
            "background process with POST .../processes"
        )
    return value


def validate_stdin_size(size: int) -> None:
    """Decoded ``stdin`` at most MAX_STDIN_BYTES."""
    if size > MAX_STDIN_BYTES:
        raise InvalidRequest(
            f"stdin is {size} bytes; at most {MAX_STDIN_BYTES} fit in a request body; start the process "
            "and send the rest with POST .../processes/{pid}/stdin"
        )


def validate_tty_size(field: str, value: int) -> int:
    """A terminal dimension (``rows`` or ``cols``): 1..65535."""
    if not TTY_MIN <= value <= TTY_MAX:
        raise InvalidRequest(f"{field} = {value}: give {TTY_MIN} to {TTY_MAX}")
    return value


def parse_signal_name(name: str) -> int:
    """The signal number for INT, TERM, KILL or HUP (exact upper case, no ``SIG`` prefix)."""
    try:
        return SIGNALS[name]
    except KeyError:
        raise InvalidRequest(f"signal: {name!r} is not accepted; use one of {', '.join(SIGNALS)}") from None
