"""The Python SDK of the sandbox service (async; a sync wrapper and typed models come later).

    async with AsyncClient() as client:          # SANDBOX_URL / SANDBOX_TOKEN, else /run/sandboxd.sock
        sandbox = await client.create(image="python:3.12")
        result = await client.run(sandbox["id"], ["python3", "-c", "print(1)"])
        print(result.stdout.decode())
        await client.delete(sandbox["id"])

Errors are the service's own (``sbx.api.errors``), re-exported here.
"""

from sbx.api.errors import (
    BadGateway,
    Conflict,
    ForbiddenOrigin,
    Internal,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    Refused,
    SandboxError,
    Unauthorized,
    Unavailable,
    Unsupported,
)
from sbx.client._client import AsyncClient, RunResult
from sbx.client._transport import DEFAULT_SOCKET, Endpoint, resolve_endpoint

__all__ = [
    "DEFAULT_SOCKET",
    "AsyncClient",
    "BadGateway",
    "Conflict",
    "Endpoint",
    "ForbiddenOrigin",
    "Internal",
    "InvalidRequest",
    "NotFound",
    "PayloadTooLarge",
    "Refused",
    "RunResult",
    "SandboxError",
    "Unauthorized",
    "Unavailable",
    "Unsupported",
    "resolve_endpoint",
]
