"""The TypeScript SDK (sdk/typescript) against real servers: its tests (Node's own runner, ``node --test``) run
against a real sandboxd over its unix socket and a second one over HTTPS with a token (gVisor sandboxes), and
against a real sandbox-gateway over two nodes (services, jobs, agent runs, secrets, SSH keys, API keys). This file
starts the servers with the usual harnesses, builds the SDK (tsc, pinned in its package-lock.json; its
dependencies come from ``npm ci``, run by scripts/install.sh) and fails with node's output when a node test fails,
is skipped or cancelled. Exposed ports run against a gateway with --ports-domain (``ports_world``). The examples of
docs/sdk-typescript.md are files the tests run. Last, the SDK bundled for browsers (esbuild) runs in Debian's
Chromium on a page of another origin than the gateway.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_harness import GatewayProcess
from ports_world import GUEST_PORT, ports_world
from sandboxd_harness import REPO, Sandboxd, free_port, localhost_certificate
from services_world import World, world

SDK = REPO / "sdk" / "typescript"
ARTIFACTS = REPO / "test-artifacts" / "sdk-typescript"
#: Seconds one node test file may take in all (the slowest, the node tests, take about three minutes).
NODE_TIMEOUT_SECS = 1500


@pytest.fixture(scope="module")
def built() -> Path:
    """The SDK compiled (package and tests) with the pinned tsc; fails when its dependencies are not installed."""
    if shutil.which("node") is None:
        pytest.fail("node is not installed: run scripts/install.sh")
    if not (SDK / "node_modules" / ".package-lock.json").is_file():
        pytest.fail(f"the SDK's dependencies are not installed: run scripts/install.sh (npm ci in {SDK})")
    # tsc itself rather than `npm run build`: the tests need node, not npm (Debian 12's npm may differ).
    for config in ("tsconfig.json", "tsconfig.test.json"):
        result = subprocess.run(
            ["node", "node_modules/typescript/bin/tsc", "-p", config], cwd=SDK, capture_output=True, text=True,
            check=False,
        )  # fmt: skip
        assert result.returncode == 0, f"tsc -p {config} failed:\n{result.stdout}\n{result.stderr}"
    return SDK / "build"


def run_node_tests(files: list[str], env: dict[str, str]) -> str:
    """Run ``node --test`` on ``files`` (under build/) with ``env`` added; return its TAP output. Fails, with the
    output, when a test failed, was cancelled or skipped, or none ran."""
    result = subprocess.run(
        ["node", "--test", "--test-reporter=tap", *(f"build/{f}" for f in files)],
        cwd=SDK, env={**os.environ, **env}, capture_output=True, text=True, timeout=NODE_TIMEOUT_SECS, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    # The whole TAP output is kept for a post-mortem; the failure message holds the failed tests' parts.
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / (Path(files[0]).stem + ".tap")).write_text(output, encoding="utf-8")
    counts = {
        name: int(n)
        for name, n in re.findall(r"^# (pass|fail|cancelled|skipped|todo) (\d+)$", output, re.MULTILINE)
    }
    summary = {k: counts.get(k, 0) for k in ("pass", "fail", "cancelled", "skipped", "todo")}
    ok = (
        result.returncode == 0
        and summary["pass"] > 0
        and not any(summary[k] for k in ("fail", "cancelled", "skipped", "todo"))
    )
    failed = [
        block
        for block in re.split(r"\n(?=\s*# Subtest: )", output)
        if re.search(r"^\s*not ok ", block, re.MULTILINE)
    ]
    assert ok, (
        f"node --test {files} exited {result.returncode} with {summary} (all of it in {ARTIFACTS}):\n"
        + "\n".join(failed)[-30000:]
        + "\n"
        + result.stderr[-3000:]
    )
    return output


def test_unit(built: Path) -> None:
    """What needs no server: the generated types are fresh, the error tree, frames, endpoints, and `sandbox.ports`
    against a local HTTP server answering the ports endpoints."""
    run_node_tests(["test/unit.test.js", "test/ports.test.js"], {})


@pytest.fixture(scope="module")
def https_node() -> Iterator[tuple[str, str, Path]]:
    """A second sandboxd listening on loopback TCP with TLS and a token: (url, token, CA file)."""
    workdir = Path(tempfile.mkdtemp(prefix="sbxts-", dir="/var/tmp"))
    cert, key, token_file = workdir / "cert.pem", workdir / "key.pem", workdir / "token"
    localhost_certificate(cert, key)
    token_file.write_text("ts-sdk-token-not-to-be-logged")
    port = free_port()
    server = Sandboxd(workdir, args=[
        "--socket", str(workdir / "s.sock"), "--listen", f"127.0.0.1:{port}", "--token-file", str(token_file),
        "--tls-cert", str(cert), "--tls-key", str(key),
    ])  # fmt: skip
    server.socket_path = workdir / "s.sock"
    server.token = "ts-sdk-token-not-to-be-logged"
    server.start()
    try:
        yield f"https://localhost:{port}", server.token, cert
    finally:
        server.teardown()
        # The token never reached the server's log.
        assert server.token not in server.log_text()
        shutil.rmtree(workdir, ignore_errors=True)


def test_against_sandboxd(built: Path, sandboxd: Sandboxd, https_node: tuple[str, str, Path]) -> None:
    """Sandboxes, run, processes, files, attach (a cut stream included), suspend, persistent sandboxes (created
    with a name, stopped, resumed, woken by a run and a file read, suspended by their idle timeout), snapshots,
    forks, volumes, metrics, events, images and their errors, over the unix socket and over HTTPS with a token."""
    url, token, ca = https_node
    run_node_tests(["test/node.test.js"], {
        "SBX_TEST_URL": f"unix://{sandboxd.socket_path}",
        "SBX_TEST_HTTPS_URL": url, "SBX_TEST_HTTPS_TOKEN": token, "SBX_TEST_HTTPS_CA": str(ca),
    })  # fmt: skip
    assert token not in sandboxd.log_text()


@pytest.fixture(scope="module")
def gateway_world() -> Iterator[World]:
    """The services world (two nodes, secrets, agents) with SSH served."""
    with world(["--ssh-listen", f"127.0.0.1:{free_port()}"], prefix="sbxts-gw-") as w:
        yield w


@pytest.fixture(scope="module")
def plain_gateway() -> Iterator[tuple[GatewayProcess, Sandboxd, str]]:
    """A gateway serving no SSH over one node of its own (which a test kills): (gateway, node, key)."""
    workdir = Path(tempfile.mkdtemp(prefix="sbxts-plain-", dir="/var/tmp"))
    (workdir / "n").mkdir()
    (workdir / "gw").mkdir()
    node = Sandboxd(workdir / "n", args=["--node-id", "c"]).start()
    gw = GatewayProcess(workdir / "gw", [("c", node)])
    key = gw.create_key("pat", "sandbox:read", "sandbox:create", "sandbox:delete")
    try:
        gw.start()
        yield gw, node, key
    finally:
        gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def test_against_the_gateway(
    built: Path, gateway_world: World, plain_gateway: tuple[GatewayProcess, Sandboxd, str]
) -> None:
    """The gateway's calls: services, jobs, agent runs, secrets, SSH keys, API keys, and its errors (NotServed
    from a gateway without SSH, BadGateway from one whose node was killed)."""
    w = gateway_world
    plain, plain_node, plain_key = plain_gateway
    assert plain_node.proc is not None
    run_node_tests(["test/gateway.test.js"], {
        "SBX_TEST_GATEWAY_URL": f"http://127.0.0.1:{w.gw.port}",
        "SBX_TEST_GATEWAY_ADMIN_KEY": w.keys["admin"], "SBX_TEST_GATEWAY_KEY": w.keys["alice"],
        "SBX_TEST_GATEWAY_READER_KEY": w.keys["reader"],
        "SBX_TEST_PLAIN_GATEWAY_URL": f"http://127.0.0.1:{plain.port}", "SBX_TEST_PLAIN_GATEWAY_KEY": plain_key,
        "SBX_TEST_PLAIN_NODE_PID": str(plain_node.proc.pid),
    })  # fmt: skip
    log = w.gw.log_text() + plain.log_text()
    assert not [k for k in [*w.keys.values(), plain_key] if k in log], "a key reached a gateway's log"


def test_ports_against_a_gateway(built: Path, sandboxd: Sandboxd) -> None:
    """``sandbox.ports`` through a gateway run with --ports-domain: the listing, the URL, a token URL opened as a
    browser does (cookie, redirect, the guest's page), public and private again, another user's 404."""
    with ports_world(sandboxd, prefix="sbxts-ports-") as pw:
        sandbox_id = pw.sandbox_with_server()
        try:
            run_node_tests(["test/ports-gateway.test.js"], {
                "SBX_TEST_PORTS_GATEWAY_URL": pw.url, "SBX_TEST_PORTS_KEY": pw.keys["owner"],
                "SBX_TEST_PORTS_OTHER_KEY": pw.keys["other"], "SBX_TEST_PORTS_SANDBOX": sandbox_id,
                "SBX_TEST_PORTS_PORT": str(GUEST_PORT), "SBX_TEST_PORTS_URL": pw.port_url(sandbox_id, GUEST_PORT),
            })  # fmt: skip
        finally:
            pw.gw.request("DELETE", f"/v1/sandboxes/{sandbox_id}", key=pw.keys["owner"])


@pytest.fixture(scope="module")
def page_server() -> Iterator[tuple[str, Path]]:
    """A static HTTP server on loopback for the browser test's page: (its origin, the directory it serves)."""
    import functools
    import http.server
    import threading

    directory = Path(tempfile.mkdtemp(prefix="sbxts-page-", dir="/var/tmp"))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", directory
    finally:
        server.shutdown()
        server.server_close()
        shutil.rmtree(directory, ignore_errors=True)


def test_in_a_browser(built: Path, sandboxd: Sandboxd, page_server: tuple[str, Path]) -> None:
    """The SDK bundled for browsers (esbuild) in Debian's Chromium, on a page of another origin than the gateway
    (allowed with --cors-origin): fetch, the browser's WebSocket with the key as a subprotocol, resize, the
    errors, and what a browser cannot do (unix socket, tunnels). No request or WebSocket URL holds the key."""
    from playwright.sync_api import sync_playwright

    origin, directory = page_server
    bundle = subprocess.run(
        ["node", "node_modules/esbuild/bin/esbuild", "dist/index.js", "--bundle", "--format=esm",
         "--platform=browser", f"--outfile={directory / 'sbx-sdk.js'}", "--log-level=warning"],
        cwd=SDK, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bundle.returncode == 0, bundle.stderr
    for name in ("index.html", "scenario.js"):
        shutil.copy(SDK / "test" / "browser" / name, directory / name)
    workdir = Path(tempfile.mkdtemp(prefix="sbxts-bgw-", dir="/var/tmp"))
    gw = GatewayProcess(workdir, [("n", sandboxd)], ["--cors-origin", origin])
    key = gw.create_key("bea", "sandbox:read", "sandbox:create", "sandbox:delete")
    seen_urls: list[str] = []
    try:
        gw.start()
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium")
            try:
                page = browser.new_page()
                page.on("request", lambda request: seen_urls.append(request.url))
                page.on("websocket", lambda ws: seen_urls.append(ws.url))
                page.goto(f"{origin}/index.html")
                page.wait_for_function("document.title === 'ready'", timeout=60_000)
                page.set_default_timeout(240_000)
                out = page.evaluate(
                    "(args) => window.scenario(args)", {"url": f"http://127.0.0.1:{gw.port}", "key": key}
                )
            finally:
                browser.close()
    finally:
        gw.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    assert out["run"] == [3, "from the page", "err\n"]
    assert out["file"] == [0, 1, 254, 255] and out["listed"]
    assert out["followed"] == "one\n"
    assert out["attach"] == ["one\ngot typed\n", 5]
    assert out["resized"] is True
    assert out["errors"] == {
        "notFound": ["NotFound", 404, "not_found"],
        "unauthorized": ["Unauthorized", 401, "unauthorized"],
        "attachUnauthorized": ["Unauthorized", 401, "unauthorized"],
        "tunnel": ["Unsupported", 501, "unsupported"],
        "forward": ["Unsupported", 501, "unsupported"],
        "unixSocket": ["InvalidRequest", 400, "invalid_request"],
    }
    assert out["terminated"] == "terminated"
    assert any(u.startswith("ws://127.0.0.1") for u in seen_urls), seen_urls
    assert any("/v1/sandboxes" in u for u in seen_urls), seen_urls
    assert not [u for u in seen_urls if key in u]
