"""The API description: docs/openapi.yaml is exactly what the code generates, every route both servers serve is
in it (and nothing else), every wire type's fields and every error code are described."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import msgspec
import pytest
import yaml
from aiohttp import web

from sbx.api.endpoints import ENDPOINTS, served_by, wire_types
from sbx.api.errors import ALL_ERRORS
from sbx.api.openapi import document
from sbx.gateway.routes import table
from sbx.node.routes import all_routes

DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"


@functools.cache
def committed() -> Any:
    return yaml.load(DOC_PATH.read_text(encoding="utf-8"), Loader=yaml.CSafeLoader)


def test_the_committed_file_is_what_the_code_generates() -> None:
    generated = json.loads(json.dumps(document()))  # as JSON holds it (tuples are arrays)
    assert committed() == generated, (
        "docs/openapi.yaml is stale: run `python -m sbx.api.openapi > docs/openapi.yaml`"
    )


def _described() -> set[tuple[str, str]]:
    paths = committed()["paths"]
    return {(method.upper(), path) for path, item in paths.items() for method in item}


def test_every_node_route_is_described() -> None:
    # all_routes itself refuses to build a route set that differs from the catalogue.
    routes = all_routes(MagicMock())
    served = {(r.method, r.path) for r in routes if isinstance(r, web.RouteDef)}
    assert served == {ep.key for ep in served_by("node")}
    assert served <= _described()


def test_every_gateway_route_is_described() -> None:
    served = {row.endpoint.key for row in table(MagicMock())}
    assert served == {ep.key for ep in served_by("gateway")}
    assert served <= _described()


def test_nothing_is_described_that_no_server_serves() -> None:
    assert _described() == {ep.key for ep in ENDPOINTS}


@pytest.mark.parametrize(
    "wire_type", sorted(set(wire_types()), key=lambda t: t.__name__), ids=lambda t: t.__name__
)
def test_every_field_of_every_wire_type_is_described(wire_type: type[msgspec.Struct]) -> None:
    schema = committed()["components"]["schemas"][wire_type.__name__]
    assert set(schema.get("properties", {})) == set(wire_type.__struct_encode_fields__)


def test_every_error_code_is_described() -> None:
    paths = committed()["paths"]
    described = {
        (int(status), code)
        for item in paths.values() for op in item.values()
        for status, answer in op["responses"].items() for code in answer.get("x-codes", ())
    }  # fmt: skip
    assert {(cls.status, cls.code) for cls in ALL_ERRORS} <= described
