"""Request bodies the gateway reads itself (admin, orgs, volumes): one JSON object, only known fields."""

from __future__ import annotations

import json
from typing import Any

from sbx.api.errors import InvalidRequest


def json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object (an empty body is ``{}``); 400 otherwise."""
    try:
        obj = json.loads(raw) if raw else {}
    except ValueError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidRequest("the body must be a JSON object")
    return obj


def only_fields(obj: dict[str, Any], allowed: tuple[str, ...]) -> None:
    """400 naming the first field not in ``allowed`` (unknown fields fail loudly, as on the node)."""
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise InvalidRequest(f"unknown field {unknown[0]!r}: accepted fields are {', '.join(allowed)}")
