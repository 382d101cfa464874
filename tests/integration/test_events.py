"""Node audit events: types, fields, and what is never recorded."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from sandboxd_harness import Sandboxd


def test_events_of_a_sandbox_life(sandboxd: Sandboxd) -> None:
    secret = "s3cr3t-env-value"
    s = sandboxd.create(name="audited", labels={"team": "x"}, env={"TOKEN": secret})
    ref = s["id"]
    sandboxd.run(ref, ["sh", "-c", "echo hidden-arg-value"], env={"EXTRA": secret})
    sandboxd.request("PUT", f"/v1/sandboxes/{ref}/files?path=/tmp/f", body=b"file-contents-secret")
    sandboxd.request("GET", f"/v1/sandboxes/{ref}/files?path=/tmp/f")
    sandboxd.request("DELETE", f"/v1/sandboxes/{ref}/files?path=/tmp/f")
    sandboxd.request("PATCH", f"/v1/sandboxes/{ref}", {"labels": {"team": "y"}})
    sandboxd.request("DELETE", f"/v1/sandboxes/{ref}")
    body = sandboxd.request("GET", f"/v1/sandboxes/{ref}/events").json()
    assert body["truncated"] is False
    events = body["events"]
    types = [e["type"] for e in events]
    assert types == ["sandbox.created", "process.started", "process.exited", "file.written", "file.read",
                     "file.removed", "sandbox.updated", "sandbox.terminated"]  # fmt: skip
    for e in events:
        assert e["sandbox"] == ref and e["time"].endswith("Z")
    created = events[0]
    assert created["name"] == "audited" and created["labels"] == {"team": "x"}
    assert created["env_names"] == ["TOKEN"] and created["image"] == "default"
    assert created["network"]["mode"] == "none"
    started = events[1]
    expected = hashlib.sha256(b"-c\0echo hidden-arg-value\0").hexdigest()
    assert started["program"] == "sh" and started["arg_count"] == 2 and started["args_sha256"] == expected
    assert started["cwd"] == "/sandbox/home" and started["env_names"] == ["EXTRA"]
    assert events[2]["exit_code"] == 0 and "duration_ms" in events[2]
    assert events[3]["path"] == "/tmp/f" and events[3]["bytes"] == len(b"file-contents-secret")
    assert events[6]["labels"] == {"team": "y"}
    assert events[7]["reason"] == "request"
    # Never recorded anywhere in the log: env values, arguments, file contents.
    raw = b"".join(p.read_bytes() for p in (sandboxd.state_dir / "audit").glob("events.jsonl*"))
    for needle in (secret, "hidden-arg-value", "file-contents-secret"):
        assert needle.encode() not in raw
        assert base64.b64encode(needle.encode()) not in raw
    # A terminated sandbox's events are still answered by id, not by name.
    assert sandboxd.request("GET", "/v1/sandboxes/audited/events").status == 404


def test_events_of_unknown_sandbox_404(sandboxd: Sandboxd) -> None:
    resp = sandboxd.request("GET", "/v1/sandboxes/sbx_ffffffffffffffff/events")
    assert resp.status == 404 and resp.error[0] == "not_found"


def test_events_start_with_sandbox_created(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    events = sandboxd.request("GET", f"/v1/sandboxes/{sandbox['id']}/events").json()["events"]
    assert events[0]["type"] == "sandbox.created"
