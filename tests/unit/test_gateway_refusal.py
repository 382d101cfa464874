"""A node's refusal of a tunnel, as the gateway's errors name it: the node's own message when it sent one."""

from __future__ import annotations

import json

import pytest

from sbx.gateway.nodeclient import Refusal

_CONFLICT = json.dumps(
    {
        "error": {
            "code": "conflict",
            "message": "cannot connect to 127.0.0.1:8080 in the sandbox: nothing is listening",
        }
    }
).encode()


@pytest.mark.parametrize(
    ("status", "body", "reason"),
    [
        (409, _CONFLICT, "HTTP 409: cannot connect to 127.0.0.1:8080 in the sandbox: nothing is listening"),
        (502, b"<html>Bad Gateway</html>", "HTTP 502"),  # not the error JSON: the status alone
        (503, b"", "HTTP 503"),
    ],
    ids=["error-json", "html", "empty"],
)
def test_a_refusal_names_the_nodes_reason(status: int, body: bytes, reason: str) -> None:
    assert Refusal(status, "application/json", body).reason() == reason
