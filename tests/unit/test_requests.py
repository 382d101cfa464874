"""Request parsing: JSON decoding, unknown fields, types, defaults, and each body's own rules."""

from __future__ import annotations

import base64
import json
import signal
from collections.abc import Callable
from typing import Any

import pytest

from sbx.api import requests as m
from sbx.api.errors import InvalidRequest, Refused, SandboxError
from sbx.api.network_policy import NetworkConfig, NetworkPolicy
from sbx.api.sandboxes import VolumeMount
from sbx.api.validation import MAX_STDIN_BYTES
from sbx.node.config import DefaultsConfig, LimitsConfig, NodeConfig

CONFIG = NodeConfig(
    network=NetworkConfig(
        default=NetworkPolicy("allowlist", ("pypi.org",)), ceiling="allowlist", may_allow=("*.example.com",)
    )
)
UNBOUNDED = NodeConfig(
    limits=LimitsConfig(max_idle_timeout_secs=0), defaults=DefaultsConfig(idle_timeout_secs=0)
)


def body(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def rejects(fn: Callable[[], object], error: type[SandboxError], message: str) -> None:
    with pytest.raises(SandboxError) as info:
        fn()
    assert type(info.value) is error, info.value
    assert message in info.value.message, info.value.message


# --- decoding, common to every body -------------------------------------------------------------------

PARSERS: list[tuple[str, Callable[[bytes], object]]] = [
    ("create", lambda b: m.parse_create(b, CONFIG)),
    ("patch", lambda b: m.parse_patch(b, CONFIG)),
    ("run", m.parse_run),
    ("process", m.parse_process),
    ("signal", m.parse_signal),
    ("cordon", m.parse_cordon),
    ("schedule", lambda b: m.parse_schedule(b, CONFIG)),
    ("volume", lambda b: m.parse_volume_create(b, CONFIG)),
]


@pytest.mark.parametrize(("name", "parse"), [pytest.param(n, p, id=n) for n, p in PARSERS])
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param(b"", "body is empty", id="empty"),
        pytest.param(b"  \n", "body is empty", id="whitespace"),
        pytest.param(b"{", "not valid JSON", id="truncated"),
        pytest.param(b"{'a': 1}", "not valid JSON", id="single-quotes"),
        pytest.param(b"[]", "must be a JSON object, not an array", id="array"),
        pytest.param(b'"x"', "not a string", id="string"),
        pytest.param(b"null", "not null", id="null"),
        pytest.param(b"3", "not an integer", id="number"),
        pytest.param(b"\xff{}", "not UTF-8", id="not-utf8"),
        pytest.param(b'{"x": NaN}', "NaN is not a JSON number", id="nan"),
        pytest.param(b'{"x": Infinity}', "Infinity is not a JSON number", id="infinity"),
        pytest.param(b'{"x": 1, "x": 2}', "'x' appears twice", id="duplicate-key"),
        pytest.param(b'{"zzz": 1}', "unknown field 'zzz'", id="unknown-field"),
        # Hostile bodies: once a 500 (the interpreter's recursion and digit limits), now 400 like any other.
        pytest.param(
            b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply", id="deep-nesting"
        ),
        pytest.param(b'{"cpus": ' + b"9" * 5000 + b"}", "number too long", id="5000-digit-integer"),
        pytest.param(b'{"a": "\\ud800"}', "unpaired surrogate", id="lone-surrogate"),
    ],
)
def test_every_parser_rejects_malformed_bodies(
    name: str, parse: Callable[[bytes], object], raw: bytes, message: str
) -> None:
    rejects(lambda: parse(raw), InvalidRequest, message)


def test_unknown_fields_are_all_named_with_the_known_ones() -> None:
    rejects(
        lambda: m.parse_cordon(body({"cordoned": True, "x": 1, "y": 2})),
        InvalidRequest,
        "unknown fields 'x', 'y'; the fields are cordoned",
    )


# --- create -------------------------------------------------------------------------------------------


def test_create_empty_object_applies_every_default() -> None:
    req = m.parse_create(b"{}", CONFIG)
    assert req == m.CreateSpec(
        image="default",
        cpus=2,
        memory_mb=512,
        disk_mb=2048,
        idle_timeout_secs=600,
        network=NetworkPolicy("allowlist", ("pypi.org",)),
        fields_given=frozenset(),
    )


def test_create_full_request() -> None:
    req = m.parse_create(
        body(
            {
                "name": "web-1",
                "image": "python:3.12",
                "cpus": 4,
                "memory_mb": 8192,
                "disk_mb": 20480,
                "env": {"A": "1"},
                "network": {"mode": "allowlist", "allow": ["a.example.com"], "deny": ["b.example.com"]},
                "labels": {"team": "infra"},
                "idle_timeout_secs": 86400,
                "snapshot_every_secs": 60,
                "snapshot_keep": 10,
                "volumes": [
                    {"name": "data", "path": "/data/", "read_only": True},
                    {"name": "c", "path": "/c"},
                ],
            }
        ),
        CONFIG,
    )
    assert req.name == "web-1"
    assert req.image == "python:3.12"
    assert (req.cpus, req.memory_mb, req.disk_mb) == (4, 8192, 20480)
    assert req.env == {"A": "1"}
    assert req.network == NetworkPolicy("allowlist", ("a.example.com",), ("b.example.com",))
    assert req.labels == {"team": "infra"}
    assert req.idle_timeout_secs == 86400
    assert (req.snapshot_every_secs, req.snapshot_keep) == (60, 10)
    assert req.volumes == (VolumeMount("data", "/data", True), VolumeMount("c", "/c", False))
    assert "cpus" in req.fields_given and "snapshot_id" not in req.fields_given


@pytest.mark.parametrize(
    ("body", "persistent"),
    [(b"{}", False), (b'{"persistent": false}', False), (b'{"persistent": true, "name": "work"}', True),
     (b'{"persistent": false, "name": "work"}', False)],
)  # fmt: skip
def test_create_persistent(body: bytes, persistent: bool) -> None:
    assert m.parse_create(body, CONFIG).persistent is persistent


def test_create_secret_env_is_kept_apart_from_env() -> None:
    req = m.parse_create(body({"env": {"A": "1"}, "secret_env": {"TOKEN": "s3cret", "EMPTY": ""}}), CONFIG)
    assert (req.env, req.secret_env) == ({"A": "1"}, {"TOKEN": "s3cret", "EMPTY": ""})
    assert "secret_env" in req.fields_given
    assert "s3cret" not in repr(req)  # a logged spec never shows a value
    assert m.parse_create(b"{}", CONFIG).secret_env == {}


def test_create_accepts_eight_mounts_side_by_side() -> None:
    mounts = [{"name": f"v{i}", "path": f"/data/m{i}", "read_only": i % 2 == 0} for i in range(8)]
    req = m.parse_create(body({"volumes": mounts}), CONFIG)
    assert [(v.name, v.path, v.read_only) for v in req.volumes] == [
        (f"v{i}", f"/data/m{i}", i % 2 == 0) for i in range(8)
    ]


def test_create_fields_given_tells_omitted_from_default_valued() -> None:
    req = m.parse_create(body({"cpus": 1}), CONFIG)
    assert req.cpus == 1
    assert req.fields_given == frozenset({"cpus"})


def test_create_fork_from_snapshot() -> None:
    req = m.parse_create(body({"snapshot_id": "snap_1"}), CONFIG)
    assert req.snapshot_id == "snap_1"


@pytest.mark.parametrize(
    ("idle", "config", "expected"),
    [
        pytest.param(0, CONFIG, 600, id="zero-is-default"),
        pytest.param(1, CONFIG, 1, id="one"),
        pytest.param(0, UNBOUNDED, 0, id="zero-never-when-unbounded"),
        pytest.param(10**8, UNBOUNDED, 10**8, id="large-when-unbounded"),
    ],
)
def test_create_idle_timeout(idle: int, config: NodeConfig, expected: int) -> None:
    assert m.parse_create(body({"idle_timeout_secs": idle}), config).idle_timeout_secs == expected


@pytest.mark.parametrize(
    ("obj", "error", "message"),
    [
        pytest.param({"bind": "/home"}, InvalidRequest, "field 'bind' is not supported", id="bind"),
        pytest.param({"bind": None, "cpus": 1}, InvalidRequest, "use volumes", id="bind-null"),
        pytest.param({"nmae": "x"}, InvalidRequest, "unknown field 'nmae'", id="typo"),
        pytest.param({"name": 5}, InvalidRequest, "name: expected a string, got an integer", id="name-type"),
        pytest.param({"name": None}, InvalidRequest, "omit the field", id="name-null"),
        pytest.param({"name": "Bad Name"}, InvalidRequest, "not a valid sandbox name", id="name-rule"),
        pytest.param({"name": "sbx_00ff"}, InvalidRequest, "how sandbox ids look", id="name-like-id"),
        pytest.param({"image": ""}, InvalidRequest, "image is empty", id="image-empty"),
        pytest.param({"cpus": "2"}, InvalidRequest, "cpus: expected an integer, got a string", id="cpus-string"),
        pytest.param({"cpus": 2.0}, InvalidRequest, "cpus: expected an integer, got a number", id="cpus-float"),
        pytest.param({"cpus": True}, InvalidRequest, "cpus: expected an integer, got a boolean", id="cpus-bool"),
        pytest.param({"cpus": 5}, InvalidRequest, "limits.max_cpus = 4", id="cpus-one-over"),
        pytest.param({"memory_mb": 8193}, InvalidRequest, "limits.max_memory_mb = 8192", id="memory-one-over"),
        pytest.param({"disk_mb": 20481}, InvalidRequest, "limits.max_disk_mb = 20480", id="disk-one-over"),
        pytest.param({"disk_mb": 0}, InvalidRequest, "positive integer", id="disk-zero"),
        pytest.param({"env": []}, InvalidRequest, "env: expected an object, got an array", id="env-type"),
        pytest.param({"env": {"A": 1}}, InvalidRequest, "env.A: expected a string", id="env-value-type"),
        pytest.param({"env": {"1A": "x"}}, InvalidRequest, "not a valid environment variable name", id="env-name"),
        pytest.param({"env": {"LD_PRELOAD": "/x.so"}}, Refused, "LD_PRELOAD is reserved", id="env-reserved"),
        pytest.param({"env": {"A": "\ud800"}}, InvalidRequest, "unpaired surrogate", id="env-lone-surrogate"),
        pytest.param({"secret_env": []}, InvalidRequest, "secret_env: expected an object", id="secret-env-type"),
        pytest.param({"secret_env": {"A": 1}}, InvalidRequest, "secret_env.A: expected a string", id="secret-env-value-type"),
        pytest.param({"secret_env": {"1A": "x"}}, InvalidRequest, "secret_env: '1A' is not a valid environment variable name", id="secret-env-name"),
        pytest.param({"secret_env": {"A": "a\u0000b"}}, InvalidRequest, "secret_env.A: the value contains a NUL", id="secret-env-nul"),
        pytest.param({"secret_env": {"LD_PRELOAD": "/x.so"}}, Refused, "secret_env: LD_PRELOAD is reserved (it controls sandbox start-up, the loader or the shell); remove it from secret_env", id="secret-env-reserved"),
        pytest.param({"env": {"B": "1", "A": "1"}, "secret_env": {"A": "2", "B": "2"}}, InvalidRequest, "secret_env: A, B also in env; give each variable in one of env and secret_env", id="secret-env-also-in-env"),
        pytest.param({"secret_env": {"BASH_ENV": "x"}, "labels": {"K": "v"}}, InvalidRequest, "lowercase", id="400-before-403-secret-env"),
        pytest.param({"persistent": True}, InvalidRequest, "persistent: a persistent sandbox needs a name (it is found again by it after every sleep); add name", id="persistent-without-name"),
        pytest.param({"persistent": 1, "name": "w"}, InvalidRequest, "persistent: expected a boolean", id="persistent-type"),
        pytest.param({"labels": {"K": "v"}}, InvalidRequest, "lowercase", id="label-key"),
        pytest.param({"labels": {"k": 1}}, InvalidRequest, "labels.k: expected a string", id="label-value-type"),
        pytest.param({"labels": {f"k{i}": "v" for i in range(33)}}, InvalidRequest, "at most 32", id="33-labels"),
        pytest.param({"idle_timeout_secs": 86401}, InvalidRequest, "max_idle_timeout_secs = 86400", id="idle-one-over"),
        pytest.param({"idle_timeout_secs": -1}, InvalidRequest, "negative", id="idle-negative"),
        pytest.param({"snapshot_every_secs": 59}, InvalidRequest, "snapshot_every_secs = 59", id="every-under"),
        pytest.param({"snapshot_keep": 11}, InvalidRequest, "snapshot_keep = 11", id="keep-over"),
        pytest.param({"volumes": {}}, InvalidRequest, "volumes: expected an array", id="volumes-type"),
        pytest.param({"volumes": [{"name": "a"}]}, InvalidRequest, "volumes[0].path is required", id="mount-no-path"),
        pytest.param({"volumes": [{"path": "/a"}]}, InvalidRequest, "volumes[0].name is required", id="mount-no-name"),
        pytest.param({"volumes": [{"name": "a", "path": "/a", "ro": True}]}, InvalidRequest, "unknown field 'volumes[0].ro'", id="mount-unknown"),
        pytest.param({"volumes": [{"name": "a", "path": "/a", "read_only": "yes"}]}, InvalidRequest, "volumes[0].read_only: expected a boolean", id="mount-ro-type"),
        pytest.param({"volumes": [{"name": "a", "path": "/tmp"}]}, InvalidRequest, "under /tmp", id="mount-tmp"),
        pytest.param({"volumes": [{"name": "a", "path": "/d"}, {"name": "b", "path": "/d/e"}]}, InvalidRequest, "nest", id="mount-nest"),
        pytest.param({"volumes": [{"name": f"v{i}", "path": f"/m{i}"} for i in range(9)]}, InvalidRequest, "at most 8", id="nine-mounts"),
        pytest.param({"volumes": [{"name": "a", "path": "data"}]}, InvalidRequest, "volumes[0].path: 'data' is relative", id="mount-relative"),
        pytest.param({"volumes": [{"name": "a", "path": "/"}]}, InvalidRequest, "cannot be mounted on '/'", id="mount-root"),
        pytest.param({"volumes": [{"name": "a", "path": "/a/../etc"}]}, InvalidRequest, "'..'", id="mount-dotdot"),
        pytest.param({"volumes": [{"name": "a", "path": "/a b"}]}, InvalidRequest, "may contain only", id="mount-space"),
        pytest.param({"volumes": [{"name": "a", "path": "/proc/x"}]}, InvalidRequest, "under /proc", id="mount-proc"),
        pytest.param({"volumes": [{"name": "a", "path": "/lib64"}]}, InvalidRequest, "under /lib64", id="mount-lib-star"),
        pytest.param({"volumes": [{"name": "a", "path": "/.sbx/ctl"}]}, InvalidRequest, "under /.sbx", id="mount-agent-dir"),
        pytest.param({"volumes": [{"name": "a", "path": "/x"}, {"name": "b", "path": "/x/"}]}, InvalidRequest, "volumes[1]: path '/x' and volumes[0] path '/x' nest or coincide", id="mount-same-path"),
        pytest.param({"volumes": [{"name": "a", "path": "/d/e"}, {"name": "b", "path": "//d"}]}, InvalidRequest, "nest", id="mount-nest-reverse"),
        pytest.param({"volumes": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]}, InvalidRequest, "volume 'a' is already mounted", id="mount-volume-twice"),
        pytest.param({"volumes": [{"name": "A", "path": "/x"}]}, InvalidRequest, "volumes[0].name", id="mount-bad-name"),
        pytest.param({"snapshot_id": "s", "volumes": [{"name": "a", "path": "/a"}]}, InvalidRequest, "cannot mount volumes", id="fork-with-volumes"),
        pytest.param({"network": "open"}, InvalidRequest, "network: expected an object", id="network-type"),
        pytest.param({"network": None}, InvalidRequest, "network: expected an object", id="network-null"),
        pytest.param({"network": {"mode": "open"}}, Refused, "rule 3", id="network-over-ceiling"),
        pytest.param({"network": {"mode": "allowlist", "allow": []}}, Refused, "rule 5", id="network-empty-allow"),
        pytest.param({"network": {"mode": "allowlist", "allow": ["x.org"]}}, Refused, "rule 4", id="network-outside-may-allow"),
        pytest.param({"network": {"mode": "none", "allow": ["a.com"]}}, InvalidRequest, "rule 6", id="network-allow-with-none"),
        pytest.param({"network": {"mode": "open"}, "cpus": 99}, InvalidRequest, "max_cpus", id="400-before-403-network"),
        pytest.param({"env": {"LD_PRELOAD": "x"}, "labels": {"K": "v"}}, InvalidRequest, "lowercase", id="400-before-403-env"),
    ],
)  # fmt: skip
def test_create_rejects(obj: dict[str, Any], error: type[SandboxError], message: str) -> None:
    rejects(lambda: m.parse_create(body(obj), CONFIG), error, message)


# --- patch --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        pytest.param({}, m.PatchSpec(), id="nothing"),
        pytest.param({"name": ""}, m.PatchSpec(name=""), id="remove-name"),
        pytest.param({"name": "new"}, m.PatchSpec(name="new"), id="rename"),
        pytest.param({"labels": {}}, m.PatchSpec(labels={}), id="remove-labels"),
        pytest.param({"labels": {"a": "b"}}, m.PatchSpec(labels={"a": "b"}), id="replace-labels"),
        pytest.param({"idle_timeout_secs": 1}, m.PatchSpec(idle_timeout_secs=1), id="idle-one"),
        pytest.param({"idle_timeout_secs": 86400}, m.PatchSpec(idle_timeout_secs=86400), id="idle-at-limit"),
        pytest.param(
            {"network": {"mode": "none"}}, m.PatchSpec(network=NetworkPolicy("none")), id="network-none"
        ),
        pytest.param(
            {"network": {}},
            m.PatchSpec(network=NetworkPolicy("allowlist", ("pypi.org",))),
            id="network-default",
        ),
    ],
)
def test_patch_accepts(obj: dict[str, Any], expected: m.PatchSpec) -> None:
    assert m.parse_patch(body(obj), CONFIG) == expected


def test_patch_omitted_is_distinct_from_empty_values() -> None:
    omitted = m.parse_patch(b"{}", CONFIG)
    given = m.parse_patch(body({"name": "", "labels": {}}), CONFIG)
    assert omitted.name is None and omitted.labels is None
    assert given.name == "" and given.labels == {}


def test_patch_idle_zero_only_when_unbounded() -> None:
    assert m.parse_patch(body({"idle_timeout_secs": 0}), UNBOUNDED).idle_timeout_secs == 0
    rejects(
        lambda: m.parse_patch(body({"idle_timeout_secs": 0}), CONFIG),
        InvalidRequest,
        "0 (never) is not allowed",
    )


@pytest.mark.parametrize(
    ("obj", "error", "message"),
    [
        pytest.param({"cpus": 2}, InvalidRequest, "unknown field 'cpus'", id="resources-fixed"),
        pytest.param({"bind": "/x"}, InvalidRequest, "'bind' is not supported", id="bind"),
        pytest.param({"name": None}, InvalidRequest, "name: expected a string, got null", id="name-null"),
        pytest.param({"name": "UP"}, InvalidRequest, "lowercase", id="name-rule"),
        pytest.param({"labels": None}, InvalidRequest, "labels: expected an object", id="labels-null"),
        pytest.param({"labels": {"a": "\n"}}, InvalidRequest, "control", id="label-value"),
        pytest.param({"idle_timeout_secs": 86401}, InvalidRequest, "at most 86400", id="idle-one-over"),
        pytest.param({"idle_timeout_secs": "60"}, InvalidRequest, "expected an integer", id="idle-type"),
        pytest.param({"network": {"mode": "open"}}, Refused, "rule 3", id="network-over-ceiling"),
        pytest.param(
            {"network": {"mode": "allowlist", "allow": []}}, Refused, "rule 5", id="network-empty-allow"
        ),
    ],
)
def test_patch_rejects(obj: dict[str, Any], error: type[SandboxError], message: str) -> None:
    rejects(lambda: m.parse_patch(body(obj), CONFIG), error, message)


# --- run and processes --------------------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_run_minimal_applies_defaults() -> None:
    # cwd None: the sandbox's default (its image's WorkingDir, else the home), chosen where the sandbox is known.
    assert m.parse_run(body({"argv": ["ls"]})) == m.RunSpec(argv=("ls",), cwd=None)


def test_run_full() -> None:
    req = m.parse_run(
        body(
            {
                "argv": ["cat"],
                "env": {"X": "1"},
                "cwd": "/tmp//x/",
                "stdin": b64(b"\x00hi"),
                "timeout_secs": 1.5,
            }
        )
    )
    assert req == m.RunSpec(("cat",), {"X": "1"}, "/tmp/x", b"\x00hi", 1.5)


def test_run_stdin_size_boundary() -> None:
    assert (
        len(m.parse_run(body({"argv": ["x"], "stdin": b64(b"a" * MAX_STDIN_BYTES)})).stdin) == MAX_STDIN_BYTES
    )
    rejects(
        lambda: m.parse_run(body({"argv": ["x"], "stdin": b64(b"a" * (MAX_STDIN_BYTES + 1))})),
        InvalidRequest,
        f"at most {MAX_STDIN_BYTES}",
    )


COMMAND_ERRORS = [
    pytest.param({}, InvalidRequest, "missing command", id="no-argv"),
    pytest.param({"argv": []}, InvalidRequest, "missing command", id="empty-argv"),
    pytest.param({"argv": [""]}, InvalidRequest, "missing command", id="empty-program"),
    pytest.param({"argv": "ls -l"}, InvalidRequest, "argv: expected an array of strings, got a string", id="argv-string"),
    pytest.param({"argv": ["ls", 1]}, InvalidRequest, "argv[1]: expected a string, got an integer", id="argv-item"),
    pytest.param({"argv": ["ls", "\x00"]}, InvalidRequest, "argv[1] contains a NUL", id="argv-nul"),
    pytest.param({"argv": ["ls"], "cwd": "work"}, InvalidRequest, "cwd: 'work' is relative", id="cwd-relative"),
    pytest.param({"argv": ["ls"], "cwd": "/a/../b"}, InvalidRequest, "'..'", id="cwd-dotdot"),
    pytest.param({"argv": ["ls"], "cwd": 1}, InvalidRequest, "cwd: expected a string", id="cwd-type"),
    pytest.param({"argv": ["ls"], "stdin": "not base64!"}, InvalidRequest, "stdin: expected standard base64", id="stdin-not-b64"),
    pytest.param({"argv": ["ls"], "stdin": "aGk"}, InvalidRequest, "base64", id="stdin-no-padding"),
    pytest.param({"argv": ["ls"], "stdin": "é"}, InvalidRequest, "base64", id="stdin-non-ascii"),
    pytest.param({"argv": ["ls"], "stdin": [1]}, InvalidRequest, "stdin: expected a string", id="stdin-type"),
    pytest.param({"argv": ["ls"], "env": {"BASH_ENV": "/x"}}, Refused, "BASH_ENV is reserved", id="env-reserved"),
    pytest.param({"argv": ["ls"], "env": {"A-B": "x"}}, InvalidRequest, "not a valid environment", id="env-name"),
    pytest.param({"argv": ["ls"], "env": {"IFS": "x"}, "cwd": "rel"}, InvalidRequest, "relative", id="400-before-403"),
]  # fmt: skip


@pytest.mark.parametrize(("obj", "error", "message"), COMMAND_ERRORS)
def test_run_rejects_bad_commands(obj: dict[str, Any], error: type[SandboxError], message: str) -> None:
    rejects(lambda: m.parse_run(body(obj)), error, message)


@pytest.mark.parametrize(("obj", "error", "message"), COMMAND_ERRORS)
def test_process_rejects_bad_commands(obj: dict[str, Any], error: type[SandboxError], message: str) -> None:
    rejects(lambda: m.parse_process(body(obj)), error, message)


@pytest.mark.parametrize(
    ("timeout", "message"),
    [
        pytest.param(0, "positive number", id="zero"),
        pytest.param(-1, "positive number", id="negative"),
        pytest.param(86401, "24 hours", id="over-24h"),
        pytest.param("10", "timeout_secs: expected a number, got a string", id="string"),
        pytest.param(True, "expected a number, got a boolean", id="bool"),
        pytest.param(None, "expected a number, got null", id="null"),
    ],
)
def test_run_timeout_rejects(timeout: Any, message: str) -> None:
    rejects(lambda: m.parse_run(body({"argv": ["ls"], "timeout_secs": timeout})), InvalidRequest, message)


@pytest.mark.parametrize("timeout", [1, 0.5, 86400])
def test_run_timeout_accepts(timeout: float) -> None:
    assert m.parse_run(body({"argv": ["ls"], "timeout_secs": timeout})).timeout_secs == timeout


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        pytest.param({"argv": ["sleep", "9"]}, m.ProcessSpec(("sleep", "9")), id="background"),
        pytest.param({"argv": ["sh"], "tty": True}, m.ProcessSpec(("sh",), tty=True, rows=24, cols=80), id="tty-24x80"),
        pytest.param({"argv": ["sh"], "tty": True, "rows": 50, "cols": 200}, m.ProcessSpec(("sh",), tty=True, rows=50, cols=200), id="tty-sized"),
        pytest.param({"argv": ["sh"], "tty": True, "rows": 65535, "cols": 1}, m.ProcessSpec(("sh",), tty=True, rows=65535, cols=1), id="tty-bounds"),
        pytest.param({"argv": ["sh"], "tty": False}, m.ProcessSpec(("sh",)), id="tty-false"),
        pytest.param({"argv": ["cat"], "stdin": b64(b"x")}, m.ProcessSpec(("cat",), stdin=b"x"), id="stdin"),
    ],
)  # fmt: skip
def test_process_accepts(obj: dict[str, Any], expected: m.ProcessSpec) -> None:
    assert m.parse_process(body(obj)) == expected


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        pytest.param({"argv": ["sh"], "timeout_secs": 5}, "timeout_secs applies only to run", id="timeout"),
        pytest.param({"argv": ["sh"], "rows": 50}, "set tty: true", id="rows-without-tty"),
        pytest.param({"argv": ["sh"], "tty": False, "cols": 50}, "set tty: true", id="cols-with-tty-false"),
        pytest.param({"argv": ["sh"], "tty": True, "rows": 0}, "rows = 0", id="rows-zero"),
        pytest.param({"argv": ["sh"], "tty": True, "cols": 65536}, "cols = 65536", id="cols-over"),
        pytest.param(
            {"argv": ["sh"], "tty": True, "rows": "24"}, "rows: expected an integer", id="rows-type"
        ),
        pytest.param({"argv": ["sh"], "tty": 1}, "tty: expected a boolean, got an integer", id="tty-type"),
        pytest.param({"argv": ["sh"], "tty_rows": 24}, "unknown field 'tty_rows'", id="tty-rows-name"),
    ],
)
def test_process_rejects(obj: dict[str, Any], message: str) -> None:
    rejects(lambda: m.parse_process(body(obj)), InvalidRequest, message)


# --- signal, cordon, schedule, volumes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "signum"),
    [("INT", signal.SIGINT), ("TERM", signal.SIGTERM), ("KILL", signal.SIGKILL), ("HUP", signal.SIGHUP)],
)
def test_signal_accepts(name: str, signum: int) -> None:
    assert m.parse_signal(body({"signal": name})) == int(signum)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        pytest.param({}, "signal is required", id="missing"),
        pytest.param({"signal": "STOP"}, "use one of INT, TERM, KILL, HUP", id="other-signal"),
        pytest.param({"signal": "SIGTERM"}, "use one of", id="sig-prefix"),
        pytest.param({"signal": 15}, "signal: expected a string, got an integer", id="number"),
    ],
)
def test_signal_rejects(obj: dict[str, Any], message: str) -> None:
    rejects(lambda: m.parse_signal(body(obj)), InvalidRequest, message)


@pytest.mark.parametrize("value", [True, False])
def test_cordon_accepts(value: bool) -> None:
    assert m.parse_cordon(body({"cordoned": value})) is value


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        pytest.param({}, "cordoned is required", id="missing"),
        pytest.param({"cordoned": "true"}, "cordoned: expected a boolean, got a string", id="string"),
        pytest.param({"cordoned": 1}, "expected a boolean, got an integer", id="integer"),
    ],
)
def test_cordon_rejects(obj: dict[str, Any], message: str) -> None:
    rejects(lambda: m.parse_cordon(body(obj)), InvalidRequest, message)


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        pytest.param({"every_secs": 0}, m.ScheduleSpec(0, 1), id="stop"),
        pytest.param({"every_secs": 60}, m.ScheduleSpec(60, 1), id="keep-defaults-to-1"),
        pytest.param({"every_secs": 3600, "keep": 10}, m.ScheduleSpec(3600, 10), id="keep-at-limit"),
    ],
)
def test_schedule_accepts(obj: dict[str, Any], expected: m.ScheduleSpec) -> None:
    assert m.parse_schedule(body(obj), CONFIG) == expected


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        pytest.param({}, "every_secs is required", id="missing"),
        pytest.param({"every_secs": 59}, "min_snapshot_every_secs = 60", id="every-under"),
        pytest.param({"every_secs": 60, "keep": 11}, "max_snapshot_keep = 10", id="keep-over"),
        pytest.param({"every_secs": 60, "keep": 0}, "keep = 0", id="keep-zero"),
    ],
)
def test_schedule_rejects(obj: dict[str, Any], message: str) -> None:
    rejects(lambda: m.parse_schedule(body(obj), CONFIG), InvalidRequest, message)


@pytest.mark.parametrize(
    ("obj", "expected"),
    [
        pytest.param({"name": "data"}, m.VolumeSpec("data", 2048), id="default-size"),
        pytest.param({"name": "data", "size_mb": 20480}, m.VolumeSpec("data", 20480), id="at-limit"),
    ],
)
def test_volume_create_accepts(obj: dict[str, Any], expected: m.VolumeSpec) -> None:
    assert m.parse_volume_create(body(obj), CONFIG) == expected


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        pytest.param({}, "name is required", id="missing-name"),
        pytest.param({"name": "Data"}, "lowercase", id="bad-name"),
        pytest.param({"name": "d", "size_mb": 20481}, "limits.max_disk_mb = 20480", id="one-over"),
        pytest.param({"name": "d", "size_mb": 0}, "positive", id="zero"),
    ],
)
def test_volume_create_rejects(obj: dict[str, Any], message: str) -> None:
    rejects(lambda: m.parse_volume_create(body(obj), CONFIG), InvalidRequest, message)


def test_requests_are_frozen() -> None:
    req = m.parse_run(body({"argv": ["ls"]}))
    with pytest.raises(AttributeError):
        req.argv = ("rm",)  # type: ignore[misc]
