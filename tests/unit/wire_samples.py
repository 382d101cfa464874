"""Whole answers of the wire contract, for tests whose fake servers must answer as a real one does.

Each ``*_body`` is the JSON a server sends (a dict, overrides applied on top); each other function is the
matching wire type, decoded from it as a client would."""

from __future__ import annotations

from typing import Any

from sbx.api.codec import convert_answer, to_builtins
from sbx.api.network_policy import NetworkConfig, NetworkPolicy
from sbx.api.node import Capabilities, Defaults, Limits, NodeStatus, Resources
from sbx.api.processes import Process
from sbx.api.sandboxes import Sandbox


def sandbox_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "sbx_1", "name": None, "state": "running", "image": "default", "cpus": 1, "memory_mb": 512,
        "disk_mb": 2048, "env_names": [], "network": {"mode": "none", "deny": []}, "labels": {},
        "idle_timeout_secs": 600, "snapshot_every_secs": 0, "snapshot_keep": 0,
        "created_at": "2024-05-01T12:00:00.000Z", "persistent": False,
    }  # fmt: skip
    body.update(overrides)
    return body


def sandbox(**overrides: Any) -> Sandbox:
    return convert_answer(sandbox_body(**overrides), Sandbox, "Sandbox")


def process_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "pid": 1, "argv": ["sh"], "state": "running", "exit_code": None, "started_at": "2024-05-01T12:00:00.000Z"
    }  # fmt: skip
    body.update(overrides)
    return body


def process(**overrides: Any) -> Process:
    return convert_answer(process_body(**overrides), Process, "Process")


def snapshot_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "snap_1", "sandbox": "sbx_1", "image": "default", "kind": "memory", "bytes": 3,
        "created_at": "2024-05-01T12:00:00.000Z",
    }  # fmt: skip
    body.update(overrides)
    return body


def volume_body(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "data",
        "size_mb": 64,
        "created_at": "2024-05-01T12:00:00.000Z",
        "attached_to": None,
    }
    body.update(overrides)
    return body


def capabilities_body(**flags: bool) -> dict[str, Any]:
    caps = Capabilities(
        api_version="v1", backend="gvisor", capabilities={"tunnel": True, "images": True, **flags},
        limits=Limits(), network=NetworkConfig(NetworkPolicy("none")),
    )  # fmt: skip
    body: dict[str, Any] = to_builtins(caps)
    return body


def node_status_body(**overrides: Any) -> dict[str, Any]:
    status = NodeStatus(
        name="", version="0.1.0", capabilities=convert_answer(capabilities_body(), Capabilities, "Capabilities"),
        capacity=Resources(8, 16384, 100000), free=Resources(8, 16384, 100000), running=0, pooled={},
        images=["default"], labels={}, cordoned=False, defaults=Defaults(),
    )  # fmt: skip
    body: dict[str, Any] = to_builtins(status)
    body.update(overrides)
    return body
