"""sandboxd's command line: listening rules, tokens, TLS, metrics."""

from __future__ import annotations

import http.client
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from sandboxd_harness import Sandboxd, free_port, localhost_certificate


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--listen", "127.0.0.1:7999"], "refuses to listen on TCP without a token"),
        (["--listen", "0.0.0.0:7999", "--token-file", "{token}"], "without TLS"),
        (["--metrics-listen", "0.0.0.0:9999"], "loopback"),
        (["--node-id", "Bad_Id"], "a-z"),
    ],
    ids=["tcp-without-token", "public-without-tls", "metrics-not-loopback", "bad-node-id"],
)
def test_refuses_unsafe_listening(tmp_path: Path, args: list[str], needle: str) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    argv = [a.replace("{token}", str(token)) for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "sbx.node.main", "--state-dir", str(tmp_path / "state"), *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 2
    assert needle in proc.stderr


def test_tcp_with_token_and_metrics(sandboxd_factory: Callable[..., Sandboxd], tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t0ken-value\n")
    port, metrics_port = free_port(), free_port()
    server = sandboxd_factory(
        args=["--socket", str(tmp_path / "s.sock"), "--listen", f"127.0.0.1:{port}", "--token-file", str(token),
              "--metrics-listen", f"127.0.0.1:{metrics_port}"],
        wait=False,
    )  # fmt: skip
    server.socket_path = tmp_path / "s.sock"
    server.token = "t0ken-value"
    server.wait_ready()
    assert server.socket_path.stat().st_mode & 0o777 == 0o600

    def get(path: str, auth: str | None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", path, headers={"Authorization": auth} if auth else {})
        resp = conn.getresponse()
        return resp.status, resp.read()

    status, body = get("/v1/capabilities", None)
    assert status == 401 and b'"unauthorized"' in body
    status, body = get("/v1/capabilities", "Bearer wrong")
    assert status == 401
    status, body = get("/v1/capabilities", "Bearer t0ken-value")
    assert status == 200
    # A token is required on the unix socket too once one is configured.
    server.token = None
    assert server.request("GET", "/v1/capabilities").status == 401
    server.token = "t0ken-value"
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    for name in (
        "sandboxd_sandboxes",
        "sandboxd_processes_running",
        "sandboxd_capacity_cpus",
        "sandboxd_free_cpus",
        "sandboxd_cordoned",
        "sandboxd_creates_total",
        "sandboxd_create_seconds",
        "sandboxd_pool_target",
    ):
        assert name in metrics, name
    server.create()
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    assert 'sandboxd_sandboxes{state="running"} 1.0' in metrics
    assert 'sandboxd_creates_total{status="created"} 1.0' in metrics


def test_tls_listener(sandboxd_factory: Callable[..., Sandboxd], tmp_path: Path) -> None:
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    localhost_certificate(cert, key)
    token = tmp_path / "token"
    token.write_text("tls-token")
    port = free_port()
    server = sandboxd_factory(
        args=["--socket", str(tmp_path / "s.sock"), "--listen", f"127.0.0.1:{port}", "--token-file", str(token),
              "--tls-cert", str(cert), "--tls-key", str(key)],
        wait=False,
    )  # fmt: skip
    server.socket_path = tmp_path / "s.sock"
    server.token = "tls-token"
    server.wait_ready()
    context = ssl.create_default_context(cafile=str(cert))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
    conn.request("GET", "/v1/capabilities", headers={"Authorization": "Bearer tls-token"})
    resp = conn.getresponse()
    assert resp.status == 200 and b'"api_version":"v1"' in resp.read()
    # Plain HTTP to the TLS port gets no API answer.
    plain = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        plain.request("GET", "/v1/capabilities", headers={"Authorization": "Bearer tls-token"})
        plain.getresponse().read()
