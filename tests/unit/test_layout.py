"""The layout tells the architecture (docs/architecture.md): which package may import which, checked on the
source itself, so an arrow pointing up fails here rather than in a review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "sbx"

#: package -> prefixes of project modules it must not import (``sbx.api`` imports nothing above itself).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "api": ("sbx.web", "sbx.node", "sbx.gateway", "sbx.client", "sbx.cli", "sbx.backends", "sbx.images",
            "sbx.net", "sbx.agent", "sbx.mcp"),
    "web": ("sbx.node", "sbx.gateway", "sbx.client", "sbx.cli", "sbx.backends", "sbx.images", "sbx.agent",
            "sbx.mcp"),
    "backends": ("sbx.node", "sbx.gateway", "sbx.client", "sbx.cli", "sbx.web", "aiohttp.web", "sbx.mcp"),
    "gateway": ("sbx.node", "sbx.client", "sbx.cli", "sbx.backends", "sbx.mcp"),
    "node": ("sbx.gateway", "sbx.client", "sbx.cli", "sbx.mcp"),
    "client": ("sbx.node", "sbx.gateway", "sbx.cli", "sbx.backends", "sbx.mcp"),
    "mcp": ("sbx.node", "sbx.gateway", "sbx.cli", "sbx.backends", "sbx.web", "sbx.images", "sbx.agent"),
    "cli": ("sbx.node", "sbx.gateway", "sbx.backends"),
}  # fmt: skip


#: Parts of the node's lifecycle written against the narrow interfaces of ``sbx.node.host``, never the manager.
NARROW = (
    "node/pools.py",
    "node/checkpoints.py",
    "node/volumes.py",
    "node/sandbox.py",
    "node/reservations.py",
)


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_arrow_points_up(package: str) -> None:
    wrong = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in sorted((SRC / package).rglob("*.py"))
        for name in sorted(imports_of(path))
        if any(name == p or name.startswith(p + ".") for p in FORBIDDEN[package])
    ]
    assert wrong == []


@pytest.mark.parametrize("module", NARROW)
def test_the_lifecycle_parts_do_not_import_the_manager(module: str) -> None:
    assert not {name for name in imports_of(SRC / module) if name.startswith("sbx.node.manager")}


#: The gateway's assembly and HTTP layer, the only modules that know ``Gateway`` (issue 34): every other part is
#: given the narrow interfaces it uses (``sbx.gateway.interfaces`` and each package's own), docs/architecture.md.
GATEWAY_ASSEMBLY = ("main.py", "server.py", "middlewares.py", "routes/")
GATEWAY_OBJECT = ("sbx.gateway.server", "sbx.gateway.main", "sbx.gateway.middlewares", "sbx.gateway.routes")


def test_only_the_gateways_assembly_and_http_layer_know_the_gateway() -> None:
    parts = [
        path
        for path in sorted((SRC / "gateway").rglob("*.py"))
        if not str(path.relative_to(SRC / "gateway")).startswith(GATEWAY_ASSEMBLY)
    ]
    assert len(parts) > 60  # the jobs, services, ports and ssh packages, the services, the store...
    wrong = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in parts
        for name in sorted(imports_of(path))  # TYPE_CHECKING imports too: not even for types
        if any(name == p or name.startswith(p + ".") for p in GATEWAY_OBJECT)
    ]
    assert wrong == []


#: The MCP server is a client of the SDK: of the project it imports the wire contract, the SDK, itself and the
#: loopback rule of ``net`` (one leaf module), nothing else.
MCP_MAY_IMPORT = ("sbx.api", "sbx.client", "sbx.mcp", "sbx.net.loopback")


def test_the_mcp_server_is_a_client_of_the_sdk() -> None:
    wrong = [
        f"{path.relative_to(SRC)} imports {name}"
        for path in sorted((SRC / "mcp").rglob("*.py"))
        for name in sorted(imports_of(path))
        if name.startswith("sbx.") and not any(name == p or name.startswith(p + ".") for p in MCP_MAY_IMPORT)
    ]
    assert wrong == []


def test_the_check_sees_a_wrong_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from sbx.node.manager import SandboxManager\nimport aiohttp.web\n", encoding="utf-8")
    assert {"sbx.node.manager", "aiohttp.web"} <= imports_of(module)
