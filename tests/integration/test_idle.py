"""Idle timeout: no request naming the sandbox and no process running -> terminated, reason idle."""

from __future__ import annotations

import time
from collections.abc import Callable

from sandboxd_harness import Sandboxd


def test_idle_timeout_terminates(sandboxd_factory: Callable[..., Sandboxd]) -> None:
    server = sandboxd_factory()
    idle = server.create(idle_timeout_secs=2)
    busy = server.create(idle_timeout_secs=2)
    server.request("POST", f"/v1/sandboxes/{busy['id']}/processes", {"argv": ["sleep", "6"]})
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        states = {s["id"]: s["state"] for s in server.request("GET", "/v1/sandboxes").json()["sandboxes"]}
        if states[idle["id"]] == "terminated":
            break
        time.sleep(0.25)
    assert states[idle["id"]] == "terminated"
    # A running process keeps a sandbox alive past its idle timeout.
    assert states[busy["id"]] == "running"
    events = server.request("GET", f"/v1/sandboxes/{idle['id']}/events").json()["events"]
    assert events[-1]["type"] == "sandbox.terminated" and events[-1]["reason"] == "idle"
