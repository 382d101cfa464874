"""Fixtures for integration tests against a real sandboxd with the gVisor backend."""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from console_harness import browser_fixture
from pg_cluster import pg_cluster_fixture
from sandboxd_harness import REPO, Sandboxd, missing_requirements

# Fixtures defined elsewhere: the private PostgreSQL cluster, once per session (tests/support/pg_cluster.py), and
# Chromium for the console's browser tests, once per module (console_harness.py).
__all__ = ["browser_fixture", "pg_cluster_fixture"]

_MISSING = missing_requirements()


#: Modules that take longest (seconds of the suite alone, measured 2026-12-01), started first by parallel
#: workers so that none is left running alone at the end; the others follow in their file order.
LONG_FIRST = (
    "test_fuzz",
    "test_parking",
    "test_console_workloads",
    "test_sdk_typescript",
    "test_gateway_ssh_limits",
    "test_gateway_haproxy",
    "test_gateway_replicas",
    "test_cli_console",
    "test_snapshots",
    "test_gateway_ssh",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark integration tests (and skip them where gVisor sandboxes cannot run); put the LONG_FIRST modules
    first (parallel runs, ``-n N --dist loadfile --no-loadscope-reorder``, hand out whole modules in this
    order, since a module's tests share its module-scoped servers)."""
    for item in items:
        if "integration" in item.nodeid.split("/"):
            item.add_marker(pytest.mark.integration)
            if _MISSING:
                item.add_marker(pytest.mark.skip(reason=f"needs gVisor sandboxes: {_MISSING}"))
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)


def _evidence_dir(request: pytest.FixtureRequest) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid)
    return REPO / "test-artifacts" / name


@pytest.fixture
def sandboxd_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., Sandboxd]]:
    """Start sandboxd servers (each in its own temp dir); all are torn down after the test."""
    servers: list[Sandboxd] = []
    dirs: list[Path] = []

    def start(config_text: str = "", args: list[str] | None = None, wait: bool = True) -> Sandboxd:
        workdir = Path(tempfile.mkdtemp(prefix="sbxd-", dir="/var/tmp"))
        dirs.append(workdir)
        server = Sandboxd(workdir, config_text, args)
        servers.append(server)
        return server.start(wait=wait)

    yield start
    failed = any(getattr(request.node, f"rep_{w}", None) and getattr(request.node, f"rep_{w}").failed
                 for w in ("setup", "call"))  # fmt: skip
    for server in servers:
        if failed:
            server.save_evidence(_evidence_dir(request) / server.workdir.name)
        server.teardown()
    for workdir in dirs:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def sandboxd(request: pytest.FixtureRequest) -> Iterator[Sandboxd]:
    """One sandboxd shared by a test module (default config)."""
    workdir = Path(tempfile.mkdtemp(prefix="sbxd-", dir="/var/tmp"))
    server = Sandboxd(workdir).start()
    yield server
    server.teardown()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def sandbox(sandboxd: Sandboxd) -> Iterator[dict[str, object]]:
    """One running sandbox shared by a test module."""
    created = sandboxd.create()
    yield created
    sandboxd.request("DELETE", f"/v1/sandboxes/{created['id']}")
