"""sandboxd's configuration file (TOML): typed, validated at load, every key optional.

``load_config(path)`` reads the file (or nothing, for ``None``) and returns a frozen :class:`NodeConfig`.
Every mistake is a :class:`ConfigError` naming the key and what to change; unknown sections and keys
are errors too, so a typo never passes silently. Keys, defaults and the meaning of 0 are documented in
docs/config.md; the defaults below are the same values.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import shutil
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar
from urllib.parse import urlsplit

import msgspec
from msgspec import UNSET

from sbx.api.errors import InvalidRequest
from sbx.api.network_policy import (
    MODE_ORDER,
    NetworkConfig,
    NetworkPolicy,
    mode_rank,
    normalise_name,
    normalise_pattern,
    parse_mode,
)
from sbx.api.node import Defaults, Limits, Resources
from sbx.backends.runsc import DEFAULT_RUNSC
from sbx.net.dns import parse_server
from sbx.net.egress import MIN_SUBNET_PREFIX, EgressConfig
from sbx.node.backend_kinds import DEFAULT_KIND, KINDS

__all__ = [
    "AuditConfig",
    "BackendConfig",
    "Capacity",
    "CapacityConfig",
    "ConfigError",
    "DefaultsConfig",
    "GVisorConfig",
    "ImagesConfig",
    "LimitsConfig",
    "NetworkConfig",
    "NodeConfig",
    "ParkingConfig",
    "PathsConfig",
    "PoolConfig",
    "ServerConfig",
    "config_from_mapping",
    "image_pattern_matches",
    "load_config",
    "measure_capacity",
    "resolve_capacity",
]

MIB: Final = 1024 * 1024
#: Memory kept back from the measured total for the host, sandboxd and the VMMs: the larger of these.
MEMORY_RESERVE_MIN_MB: Final = 512
MEMORY_RESERVE_FRACTION: Final = 0.10
#: Disk kept back from the measured free space of the state directory's filesystem: the larger of these.
DISK_RESERVE_MIN_MB: Final = 1024
DISK_RESERVE_FRACTION: Final = 0.05


class ConfigError(Exception):
    """The configuration file is unreadable or wrong; the message names the key and the fix.

    Not a SandboxError: it stops sandboxd at start-up and is never sent to a client.
    """


#: ``[limits]``: the most a request may ask for (capabilities ``limits``). ``max_idle_timeout_secs`` 0 means no
#: upper bound, and only then may a sandbox idle forever (``idle_timeout_secs`` 0). The wire type of
#: capabilities, so request rules (``sbx.api.requests``) take it as is.
LimitsConfig = Limits
#: ``[defaults]``: what a create request gets for a field it omits. ``idle_timeout_secs`` 0 means never idle
#: out, allowed only when ``limits.max_idle_timeout_secs`` is 0. Reported in NodeStatus ``defaults``.
DefaultsConfig = Defaults


@dataclass(frozen=True)
class CapacityConfig:
    """``[capacity]``: what this node offers to sandboxes; 0 means measured from the host."""

    cpus: int = 0
    memory_mb: int = 0
    disk_mb: int = 0
    #: vCPUs offered per measured core when ``cpus`` is 0 (vCPUs are time-shared, as in every cloud). 16, so
    #: a core holds 8 sandboxes of the default 2 vCPUs, as it held 8 of 1 vCPU at 8.
    cpu_overcommit: int = 16
    #: Memory and disk given out per MiB of capacity (1: none). A sandbox's ``memory_mb`` is a limit, most of
    #: which an idle one never touches, and its disk a sparse file; the host's own headroom is checked live at
    #: every create (sbx.node.capacity), whatever these say.
    memory_overcommit: float = 1.0
    disk_overcommit: float = 1.0
    #: The most sandboxes (pooled ones included) the node holds at once; 0: no cap of its own.
    max_sandboxes: int = 0


@dataclass(frozen=True)
class ParkingConfig:
    """``[parking]``: ``park_after_secs``, the idle time (seconds, no request naming it, no process running,
    nothing open on it) after which a running sandbox whose guest runs nothing but its agent is parked: its
    processes are stopped on the host (no CPU at all) and woken in milliseconds by the next request
    (sbx.node.parking). 0 never parks."""

    park_after_secs: int = 30


#: Capacity with every 0 replaced by a measurement (cpus in cores, memory and disk in MiB).
Capacity = Resources


@dataclass(frozen=True)
class ServerConfig:
    """``[server]``: request guard additions, and what a connection may do before it authenticates.

    ``allowed_hosts`` are Host names accepted besides the loopback names (``localhost``, 127.0.0.1,
    ::1), lowercased, without a port. ``allowed_origins`` are exact origins ``scheme://host[:port]``.
    ``idle_timeout_secs``: a connection with no whole request head that long after opening or after its previous
    answer is closed. ``max_unauthenticated``: TCP connections not yet authenticated kept at most (a new one past
    that closes the oldest). See ``sbx.web.connections``.
    """

    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    idle_timeout_secs: int = 30
    max_unauthenticated: int = 256


@dataclass(frozen=True)
class PathsConfig:
    """``[paths]``: where images, the guest agent binary and the gVisor runtime live (absolute paths).
    ``runsc`` defaults to the one scripts/install.sh builds (a link to its pinned version, docs/backends.md)."""

    images_dir: Path = Path("/var/lib/sandboxd/images")
    agent_path: Path = Path("/var/lib/sandboxd/agent/sbx-agent")
    runsc: Path = Path(DEFAULT_RUNSC)


@dataclass(frozen=True)
class AuditConfig:
    """``[audit]``: ``enabled`` keeps the node's sandbox event log (capability ``audit``)."""

    enabled: bool = True


@dataclass(frozen=True)
class ImagesConfig:
    """``[images]``: which images may be pulled and run, and how to reach registries.

    ``allowed`` holds reference patterns (see :func:`image_pattern_matches`); ``("**",)``, the default,
    allows every reference and ``()`` only the default image. ``credentials_file`` is a Docker
    ``config.json``-style file of registry logins (None: anonymous). ``insecure_registries`` are
    ``host[:port]`` reached over plain HTTP besides loopback ones. ``allow_private_registries`` are the
    ``host[:port]`` that pulls may reach on loopback, private or this host's own addresses (none by default;
    link-local and metadata addresses are never reached; docs/images.md).
    """

    allowed: tuple[str, ...] = ("**",)
    credentials_file: Path | None = None
    insecure_registries: tuple[str, ...] = ()
    allow_private_registries: tuple[str, ...] = ()


@dataclass(frozen=True)
class PoolConfig:
    """One ``[[pools]]`` entry: keep ``size`` sandboxes of ``image`` booted ahead of creates.

    ``image`` is normalised as a reference (``python:3.12`` is ``docker.io/library/python:3.12``) except
    for the default image's own name; 0 keeps no pool.
    """

    image: str
    size: int


#: Values of ``[gvisor] platform``: ``auto`` probes systrap at start and falls back to ptrace.
GVISOR_PLATFORMS: Final = ("auto", "systrap", "ptrace")
#: The smallest ``[gvisor] dentry_cache`` accepted besides 0 (runsc's own per-mount default is 1,000).
MIN_DENTRY_CACHE: Final = 100


@dataclass(frozen=True)
class GVisorConfig:
    """``[gvisor]``: ``platform`` sandboxes run on, ``auto`` (systrap where it works here, else ptrace; see
    docs/backends.md) or a platform name used as told. ``dentry_cache``: unused file-system entries each
    sandbox's sentry keeps cached (runsc ``--dcache``); 0 means sized from the open-file limit sandboxd runs
    with (sbx.backends.runsc.dentry_cache_size). ``usr_erofs``: serve each image's /usr, when nothing in it is
    writable by a user, from an EROFS image of it the sentry reads itself (sbx.backends.usr_erofs).
    ``root_overlay``: true (the default): an ephemeral sandbox's writes go to gVisor's own overlay, sized to its
    disk, above its ext4 layer (sbx.backends.root_overlay), where the runsc is one scripts/install.sh built;
    false: to the ext4 layer, as a persistent sandbox's always do."""

    platform: str = "auto"
    dentry_cache: int = 0
    usr_erofs: bool = True
    root_overlay: bool = True


@dataclass(frozen=True)
class BackendConfig:
    """``[backend]``: ``kind``, the backend that isolates sandboxes (``gvisor``; sbx.node.backend_kinds)."""

    kind: str = DEFAULT_KIND


@dataclass(frozen=True)
class NodeConfig:
    """The whole node configuration; ``source`` is the file it came from (None: built-in defaults)."""

    limits: LimitsConfig = field(default_factory=LimitsConfig)
    defaults: DefaultsConfig = field(default_factory=DefaultsConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    #: How egress is enforced (``[network]`` subnet, upstream_dns; docs/network.md).
    egress: EgressConfig = field(default_factory=EgressConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    images: ImagesConfig = field(default_factory=ImagesConfig)
    pools: tuple[PoolConfig, ...] = ()
    parking: ParkingConfig = field(default_factory=ParkingConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    gvisor: GVisorConfig = field(default_factory=GVisorConfig)
    source: Path | None = None


_SECTIONS: Final = (
    "limits",
    "defaults",
    "network",
    "capacity",
    "server",
    "paths",
    "audit",
    "images",
    "parking",
    "backend",
    "gvisor",
)
#: Top-level arrays of tables (``[[pools]]``), checked apart from the sections.
_ARRAYS: Final = ("pools",)

_T = TypeVar("_T")


def load_config(path: Path | None) -> NodeConfig:
    """Read and validate the TOML file at ``path``; ``None`` gives the built-in defaults.

    Raises ConfigError for a missing or unreadable file, invalid TOML, an unknown section or key, a
    value of the wrong type or out of range, defaults outside the limits, or a default network policy
    the ceiling does not permit.
    """
    if path is None:
        return NodeConfig()
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; create it or leave out --config") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    try:
        return _build(raw, path)
    except ConfigError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None


def config_from_mapping(raw: Mapping[str, Any], source: Path | None = None) -> NodeConfig:
    """Validate an already-parsed TOML document (what ``load_config`` does after reading the file)."""
    return _build(raw, source)


def _build(raw: Mapping[str, Any], source: Path | None) -> NodeConfig:
    _no_unknown(raw, _SECTIONS + _ARRAYS, "")
    sections = {name: _section(raw, name) for name in _SECTIONS}

    lim = sections["limits"]
    _no_unknown(lim, _fields(LimitsConfig), "limits.")
    base_lim = LimitsConfig()
    limits = LimitsConfig(
        max_cpus=_int(lim, "limits.max_cpus", base_lim.max_cpus, minimum=1),
        max_memory_mb=_int(lim, "limits.max_memory_mb", base_lim.max_memory_mb, minimum=1),
        max_disk_mb=_int(lim, "limits.max_disk_mb", base_lim.max_disk_mb, minimum=1),
        max_idle_timeout_secs=_int(lim, "limits.max_idle_timeout_secs", base_lim.max_idle_timeout_secs),
        min_snapshot_every_secs=_int(
            lim, "limits.min_snapshot_every_secs", base_lim.min_snapshot_every_secs, minimum=1
        ),
        max_snapshot_keep=_int(lim, "limits.max_snapshot_keep", base_lim.max_snapshot_keep, minimum=1),
    )

    dfl = sections["defaults"]
    _no_unknown(dfl, _fields(DefaultsConfig), "defaults.")
    base_dfl = DefaultsConfig()
    defaults = DefaultsConfig(
        # The built-in 2 follows a smaller limits.max_cpus; one set here must fit it.
        cpus=_int(
            dfl,
            "defaults.cpus",
            min(base_dfl.cpus, limits.max_cpus),
            minimum=1,
            maximum=(limits.max_cpus, "limits.max_cpus"),
        ),
        memory_mb=_int(
            dfl,
            "defaults.memory_mb",
            base_dfl.memory_mb,
            minimum=1,
            maximum=(limits.max_memory_mb, "limits.max_memory_mb"),
        ),
        disk_mb=_int(
            dfl,
            "defaults.disk_mb",
            base_dfl.disk_mb,
            minimum=1,
            maximum=(limits.max_disk_mb, "limits.max_disk_mb"),
        ),
        idle_timeout_secs=_idle_default(dfl, limits, base_dfl.idle_timeout_secs),
        image=_nonempty_str(dfl, "defaults.image", base_dfl.image),
    )

    network = _network(sections["network"])
    egress = _egress(sections["network"])

    cap = sections["capacity"]
    _no_unknown(cap, _fields(CapacityConfig), "capacity.")
    capacity = CapacityConfig(
        cpus=_int(cap, "capacity.cpus", 0),
        memory_mb=_int(cap, "capacity.memory_mb", 0),
        disk_mb=_int(cap, "capacity.disk_mb", 0),
        cpu_overcommit=_int(cap, "capacity.cpu_overcommit", CapacityConfig.cpu_overcommit, minimum=1),
        memory_overcommit=_overcommit(cap, "capacity.memory_overcommit"),
        disk_overcommit=_overcommit(cap, "capacity.disk_overcommit"),
        max_sandboxes=_int(cap, "capacity.max_sandboxes", 0),
    )

    prk = sections["parking"]
    _no_unknown(prk, _fields(ParkingConfig), "parking.")
    parking = ParkingConfig(
        park_after_secs=_int(prk, "parking.park_after_secs", ParkingConfig.park_after_secs)
    )

    srv = sections["server"]
    _no_unknown(srv, _fields(ServerConfig), "server.")
    server = ServerConfig(
        allowed_hosts=_str_list(srv, "server.allowed_hosts", _host_entry),
        allowed_origins=_str_list(srv, "server.allowed_origins", _origin_entry),
        idle_timeout_secs=_int(srv, "server.idle_timeout_secs", ServerConfig.idle_timeout_secs, minimum=1),
        max_unauthenticated=_int(
            srv, "server.max_unauthenticated", ServerConfig.max_unauthenticated, minimum=1
        ),
    )

    pth = sections["paths"]
    _no_unknown(pth, _fields(PathsConfig), "paths.")
    base_pth = PathsConfig()
    paths = PathsConfig(
        images_dir=_abs_path(pth, "paths.images_dir", base_pth.images_dir),
        agent_path=_abs_path(pth, "paths.agent_path", base_pth.agent_path),
        runsc=_abs_path(pth, "paths.runsc", base_pth.runsc),
    )

    aud = sections["audit"]
    _no_unknown(aud, _fields(AuditConfig), "audit.")
    audit = AuditConfig(enabled=_bool(aud, "audit.enabled", True))

    images = _images(sections["images"])
    pools = _pools(raw.get("pools", []), images, defaults.image)

    bke = sections["backend"]
    _no_unknown(bke, _fields(BackendConfig), "backend.")
    kind = _nonempty_str(bke, "backend.kind", DEFAULT_KIND)
    if kind not in KINDS:
        raise ConfigError(f"backend.kind = {kind!r}: expected one of {', '.join(sorted(KINDS))}")

    gvi = sections["gvisor"]
    _no_unknown(gvi, _fields(GVisorConfig), "gvisor.")
    platform = _nonempty_str(gvi, "gvisor.platform", GVisorConfig.platform)
    if platform not in GVISOR_PLATFORMS:
        raise ConfigError(f"gvisor.platform = {platform!r}: expected one of {', '.join(GVISOR_PLATFORMS)}")
    dentry_cache = _int(gvi, "gvisor.dentry_cache", GVisorConfig.dentry_cache)
    if 0 < dentry_cache < MIN_DENTRY_CACHE:
        raise ConfigError(
            f"gvisor.dentry_cache = {dentry_cache}: expected 0 (sized from the open-file limit) or at least "
            f"{MIN_DENTRY_CACHE}"
        )

    return NodeConfig(
        limits=limits, defaults=defaults, network=network, egress=egress, capacity=capacity, server=server,
        paths=paths, audit=audit, images=images, pools=pools, parking=parking, backend=BackendConfig(kind),
        gvisor=GVisorConfig(
            platform=platform, dentry_cache=dentry_cache,
            usr_erofs=_bool(gvi, "gvisor.usr_erofs", GVisorConfig.usr_erofs),
            root_overlay=_bool(gvi, "gvisor.root_overlay", GVisorConfig.root_overlay),
        ),
        source=source,
    )  # fmt: skip


def _images(sec: Mapping[str, Any]) -> ImagesConfig:
    _no_unknown(sec, _fields(ImagesConfig), "images.")
    allowed = _str_list(sec, "images.allowed", _image_pattern) if "allowed" in sec else ImagesConfig.allowed
    raw_file = sec.get("credentials_file", "")
    if not isinstance(raw_file, str):
        raise ConfigError(f"images.credentials_file: expected a path string, got {_kind(raw_file)}")
    if raw_file and not raw_file.startswith("/"):
        raise ConfigError(f"images.credentials_file = {raw_file!r} is relative; give an absolute path")
    insecure = _str_list(sec, "images.insecure_registries", _registry_entry)
    private = _str_list(sec, "images.allow_private_registries", _registry_entry)
    return ImagesConfig(allowed, Path(raw_file) if raw_file else None, insecure, private)


def _registry_entry(value: str, key: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?", value):
        raise ConfigError(
            f"{key}: {value!r} is not a registry host[:port]; give e.g. 'registry.internal:5000'"
        )
    return value.lower()


def _pools(raw: Any, images: ImagesConfig, default_image: str) -> tuple[PoolConfig, ...]:
    if not isinstance(raw, list) or not all(isinstance(p, Mapping) for p in raw):
        raise ConfigError('pools: expected an array of tables [[pools]] with image = "..." and size = N')
    pools: list[PoolConfig] = []
    for i, entry in enumerate(raw):
        key = f"pools[{i}]"
        _no_unknown(entry, ("image", "size"), f"{key}.")
        if "image" not in entry:
            raise ConfigError(
                f'{key}.image is missing; name the image to keep sandboxes of, e.g. image = "default"'
            )
        image = _nonempty_str(entry, f"{key}.image", "")
        if image != default_image:
            image = _normalise(image, f"{key}.image")
            if not any(image_pattern_matches(p, image) for p in images.allowed):
                raise ConfigError(
                    f"{key}.image {image!r} is not allowed by images.allowed; allow it or drop the pool"
                )
        if "size" not in entry:
            raise ConfigError(f"{key}.size is missing; give how many sandboxes to keep booted")
        size = _int(entry, f"{key}.size", 0)
        if any(p.image == image for p in pools):
            raise ConfigError(f"{key}: image {image!r} has two pools; keep one entry per image")
        pools.append(PoolConfig(image, size))
    return tuple(pools)


def _normalise(reference: str, key: str) -> str:
    # Imported here: sbx.images depends on nothing in sbx.node, but keep config importable on its own.
    from sbx.images.reference import normalize_reference

    try:
        return normalize_reference(reference)
    except InvalidRequest as exc:
        raise ConfigError(f"{key}: {exc.message}") from None


# --- image reference patterns ----------------------------------------------------------------------------------


def _split_pattern(pattern: str) -> tuple[str, str | None]:
    """(name glob, tag glob or None) of a pattern, with Docker Hub short names expanded."""
    name, tag = pattern, None
    last_colon = name.rfind(":")
    if last_colon > name.rfind("/"):
        name, tag = name[:last_colon], name[last_colon + 1 :]
    first, slash, _ = name.partition("/")
    if "*" not in first and not (slash and ("." in first or ":" in first or first == "localhost")):
        name = f"docker.io/{name}" if slash else f"docker.io/library/{name}"
    return name.lower(), tag


def _glob(text: str, *, slash: bool) -> str:
    """A regular expression for a glob: ``**`` any characters, ``*`` any but ``/`` (any at all if ``slash``)."""
    out = []
    for i, part in enumerate(text.split("**")):
        if i:
            out.append(".*")
        out.append((".*" if slash else "[^/]*").join(re.escape(p) for p in part.split("*")))
    return "".join(out)


def _image_pattern(value: str, key: str) -> str:
    if not value or any(c.isspace() for c in value) or "@" in value:
        raise ConfigError(
            f"{key}: {value!r} is not an image pattern; give e.g. 'docker.io/library/*', 'python:3.*' or "
            "'registry.internal:5000/**' (no spaces, no @digest)"
        )
    _, tag = _split_pattern(value)
    if tag is not None and (not tag or "/" in tag):
        raise ConfigError(f"{key}: {value!r} has an empty or malformed tag pattern after ':'")
    return value


def image_pattern_matches(pattern: str, reference: str) -> bool:
    """Whether the normalised ``reference`` (``registry/repository[:tag][@digest]``) matches ``pattern``.

    A pattern is ``name[:tag]``. In the name, ``*`` matches within one path component and ``**`` across
    components; a name whose first component is neither a registry (with ``.`` or ``:``, or ``localhost``)
    nor a wildcard is a Docker Hub name and expanded as references are (``python`` is
    ``docker.io/library/python``). Without ``:tag`` every tag and digest of the name matches; with one, the
    reference's tag must match it (``*`` matches any characters there). ``**`` alone matches everything.
    """
    name_glob, tag_glob = _split_pattern(pattern)
    ref = reference.split("@", 1)[0]
    ref_name, ref_tag = ref, None
    last_colon = ref.rfind(":")
    if last_colon > ref.rfind("/"):
        ref_name, ref_tag = ref[:last_colon], ref[last_colon + 1 :]
    if not re.fullmatch(_glob(name_glob, slash=False), ref_name.lower()):
        return False
    if tag_glob is None:
        return True
    return ref_tag is not None and re.fullmatch(_glob(tag_glob, slash=True), ref_tag) is not None


def _egress(sec: Mapping[str, Any]) -> EgressConfig:
    """``subnet`` (IPv4, /MIN_SUBNET_PREFIX or larger) and ``upstream_dns`` (``"ip"`` or ``"ip:port"``)."""
    subnet = EgressConfig.subnet
    if "subnet" in sec:
        raw = sec["subnet"]
        if not isinstance(raw, str):
            raise ConfigError(f'network.subnet: expected a string such as "10.200.0.0/16", got {_kind(raw)}')
        try:
            subnet = ipaddress.IPv4Network(raw)
        except ValueError as exc:
            raise ConfigError(
                f"network.subnet {raw!r}: {exc}; give an IPv4 network such as 10.200.0.0/16"
            ) from None
        if subnet.prefixlen > MIN_SUBNET_PREFIX:
            raise ConfigError(f"network.subnet {raw} is too small; give a /{MIN_SUBNET_PREFIX} or larger")

    def server(value: str, key: str) -> tuple[str, int]:
        try:
            return parse_server(value)
        except ValueError as exc:
            raise ConfigError(f'{key} {value!r}: {exc}; give "ip" or "ip:port"') from None

    return EgressConfig(subnet, _str_list(sec, "network.upstream_dns", server))


def _network(sec: Mapping[str, Any]) -> NetworkConfig:
    _no_unknown(sec, ("default", "ceiling", "may_allow", "subnet", "upstream_dns"), "network.")
    ceiling = _wrap(lambda: parse_mode(sec.get("ceiling", "none"), "network.ceiling"))
    may_allow = _str_list(sec, "network.may_allow", lambda v, k: _wrap(lambda: normalise_pattern(v, k)))
    raw_default = sec.get("default", {"mode": "none"})
    if not isinstance(raw_default, Mapping):
        raise ConfigError('network.default: expected an inline table such as {mode = "none"}')
    _no_unknown(raw_default, ("mode", "allow", "deny"), "network.default.")
    if "mode" not in raw_default:
        raise ConfigError('network.default.mode is missing; set it to "none", "allowlist" or "open"')
    mode = _wrap(lambda: parse_mode(raw_default["mode"], "network.default.mode"))
    allow: tuple[str, ...] = ()
    if "allow" in raw_default:
        if mode != "allowlist":
            raise ConfigError(
                f"network.default.allow is only meaningful with mode allowlist, not {mode}; "
                "remove allow or set mode to allowlist"
            )
        allow = _str_list(
            raw_default, "network.default.allow", lambda v, k: _wrap(lambda: normalise_name(v, k))
        )
    if mode == "allowlist" and not allow:
        raise ConfigError(
            "network.default: mode allowlist needs a non-empty allow list (network policy rule 5); "
            'add allow = ["example.com", ...] or use mode "none"'
        )
    deny = _str_list(raw_default, "network.default.deny", lambda v, k: _wrap(lambda: normalise_name(v, k)))
    if mode == "none":
        deny = ()  # rule 6: deny means nothing without egress
    if mode_rank(mode) > mode_rank(ceiling):
        raise ConfigError(
            f"network.default.mode {mode} is above network.ceiling {ceiling}; raise the ceiling to "
            f"{mode} or choose a default mode among {', '.join(MODE_ORDER[: mode_rank(ceiling) + 1])}"
        )
    return NetworkConfig(
        NetworkPolicy(mode, allow if mode == "allowlist" else UNSET, deny), ceiling, may_allow
    )


def _idle_default(sec: Mapping[str, Any], limits: LimitsConfig, default: int) -> int:
    key = "defaults.idle_timeout_secs"
    limit = limits.max_idle_timeout_secs
    value = _int(sec, key, default)
    if limit == 0:
        return value
    if value == 0:
        raise ConfigError(
            f"{key} = 0 (never idle out) is allowed only when limits.max_idle_timeout_secs is 0 "
            f"(no bound), and that limit is {limit}; give 1 to {limit} or set the limit to 0"
        )
    if value > limit:
        raise ConfigError(
            f"{key} = {value}{_builtin(sec, key)} is above limits.max_idle_timeout_secs = {limit}; "
            f"set {key} to at most {limit} or raise the limit"
        )
    return value


def _host_entry(value: str, key: str) -> str:
    host = value.lower()
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(bare)
        return host
    except ValueError:
        pass
    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*", host):
        raise ConfigError(
            f"{key}: {value!r} is not a host name or IP address; give the name alone, without scheme or port"
        )
    return host


def _origin_entry(value: str, key: str) -> str:
    parts = urlsplit(value)
    ok = (
        parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and parts.path in ("", "/")
        and not parts.query
        and not parts.fragment
        and parts.username is None
    )
    if ok:
        try:
            _ = parts.port
        except ValueError:
            ok = False
    if not ok:
        raise ConfigError(
            f"{key}: {value!r} is not an origin; give scheme://host[:port] such as 'https://console.example.com'"
        )
    return value.rstrip("/").lower()


def _section(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    sec = raw.get(name, {})
    if not isinstance(sec, Mapping):
        raise ConfigError(f"{name}: expected a table [{name}], got {_kind(sec)}")
    return sec


def _no_unknown(sec: Mapping[str, Any], known: tuple[str, ...], prefix: str) -> None:
    for key in sec:
        if key not in known:
            where = "section" if not prefix else "key"
            raise ConfigError(f"unknown {where} {prefix}{key}; known: {', '.join(prefix + k for k in known)}")


def _fields(cls: Any) -> tuple[str, ...]:
    if issubclass(cls, msgspec.Struct):
        return tuple(cls.__struct_fields__)
    return tuple(f.name for f in dataclasses.fields(cls))


def _int(
    sec: Mapping[str, Any],
    key: str,
    default: int,
    *,
    minimum: int = 0,
    maximum: tuple[int, str] | None = None,
) -> int:
    value = sec.get(key.rsplit(".", 1)[1], default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got {_kind(value)}")
    if value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise ConfigError(f"{key} = {value}: expected {what}")
    if maximum is not None and value > maximum[0]:
        raise ConfigError(
            f"{key} = {value}{_builtin(sec, key)} is above {maximum[1]} = {maximum[0]}; "
            f"set {key} to at most {maximum[0]} or raise {maximum[1]}"
        )
    return value


def _builtin(sec: Mapping[str, Any], key: str) -> str:
    return "" if key.rsplit(".", 1)[1] in sec else " (the built-in default)"


#: The largest overcommit factor accepted: far beyond what any host holds, so a typo (1000 for 10.00) is caught.
MAX_OVERCOMMIT: Final = 1000.0


def _overcommit(sec: Mapping[str, Any], key: str) -> float:
    """An overcommit factor: a number (integer or not) from 1 to MAX_OVERCOMMIT; 1 by default."""
    value = sec.get(key.rsplit(".", 1)[1], 1.0)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number such as 1.5 or 4, got {_kind(value)}")
    if not 1.0 <= value <= MAX_OVERCOMMIT:
        raise ConfigError(f"{key} = {value}: expected a number from 1 (no overcommit) to {MAX_OVERCOMMIT:g}")
    return float(value)


def _bool(sec: Mapping[str, Any], key: str, default: bool) -> bool:
    value = sec.get(key.rsplit(".", 1)[1], default)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: expected true or false, got {_kind(value)}")
    return value


def _nonempty_str(sec: Mapping[str, Any], key: str, default: str) -> str:
    value = sec.get(key.rsplit(".", 1)[1], default)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}: expected a non-empty string, got {_kind(value)}")
    return value


def _abs_path(sec: Mapping[str, Any], key: str, default: Path) -> Path:
    value = sec.get(key.rsplit(".", 1)[1], str(default))
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}: expected a path string, got {_kind(value)}")
    if not value.startswith("/"):
        raise ConfigError(f"{key} = {value!r} is relative; give an absolute path")
    return Path(value)


def _str_list(sec: Mapping[str, Any], key: str, check: Callable[[str, str], _T]) -> tuple[_T, ...]:
    value = sec.get(key.rsplit(".", 1)[1], [])
    if not isinstance(value, list):
        raise ConfigError(f"{key}: expected an array of strings, got {_kind(value)}")
    out: list[_T] = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise ConfigError(f"{key}[{i}]: expected a string, got {_kind(item)}")
        out.append(check(item, f"{key}[{i}]"))
    return tuple(dict.fromkeys(out))


def _wrap(fn: Callable[[], _T]) -> _T:
    # The network rules raise request errors; at load time they are configuration mistakes.
    try:
        return fn()
    except InvalidRequest as exc:
        raise ConfigError(exc.message) from None


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, (int, float)):
        return f"number {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, Mapping):
        return "a table"
    return type(value).__name__


def resolve_capacity(config: CapacityConfig, state_dir: Path) -> Capacity:
    """The capacity this node offers: each configured value, or the measurement where it is 0; memory and disk
    times their overcommit (a configured value too: it says what the host has, the factor how far to go)."""
    measured: Capacity | None = None
    if 0 in (config.cpus, config.memory_mb, config.disk_mb):
        measured = measure_capacity(state_dir)
    memory = config.memory_mb or (measured.memory_mb if measured else 0)
    disk = config.disk_mb or (measured.disk_mb if measured else 0)
    return Capacity(
        cpus=config.cpus or (measured.cpus * config.cpu_overcommit if measured else 0),
        memory_mb=int(memory * config.memory_overcommit),
        disk_mb=int(disk * config.disk_overcommit),
    )


def measure_capacity(state_dir: Path) -> Capacity:
    """Measure the host: usable cores, total memory less the reserve, free disk less the reserve.

    cpus: cores this process may run on, no reserve (vCPUs are time-shared, and the host's own work
    needs little CPU). memory_mb: MemTotal less max(512 MiB, 10 %). disk_mb: free space of the
    filesystem holding ``state_dir`` (its nearest existing ancestor) less max(1 GiB, 5 % of that
    filesystem's size). Never negative.
    """
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // MIB
    memory_reserve = max(MEMORY_RESERVE_MIN_MB, int(total_mb * MEMORY_RESERVE_FRACTION))
    probe = state_dir
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    usage = shutil.disk_usage(probe)
    disk_reserve = max(DISK_RESERVE_MIN_MB, int(usage.total // MIB * DISK_RESERVE_FRACTION))
    return Capacity(
        cpus=cpus,
        memory_mb=max(0, total_mb - memory_reserve),
        disk_mb=max(0, usage.free // MIB - disk_reserve),
    )
