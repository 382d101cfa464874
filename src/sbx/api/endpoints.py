"""Every endpoint of the API, once: method, path, body and answer types, the errors it may answer, the scope a
gateway key needs, which servers serve it (spec: Endpoints, Authentication, Errors).

This catalogue is the contract the servers bind their handlers to (``sbx.node.routes``, ``sbx.gateway.routes``)
and the source of the machine-readable description (``sbx.api.openapi``, ``docs/openapi.yaml``). A server
serves exactly the endpoints marked for it; a test holds both to that.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from sbx.api import errors as e
from sbx.api.events import AuditEntries, EventList
from sbx.api.files import DirListing
from sbx.api.gateway import (
    DrainRequest,
    DrainResult,
    GatewayNode,
    Health,
    KeyCreated,
    KeyCreateRequest,
    KeyList,
    LostList,
    NodeAddRequest,
    NodeList,
    QuotaList,
    QuotaRequest,
    Readiness,
    TenantQuota,
    Whoami,
)
from sbx.api.images import Image, ImageList, ImageRemoved, ImageRequest
from sbx.api.jobs import AgentList, AgentRunRequest, Job, JobList, JobSpec, RunOutput
from sbx.api.metrics import SandboxMetrics
from sbx.api.node import Capabilities, CordonRequest, NodeStatus
from sbx.api.orgs import (
    AdminOrgList,
    Member,
    MemberList,
    MemberRequest,
    OrgCreated,
    OrgCreateRequest,
    OwnOrgList,
)
from sbx.api.ports import ListeningPorts
from sbx.api.processes import Process, ProcessList, ProcessRequest, RunRequest, RunResult, SignalRequest
from sbx.api.sandboxes import CreateRequest, PatchRequest, Sandbox, SandboxList
from sbx.api.services import ScaleRequest, SecretList, SecretRequest, Service, ServiceList, ServiceSpec
from sbx.api.snapshots import ScheduleRequest, Snapshot, SnapshotList, SnapshotRequest
from sbx.api.ssh import SshAccess, SshAccessRequest, SshInfo, SshKey, SshKeyList, SshKeyRequest
from sbx.api.volumes import Volume, VolumeCreateRequest, VolumeList

Server = Literal["node", "gateway"]
#: How a request's body is sent: none, a JSON object, or raw bytes (a file, process stdin).
BodyKind = Literal["none", "json", "raw"]
#: How a 2xx answer comes: a JSON object, nothing (204), raw bytes, an ndjson stream, or an upgraded stream.
AnswerKind = Literal["json", "empty", "raw", "ndjson", "upgrade"]

NODE: Final[frozenset[Server]] = frozenset({"node"})
GATEWAY: Final[frozenset[Server]] = frozenset({"gateway"})
BOTH: Final[frozenset[Server]] = frozenset({"node", "gateway"})

READ, CREATE, DELETE, SSH = "sandbox:read", "sandbox:create", "sandbox:delete", "sandbox:ssh"


@dataclass(frozen=True)
class Query:
    """A query parameter: ``repeat`` when it may be given more than once."""

    name: str
    description: str
    required: bool = False
    repeat: bool = False


@dataclass(frozen=True)
class Endpoint:
    """One endpoint. ``path`` uses ``{name}`` placeholders (also the metric and audit label). ``scope``: what
    a gateway key needs (all of them); ``()`` any valid key; None no credential at all. ``errors``: the error
    classes it may answer besides those every request may (401, 403 ``forbidden_origin``, 413, 500, and on a
    gateway 403 ``refused`` for a missing scope). ``upgrade``: the protocol of an upgrading endpoint."""

    method: str
    path: str
    summary: str
    servers: frozenset[Server]
    scope: tuple[str, ...] | None
    status: int = 200
    body: BodyKind = "none"
    request: type[Any] | None = None
    answers: AnswerKind = "json"
    answer: type[Any] | None = None
    errors: frozenset[type[e.SandboxError]] = frozenset()
    query: tuple[Query, ...] = ()
    upgrade: str | None = None
    capability: str | None = None
    notes: str = ""
    #: Answers the gateway gives instead (e.g. 501 for images), when it differs from the node's.
    gateway_errors: frozenset[type[e.SandboxError]] = field(default=frozenset())

    @property
    def key(self) -> tuple[str, str]:
        """``(method, path)``, as routers name a route."""
        return self.method, self.path


def _errs(*classes: type[e.SandboxError]) -> frozenset[type[e.SandboxError]]:
    return frozenset(classes)


_REF = _errs(e.NotFound, e.Conflict, e.Unavailable, e.BadGateway)  # 409: a name matching several
_BODY = _errs(e.InvalidRequest)
_SBX = "/v1/sandboxes/{ref}"
_PROC = _SBX + "/processes/{pid}"
_PATH_Q = (Query("path", "absolute guest path", required=True),)
_TENANT_Q = (Query("tenant", "admin only: the tenant whose service it is (default: the one acted in)"),)

ENDPOINTS: Final[tuple[Endpoint, ...]] = (
    # -- server-wide ------------------------------------------------------------------------------
    Endpoint("GET", "/v1/capabilities", "What this server offers and its limits", BOTH, (), answer=Capabilities,
             errors=_errs(e.Unavailable)),
    Endpoint("GET", "/v1/node", "Node status", BOTH, (), answer=NodeStatus,
             gateway_errors=_errs(e.NotFound), notes="A gateway answers 404."),
    Endpoint("POST", "/v1/node/cordon", "Cordon or uncordon this node", BOTH, (), body="json",
             request=CordonRequest, answer=NodeStatus, errors=_BODY, gateway_errors=_errs(e.NotFound)),
    Endpoint("GET", "/v1/health", "Gateway health", GATEWAY, None, answer=Health),
    Endpoint("GET", "/v1/ready", "Whether this gateway replica can serve now (for load balancers)", GATEWAY, None,
             answer=Readiness, errors=_errs(e.Unavailable),
             notes="503 while its database is unreachable, its owner lock lost, its change notifications not "
                   "listened to, or it is stopping (--drain); checked at most once a second."),
    Endpoint("GET", "/openapi.json", "This description (OpenAPI 3.1), outside /v1: no API addition", BOTH, None,
             notes="A gateway serves it without a key; a node behind its request guard, as any request."),
    Endpoint("GET", "/v1/whoami", "The calling key", GATEWAY, (), answer=Whoami),
    # -- sandboxes ----------------------------------------------------------------------------------
    Endpoint("POST", "/v1/sandboxes", "Create a sandbox", BOTH, (CREATE,), status=201, body="json",
             request=CreateRequest, answer=Sandbox,
             errors=_errs(e.InvalidRequest, e.Refused, e.NotFound, e.Conflict, e.Unsupported, e.Unavailable,
                          e.BadGateway, e.Internal)),
    Endpoint("GET", "/v1/sandboxes", "List sandboxes, newest first", BOTH, (READ,), answer=SandboxList,
             errors=_BODY, query=(Query("label", "key=value; all must match", repeat=True),)),
    Endpoint("GET", _SBX, "One sandbox", BOTH, (READ,), answer=Sandbox, errors=_REF),
    Endpoint("PATCH", _SBX, "Change network, name, labels or idle timeout", BOTH, (CREATE,), body="json",
             request=PatchRequest, answer=Sandbox, errors=_REF | _errs(e.InvalidRequest, e.Refused)),
    Endpoint("DELETE", _SBX, "Terminate a sandbox (idempotent)", BOTH, (DELETE,), status=204, answers="empty",
             errors=_REF),
    # -- processes ----------------------------------------------------------------------------------
    Endpoint("POST", _SBX + "/run", "Run a command to completion", BOTH, (CREATE,), body="json",
             request=RunRequest, answer=RunResult, errors=_REF | _errs(e.InvalidRequest, e.Refused)),
    Endpoint("POST", _SBX + "/processes", "Start a background process", BOTH, (CREATE,), status=201,
             body="json", request=ProcessRequest, answer=Process,
             errors=_REF | _errs(e.InvalidRequest, e.Refused)),
    Endpoint("GET", _SBX + "/processes", "Processes, running and exited", BOTH, (READ,), answer=ProcessList,
             errors=_REF),
    Endpoint("GET", _PROC, "One process", BOTH, (READ,), answer=Process, errors=_REF | _BODY),
    Endpoint("GET", _PROC + "/output", "Output from the start, following until exit", BOTH, (READ,),
             answers="ndjson", errors=_REF | _BODY,
             notes="Lines {stream, data (base64)}, then {exit_code, truncated?}."),
    Endpoint("POST", _PROC + "/stdin", "Write to stdin", BOTH, (CREATE,), status=204, body="raw",
             answers="empty", errors=_REF | _BODY,
             query=(Query("close", "1 closes stdin after the bytes"),)),
    Endpoint("POST", _PROC + "/signal", "Send INT, TERM, KILL or HUP", BOTH, (CREATE,), status=204,
             body="json", request=SignalRequest, answers="empty", errors=_REF | _BODY),
    Endpoint("GET", _PROC + "/attach", "Attach (sbx-stream/1 frames)", BOTH, (CREATE,), status=101,
             answers="upgrade", upgrade="sbx-stream/1", errors=_REF | _BODY),
    # -- tunnel, files, events, metrics ----------------------------------------------------------------
    Endpoint("GET", _PROC + "/attach/websocket", "Attach over a WebSocket (the sbx-stream/1 frames)", BOTH,
             (CREATE,), status=101, answers="upgrade", upgrade="websocket", capability="websocket_attach",
             errors=_REF | _BODY,
             notes="An addition for browsers. Subprotocol sbx-stream.v1; each binary message holds one or more "
                   "whole sbx-stream/1 frames, both ways. The credential may be offered as a second subprotocol "
                   "bearer.<token> (and a gateway organisation as org.<name>); see docs/node-api.md."),
    Endpoint("GET", _SBX + "/tunnel", "TCP to 127.0.0.1:port in the guest (sbx-tunnel/1)", BOTH, (CREATE,),
             status=101, answers="upgrade", upgrade="sbx-tunnel/1", capability="tunnel",
             errors=_REF | _BODY, query=(Query("port", "1 to 65535", required=True),)),
    Endpoint("GET", _SBX + "/files", "Read a file", BOTH, (READ,), answers="raw", query=_PATH_Q,
             errors=_REF | _errs(e.InvalidRequest, e.Refused)),
    Endpoint("PUT", _SBX + "/files", "Write a file (parents made)", BOTH, (CREATE,), status=204, body="raw",
             answers="empty", query=_PATH_Q, errors=_REF | _errs(e.InvalidRequest, e.Refused)),
    Endpoint("DELETE", _SBX + "/files", "Remove a file or empty directory", BOTH, (CREATE,), status=204,
             answers="empty", query=_PATH_Q, errors=_REF | _errs(e.InvalidRequest, e.Refused)),
    Endpoint("GET", _SBX + "/dirs", "List a directory", BOTH, (READ,), answer=DirListing, query=_PATH_Q,
             errors=_REF | _errs(e.InvalidRequest, e.Refused)),
    Endpoint("GET", _SBX + "/events", "Audit events, oldest first", BOTH, (READ,), answer=EventList,
             capability="audit", errors=_REF | _errs(e.Unsupported)),
    Endpoint("GET", _SBX + "/metrics", "The last hour of host-side samples", BOTH, (READ,),
             answer=SandboxMetrics, capability="metrics", errors=_REF | _errs(e.Unsupported)),
    # -- ports (an addition: listening_ports on a node; docs/ports.md) ------------------------------------
    Endpoint("GET", _SBX + "/listening", "TCP ports the guest listens on", NODE, (READ,), answer=ListeningPorts,
             capability="listening_ports", errors=_REF,
             notes="Never wakes a sandbox: a suspended or stopped one answers awake false and no ports."),
    # -- suspend, snapshots -------------------------------------------------------------------------
    Endpoint("POST", _SBX + "/suspend", "Suspend", BOTH, (CREATE,), answer=Sandbox, capability="suspend",
             errors=_REF | _errs(e.Unsupported, e.Internal)),
    Endpoint("POST", _SBX + "/resume", "Resume", BOTH, (CREATE,), answer=Sandbox, capability="suspend",
             errors=_REF | _errs(e.Unsupported, e.Internal),
             notes="A stopped persistent sandbox is started from its disk (new processes, every file kept). 503 "
                   "when the node no longer has room for its cpus and memory (it stays as it was)."),
    Endpoint("POST", _SBX + "/stop", "Stop a persistent sandbox: disk kept, memory freed", BOTH, (CREATE,),
             answer=Sandbox, capability="persistent", errors=_REF | _errs(e.Unsupported, e.Internal),
             notes="Persistent sandboxes only (409 otherwise). Ends its processes and frees its memory, keeping "
                   "disk, volumes, name, labels and network; state stopped. Idempotent: a stopped one answers "
                   "200 as it is. Resume, or any request that needs the guest, starts it again."),
    Endpoint("POST", _SBX + "/snapshots", "Take a memory or disk snapshot", BOTH, (CREATE,), status=201,
             body="json", request=SnapshotRequest, answer=Snapshot, capability="memory_snapshot",
             errors=_REF | _errs(e.InvalidRequest, e.Unsupported, e.Internal),
             notes="An empty body is {}: a memory snapshot. A suspended sandbox gives a disk snapshot (a memory "
                   "one is 409: resume it first). 409 too for a memory snapshot of a sandbox another runsc started "
                   "(docs/backends.md, upgrading the runtime)."),
    Endpoint("PUT", _SBX + "/snapshot-schedule", "Set or stop the snapshot schedule", BOTH, (CREATE,),
             body="json", request=ScheduleRequest, answer=Sandbox, errors=_REF | _errs(e.InvalidRequest, e.Unsupported)),
    Endpoint("GET", "/v1/snapshots", "Snapshots, newest first", BOTH, (READ,), answer=SnapshotList,
             errors=_errs(e.Unsupported)),
    Endpoint("DELETE", "/v1/snapshots/{id}", "Delete a snapshot", BOTH, (DELETE,), status=204, answers="empty",
             errors=_errs(e.NotFound, e.Unsupported, e.Unavailable, e.BadGateway)),
    # -- volumes ------------------------------------------------------------------------------------
    Endpoint("POST", "/v1/volumes", "Create an empty volume", BOTH, (CREATE,), status=201, body="json",
             request=VolumeCreateRequest, answer=Volume,
             errors=_errs(e.InvalidRequest, e.Conflict, e.Unavailable, e.Internal)),
    Endpoint("GET", "/v1/volumes", "Volumes", BOTH, (READ,), answer=VolumeList),
    Endpoint("DELETE", "/v1/volumes/{name}", "Delete a volume and its contents", BOTH, (DELETE,), status=204,
             answers="empty", errors=_errs(e.NotFound, e.Conflict, e.Unavailable, e.BadGateway)),
    # -- images ---------------------------------------------------------------------------------------
    Endpoint("GET", "/v1/images", "Images, by name", BOTH, (), answer=ImageList, capability="images",
             gateway_errors=_errs(e.Unsupported)),
    Endpoint("POST", "/v1/images", "Install an image in the background", BOTH, (), status=202, body="json",
             request=ImageRequest, answer=Image, capability="images",
             errors=_errs(e.InvalidRequest, e.Refused, e.NotFound, e.Conflict),
             gateway_errors=_errs(e.Unsupported)),
    Endpoint("DELETE", "/v1/images", "Remove an image", BOTH, (), answer=ImageRemoved, capability="images",
             query=(Query("image", "the reference", required=True),),
             errors=_errs(e.InvalidRequest, e.NotFound, e.Conflict), gateway_errors=_errs(e.Unsupported)),
    # -- gateway: SSH -------------------------------------------------------------------------------
    Endpoint("GET", "/v1/ssh", "Where the gateway's SSH server listens", GATEWAY, (), answer=SshInfo,
             errors=_errs(e.NotServed)),
    Endpoint("POST", "/v1/ssh-keys", "Register an SSH key", GATEWAY, (SSH,), status=201, body="json",
             request=SshKeyRequest, answer=SshKey, errors=_errs(e.InvalidRequest, e.Conflict, e.NotFound, e.NotServed)),
    Endpoint("GET", "/v1/ssh-keys", "The caller's SSH keys", GATEWAY, (SSH,), answer=SshKeyList,
             errors=_errs(e.NotServed)),
    Endpoint("DELETE", "/v1/ssh-keys/{id}", "Remove an SSH key", GATEWAY, (SSH,), status=204, answers="empty",
             errors=_errs(e.NotFound, e.NotServed)),
    Endpoint("POST", _SBX + "/ssh-access", "A short-lived SSH login", GATEWAY, (SSH,), status=201, body="json",
             request=SshAccessRequest, answer=SshAccess,
             errors=_errs(e.InvalidRequest, e.NotFound, e.Conflict, e.NotServed)),
    Endpoint("GET", "/v1/admin/ssh-keys", "A user's SSH keys", GATEWAY, ("admin",), answer=SshKeyList,
             query=(Query("user", "the user", required=True),), errors=_errs(e.InvalidRequest, e.NotServed)),
    Endpoint("DELETE", "/v1/admin/ssh-keys/{id}", "Remove any SSH key", GATEWAY, ("admin",), status=204,
             answers="empty", errors=_errs(e.NotFound, e.NotServed)),
    # -- gateway: services, jobs, secrets -----------------------------------------------------------------
    Endpoint("POST", "/v1/services", "Create a service", GATEWAY, (CREATE,), status=201, body="json",
             request=ServiceSpec, answer=Service,
             errors=_errs(e.InvalidRequest, e.Refused, e.Conflict, e.Unsupported)),
    Endpoint("GET", "/v1/services", "Services: the caller's own (admin: every one)", GATEWAY, (READ,),
             answer=ServiceList),
    Endpoint("GET", "/v1/services/{name}", "One service", GATEWAY, (READ,), answer=Service,
             errors=_errs(e.NotFound), query=_TENANT_Q),
    Endpoint("PUT", "/v1/services/{name}", "Change a service (a rollout when its replicas change)", GATEWAY,
             (CREATE,), body="json", request=ServiceSpec, answer=Service, query=_TENANT_Q,
             errors=_errs(e.InvalidRequest, e.Refused, e.NotFound, e.Unsupported)),
    Endpoint("POST", "/v1/services/{name}/scale", "Scale a service", GATEWAY, (CREATE,), body="json",
             request=ScaleRequest, answer=Service, query=_TENANT_Q, errors=_errs(e.InvalidRequest, e.NotFound)),
    Endpoint("DELETE", "/v1/services/{name}", "Delete a service and its replicas", GATEWAY, (CREATE, DELETE),
             status=204, answers="empty", query=_TENANT_Q, errors=_errs(e.NotFound)),
    Endpoint("POST", "/v1/jobs", "Start a job", GATEWAY, (CREATE,), status=201, body="json", request=JobSpec,
             answer=Job, errors=_errs(e.InvalidRequest, e.Refused, e.Unsupported)),
    Endpoint("GET", "/v1/jobs", "Jobs: the caller's own (admin: every one), newest first, without runs",
             GATEWAY, (READ,), answer=JobList),
    Endpoint("GET", "/v1/jobs/{id}", "One job", GATEWAY, (READ,), answer=Job, errors=_errs(e.NotFound)),
    Endpoint("DELETE", "/v1/jobs/{id}", "Cancel a job; answers once its runs have stopped", GATEWAY, (CREATE,),
             answer=Job, errors=_errs(e.NotFound)),
    Endpoint("GET", "/v1/jobs/{id}/runs/{n}/output", "A finished run's kept output", GATEWAY, (READ,),
             answer=RunOutput, errors=_errs(e.NotFound)),
    Endpoint("GET", "/v1/jobs/{id}/runs/{n}/files", "A file kept from a finished run", GATEWAY, (READ,),
             answers="raw", query=(Query("path", "a path of the job's keep.files", required=True),),
             errors=_errs(e.NotFound)),
    Endpoint("POST", "/v1/agent-runs", "Start an agent run (a job of one run)", GATEWAY, (CREATE,), status=201,
             body="json", request=AgentRunRequest, answer=Job,
             errors=_errs(e.InvalidRequest, e.Refused, e.Unsupported)),
    Endpoint("GET", "/v1/agents", "The agents this gateway defines (its --agents-file; an addition)", GATEWAY,
             (READ,), answer=AgentList),
    Endpoint("PUT", "/v1/secrets/{name}", "Set a tenant secret", GATEWAY, ("secrets:write",), status=204,
             body="json", request=SecretRequest, answers="empty", errors=_errs(e.InvalidRequest, e.Unsupported)),
    Endpoint("GET", "/v1/secrets", "The tenant's secrets (names only)", GATEWAY, (READ,), answer=SecretList,
             errors=_errs(e.Unsupported)),
    Endpoint("DELETE", "/v1/secrets/{name}", "Delete a tenant secret", GATEWAY, ("secrets:write",), status=204,
             answers="empty", errors=_errs(e.NotFound, e.Unsupported)),
    # -- gateway: organisations ---------------------------------------------------------------------------
    Endpoint("GET", "/v1/orgs", "The key's tenant and its user's organisations", GATEWAY, (), answer=OwnOrgList),
    Endpoint("POST", "/v1/orgs", "Create an organisation", GATEWAY, ("org:create",), status=201, body="json",
             request=OrgCreateRequest, answer=OrgCreated, errors=_errs(e.InvalidRequest, e.Conflict, e.Refused)),
    Endpoint("GET", "/v1/orgs/{name}/members", "Members", GATEWAY, (), answer=MemberList, errors=_errs(e.NotFound)),
    Endpoint("POST", "/v1/orgs/{name}/members", "Add a member or change a role", GATEWAY, (), status=201,
             body="json", request=MemberRequest, answer=Member,
             errors=_errs(e.InvalidRequest, e.NotFound, e.Refused, e.Conflict), notes="200 for a role change."),
    Endpoint("DELETE", "/v1/orgs/{name}/members/{user}", "Remove a member", GATEWAY, (), status=204,
             answers="empty", query=(Query("tenant", "the member's tenant"),),
             errors=_errs(e.NotFound, e.Refused, e.Conflict)),
    # -- gateway: admin ---------------------------------------------------------------------------------
    Endpoint("POST", "/v1/admin/keys", "Issue an API key", GATEWAY, ("admin",), status=201, body="json",
             request=KeyCreateRequest, answer=KeyCreated, errors=_BODY),
    Endpoint("GET", "/v1/admin/keys", "API keys, never a secret", GATEWAY, ("admin",), answer=KeyList),
    Endpoint("DELETE", "/v1/admin/keys/{id}", "Revoke a key (its open requests end first)", GATEWAY, ("admin",),
             status=204, answers="empty", errors=_errs(e.NotFound)),
    Endpoint("GET", "/v1/admin/nodes", "Nodes", GATEWAY, ("admin",), answer=NodeList),
    Endpoint("POST", "/v1/admin/nodes", "Add a node", GATEWAY, ("admin",), status=201, body="json",
             request=NodeAddRequest, answer=GatewayNode, errors=_errs(e.InvalidRequest, e.Refused, e.Conflict)),
    Endpoint("DELETE", "/v1/admin/nodes/{name}", "Remove a node", GATEWAY, ("admin",), status=204,
             answers="empty", errors=_errs(e.NotFound, e.Conflict)),
    Endpoint("POST", "/v1/admin/nodes/{name}/cordon", "Cordon or uncordon a node", GATEWAY, ("admin",),
             body="json", request=CordonRequest, answer=GatewayNode,
             errors=_errs(e.InvalidRequest, e.NotFound, e.BadGateway)),
    Endpoint("POST", "/v1/admin/nodes/{name}/drain", "Drain a node", GATEWAY, ("admin",), body="json",
             request=DrainRequest, answer=DrainResult, errors=_errs(e.InvalidRequest, e.NotFound, e.Unavailable)),
    Endpoint("GET", "/v1/admin/lost", "Sandboxes on lost nodes", GATEWAY, ("admin",), answer=LostList),
    Endpoint("GET", "/v1/admin/audit", "The gateway's audit log, oldest first", GATEWAY, ("admin",),
             answer=AuditEntries, errors=_errs(e.InvalidRequest, e.Unsupported),
             query=(Query("since", "RFC 3339 time"), Query("limit", "1 to 1000, default 100"))),
    Endpoint("GET", "/v1/admin/orgs", "Every organisation", GATEWAY, ("admin",), answer=AdminOrgList),
    Endpoint("GET", "/v1/admin/quotas", "Tenant quotas and usage", GATEWAY, ("admin",), answer=QuotaList,
             notes="An addition: the spec names no quota endpoint."),
    Endpoint("PUT", "/v1/admin/quotas/{tenant}", "Set a tenant's quota", GATEWAY, ("admin",), body="json",
             request=QuotaRequest, answer=TenantQuota, errors=_BODY,
             notes="An addition. All amounts null removes the quota; 'default' names the default tenant."),
)  # fmt: skip

#: Errors any request may answer (the request guard, authentication, body caps, a bug).
COMMON_ERRORS: Final = _errs(e.Unauthorized, e.ForbiddenOrigin, e.PayloadTooLarge, e.Internal)
#: What a gateway may answer any request besides (a missing scope; a malformed X-Sandbox-Org; a
#: non-member organisation).
GATEWAY_COMMON_ERRORS: Final = _errs(e.Refused, e.InvalidRequest, e.NotFound)


def served_by(server: Server) -> tuple[Endpoint, ...]:
    """The endpoints ``server`` answers."""
    return tuple(ep for ep in ENDPOINTS if server in ep.servers)


def find(method: str, path: str) -> Endpoint:
    """The endpoint with this method and path pattern; ``KeyError`` when the catalogue has none."""
    for ep in ENDPOINTS:
        if ep.key == (method, path):
            return ep
    raise KeyError(f"{method} {path} is not an endpoint of the API")


def errors_of(ep: Endpoint, server: Server) -> frozenset[type[e.SandboxError]]:
    """Every error class ``ep`` may answer on ``server``."""
    found = set(COMMON_ERRORS) | set(ep.errors)
    if server == "gateway":
        found |= GATEWAY_COMMON_ERRORS | ep.gateway_errors
        if ep.scope is None:
            found.discard(e.Unauthorized)
    return frozenset(found)


def wire_types() -> Iterable[type[Any]]:
    """Every request and answer type the catalogue names."""
    for ep in ENDPOINTS:
        if ep.request is not None:
            yield ep.request
        if ep.answer is not None:
            yield ep.answer
