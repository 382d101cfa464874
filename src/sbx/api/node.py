"""Wire types of what a server is and offers (spec: Capabilities, NodeStatus, cordon).

``Limits`` and ``Defaults`` are also the node's own configuration of them (``[limits]``, ``[defaults]``), so
that request rules (``sbx.api.requests``) depend on nothing above this package.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec
from msgspec import UNSET, UnsetType

from sbx.api.network_policy import NetworkConfig


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """The server's limits: resources per sandbox (CPUs, MiB), the longest idle timeout in seconds (0: no
    bound, and 0 may then mean "never"), the shortest snapshot interval in seconds and the most scheduled
    snapshots kept."""

    max_cpus: int = 4
    max_memory_mb: int = 8192
    max_disk_mb: int = 20480
    max_idle_timeout_secs: int = 86400
    min_snapshot_every_secs: int = 60
    max_snapshot_keep: int = 10


class Defaults(msgspec.Struct, frozen=True, kw_only=True):
    """What a create gets for what it omits: image, CPUs, memory and disk (MiB), idle timeout in seconds
    (0: never, only where ``max_idle_timeout_secs`` is 0). Two CPUs by default: gVisor's systrap platform
    answers system calls about twice as fast with two cores of quota as with one (docs/benchmarks.md)."""

    cpus: int = 2
    memory_mb: int = 512
    disk_mb: int = 2048
    idle_timeout_secs: int = 600
    image: str = "default"


class Resources(msgspec.Struct, frozen=True):
    """An amount of CPUs and MiB of memory and disk."""

    cpus: int
    memory_mb: int
    disk_mb: int


#: Capability flag of the WebSocket form of attach (an addition: ``GET .../processes/{pid}/attach/websocket``,
#: the ``sbx-stream/1`` frames in binary messages, for browsers, which cannot send ``Upgrade: sbx-stream/1``).
WEBSOCKET_ATTACH = "websocket_attach"
#: Capability flag of ``secret_env`` in a create request (an addition): environment the node holds in memory only.
SECRET_ENV = "secret_env"
#: Capability flag of persistent sandboxes (an addition, docs/node-api.md "Persistent sandboxes"): create takes
#: ``persistent``; such a sandbox is suspended, not terminated, at its idle timeout, woken by the next request that
#: needs its guest, and can be stopped (``POST .../stop``: disk kept, memory freed) and started again.
PERSISTENT = "persistent"


class Capabilities(msgspec.Struct, kw_only=True):
    """``GET /v1/capabilities``: what this server offers; a client asks rather than assumes. Flags in
    ``capabilities``: the spec's (``network_policy_update``, ``suspend``, ``memory_snapshot``, ``disk_snapshot``,
    ``tunnel``, ``metrics``, ``audit``, ``images``) and the additions (``websocket_attach``, ``secret_env``, ``persistent``)."""

    api_version: str
    backend: str
    capabilities: dict[str, bool]
    limits: Limits
    network: NetworkConfig


class Runtime(msgspec.Struct, kw_only=True):
    """What runs a node's sandboxes (an addition to NodeStatus): the ``platform`` guest code runs on and
    ``platform_reason`` why it was chosen, ``limitations`` (one sentence each: what sandboxes here cannot do
    or do slowly) and, for gVisor, the runsc release read at start and its path."""

    platform: str
    platform_reason: str = ""
    limitations: list[str] = msgspec.field(default_factory=list)
    runsc_version: str | UnsetType = UNSET
    runsc_path: str | UnsetType = UNSET


class SandboxLimit(msgspec.Struct, frozen=True, kw_only=True):
    """One limit on how many sandboxes a node holds (an addition, in ``sandbox_capacity``): the ``resource``
    (``cpus``, ``memory``, ``disk`` and ``max_sandboxes`` of the node's accounting; ``host_memory``, ``tasks``
    and ``open_files`` read from the host), how many sandboxes of the default size it allows in all
    (``sandboxes``), and ``why``, one sentence with the figures it was computed from."""

    resource: str
    sandboxes: int
    why: str


class HostHeadroom(msgspec.Struct, kw_only=True):
    """The host's live figures every create is checked against (an addition, in ``sandbox_capacity``): memory
    available and the reserve kept (MiB), host tasks (threads) running, the most the kernel allows (the smaller
    of ``kernel.pid_max`` and ``kernel.threads-max``) and the reserve kept, and the server's open files, its
    limit (RLIMIT_NOFILE) and the reserve kept. A create is refused (503) when one would fall below its
    reserve."""

    memory_available_mb: int
    memory_reserve_mb: int
    tasks: int
    tasks_limit: int
    tasks_reserve: int
    open_files: int
    open_files_limit: int
    open_files_reserve: int


class SandboxCapacity(msgspec.Struct, kw_only=True):
    """How many sandboxes a node can hold and why (an addition to NodeStatus): ``max_sandboxes`` of the default
    size, the smallest of ``limits``, the one that binds (``limited_by``), how many it holds now
    (``sandboxes``, pooled ones included) and the host's live figures (``host``)."""

    max_sandboxes: int
    limited_by: str
    sandboxes: int
    limits: list[SandboxLimit]
    host: HostHeadroom


class NodeStatus(msgspec.Struct, kw_only=True):
    """``GET /v1/node``: a node's name (empty when standalone), version, capabilities, capacity and what is
    free (capacity less what every live sandbox holds, pooled ones included), sandboxes running, pooled
    sandboxes ready by image, installed images, labels and cordon. Additions: ``defaults`` (what a create
    gets for what it omits; a gateway counts quotas with it), ``runtime`` (the backend's own facts, such
    as its version and platform), ``parked`` (running sandboxes parked for idleness: counted in ``running``
    too) and ``sandbox_capacity`` (how many sandboxes it can hold, and why)."""

    name: str
    version: str
    capabilities: Capabilities
    capacity: Resources
    free: Resources
    running: int
    pooled: dict[str, int]
    images: list[str]
    labels: dict[str, str]
    cordoned: bool
    defaults: Defaults | UnsetType = UNSET
    runtime: Runtime | UnsetType = UNSET
    parked: int | UnsetType = UNSET
    sandbox_capacity: SandboxCapacity | UnsetType = UNSET


class CordonRequest(msgspec.Struct):
    """``POST /v1/node/cordon`` (and a gateway's admin cordon): ``{cordoned: bool}``."""

    required_hints: ClassVar[dict[str, str]] = {"cordoned": "cordoned is required: true or false"}

    cordoned: bool
