"""The Transport section: request guard, body caps, error bodies, unknown fields."""

from __future__ import annotations

import socket
import time

import pytest
from sandboxd_harness import Sandboxd


@pytest.mark.parametrize(
    ("headers", "status", "code", "needle"),
    [
        ({"Host": "evil.example"}, 403, "forbidden_origin", "Host 'evil.example'"),
        ({"Host": "127.0.0.1:8080"}, 200, None, None),
        ({"Host": "[::1]"}, 200, None, None),
        ({"Origin": "https://evil.example"}, 403, "forbidden_origin", "Origin 'https://evil.example'"),
        # A Host is a host and an optional port, compared whole: a loopback address with a suffix is not one.
        ({"Host": "[::1].evil.example"}, 403, "forbidden_origin", "Host '[::1].evil.example'"),
        ({"Host": "[::1]evil"}, 403, "forbidden_origin", "Host '[::1]evil'"),
        ({"Host": "localhost:80:80"}, 403, "forbidden_origin", "Host 'localhost:80:80'"),
    ],
    ids=[
        "foreign-host",
        "loopback-ip-host",
        "ipv6-loopback-host",
        "foreign-origin",
        "bracket-suffix",
        "bracket-glued",
        "two-ports",
    ],
)
def test_request_guard(sandboxd: Sandboxd, headers: dict[str, str], status: int, code: str | None,
                       needle: str | None) -> None:  # fmt: skip
    resp = sandboxd.request("GET", "/v1/capabilities", headers=headers)
    assert resp.status == status
    if code is not None:
        assert resp.error[0] == code
        assert needle is not None and needle in resp.error[1]


def test_guard_runs_before_handlers(sandboxd: Sandboxd) -> None:
    before = sandboxd.request("GET", "/v1/sandboxes").json()["sandboxes"]
    resp = sandboxd.request("POST", "/v1/sandboxes", {}, headers={"Origin": "https://evil.example"})
    assert resp.status == 403 and resp.error[0] == "forbidden_origin"
    assert sandboxd.request("GET", "/v1/sandboxes").json()["sandboxes"] == before


def test_unknown_endpoint_has_error_body(sandboxd: Sandboxd) -> None:
    resp = sandboxd.request("GET", "/v1/nothing-here")
    assert resp.status == 404
    assert resp.error == ("not_found", "no endpoint GET /v1/nothing-here")


def test_gateway_only_endpoints_are_404(sandboxd: Sandboxd) -> None:
    for path in ("/v1/health", "/v1/whoami", "/v1/admin/keys"):
        resp = sandboxd.request("GET", path)
        assert resp.status == 404 and resp.error[0] == "not_found"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "JSON"),
        (b"[1,2]", "object"),
        (b'{"bind": "/etc"}', "bind"),
        (b'{"imagee": "default"}', "imagee"),
        (b'{"cpus": "two"}', "cpus"),
    ],
    ids=["invalid-json", "not-an-object", "bind", "unknown-field", "wrong-type"],
)
def test_bad_create_bodies_are_400_and_change_nothing(sandboxd: Sandboxd, body: bytes, needle: str) -> None:
    before = sandboxd.request("GET", "/v1/sandboxes").json()["sandboxes"]
    resp = sandboxd.request("POST", "/v1/sandboxes", body=body, headers={"Content-Type": "application/json"})
    assert resp.status == 400
    code, message = resp.error
    assert code == "invalid_request"
    assert needle in message
    assert sandboxd.request("GET", "/v1/sandboxes").json()["sandboxes"] == before


def test_json_body_over_1mib_is_413_with_error_body(sandboxd: Sandboxd) -> None:
    body = b'{"name": "' + b"a" * (1024 * 1024 + 10) + b'"}'
    started = time.monotonic()
    resp = sandboxd.request("POST", "/v1/sandboxes", body=body, headers={"Content-Type": "application/json"})
    assert resp.status == 413
    assert resp.error[0] == "invalid_request"
    assert "limit" in resp.error[1]
    assert time.monotonic() - started < 10


def test_body_cap_without_content_length_never_hangs(sandboxd: Sandboxd) -> None:
    """A chunked body past the cap is answered with the error body, not left hanging."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(20)
    sock.connect(str(sandboxd.socket_path))
    sock.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")  # fmt: skip
    chunk = b"a" * 65536
    answer = b""
    try:
        for _ in range(40):  # 2.5 MiB, well past the 1 MiB cap
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        while b"\r\n\r\n" not in answer or b"}}" not in answer:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b'"code":"invalid_request"' in answer
