"""Field rules of the sandbox API: each rule's valid cases, boundaries, error class and message."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import pytest

from sbx.api import validation as v
from sbx.api.errors import InvalidRequest, Refused, SandboxError
from sbx.node.config import DefaultsConfig, LimitsConfig

LIMITS = LimitsConfig()  # max_cpus 4, memory 8192, disk 20480, idle 86400, snapshot every >= 60, keep <= 10
UNBOUNDED_IDLE = LimitsConfig(max_idle_timeout_secs=0)
DEFAULTS = DefaultsConfig()  # idle 600


def rejects(fn: Callable[[], object], error: type[SandboxError], message: str) -> None:
    with pytest.raises(SandboxError) as info:
        fn()
    assert type(info.value) is error, info.value
    assert message in info.value.message


# --- sandbox and volume names -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("a", id="one-char"),
        pytest.param("9", id="one-digit"),
        pytest.param("web-1", id="hyphen"),
        pytest.param("my_box.v2", id="underscore-dot"),
        pytest.param("a" * 63, id="63-chars"),
        pytest.param("sbx-dev", id="sbx-with-hyphen"),
        pytest.param("sbx", id="sbx-alone"),
    ],
)
def test_sandbox_name_accepts(name: str) -> None:
    assert v.validate_sandbox_name(name) == name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        pytest.param("", "empty", id="empty"),
        pytest.param("a" * 64, "use at most 63", id="64-chars"),
        pytest.param("Web", "use lowercase", id="uppercase"),
        pytest.param("-web", "starting with a letter or digit", id="leading-hyphen"),
        pytest.param(".hidden", "starting with a letter or digit", id="leading-dot"),
        pytest.param("_x", "starting with a letter or digit", id="leading-underscore"),
        pytest.param("a b", "not a valid sandbox name", id="space"),
        pytest.param("a/b", "not a valid sandbox name", id="slash"),
        pytest.param("café", "not a valid sandbox name", id="non-ascii"),
        pytest.param("sbx_1234abcd", "how sandbox ids look", id="looks-like-id"),
        pytest.param("sbx_", "how sandbox ids look", id="id-prefix-alone"),
    ],
)
def test_sandbox_name_rejects(name: str, message: str) -> None:
    rejects(lambda: v.validate_sandbox_name(name), InvalidRequest, message)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        pytest.param("build-1.v2", None, id="ok"),
        pytest.param("sbx_nightly", None, id="id-like-prefix-is-fine"),
        pytest.param("", "name: the job name is empty; give 1 to 63 characters", id="empty"),
        pytest.param("j" * 64, "name: the job name is 64 characters long; use at most 63", id="64-chars"),
        pytest.param(
            "Build",
            "name: 'Build' is not a valid job name: use lowercase letters, digits and '-', '_', "
            "'.', starting with a letter or digit; use lowercase",
            id="uppercase",
        ),
    ],
)
def test_job_name(name: str, message: str | None) -> None:
    if message is None:
        assert v.validate_job_name(name) == name
    else:
        rejects(lambda: v.validate_job_name(name), InvalidRequest, message)


def test_volume_name_allows_id_like_prefix_but_same_alphabet() -> None:
    assert v.validate_volume_name("sbx_data") == "sbx_data"
    rejects(lambda: v.validate_volume_name("Data", "volumes[0].name"), InvalidRequest, "volumes[0].name")


@pytest.mark.parametrize(
    ("image", "ok"),
    [
        pytest.param("default", True, id="plain"),
        pytest.param("docker.io/library/python:3.12-slim", True, id="registry-tag"),
        pytest.param("a" * 255, True, id="255-chars"),
        pytest.param("a" * 256, False, id="256-chars"),
        pytest.param("", False, id="empty"),
        pytest.param("python 3", False, id="space"),
        pytest.param("py\nthon", False, id="newline"),
    ],
)
def test_image_ref(image: str, ok: bool) -> None:
    if ok:
        assert v.validate_image_ref(image) == image
    else:
        rejects(lambda: v.validate_image_ref(image), InvalidRequest, "image")


@pytest.mark.parametrize(
    ("snapshot_id", "ok"),
    [
        pytest.param("snap_0123abcd", True, id="plain"),
        pytest.param("s" * 128, True, id="128-chars"),
        pytest.param("s" * 129, False, id="129-chars"),
        pytest.param("", False, id="empty"),
        pytest.param("../x", False, id="slash"),
        pytest.param("a b", False, id="space"),
    ],
)
def test_snapshot_id(snapshot_id: str, ok: bool) -> None:
    if ok:
        assert v.validate_snapshot_id(snapshot_id) == snapshot_id
    else:
        rejects(lambda: v.validate_snapshot_id(snapshot_id), InvalidRequest, "snapshot_id")


# --- labels -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "labels",
    [
        pytest.param({}, id="none"),
        pytest.param({"team": "infra"}, id="simple"),
        pytest.param({"app.kubernetes.io/name-x_y": "v"}, id="all-key-punctuation"),
        pytest.param({"k" * 63: "v"}, id="key-63-chars"),
        pytest.param({"k": "v" * 256}, id="value-256-bytes"),
        pytest.param({"k": "é" * 128}, id="value-256-bytes-multibyte"),
        pytest.param({"k": ""}, id="empty-value"),
        pytest.param({"k": "hello world!"}, id="value-with-space"),
        pytest.param({f"k{i}": "v" for i in range(32)}, id="32-labels"),
    ],
)
def test_labels_accept(labels: dict[str, str]) -> None:
    assert v.validate_labels(labels) == labels


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        pytest.param({f"k{i}": "v" for i in range(33)}, "33 labels given; at most 32", id="33-labels"),
        pytest.param({"": "v"}, "key is empty", id="empty-key"),
        pytest.param({"k" * 64: "v"}, "at most 63", id="key-64-chars"),
        pytest.param({"Team": "v"}, "lowercase letters", id="uppercase-key"),
        pytest.param({"a b": "v"}, "lowercase letters", id="space-in-key"),
        pytest.param({"a:b": "v"}, "lowercase letters", id="colon-in-key"),
        pytest.param({"k": "v" * 257}, "257 bytes", id="value-257-bytes"),
        pytest.param({"k": "é" * 128 + "x"}, "257 bytes", id="value-257-bytes-multibyte"),
        pytest.param({"k": "a\nb"}, "labels.k: the value contains a control", id="newline-in-value"),
        pytest.param({"k": "a\x00b"}, "control", id="nul-in-value"),
        pytest.param({"k": "a\u2028b"}, "control", id="line-separator-in-value"),
    ],
)
def test_labels_reject(labels: dict[str, str], message: str) -> None:
    rejects(lambda: v.validate_labels(labels), InvalidRequest, message)


def test_labels_limit_is_a_parameter_for_the_gateway() -> None:
    thirty_one = {f"k{i}": "v" for i in range(31)}
    rejects(lambda: v.validate_labels(thirty_one, max_labels=30), InvalidRequest, "at most 30")


# --- environment --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "PATH",
        "HOME",
        "_",
        "_x1",
        "a",
        "TMPDIR",
        "TZDIR",
        "LD",
        "LDFLAGS",
        "SBX",
        "BASH",
        "MALLOC",
        "PS1",
        "TERM",
    ],
)
def test_env_name_not_reserved(name: str) -> None:
    assert v.validate_env({name: "x"}) == {name: "x"}
    assert not v.is_reserved_env_name(name)


@pytest.mark.parametrize(
    "name",
    [
        *sorted(v.RESERVED_ENV_NAMES),
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "LD_AUDIT",
        "SBX_TOKEN",
        "BASH_ENV",
        "BASH_FUNC_ls",
        "BASH_XTRACEFD",
        "MALLOC_CHECK_",
        "MALLOC_ARENA_MAX",
    ],
)
def test_env_name_reserved_is_refused(name: str) -> None:
    rejects(lambda: v.validate_env({name: "x"}), Refused, f"env: {name} is reserved")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        pytest.param({"1A": "x"}, "not a valid environment variable name", id="leading-digit"),
        pytest.param({"": "x"}, "not a valid environment variable name", id="empty"),
        pytest.param({"A-B": "x"}, "not a valid environment variable name", id="hyphen"),
        pytest.param({"A=B": "x"}, "not a valid environment variable name", id="equals"),
        pytest.param({"A B": "x"}, "not a valid environment variable name", id="space"),
        pytest.param({"A": "x\x00y"}, "env.A: the value contains a NUL", id="nul-value"),
        pytest.param({"LD_PRELOAD": "x", "1A": "y"}, "not a valid", id="400-before-403"),
    ],
)
def test_env_rejects(env: dict[str, str], message: str) -> None:
    rejects(lambda: v.validate_env(env), InvalidRequest, message)


def test_env_values_may_hold_any_text_but_nul() -> None:
    env = {"A": "", "B": "line1\nline2", "C": "ünïcode", "D": "=;$(x)"}
    assert v.validate_env(env) == env


def test_env_reserved_is_case_sensitive() -> None:
    assert not v.is_reserved_env_name("ld_preload")
    assert not v.is_reserved_env_name("ifs")


# --- resources ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "memory_mb", "disk_mb"),
    [
        pytest.param(None, None, None, id="all-omitted"),
        pytest.param(1, 1, 1, id="minimum"),
        pytest.param(4, 8192, 20480, id="exactly-at-limits"),
    ],
)
def test_resources_accept(cpus: int | None, memory_mb: int | None, disk_mb: int | None) -> None:
    v.validate_resources(cpus, memory_mb, disk_mb, LIMITS)


@pytest.mark.parametrize(
    ("cpus", "memory_mb", "disk_mb", "message"),
    [
        pytest.param(
            5, None, None, "cpus = 5 is above this server's limit limits.max_cpus = 4", id="cpus-one-over"
        ),
        pytest.param(None, 8193, None, "limits.max_memory_mb = 8192", id="memory-one-over"),
        pytest.param(None, None, 20481, "limits.max_disk_mb = 20480", id="disk-one-over"),
        pytest.param(0, None, None, "cpus = 0: expected a positive integer", id="cpus-zero"),
        pytest.param(None, -1, None, "memory_mb = -1", id="memory-negative"),
    ],
)
def test_resources_reject(cpus: int | None, memory_mb: int | None, disk_mb: int | None, message: str) -> None:
    rejects(lambda: v.validate_resources(cpus, memory_mb, disk_mb, LIMITS), InvalidRequest, message)


# --- idle timeout -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "limits", "expected"),
    [
        pytest.param(None, LIMITS, 600, id="omitted-is-default"),
        pytest.param(0, LIMITS, 600, id="zero-is-default"),
        pytest.param(1, LIMITS, 1, id="one"),
        pytest.param(86400, LIMITS, 86400, id="exactly-limit"),
        pytest.param(10**6, UNBOUNDED_IDLE, 10**6, id="no-limit"),
        pytest.param(v.ABSOLUTE_MAX_INT, UNBOUNDED_IDLE, v.ABSOLUTE_MAX_INT, id="no-limit-absolute-max"),
    ],
)
def test_create_idle_timeout_accepts(value: int | None, limits: LimitsConfig, expected: int) -> None:
    assert v.resolve_create_idle_timeout(value, limits, DEFAULTS) == expected


@pytest.mark.parametrize(
    ("value", "limits", "message"),
    [
        pytest.param(86401, LIMITS, "above limits.max_idle_timeout_secs = 86400", id="one-over-limit"),
        pytest.param(-1, LIMITS, "negative", id="negative"),
        pytest.param(
            v.ABSOLUTE_MAX_INT + 1, UNBOUNDED_IDLE, "above the maximum", id="no-limit-over-absolute"
        ),
    ],
)
def test_create_idle_timeout_rejects(value: int, limits: LimitsConfig, message: str) -> None:
    rejects(lambda: v.resolve_create_idle_timeout(value, limits, DEFAULTS), InvalidRequest, message)


@pytest.mark.parametrize(
    ("value", "limits", "expected"),
    [
        pytest.param(1, LIMITS, 1, id="one"),
        pytest.param(86400, LIMITS, 86400, id="exactly-limit"),
        pytest.param(0, UNBOUNDED_IDLE, 0, id="never-when-limit-zero"),
        pytest.param(5, UNBOUNDED_IDLE, 5, id="any-when-limit-zero"),
    ],
)
def test_patch_idle_timeout_accepts(value: int, limits: LimitsConfig, expected: int) -> None:
    assert v.validate_patch_idle_timeout(value, limits) == expected


@pytest.mark.parametrize(
    ("value", "limits", "message"),
    [
        pytest.param(0, LIMITS, "0 (never) is not allowed here", id="zero-with-limit"),
        pytest.param(86401, LIMITS, "give at most 86400", id="one-over-limit"),
        pytest.param(-5, UNBOUNDED_IDLE, "negative", id="negative"),
    ],
)
def test_patch_idle_timeout_rejects(value: int, limits: LimitsConfig, message: str) -> None:
    rejects(lambda: v.validate_patch_idle_timeout(value, limits), InvalidRequest, message)


# --- snapshot schedule --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("every", "keep", "ok", "message"),
    [
        pytest.param(None, None, True, "", id="omitted"),
        pytest.param(0, 1, True, "", id="zero-stops"),
        pytest.param(60, 10, True, "", id="exactly-at-limits"),
        pytest.param(
            59,
            None,
            False,
            "every_secs = 59 is below limits.min_snapshot_every_secs = 60",
            id="every-one-under",
        ),
        pytest.param(-1, None, False, "every_secs = -1", id="every-negative"),
        pytest.param(
            None, 11, False, "keep = 11 is outside 1 to limits.max_snapshot_keep = 10", id="keep-one-over"
        ),
        pytest.param(None, 0, False, "keep = 0", id="keep-zero"),
    ],
)
def test_snapshot_schedule(every: int | None, keep: int | None, ok: bool, message: str) -> None:
    if ok:
        v.validate_snapshot_schedule(every, keep, LIMITS)
    else:
        rejects(lambda: v.validate_snapshot_schedule(every, keep, LIMITS), InvalidRequest, message)


def test_snapshot_schedule_prefix_names_create_fields() -> None:
    rejects(
        lambda: v.validate_snapshot_schedule(1, None, LIMITS, prefix="snapshot_"),
        InvalidRequest,
        "snapshot_every_secs = 1",
    )


# --- guest paths --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        pytest.param("/", "/", id="root"),
        pytest.param("/sandbox/home/a.txt", "/sandbox/home/a.txt", id="plain"),
        pytest.param("//sandbox///home", "/sandbox/home", id="double-slashes"),
        pytest.param("/sandbox/home/", "/sandbox/home", id="trailing-slash"),
        pytest.param("/sandbox/./home/.", "/sandbox/home", id="dot-components"),
        pytest.param("/a/..b/c..", "/a/..b/c..", id="dots-inside-names"),
        pytest.param("/a b/ü", "/a b/ü", id="space-and-unicode"),
        pytest.param("/" + "n" * 255, "/" + "n" * 255, id="component-255-bytes"),
        pytest.param("/a" * 2048, "/a" * 2048, id="4096-bytes"),
        pytest.param("/a" * 2048 + "/", "/a" * 2048, id="4096-bytes-after-normalising"),
    ],
)
def test_guest_path_accepts(path: str, expected: str) -> None:
    assert v.validate_guest_path(path) == expected


@pytest.mark.parametrize(
    ("path", "message"),
    [
        pytest.param("sandbox/home", "is relative", id="relative"),
        pytest.param("", "is relative", id="empty"),
        pytest.param("./x", "is relative", id="dot-relative"),
        pytest.param("/sandbox/../etc", "'..' component", id="dotdot"),
        pytest.param("/..", "'..' component", id="dotdot-at-root"),
        pytest.param("/a/..", "'..' component", id="trailing-dotdot"),
        pytest.param("/a\x00b", "NUL", id="nul"),
        pytest.param("/" + "n" * 256, "longer than 255 bytes", id="component-256-bytes"),
        pytest.param("/a" * 2048 + "b", "longer than 4096 bytes", id="4097-bytes"),
    ],
)
def test_guest_path_rejects(path: str, message: str) -> None:
    rejects(lambda: v.validate_guest_path(path, "cwd"), InvalidRequest, message)


def test_guest_path_error_names_the_field() -> None:
    rejects(lambda: v.validate_guest_path("x", "cwd"), InvalidRequest, "cwd: 'x' is relative")


# --- volume mounts ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        pytest.param("/data", "/data", id="top-level"),
        pytest.param("/sandbox/home/cache/", "/sandbox/home/cache", id="under-home"),
        pytest.param("/var/lib/app", "/var/lib/app", id="under-var"),
        pytest.param("/opt/x-1_2.3", "/opt/x-1_2.3", id="punctuation"),
        pytest.param("//data//./x", "/data/x", id="normalised"),
        pytest.param("/data/lib", "/data/lib", id="lib-below-top"),
        pytest.param("/data/tmp", "/data/tmp", id="tmp-below-top"),
    ],
)
def test_mount_path_accepts(path: str, expected: str) -> None:
    assert v.validate_mount_path(path) == expected


@pytest.mark.parametrize(
    ("path", "message"),
    [
        pytest.param("/", "cannot be mounted on '/'", id="root"),
        pytest.param("/tmp", "under /tmp", id="tmp"),
        pytest.param("/tmp/x", "under /tmp", id="under-tmp"),
        pytest.param("/etc", "system directory", id="etc"),
        pytest.param("/usr/local", "under /usr", id="usr"),
        pytest.param("/lib64", "under /lib64", id="lib64"),
        pytest.param("/libx32/a", "under /libx32", id="libx32"),
        pytest.param("/proc", "under /proc", id="proc"),
        pytest.param("/boot", "under /boot", id="boot"),
        pytest.param("/.sbx", "under /.sbx", id="agent-dir"),
        pytest.param("/.sbx/ctl", "under /.sbx", id="agent-ctl"),
        pytest.param("/sys/fs", "under /sys", id="sys"),
        pytest.param("/dev/shm", "under /dev", id="dev"),
        pytest.param("/run/x", "under /run", id="run"),
        pytest.param("/bin", "under /bin", id="bin"),
        pytest.param("/sbin/x", "under /sbin", id="sbin"),
        pytest.param("/lib", "under /lib", id="lib"),
        pytest.param("/library", "under /library", id="lib-star-is-a-glob"),
        pytest.param("/data:x", "may contain only", id="colon"),
        pytest.param("/data,ro", "may contain only", id="comma"),
        pytest.param("/data dir", "may contain only", id="space"),
        pytest.param("/dätä", "may contain only", id="non-ascii"),
        pytest.param("data", "relative", id="relative"),
        pytest.param("/data/../etc", "'..'", id="dotdot"),
    ],
)
def test_mount_path_rejects(path: str, message: str) -> None:
    rejects(lambda: v.validate_mount_path(path, "volumes[0].path"), InvalidRequest, message)


@pytest.mark.parametrize(
    ("mounts", "message"),
    [
        pytest.param([("a", "/a"), ("a", "/b")], "volume 'a' is already mounted", id="same-volume-twice"),
        pytest.param([("a", "/data"), ("b", "/data")], "nest or coincide", id="same-path"),
        pytest.param([("a", "/data"), ("b", "/data/sub")], "nest or coincide", id="nested"),
        pytest.param([("a", "/data/sub"), ("b", "/data")], "nest or coincide", id="nested-reverse"),
        pytest.param([(f"v{i}", f"/m{i}") for i in range(9)], "9 mounts given; at most 8", id="nine-mounts"),
    ],
)
def test_mounts_reject(mounts: list[tuple[str, str]], message: str) -> None:
    rejects(lambda: v.validate_mounts(mounts), InvalidRequest, message)


def test_mounts_accept_eight_siblings_and_name_prefixes() -> None:
    v.validate_mounts([(f"v{i}", f"/m{i}") for i in range(8)])
    v.validate_mounts([("a", "/data"), ("b", "/data2")])  # a path prefix that is not a parent


# --- processes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "ok", "message"),
    [
        pytest.param(["ls"], True, "", id="single"),
        pytest.param(["sh", "-c", ""], True, "", id="empty-later-arg"),
        pytest.param([], False, "missing command", id="empty-list"),
        pytest.param([""], False, "missing command", id="empty-program"),
        pytest.param(["ls", "a\x00b"], False, "argv[1] contains a NUL", id="nul-in-arg"),
        pytest.param(["l\x00s"], False, "argv[0] contains a NUL", id="nul-in-program"),
    ],
)
def test_argv(argv: list[str], ok: bool, message: str) -> None:
    if ok:
        assert v.validate_argv(argv) == tuple(argv)
    else:
        rejects(lambda: v.validate_argv(argv), InvalidRequest, message)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        pytest.param(0.001, True, id="tiny"),
        pytest.param(1, True, id="one"),
        pytest.param(86400, True, id="exactly-24h"),
        pytest.param(86400.5, False, id="over-24h"),
        pytest.param(0, False, id="zero"),
        pytest.param(-1, False, id="negative"),
        pytest.param(float("inf"), False, id="infinite"),
        pytest.param(float("nan"), False, id="nan"),
    ],
)
def test_timeout_secs(value: float, ok: bool) -> None:
    if ok:
        assert v.validate_timeout_secs(value) == value
    else:
        rejects(lambda: v.validate_timeout_secs(value), InvalidRequest, "timeout_secs")


def test_stdin_size_boundary() -> None:
    v.validate_stdin_size(v.MAX_STDIN_BYTES)
    rejects(lambda: v.validate_stdin_size(v.MAX_STDIN_BYTES + 1), InvalidRequest, "processes/{pid}/stdin")


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        pytest.param(1, True, id="one"),
        pytest.param(65535, True, id="uint16-max"),
        pytest.param(0, False, id="zero"),
        pytest.param(65536, False, id="over-uint16"),
    ],
)
def test_tty_size(value: int, ok: bool) -> None:
    if ok:
        assert v.validate_tty_size("rows", value) == value
    else:
        rejects(lambda: v.validate_tty_size("rows", value), InvalidRequest, "rows = ")


@pytest.mark.parametrize(
    ("name", "expected"),
    [("INT", signal.SIGINT), ("TERM", signal.SIGTERM), ("KILL", signal.SIGKILL), ("HUP", signal.SIGHUP)],
)
def test_signal_names(name: str, expected: int) -> None:
    assert v.parse_signal_name(name) == int(expected)


@pytest.mark.parametrize("name", ["SIGTERM", "term", "STOP", "USR1", "9", ""])
def test_signal_names_rejected(name: str) -> None:
    rejects(lambda: v.parse_signal_name(name), InvalidRequest, "use one of INT, TERM, KILL, HUP")


def test_every_rule_function_is_covered() -> None:
    """Guard: a new public rule added to validation must get a table here."""
    tested = {
        "validate_sandbox_name", "validate_volume_name", "validate_job_name", "validate_image_ref", "validate_snapshot_id",
        "validate_label_key", "validate_label_value", "validate_labels", "is_reserved_env_name",
        "validate_env_name", "validate_env_value", "check_env_not_reserved", "validate_env",
        "validate_resource", "validate_resources", "resolve_create_idle_timeout", "validate_patch_idle_timeout",
        "validate_snapshot_schedule", "validate_guest_path", "validate_mount_path", "validate_mounts",
        "validate_argv", "validate_timeout_secs", "validate_stdin_size", "validate_tty_size", "parse_signal_name",
    }  # fmt: skip
    public: dict[str, Any] = {
        name: obj
        for name, obj in vars(v).items()
        if callable(obj) and not name.startswith("_") and obj.__module__ == v.__name__
    }
    assert set(public) == tested
