"""sandboxd's TOML config: defaults, every key's type and range, consistency checks, capacity."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from sbx.api.network_policy import NetworkConfig, NetworkPolicy
from sbx.node.config import (
    Capacity,
    CapacityConfig,
    ConfigError,
    ImagesConfig,
    NodeConfig,
    PathsConfig,
    PoolConfig,
    config_from_mapping,
    image_pattern_matches,
    load_config,
    measure_capacity,
    resolve_capacity,
)


def load(tmp_path: Path, text: str) -> NodeConfig:
    path = tmp_path / "sandboxd.toml"
    path.write_text(text)
    return load_config(path)


def test_no_file_gives_documented_defaults() -> None:
    cfg = load_config(None)
    assert cfg == NodeConfig()
    assert (cfg.limits.max_cpus, cfg.limits.max_memory_mb, cfg.limits.max_disk_mb) == (4, 8192, 20480)
    assert (
        cfg.limits.max_idle_timeout_secs,
        cfg.limits.min_snapshot_every_secs,
        cfg.limits.max_snapshot_keep,
    ) == (
        86400,
        60,
        10,
    )
    assert (cfg.defaults.cpus, cfg.defaults.memory_mb, cfg.defaults.disk_mb) == (2, 512, 2048)
    assert (cfg.defaults.idle_timeout_secs, cfg.defaults.image) == (600, "default")
    assert cfg.network == NetworkConfig(NetworkPolicy("none"), "none", ())
    assert (cfg.capacity.cpus, cfg.capacity.memory_mb, cfg.capacity.disk_mb) == (0, 0, 0)
    assert (cfg.server.allowed_hosts, cfg.server.allowed_origins) == ((), ())
    assert cfg.paths == PathsConfig(
        Path("/var/lib/sandboxd/images"), Path("/var/lib/sandboxd/agent/sbx-agent")
    )
    assert cfg.audit.enabled is True
    assert cfg.gvisor.platform == "auto"


def test_empty_file_equals_defaults(tmp_path: Path) -> None:
    cfg = load(tmp_path, "")
    assert cfg == NodeConfig(source=tmp_path / "sandboxd.toml")


def test_full_file(tmp_path: Path) -> None:
    cfg = load(
        tmp_path,
        """
[limits]
max_cpus = 8
max_memory_mb = 16384
max_disk_mb = 40960
max_idle_timeout_secs = 0
min_snapshot_every_secs = 300
max_snapshot_keep = 3

[defaults]
cpus = 2
memory_mb = 1024
disk_mb = 4096
idle_timeout_secs = 0
image = "python:3.12"

[network]
default = {mode = "allowlist", allow = ["PyPI.org.", "*.pythonhosted.org"], deny = ["bad.pythonhosted.org"]}
ceiling = "open"
may_allow = ["*", "*.example.com"]

[capacity]
cpus = 16
memory_mb = 65536
disk_mb = 500000

[server]
allowed_hosts = ["Sandbox.Internal", "10.0.0.5", "[::1]"]
allowed_origins = ["https://console.example.com", "http://localhost:3000/"]

[paths]
images_dir = "/srv/images"
agent_path = "/srv/agent/sbx-agent"

[audit]
enabled = false
""",
    )
    assert cfg.limits.max_cpus == 8 and cfg.limits.max_idle_timeout_secs == 0
    assert cfg.defaults.idle_timeout_secs == 0 and cfg.defaults.image == "python:3.12"
    assert cfg.network == NetworkConfig(
        NetworkPolicy("allowlist", ("pypi.org", "*.pythonhosted.org"), ("bad.pythonhosted.org",)),
        "open",
        ("*", "*.example.com"),
    )
    assert cfg.capacity == CapacityConfig(16, 65536, 500000)
    assert cfg.server.allowed_hosts == ("sandbox.internal", "10.0.0.5", "[::1]")
    assert cfg.server.allowed_origins == ("https://console.example.com", "http://localhost:3000")
    assert cfg.paths == PathsConfig(Path("/srv/images"), Path("/srv/agent/sbx-agent"))
    assert cfg.audit.enabled is False


@pytest.mark.parametrize(
    ("text", "check"),
    [
        pytest.param("[defaults]\ncpus = 4", lambda c: c.defaults.cpus == 4, id="default-cpus-at-limit"),
        pytest.param("[defaults]\nmemory_mb = 8192", lambda c: c.defaults.memory_mb == 8192, id="default-memory-at-limit"),
        pytest.param("[defaults]\ndisk_mb = 20480", lambda c: c.defaults.disk_mb == 20480, id="default-disk-at-limit"),
        pytest.param("[defaults]\nidle_timeout_secs = 86400", lambda c: c.defaults.idle_timeout_secs == 86400, id="default-idle-at-limit"),
        pytest.param("[limits]\nmax_cpus = 1", lambda c: (c.limits.max_cpus, c.defaults.cpus) == (1, 1), id="limit-one-lowers-the-built-in-default"),
        pytest.param("[network]\nceiling = \"open\"", lambda c: c.network.ceiling == "open", id="ceiling-only"),
        pytest.param("[network]\ndefault = {mode = \"none\", deny = [\"a.com\"]}", lambda c: c.network.default == NetworkPolicy("none"), id="deny-dropped-under-none"),
        pytest.param("[network]\nceiling = \"open\"\ndefault = {mode = \"open\"}", lambda c: c.network.default == NetworkPolicy("open"), id="default-open-at-ceiling"),
        pytest.param("[network]\nmay_allow = [\"a.com\", \"A.com.\"]", lambda c: c.network.may_allow == ("a.com",), id="may-allow-deduped"),
        pytest.param("[capacity]\ncpus = 0", lambda c: c.capacity.cpus == 0, id="capacity-zero-measured"),
        pytest.param("[images]\nallowed = []", lambda c: c.images.allowed == (), id="images-none-allowed"),
        pytest.param("[images]\ncredentials_file = \"/etc/sbx/auth.json\"\ninsecure_registries = [\"Reg.Internal:5000\"]",
                     lambda c: c.images == ImagesConfig(("**",), Path("/etc/sbx/auth.json"), ("reg.internal:5000",)), id="images-registry-access"),
        pytest.param("[images]\nallow_private_registries = [\"127.0.0.1:5000\", \"Mirror.LAN\"]",
                     lambda c: c.images.allow_private_registries == ("127.0.0.1:5000", "mirror.lan"), id="images-private-registries"),
        pytest.param("", lambda c: c.images.allow_private_registries == (), id="no-private-registries-by-default"),
        pytest.param("[[pools]]\nimage = \"python:3.12\"\nsize = 3", lambda c: c.pools == (PoolConfig("docker.io/library/python:3.12", 3),), id="pool-normalised"),
        pytest.param("[[pools]]\nimage = \"default\"\nsize = 2", lambda c: c.pools == (PoolConfig("default", 2),), id="pool-of-default"),
        pytest.param("[images]\nallowed = []\n[[pools]]\nimage = \"default\"\nsize = 1", lambda c: c.pools[0].image == "default", id="default-always-allowed"),
        pytest.param("[[pools]]\nimage = \"default\"\nsize = 0", lambda c: c.pools == (PoolConfig("default", 0),), id="pool-size-zero"),
        pytest.param("[gvisor]\nplatform = \"ptrace\"", lambda c: c.gvisor.platform == "ptrace", id="platform-ptrace"),
        pytest.param("[gvisor]\nplatform = \"systrap\"", lambda c: c.gvisor.platform == "systrap", id="platform-systrap"),
        pytest.param("", lambda c: c.gvisor.dentry_cache == 0, id="dentry-cache-sized-by-default"),
        pytest.param("[gvisor]\ndentry_cache = 100", lambda c: c.gvisor.dentry_cache == 100, id="dentry-cache-smallest"),
        pytest.param("[gvisor]\ndentry_cache = 50000", lambda c: c.gvisor.dentry_cache == 50000, id="dentry-cache-set"),
        pytest.param("", lambda c: c.gvisor.usr_erofs is True, id="usr-erofs-by-default"),
        pytest.param("[gvisor]\nusr_erofs = false", lambda c: c.gvisor.usr_erofs is False, id="usr-erofs-off"),
        pytest.param("", lambda c: c.gvisor.root_overlay is True, id="root-overlay-on-by-default"),
        pytest.param("[gvisor]\nroot_overlay = false", lambda c: c.gvisor.root_overlay is False, id="root-overlay-off"),
        pytest.param("", lambda c: c.parking.park_after_secs == 30, id="parking-default"),
        pytest.param("[parking]\npark_after_secs = 0", lambda c: c.parking.park_after_secs == 0, id="parking-off"),
        pytest.param("[parking]\npark_after_secs = 5", lambda c: c.parking.park_after_secs == 5, id="parking-short"),
        pytest.param("", lambda c: (c.capacity.memory_overcommit, c.capacity.disk_overcommit, c.capacity.max_sandboxes) == (1.0, 1.0, 0), id="density-defaults"),
        pytest.param("[capacity]\nmemory_overcommit = 2.5\ndisk_overcommit = 20", lambda c: (c.capacity.memory_overcommit, c.capacity.disk_overcommit) == (2.5, 20.0), id="overcommit-int-or-float"),
        pytest.param("[capacity]\nmemory_overcommit = 1", lambda c: c.capacity.memory_overcommit == 1.0, id="overcommit-one"),
        pytest.param("[capacity]\nmax_sandboxes = 1000", lambda c: c.capacity.max_sandboxes == 1000, id="max-sandboxes"),
    ],
)  # fmt: skip
def test_valid_variants(tmp_path: Path, text: str, check: Callable[[NodeConfig], bool]) -> None:
    assert check(load(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # Unknown names: typos never pass silently.
        pytest.param("[limit]\nmax_cpus = 2", "unknown section limit", id="unknown-section"),
        pytest.param("[limits]\nmax_cpu = 2", "unknown key limits.max_cpu", id="unknown-key"),
        pytest.param("[network]\ndefault = {mode = \"none\", allowed = []}", "unknown key network.default.allowed", id="unknown-policy-key"),
        pytest.param("limits = 3", "limits: expected a table", id="section-not-table"),
        # Types.
        pytest.param("[limits]\nmax_cpus = \"4\"", "limits.max_cpus: expected an integer, got string '4'", id="int-as-string"),
        pytest.param("[limits]\nmax_cpus = 4.0", "limits.max_cpus: expected an integer, got number 4.0", id="int-as-float"),
        pytest.param("[limits]\nmax_cpus = true", "expected an integer, got boolean true", id="int-as-bool"),
        pytest.param("[audit]\nenabled = 1", "audit.enabled: expected true or false", id="bool-as-int"),
        pytest.param("[defaults]\nimage = \"\"", "defaults.image: expected a non-empty string", id="empty-image"),
        pytest.param("[defaults]\nimage = 3", "defaults.image: expected a non-empty string", id="image-type"),
        pytest.param("[server]\nallowed_hosts = \"a.com\"", "server.allowed_hosts: expected an array of strings", id="list-as-string"),
        pytest.param("[server]\nallowed_hosts = [1]", "server.allowed_hosts[0]: expected a string", id="list-item-type"),
        pytest.param("[paths]\nimages_dir = \"images\"", "paths.images_dir = 'images' is relative", id="relative-path"),
        pytest.param("[paths]\nagent_path = 5", "paths.agent_path: expected a path string", id="path-type"),
        pytest.param("[backend]\nkind = \"qemu\"", "backend.kind = 'qemu': expected one of gvisor", id="backend-unknown"),
        pytest.param("[backend]\nkind = \"\"", "backend.kind: expected a non-empty string", id="backend-empty"),
        pytest.param("[backend]\nplatform = \"kvm\"", "backend.platform", id="backend-unknown-key"),
        # Ranges.
        pytest.param("[limits]\nmax_cpus = 0", "limits.max_cpus = 0: expected a positive integer", id="limit-zero"),
        pytest.param("[limits]\nmax_memory_mb = -1", "limits.max_memory_mb = -1", id="limit-negative"),
        pytest.param("[limits]\nmin_snapshot_every_secs = 0", "positive", id="snapshot-every-zero"),
        pytest.param("[limits]\nmax_snapshot_keep = 0", "positive", id="snapshot-keep-zero"),
        pytest.param("[limits]\nmax_idle_timeout_secs = -1", "at least 0", id="idle-limit-negative"),
        pytest.param("[capacity]\nmemory_mb = -5", "capacity.memory_mb = -5", id="capacity-negative"),
        pytest.param("[defaults]\ncpus = 0", "defaults.cpus = 0: expected a positive integer", id="default-zero"),
        # Consistency: defaults within limits.
        pytest.param("[defaults]\ncpus = 5", "defaults.cpus = 5 is above limits.max_cpus = 4", id="default-cpus-one-over"),
        pytest.param("[defaults]\nmemory_mb = 8193", "above limits.max_memory_mb = 8192", id="default-memory-one-over"),
        pytest.param("[defaults]\ndisk_mb = 20481", "above limits.max_disk_mb = 20480", id="default-disk-one-over"),
        pytest.param("[limits]\nmax_memory_mb = 256", "defaults.memory_mb = 512 (the built-in default) is above", id="builtin-default-over-lowered-limit"),
        pytest.param("[defaults]\nidle_timeout_secs = 86401", "above limits.max_idle_timeout_secs = 86400", id="default-idle-one-over"),
        pytest.param("[limits]\nmax_idle_timeout_secs = 300", "set defaults.idle_timeout_secs to at most 300", id="builtin-idle-over-lowered-limit"),
        pytest.param("[defaults]\nidle_timeout_secs = 0", "0 (never idle out) is allowed only when", id="never-needs-unbounded-limit"),
        # Network: valid default under the ceiling.
        pytest.param("[network]\ndefault = {mode = \"open\"}", "network.default.mode open is above network.ceiling none", id="default-over-ceiling"),
        pytest.param("[network]\nceiling = \"allowlist\"\ndefault = {mode = \"open\"}", "raise the ceiling", id="open-over-allowlist"),
        pytest.param("[network]\nceiling = \"closed\"", "network.ceiling: unknown mode 'closed'", id="bad-ceiling"),
        pytest.param("[network]\ndefault = {mode = \"shut\"}", "network.default.mode: unknown mode", id="bad-default-mode"),
        pytest.param("[network]\ndefault = {allow = [\"a.com\"]}", "network.default.mode is missing", id="default-without-mode"),
        pytest.param("[network]\ndefault = \"none\"", "network.default: expected an inline table", id="default-not-table"),
        pytest.param("[network]\nceiling = \"allowlist\"\ndefault = {mode = \"allowlist\"}", "needs a non-empty allow list", id="allowlist-without-names"),
        pytest.param("[network]\nceiling = \"allowlist\"\ndefault = {mode = \"allowlist\", allow = []}", "rule 5", id="allowlist-empty"),
        pytest.param("[network]\nceiling = \"open\"\ndefault = {mode = \"open\", allow = [\"a.com\"]}", "only meaningful with mode allowlist", id="allow-with-open"),
        pytest.param("[network]\nceiling = \"allowlist\"\ndefault = {mode = \"allowlist\", allow = [\"https://a.com\"]}", "network.default.allow[0]", id="default-allow-malformed"),
        pytest.param("[network]\nceiling = \"allowlist\"\ndefault = {mode = \"allowlist\", allow = [\"*\"]}", "rule 7", id="default-allow-star"),
        pytest.param("[network]\ndefault = {mode = \"none\", deny = [\"1.2.3.4\"]}", "network.default.deny[0]", id="default-deny-malformed"),
        pytest.param("[network]\nmay_allow = [\"a.com:443\"]", "network.may_allow[0]", id="may-allow-malformed"),
        pytest.param("[network]\nmay_allow = [\"*.*\"]", "network.may_allow[0]", id="may-allow-bad-wildcard"),
        # Server guard entries.
        pytest.param("[server]\nallowed_hosts = [\"a.com:8080\"]", "without scheme or port", id="host-with-port"),
        pytest.param("[server]\nallowed_hosts = [\"https://a.com\"]", "not a host name", id="host-with-scheme"),
        pytest.param("[server]\nallowed_origins = [\"console.example.com\"]", "is not an origin", id="origin-without-scheme"),
        pytest.param("[server]\nallowed_origins = [\"https://a.com/app\"]", "is not an origin", id="origin-with-path"),
        pytest.param("[server]\nallowed_origins = [\"ftp://a.com\"]", "is not an origin", id="origin-bad-scheme"),
        pytest.param("[server]\nallowed_origins = [\"https://a.com:99999\"]", "is not an origin", id="origin-bad-port"),
        # Images and pools.
        pytest.param("[images]\nallow = []", "unknown key images.allow", id="images-unknown-key"),
        pytest.param("[images]\nallowed = \"**\"", "images.allowed: expected an array of strings", id="allowed-not-list"),
        pytest.param("[images]\nallowed = [\"a b\"]", "images.allowed[0]: 'a b' is not an image pattern", id="pattern-space"),
        pytest.param("[images]\nallowed = [\"python@sha256:00\"]", "no @digest", id="pattern-digest"),
        pytest.param("[images]\nallowed = [\"python:\"]", "empty or malformed tag", id="pattern-empty-tag"),
        pytest.param("[images]\ncredentials_file = \"auth.json\"", "images.credentials_file = 'auth.json' is relative", id="credentials-relative"),
        pytest.param("[images]\ninsecure_registries = [\"http://reg:5000\"]", "not a registry host[:port]", id="insecure-with-scheme"),
        pytest.param("[images]\nallow_private_registries = [\"127.0.0.1:5000/x\"]", "images.allow_private_registries[0]: '127.0.0.1:5000/x' is not a registry host[:port]", id="private-with-path"),
        pytest.param("[images]\nallow_private_registries = \"127.0.0.1\"", "images.allow_private_registries: expected an array of strings", id="private-not-list"),
        pytest.param("[pools]\nimage = \"default\"", "pools: expected an array of tables [[pools]]", id="pools-as-table"),
        pytest.param("[[pools]]\nsize = 1", "pools[0].image is missing", id="pool-without-image"),
        pytest.param("[[pools]]\nimage = \"default\"", "pools[0].size is missing", id="pool-without-size"),
        pytest.param("[[pools]]\nimage = \"default\"\nsize = -1", "pools[0].size = -1", id="pool-negative"),
        pytest.param("[[pools]]\nimage = \"default\"\nsize = 1\ncpus = 2", "unknown key pools[0].cpus", id="pool-unknown-key"),
        pytest.param("[[pools]]\nimage = \"Bad_Ref:\"\nsize = 1", "pools[0].image: image reference", id="pool-bad-reference"),
        pytest.param("[[pools]]\nimage = \"default\"\nsize = 1\n[[pools]]\nimage = \"default\"\nsize = 2", "has two pools", id="pool-twice"),
        pytest.param("[images]\nallowed = [\"ghcr.io/**\"]\n[[pools]]\nimage = \"python\"\nsize = 1", "is not allowed by images.allowed", id="pool-not-allowed"),
        # gVisor.
        pytest.param("[gvisor]\nplatform = \"kvm\"", "gvisor.platform = 'kvm': expected one of auto, systrap, ptrace", id="platform-unknown"),
        pytest.param("[gvisor]\nplatform = \"\"", "gvisor.platform: expected a non-empty string", id="platform-empty"),
        pytest.param("[gvisor]\nruntime = \"runsc\"", "unknown key gvisor.runtime", id="gvisor-unknown-key"),
        pytest.param("[gvisor]\ndentry_cache = 99", "gvisor.dentry_cache = 99: expected 0 (sized from the open-file limit) or at least 100", id="dentry-cache-too-small"),
        pytest.param("[gvisor]\ndentry_cache = -1", "gvisor.dentry_cache = -1: expected an integer of at least 0", id="dentry-cache-negative"),
        pytest.param("[gvisor]\nusr_erofs = 1", "gvisor.usr_erofs: expected true or false, got number 1", id="usr-erofs-not-bool"),
        pytest.param("[gvisor]\nroot_overlay = \"yes\"", "gvisor.root_overlay: expected true or false, got string", id="root-overlay-not-bool"),
        pytest.param("[gvisor]\ndentry_cache = \"big\"", "gvisor.dentry_cache: expected an integer, got string 'big'", id="dentry-cache-not-a-number"),
        # Parking and density.
        pytest.param("[parking]\npark_after_secs = -1", "parking.park_after_secs = -1: expected an integer of at least 0", id="parking-negative"),
        pytest.param("[parking]\npark_after_secs = 1.5", "parking.park_after_secs: expected an integer, got number 1.5", id="parking-float"),
        pytest.param("[parking]\nafter = 30", "unknown key parking.after; known: parking.park_after_secs", id="parking-unknown-key"),
        pytest.param("[capacity]\nmemory_overcommit = 0.5", "capacity.memory_overcommit = 0.5: expected a number from 1 (no overcommit) to 1000", id="overcommit-below-one"),
        pytest.param("[capacity]\ndisk_overcommit = 5000", "capacity.disk_overcommit = 5000: expected a number from 1", id="overcommit-too-large"),
        pytest.param("[capacity]\nmemory_overcommit = \"2\"", "capacity.memory_overcommit: expected a number such as 1.5 or 4, got string '2'", id="overcommit-string"),
        pytest.param("[capacity]\ndisk_overcommit = true", "expected a number such as 1.5 or 4, got boolean true", id="overcommit-bool"),
        pytest.param("[capacity]\nmax_sandboxes = -3", "capacity.max_sandboxes = -3", id="max-sandboxes-negative"),
        # Syntax.
        pytest.param("[limits\nmax_cpus = 1", "is not valid TOML", id="bad-toml"),
    ],
)  # fmt: skip
def test_invalid_config(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert message in str(info.value)
    assert str(tmp_path / "sandboxd.toml") in str(info.value)


def test_missing_file_names_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_config_error_is_not_a_sandbox_error() -> None:
    from sbx.api.errors import SandboxError

    assert not issubclass(ConfigError, SandboxError)


def test_config_is_frozen() -> None:
    cfg = load_config(None)
    with pytest.raises(AttributeError):
        cfg.limits.max_cpus = 99  # type: ignore[misc]


# --- capacity -----------------------------------------------------------------------------------------


def test_configured_capacity_is_not_measured(tmp_path: Path) -> None:
    assert resolve_capacity(CapacityConfig(3, 1000, 5000), tmp_path) == Capacity(3, 1000, 5000)


def test_measured_capacity_matches_the_host_less_reserves(tmp_path: Path) -> None:
    measured = measure_capacity(tmp_path)
    assert measured.cpus == len(os.sched_getaffinity(0))
    total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    assert measured.memory_mb == max(0, total_mb - max(512, int(total_mb * 0.10)))
    st = os.statvfs(tmp_path)
    free_mb = st.f_bavail * st.f_frsize // (1024 * 1024)
    total_disk_mb = st.f_blocks * st.f_frsize // (1024 * 1024)
    reserve = max(1024, int(total_disk_mb * 0.05))
    # Free space moves while tests run; allow a few MiB of drift.
    assert abs(measured.disk_mb - max(0, free_mb - reserve)) < 64


@pytest.mark.parametrize(
    ("memory_overcommit", "disk_overcommit", "expected"),
    [
        (1.0, 1.0, Capacity(3, 1000, 5000)),
        (2.0, 1.0, Capacity(3, 2000, 5000)),  # cpus are not touched: cpu_overcommit applies to measured cores
        (1.5, 10.0, Capacity(3, 1500, 50000)),
        (1.25, 1.0, Capacity(3, 1250, 5000)),
    ],
)
def test_memory_and_disk_overcommit_multiply_the_capacity(
    tmp_path: Path, memory_overcommit: float, disk_overcommit: float, expected: Capacity
) -> None:
    config = CapacityConfig(
        3, 1000, 5000, memory_overcommit=memory_overcommit, disk_overcommit=disk_overcommit
    )
    assert resolve_capacity(config, tmp_path) == expected


def test_overcommit_applies_to_the_measured_memory_too(tmp_path: Path) -> None:
    measured = measure_capacity(tmp_path)
    got = resolve_capacity(CapacityConfig(cpus=2, memory_mb=0, disk_mb=1, memory_overcommit=3.0), tmp_path)
    assert got.memory_mb == measured.memory_mb * 3


def test_zero_fields_are_measured_one_by_one(tmp_path: Path) -> None:
    measured = measure_capacity(tmp_path)
    got = resolve_capacity(CapacityConfig(cpus=7, memory_mb=0, disk_mb=0), tmp_path)
    assert got.cpus == 7
    assert got.memory_mb == measured.memory_mb
    assert abs(got.disk_mb - measured.disk_mb) < 64


def test_measure_uses_nearest_existing_parent(tmp_path: Path) -> None:
    assert measure_capacity(tmp_path / "not" / "yet").cpus >= 1


def test_documented_full_file_is_exactly_the_defaults() -> None:
    """docs/config.md ends with every key at its default; keep the two in step."""
    doc = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    example = (
        doc.split("## A complete file with every default", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    )
    assert config_from_mapping(tomllib.loads(example)) == NodeConfig()


@pytest.mark.parametrize(
    ("pattern", "reference", "matches"),
    [
        ("**", "docker.io/library/python:3.12", True),
        ("**", "127.0.0.1:5000/a/b/c@sha256:" + "0" * 64, True),
        ("python", "docker.io/library/python:3.12", True),
        ("python", "docker.io/library/pythonista:1", False),
        ("python:3.*", "docker.io/library/python:3.12-slim", True),
        ("python:3.*", "docker.io/library/python:2.7", False),
        ("python:3.12", "docker.io/library/python@sha256:" + "0" * 64, False),
        ("docker.io/library/*", "docker.io/library/debian:12", True),
        ("docker.io/library/*", "docker.io/acme/app:1", False),
        ("acme/*", "docker.io/acme/app:1", True),
        ("acme/*", "docker.io/acme/team/app:1", False),
        ("acme/**", "docker.io/acme/team/app:1", True),
        ("ghcr.io/acme/**", "ghcr.io/acme/a/b:1", True),
        ("ghcr.io/acme/**", "ghcr.io/other/a:1", False),
        ("GHCR.io/acme/*", "ghcr.io/acme/a:1", True),
        ("127.0.0.1:*/**", "127.0.0.1:5000/x/y:latest", True),
        ("localhost:5000/app", "localhost:5000/app:latest", True),
        ("*.example.com/**", "reg.example.com/team/app:1", True),
        ("*.example.com/**", "example.com/team/app:1", False),
    ],
)
def test_image_patterns(pattern: str, reference: str, matches: bool) -> None:
    assert image_pattern_matches(pattern, reference) is matches


def test_the_backend_kind_chooses_the_backend(tmp_path: Path) -> None:
    """``[backend] kind`` picks a registered factory; gvisor is the default and the only one sandboxd ships."""
    from fake_backend import FakeBackend

    from sbx.backends.gvisor import GVisorBackend
    from sbx.node import backend_kinds

    assert isinstance(backend_kinds.make_backend(load(tmp_path, ""), tmp_path), GVisorBackend)
    backend_kinds.register("fake", lambda config, state: FakeBackend(state, config.paths.agent_path))
    try:
        config = load(tmp_path, '[backend]\nkind = "fake"')
        assert config.backend.kind == "fake"
        assert isinstance(backend_kinds.make_backend(config, tmp_path), FakeBackend)
    finally:
        del backend_kinds.KINDS["fake"]
