"""The TypeScript SDK (sdk/typescript) against real servers: its tests (Node's own runner, ``node --test``) run
against a real sandboxd over its unix socket and a second one over HTTPS with a token (gVisor sandboxes), and
against a real sandbox-gateway over two nodes (services, jobs, agent runs, secrets, SSH keys, API keys). This file
starts the servers with the usual harnesses, builds the SDK (tsc, pinned in its package-lock.json; its
dependencies come from ``npm ci``, run by scripts/install.sh) and fails with node's output when a node test fails,
is skipped or cancelled. The examples of docs/sdk-typescript.md are files the tests run.
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
    """What needs no server: the generated types are fresh, the error tree, frames, endpoints."""
    run_node_tests(["test/unit.test.js"], {})


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
    """Sandboxes, run, processes, files, attach (a cut stream included), suspend, snapshots, forks, volumes,
    metrics, events, images and their errors, over the unix socket and over HTTPS with a token."""
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
