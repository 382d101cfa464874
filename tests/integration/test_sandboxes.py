"""Sandboxes: create, list, get, PATCH, DELETE, capabilities, node status and cordon, on a real node."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
from sandboxd_harness import Sandboxd


def ids(server: Sandboxd, query: str = "") -> list[str]:
    return [s["id"] for s in server.request("GET", f"/v1/sandboxes{query}").json()["sandboxes"]]


def test_capabilities_report_what_the_node_does(sandboxd: Sandboxd) -> None:
    caps = sandboxd.request("GET", "/v1/capabilities").json()
    assert caps["api_version"] == "v1"
    assert caps["backend"] == "gvisor"
    assert caps["capabilities"]["audit"] is True
    for name in ("suspend", "memory_snapshot", "disk_snapshot"):
        assert caps["capabilities"][name] is True  # docs/snapshots.md
    assert caps["capabilities"]["network_policy_update"] is True  # docs/network.md
    assert caps["capabilities"]["images"] is True
    assert caps["capabilities"]["tunnel"] is True
    assert {"max_cpus", "max_memory_mb", "max_disk_mb", "max_idle_timeout_secs"} <= set(caps["limits"])
    assert caps["network"]["default"]["mode"] == "none"
    assert caps["network"]["ceiling"] == "none"


def test_create_get_and_defaults(sandboxd: Sandboxd) -> None:
    created = sandboxd.create(name="first-one", labels={"team": "a"}, env={"GREETING": "hello"})
    try:
        assert re.fullmatch(r"sbx_[0-9a-f]{16}", created["id"])
        assert created["state"] == "running"
        assert created["name"] == "first-one"
        assert created["env_names"] == ["GREETING"]
        assert "hello" not in str(created)
        assert created["network"]["mode"] == "none"
        assert created["image"] == "default"
        for key in ("cpus", "memory_mb", "disk_mb", "idle_timeout_secs", "created_at"):
            assert key in created
        by_id = sandboxd.request("GET", f"/v1/sandboxes/{created['id']}").json()
        by_name = sandboxd.request("GET", "/v1/sandboxes/first-one").json()
        assert by_id == by_name
        assert sandboxd.run("first-one", ["sh", "-c", "echo $GREETING"])["stdout"] == b"hello\n"
    finally:
        sandboxd.request("DELETE", f"/v1/sandboxes/{created['id']}")


def test_list_newest_first_with_label_filters(sandboxd: Sandboxd) -> None:
    a = sandboxd.create(labels={"suite": "list", "color": "red"})
    b = sandboxd.create(labels={"suite": "list", "color": "blue"})
    try:
        assert ids(sandboxd, "?label=suite=list") == [b["id"], a["id"]]
        assert ids(sandboxd, "?label=suite=list&label=color=red") == [a["id"]]
        assert ids(sandboxd, "?label=suite=list&label=color=green") == []
        resp = sandboxd.request("GET", "/v1/sandboxes?label=nokeyvalue")
        assert resp.status == 400 and "key=value" in resp.error[1]
    finally:
        for s in (a, b):
            sandboxd.request("DELETE", f"/v1/sandboxes/{s['id']}")


def test_delete_is_idempotent_and_terminated_stays_listed(sandboxd: Sandboxd) -> None:
    s = sandboxd.create(name="doomed")
    assert sandboxd.request("DELETE", "/v1/sandboxes/doomed").status == 204
    assert sandboxd.request("DELETE", f"/v1/sandboxes/{s['id']}").status == 204
    got = sandboxd.request("GET", f"/v1/sandboxes/{s['id']}").json()
    assert got["state"] == "terminated"
    assert s["id"] in ids(sandboxd)
    # The name is free again once its sandbox is terminated; a name matches live sandboxes only.
    assert sandboxd.request("GET", "/v1/sandboxes/doomed").status == 404
    again = sandboxd.create(name="doomed")
    sandboxd.request("DELETE", f"/v1/sandboxes/{again['id']}")
    # A run on a terminated sandbox is a conflict, not a crash.
    resp = sandboxd.request("POST", f"/v1/sandboxes/{s['id']}/run", {"argv": ["true"]})
    assert resp.status == 409 and resp.error[0] == "conflict"


def test_unknown_sandbox_is_404(sandboxd: Sandboxd) -> None:
    for method, path in (("GET", ""), ("DELETE", ""), ("PATCH", ""), ("POST", "/run")):
        resp = sandboxd.request(
            method, f"/v1/sandboxes/sbx_0000000000000000{path}", {} if method != "GET" else None
        )
        assert resp.status == 404, (method, path)
        assert resp.error == ("not_found", "no sandbox 'sbx_0000000000000000' on this node")


def test_name_in_use_is_409_and_changes_nothing(sandboxd: Sandboxd) -> None:
    s = sandboxd.create(name="taken")
    try:
        before = ids(sandboxd)
        resp = sandboxd.request("POST", "/v1/sandboxes", {"name": "taken"})
        assert resp.status == 409
        assert resp.error[0] == "conflict" and "taken" in resp.error[1]
        assert ids(sandboxd) == before
    finally:
        sandboxd.request("DELETE", f"/v1/sandboxes/{s['id']}")


REFUSED_CREATES: list[tuple[str, dict[str, Any], int, str, str]] = [
    ("cpus-over-limit", {"cpus": 1000}, 400, "invalid_request", "max_cpus"),
    ("memory-over-limit", {"memory_mb": 10**7}, 400, "invalid_request", "max_memory_mb"),
    ("disk-over-limit", {"disk_mb": 10**8}, 400, "invalid_request", "max_disk_mb"),
    ("reserved-env", {"env": {"LD_PRELOAD": "/x.so"}}, 403, "refused", "LD_PRELOAD"),
    ("label-key", {"labels": {"Bad Key": "x"}}, 400, "invalid_request", "Bad Key"),
    ("too-many-labels", {"labels": {f"k{i}": "v" for i in range(33)}}, 400, "invalid_request", "32"),
    ("mode-above-ceiling", {"network": {"mode": "open"}}, 403, "refused", "rule 3"),
    (
        "allow-with-none",
        {"network": {"mode": "none", "allow": ["a.example.com"]}},
        400,
        "invalid_request",
        "rule 6",
    ),
    ("image-invalid", {"image": "No-Such-Image"}, 400, "invalid_request", "lowercase"),
    ("idle-over-limit", {"idle_timeout_secs": 10**9}, 400, "invalid_request", "idle_timeout_secs"),
    ("volume-unknown", {"volumes": [{"name": "v", "path": "/data"}]}, 404, "not_found", "no volume 'v'"),
    ("fork-unknown", {"snapshot_id": "snap_x"}, 404, "not_found", "no snapshot 'snap_x'"),
]


@pytest.mark.parametrize(("body", "status", "code", "needle"), [c[1:] for c in REFUSED_CREATES],
                         ids=[c[0] for c in REFUSED_CREATES])  # fmt: skip
def test_refused_create_changes_nothing(
    sandboxd: Sandboxd, body: dict[str, Any], status: int, code: str, needle: str
) -> None:
    before = ids(sandboxd)
    free_before = sandboxd.request("GET", "/v1/node").json()["free"]
    resp = sandboxd.request("POST", "/v1/sandboxes", body)
    assert resp.status == status, resp.body
    assert resp.error[0] == code
    assert needle in resp.error[1]
    assert ids(sandboxd) == before
    assert sandboxd.request("GET", "/v1/node").json()["free"] == free_before


def test_patch_rules(sandboxd: Sandboxd) -> None:
    s = sandboxd.create(name="patchme", labels={"a": "1"})
    other = sandboxd.create(name="other")
    ref = f"/v1/sandboxes/{s['id']}"
    try:
        resp = sandboxd.request("PATCH", ref, {"labels": {"b": "2"}, "idle_timeout_secs": 120})
        assert resp.status == 200
        assert resp.json()["labels"] == {"b": "2"} and resp.json()["idle_timeout_secs"] == 120
        assert resp.json()["name"] == "patchme"  # omitted: unchanged
        # One bad field changes nothing.
        resp = sandboxd.request("PATCH", ref, {"name": "renamed", "labels": {"BAD": "x"}})
        assert resp.status == 400
        assert sandboxd.request("GET", ref).json()["name"] == "patchme"
        # Name in use by another live sandbox.
        resp = sandboxd.request("PATCH", ref, {"name": "other"})
        assert resp.status == 409 and resp.error[0] == "conflict"
        # Idle timeout 0 is not allowed where the limit is not 0 (PATCH rule 4).
        resp = sandboxd.request("PATCH", ref, {"idle_timeout_secs": 0})
        assert resp.status == 400 and "idle_timeout_secs" in resp.error[1]
        # Network: the same policy changes nothing; a looser one than the ceiling (none here) is rule 3.
        resp = sandboxd.request("PATCH", ref, {"network": {"mode": "none"}})
        assert resp.status == 200 and resp.json()["network"]["mode"] == "none"
        resp = sandboxd.request("PATCH", ref, {"network": {"mode": "open"}})
        assert resp.status == 403 and resp.error[0] == "refused" and "rule 3" in resp.error[1]
        # Empty name removes it; labels {} removes all.
        resp = sandboxd.request("PATCH", ref, {"name": "", "labels": {}})
        assert resp.status == 200 and resp.json()["name"] is None and resp.json()["labels"] == {}
        resp = sandboxd.request("PATCH", ref, {"vcpus": 2})
        assert resp.status == 400 and "vcpus" in resp.error[1]
        # A terminated sandbox cannot be changed.
        sandboxd.request("DELETE", ref)
        resp = sandboxd.request("PATCH", ref, {"labels": {"x": "y"}})
        assert resp.status == 409 and resp.error[0] == "conflict"
        assert sandboxd.request("GET", ref).json()["labels"] == {}
        events = [e["type"] for e in sandboxd.request("GET", f"{ref}/events").json()["events"]]
        assert events.count("sandbox.updated") == 2
    finally:
        for x in (s, other):
            sandboxd.request("DELETE", f"/v1/sandboxes/{x['id']}")


def test_node_status_and_cordon(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory(
        args=["--node-id", "n1"], config_text="[capacity]\ncpus = 3\nmemory_mb = 4096\n"
    )
    status = server.request("GET", "/v1/node").json()
    assert status["name"] == "n1"
    assert status["capacity"]["cpus"] == 3 and status["capacity"]["memory_mb"] == 4096
    assert status["free"]["cpus"] == 3
    assert status["cordoned"] is False and status["running"] == 0
    assert "default" in status["images"]
    s = server.create(cpus=2, memory_mb=1024)
    assert re.fullmatch(r"sbx_n1_[0-9a-f]{16}", s["id"])
    status = server.request("GET", "/v1/node").json()
    assert status["free"]["cpus"] == 1 and status["free"]["memory_mb"] == 3072 and status["running"] == 1
    # Over the remaining capacity: unavailable, nothing made.
    resp = server.request("POST", "/v1/sandboxes", {"cpus": 2})
    assert resp.status == 503 and resp.error[0] == "unavailable" and "capacity" in resp.error[1]
    resp = server.request("POST", "/v1/node/cordon", {"cordoned": True})
    assert resp.status == 200 and resp.json()["cordoned"] is True
    resp = server.request("POST", "/v1/sandboxes", {})
    assert resp.status == 503 and resp.error[0] == "unavailable" and "cordoned" in resp.error[1]
    # Existing sandboxes are untouched.
    assert server.run(s["id"], ["true"])["exit_code"] == 0
    resp = server.request("POST", "/v1/node/cordon", {"cordoned": "yes"})
    assert resp.status == 400
    server.request("POST", "/v1/node/cordon", {"cordoned": False})
    resp = server.request("POST", "/v1/sandboxes", {"cpus": 1})
    assert resp.status == 201


def test_node_forgets_all_but_the_100_newest_terminated(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory()
    made = []
    for _ in range(102):
        s = server.create()
        made.append(s["id"])
        assert server.request("DELETE", f"/v1/sandboxes/{s['id']}").status == 204
    listed = ids(server)
    assert len(listed) == 100
    assert listed == list(reversed(made[2:]))  # newest first; the two oldest are forgotten
    assert server.request("GET", f"/v1/sandboxes/{made[0]}").status == 404
    # Their audit events are still answered by id.
    events = server.request("GET", f"/v1/sandboxes/{made[0]}/events").json()["events"]
    assert [e["type"] for e in events] == ["sandbox.created", "sandbox.terminated"]
    assert not (server.state_dir / "sandboxes" / made[0]).exists()


def test_ceiling_is_the_configured_one_every_mode_being_enforced(
    sandboxd_factory: Callable[..., Sandboxd],
) -> None:
    # The gVisor backend enforces none, allowlist and open (docs/network.md), so nothing is lowered; the
    # lowering itself (a backend enforcing less) is unit-tested in test_egress_rules.py.
    server = sandboxd_factory(config_text='[network]\nceiling = "allowlist"\nmay_allow = ["*"]\n')
    caps = server.request("GET", "/v1/capabilities").json()
    assert caps["network"]["ceiling"] == "allowlist"
    before = ids(server)
    resp = server.request("POST", "/v1/sandboxes", {"network": {"mode": "open"}})
    assert resp.status == 403 and resp.error[0] == "refused"
    assert "rule 3" in resp.error[1] and "allowlist" in resp.error[1]
    assert ids(server) == before
    assert "network ceiling lowered" not in server.log_text()
