"""The one error tree of the service, shared by the server, the SDK and the CLI.

Every non-2xx answer has the body ``{"error": {"code": <code>, "message": <message>}}``.
Each class maps to exactly one (HTTP status, code) pair of the spec's Errors table::

    SandboxError                      (base; never raised itself)
    ├── InvalidRequest     400 invalid_request   malformed, or a field out of range
    ├── Unauthorized       401 unauthorized      missing or wrong token or key
    ├── Refused            403 refused           well-formed but refused by policy
    ├── ForbiddenOrigin    403 forbidden_origin  the request guard refused Host or Origin
    ├── NotFound           404 not_found         no such sandbox, process, file or endpoint
    │   └── NotServed      404 unsupported       (gateway) an SSH endpoint of a gateway serving no SSH
    ├── Conflict           409 conflict          a name in use, or a sandbox in the wrong state
    ├── PayloadTooLarge    413 invalid_request   a body over its cap
    ├── Unsupported        501 unsupported       the endpoint lacks the capability
    ├── Unavailable        503 unavailable       a cordoned node takes no new sandboxes
    ├── BadGateway         502 internal          (gateway) the node did not answer
    │   └── GatewayTimeout 504 internal          (gateway) a service's replica did not begin its answer in time
    └── Internal           500 internal          a bug; the message is safe to show

Foreign exceptions are translated into these at the edges (HTTP server, SDK, backend), never ad hoc.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

import msgspec


class ErrorDetail(msgspec.Struct):
    """``code`` (one of this module's codes) and a message safe to show."""

    code: str
    message: str


class ErrorBody(msgspec.Struct):
    """The body of every non-2xx answer: ``{"error": {"code", "message"}}``."""

    error: ErrorDetail


class SandboxError(Exception):
    """Root of every error the service reports; carries the wire code and HTTP status."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_body(self) -> ErrorBody:
        """The wire body ``{"error": {"code", "message"}}``."""
        return ErrorBody(ErrorDetail(self.code, self.message))

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidRequest(SandboxError):
    """Malformed request, unknown field, or a field out of range (400)."""

    status = 400
    code = "invalid_request"


class Unauthorized(SandboxError):
    """Missing or wrong token (401)."""

    status = 401
    code = "unauthorized"


class Refused(SandboxError):
    """Well-formed but refused by policy; retrying will not help (403)."""

    status = 403
    code = "refused"


class ForbiddenOrigin(SandboxError):
    """The request guard refused the Host or Origin header (403)."""

    status = 403
    code = "forbidden_origin"


class NotFound(SandboxError):
    """No such sandbox, process, file or endpoint among this server's own (404)."""

    status = 404
    code = "not_found"


class NotServed(NotFound):
    """(gateway) The SSH endpoints of a gateway that serves no SSH (404 with code unsupported, as the spec says)."""

    code = "unsupported"


class Conflict(SandboxError):
    """A name in use, or a sandbox in the wrong state (409)."""

    status = 409
    code = "conflict"


class PayloadTooLarge(SandboxError):
    """A request body over its cap (413, code invalid_request)."""

    status = 413
    code = "invalid_request"


class Unsupported(SandboxError):
    """The endpoint lacks the capability the request needs (501)."""

    status = 501
    code = "unsupported"


class Unavailable(SandboxError):
    """The node takes no new sandboxes (cordoned) or cannot serve now (503)."""

    status = 503
    code = "unavailable"


class BadGateway(SandboxError):
    """(gateway) the node did not answer this request (502)."""

    status = 502
    code = "internal"


class GatewayTimeout(BadGateway):
    """(gateway) A service's replica did not begin its answer within the service's answer timeout (504; the
    spec has no code of its own for it: ``internal``, as the 502 of a node that did not answer)."""

    status = 504


class Internal(SandboxError):
    """A bug; the message is safe to show (500)."""

    status = 500
    code = "internal"


_BY_STATUS_AND_CODE: dict[tuple[int, str], type[SandboxError]] = {
    (cls.status, cls.code): cls
    for cls in (
        InvalidRequest,
        Unauthorized,
        Refused,
        ForbiddenOrigin,
        NotFound,
        NotServed,
        Conflict,
        PayloadTooLarge,
        Unsupported,
        Unavailable,
        BadGateway,
        GatewayTimeout,
        Internal,
    )
}


def error_from_wire(status: int, body: Any) -> SandboxError:
    """Rebuild the matching exception from an HTTP status and a decoded error body.

    Used by the SDK and CLI; an unrecognised pair becomes ``Internal`` with the status named.
    """
    code = "internal"
    message = f"HTTP {status}"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = str(body["error"].get("code", code))
        message = str(body["error"].get("message", message))
    cls = _BY_STATUS_AND_CODE.get((status, code))
    if cls is not None:
        return cls(message)
    by_code = [c for (s, c_code), c in _BY_STATUS_AND_CODE.items() if c_code == code]
    error = (by_code[0] if by_code else Internal)(message)
    # A pair this tree does not know (a proxy's, a newer server's) keeps its status and code: whoever passes
    # it on (a gateway) passes on what was sent.
    setattr(error, "status", status)  # noqa: B010 - the class's status is a ClassVar; this one differs
    setattr(error, "code", code)  # noqa: B010
    return error


def error_from_answer(status: int, body: bytes) -> SandboxError:
    """The ``SandboxError`` of a non-2xx answer from its raw body; a body that is not the error JSON (a
    proxy's HTML page) still gives an error naming the status."""
    try:
        decoded = json.loads(body) if body else None
    except ValueError:
        decoded = None
    return error_from_wire(status, decoded)


#: Errors answered only on a gateway's service traffic (``/svc/...`` and service host names), which is the
#: services' own HTTP, not an endpoint of the API.
TRAFFIC_ERRORS: tuple[type[SandboxError], ...] = (GatewayTimeout,)
#: Every error class an endpoint of the API may answer, for those that list them (the API description).
ALL_ERRORS: tuple[type[SandboxError], ...] = tuple(
    cls for cls in _BY_STATUS_AND_CODE.values() if cls not in TRAFFIC_ERRORS
)
