"""The machine-readable API description (OpenAPI 3.1), generated from the endpoint catalogue and the wire types.

``docs/openapi.yaml`` is this document; both servers answer it as JSON at ``GET /openapi.json`` (outside ``/v1``,
so it is no API addition). Regenerate the file after changing a wire type or an endpoint::

    python -m sbx.api.openapi > docs/openapi.yaml

A test holds the file to the code, and both servers' routes to the catalogue.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import Any, Final

import msgspec

from sbx import __version__
from sbx.api import errors as e
from sbx.api.endpoints import ENDPOINTS, Endpoint, errors_of, wire_types

#: Where the document is served (both servers), outside ``/v1``.
PATH: Final = "/openapi.json"
_REF: Final = "#/components/schemas/{name}"

_INTRO = (
    "The sandbox service API v1, served by a node (sandboxd) and by a gateway (sandbox-gateway), as the "
    "specification sandbox-api-v1 states it. Every non-2xx answer has the Error body. Tags say "
    "which server serves an endpoint. Unknown request fields are 400. On a gateway every request but "
    "GET /v1/health needs `Authorization: Bearer sgk_...`, and `x-scopes` names the scopes a key needs."
)


def document() -> dict[str, Any]:
    """The whole OpenAPI document."""
    types = sorted(set(wire_types()) | {e.ErrorBody}, key=lambda t: t.__name__)
    refs, components = msgspec.json.schema_components(types, ref_template=_REF)
    ref_of = {t: ref for t, ref in zip(types, refs, strict=True)}
    paths: dict[str, dict[str, Any]] = {}
    for ep in ENDPOINTS:
        paths.setdefault(ep.path, {})[ep.method.lower()] = _operation(ep, ref_of)
    return {
        "openapi": "3.1.0",
        "info": {"title": "sbx sandbox service", "version": __version__, "description": _INTRO},
        "tags": [
            {"name": "node", "description": "served by sandboxd"},
            {"name": "gateway", "description": "served by sandbox-gateway"},
        ],
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "paths": dict(sorted(paths.items())),
    }


def _operation(ep: Endpoint, ref_of: dict[type[Any], dict[str, Any]]) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": f"{ep.method.lower()}{_camel(ep.path)}",
        "summary": ep.summary,
        "tags": sorted(ep.servers),
    }
    if ep.notes:
        op["description"] = ep.notes
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _placeholders(ep.path)
    ]
    for q in ep.query:
        schema: dict[str, Any] = {"type": "string"}
        if q.repeat:
            schema = {"type": "array", "items": {"type": "string"}}
        params.append({"name": q.name, "in": "query", "required": q.required, "description": q.description,
                       "schema": schema})  # fmt: skip
    if params:
        op["parameters"] = params
    if ep.body == "json":
        schema = ref_of[ep.request] if ep.request is not None else {"type": "object"}
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    elif ep.body == "raw":
        op["requestBody"] = {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    op["responses"] = {str(ep.status): _success(ep, ref_of), **_errors(ep, ref_of)}
    if ep.scope is None:
        op["security"] = []
    else:
        op["security"] = [{"bearer": []}]
        op["x-scopes"] = list(ep.scope)
    if ep.upgrade is not None:
        op["x-upgrade"] = ep.upgrade
    if ep.capability is not None:
        op["x-capability"] = ep.capability
    return op


def _success(ep: Endpoint, ref_of: dict[type[Any], dict[str, Any]]) -> dict[str, Any]:
    if ep.answers == "json":
        schema = ref_of[ep.answer] if ep.answer is not None else {"type": "object"}
        return {"description": ep.summary, "content": {"application/json": {"schema": schema}}}
    if ep.answers == "raw":
        return {"description": "raw bytes",
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}  # fmt: skip
    if ep.answers == "ndjson":
        return {"description": "one JSON object per line, flushed as produced",
                "content": {"application/x-ndjson": {"schema": {"type": "string"}}}}  # fmt: skip
    if ep.answers == "upgrade":
        return {"description": f"Switching Protocols to {ep.upgrade} (Connection: Upgrade)"}
    return {"description": "done"}


def _errors(ep: Endpoint, ref_of: dict[type[Any], dict[str, Any]]) -> dict[str, Any]:
    """One response per HTTP status, listing the codes that status may carry on either server."""
    codes: dict[int, set[str]] = {}
    for server in ep.servers:
        for cls in errors_of(ep, server):
            codes.setdefault(cls.status, set()).add(cls.code)
    out: dict[str, Any] = {}
    for status in sorted(codes):
        names = sorted(codes[status])
        out[str(status)] = {
            "description": "error: " + ", ".join(names),
            "content": {"application/json": {"schema": ref_of[e.ErrorBody]}},
            "x-codes": names,
        }
    return out


def _placeholders(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]


def _camel(path: str) -> str:
    words = [w.strip("{}") for w in path.replace("-", "/").split("/") if w and w != "v1"]
    return "".join(w[:1].upper() + w[1:] for w in words)


@functools.cache
def openapi_json() -> bytes:
    """The document as compact JSON (what the servers answer), built once."""
    return json.dumps(document(), separators=(",", ":")).encode()


def main() -> None:
    """Print the document as YAML (needs PyYAML, a test dependency): ``docs/openapi.yaml``."""
    import yaml  # only for writing the file

    sys.stdout.write("# Generated by `python -m sbx.api.openapi` from sbx.api: do not edit by hand.\n")
    sys.stdout.write(yaml.safe_dump(document(), sort_keys=False, width=110, allow_unicode=True))


if __name__ == "__main__":
    main()
