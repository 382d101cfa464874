"""The Python SDK of the sandbox service: async first, with a blocking twin in ``sbx.client.sync``.

    async with AsyncClient() as client:          # SANDBOX_URL / SANDBOX_TOKEN, else /run/sandboxd.sock
        sandbox = await client.sandboxes.create(image="python:3.12")
        result = await sandbox.run(["python3", "-c", "print(1)"])
        print(result.stdout.decode())
        await sandbox.delete()

Errors are the service's own (``sbx.api.errors``), re-exported here. See docs/sdk.md.
"""

from sbx.api.errors import (
    BadGateway,
    Conflict,
    ForbiddenOrigin,
    GatewayTimeout,
    Internal,
    InvalidRequest,
    NotFound,
    NotServed,
    PayloadTooLarge,
    Refused,
    SandboxError,
    Unauthorized,
    Unavailable,
    Unsupported,
)
from sbx.api.frames import Frame
from sbx.client._client import AsyncClient
from sbx.client._endpoint import DEFAULT_SOCKET, Endpoint, resolve_endpoint
from sbx.client._images import Images
from sbx.client._models import DirEntry, EventList, OutputEvent, RunResult
from sbx.client._ports import Ports
from sbx.client._process import Process
from sbx.client._sandbox import Files, Sandbox, Sandboxes
from sbx.client._storage import Snapshots, Volumes
from sbx.client._streams import Attachment, Tunnel
from sbx.client._workloads import Jobs, Secrets, Services

__all__ = [
    "DEFAULT_SOCKET",
    "AsyncClient",
    "Attachment",
    "BadGateway",
    "Conflict",
    "DirEntry",
    "Endpoint",
    "EventList",
    "Files",
    "ForbiddenOrigin",
    "Frame",
    "GatewayTimeout",
    "Images",
    "Internal",
    "InvalidRequest",
    "Jobs",
    "NotFound",
    "NotServed",
    "OutputEvent",
    "PayloadTooLarge",
    "Ports",
    "Process",
    "Refused",
    "RunResult",
    "Sandbox",
    "SandboxError",
    "Sandboxes",
    "Secrets",
    "Services",
    "Snapshots",
    "Tunnel",
    "Unauthorized",
    "Unavailable",
    "Unsupported",
    "Volumes",
    "resolve_endpoint",
]
