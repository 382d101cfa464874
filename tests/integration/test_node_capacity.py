"""A node filled to its limit refuses the next create with 503 and the reason, creates nothing for it, and stays
responsive; GET /v1/node says how many sandboxes it holds and why (docs/config.md, "How many sandboxes a node
holds")."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from sandboxd_harness import Sandboxd

LIMIT = 3


def entries(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.startswith("sbx_")} if directory.is_dir() else set()


def test_a_full_node_refuses_the_next_create_and_stays_responsive(
    sandboxd_factory: Callable[..., Sandboxd],
) -> None:
    server = sandboxd_factory(f"[capacity]\nmax_sandboxes = {LIMIT}\n")
    status = server.request("GET", "/v1/node").json()["sandbox_capacity"]
    assert (status["max_sandboxes"], status["limited_by"], status["sandboxes"]) == (LIMIT, "max_sandboxes", 0)
    assert {limit["resource"] for limit in status["limits"]} == {
        "cpus", "memory", "disk", "max_sandboxes", "host_memory", "tasks", "open_files",
    }  # fmt: skip
    made = [server.create()["id"] for _ in range(LIMIT)]
    for ref in made:
        assert server.run(ref, ["true"])["exit_code"] == 0
    before = (entries(server.state_dir / "sandboxes"), entries(server.state_dir / "gvisor"))
    listed = len(server.request("GET", "/v1/sandboxes").json()["sandboxes"])

    refused = server.request("POST", "/v1/sandboxes", {})
    assert refused.status == 503, refused.body
    assert refused.error == (
        "unavailable",
        (
            f"this node holds {LIMIT} sandboxes (pooled ones included), its limit [capacity] max_sandboxes = {LIMIT}: "
            "delete one or retry on another node"
        ),
    )
    # Nothing was made for it: no record, no runtime directory, nothing listed.
    assert (entries(server.state_dir / "sandboxes"), entries(server.state_dir / "gvisor")) == before
    assert len(server.request("GET", "/v1/sandboxes").json()["sandboxes"]) == listed == LIMIT
    # The node answers as before: runs in the sandboxes it holds, its status.
    for ref in made:
        started = time.monotonic()
        assert server.run(ref, ["echo", "still here"])["stdout"] == b"still here\n"
        assert (
            time.monotonic() - started < 10
        )  # generous: a loaded 2-core machine; a stuck node takes forever
    status = server.request("GET", "/v1/node").json()
    assert status["running"] == LIMIT and status["sandbox_capacity"]["sandboxes"] == LIMIT

    # One deleted makes room for exactly one.
    assert server.request("DELETE", f"/v1/sandboxes/{made[0]}").status == 204
    replacement = server.create()["id"]
    assert server.run(replacement, ["true"])["exit_code"] == 0
    assert server.request("POST", "/v1/sandboxes", {}).status == 503
