"""The gateway's one route table: for every endpoint it serves, the handler and the relay policy. The scope a
key needs and the route's label (for metrics and the audit log) come from the endpoint in the API's catalogue
(``sbx.api.endpoints``). Authentication, relaying, the audit log and the metrics all read this table; a request
no row matches is answered 404 after authentication, never served.

Relay policies: ``local`` (the gateway answers), ``none`` (passed to the sandbox's node without a body),
``json`` (a JSON body of at most 1 MiB passed on as sent), ``raw`` (a body streamed, at most 64 MiB). An
endpoint the catalogue marks as upgrading (attach, tunnel) is switched on both sides when the client asks.
Answers are passed on as the node sent them, streams chunk by chunk. A call that needs the guest
(``persistent.WAKING_ROUTES``) first wakes a persistent sandbox asleep, once its tenant's quota has room.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from aiohttp import web

from sbx.api.endpoints import Endpoint, find, served_by
from sbx.gateway.orgs import OrgRoutes
from sbx.gateway.persistent import WAKING_ROUTES
from sbx.gateway.routes.admin import AdminRoutes
from sbx.gateway.routes.jobs import JobRoutes
from sbx.gateway.routes.meta import MetaRoutes
from sbx.gateway.routes.ports import PortRoutes
from sbx.gateway.routes.sandboxes import SandboxRoutes
from sbx.gateway.routes.secrets import SecretRoutes
from sbx.gateway.routes.services import ServiceRoutes
from sbx.gateway.routes.snapshots import SnapshotRoutes
from sbx.gateway.routes.ssh import SshRoutes
from sbx.gateway.routes.volumes import VolumeRoutes

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
RelayPolicy = Literal["local", "none", "json", "raw"]


@dataclass(frozen=True)
class Route:
    """One row: an endpoint, its handler and how its request reaches a node."""

    endpoint: Endpoint
    handler: Handler
    relay: RelayPolicy = "local"

    @property
    def scope(self) -> tuple[str, ...] | None:
        """What a key needs (all of them); ``()`` any valid key; None no credential."""
        return self.endpoint.scope

    @property
    def label(self) -> str:
        """The metric and audit label: the path pattern."""
        return self.endpoint.path


#: Where the application keeps its table, by aiohttp route.
TABLE_KEY: web.AppKey[dict[web.AbstractRoute, Route]] = web.AppKey("routes", dict)


def table(gw: Gateway) -> list[Route]:
    """Every route the gateway serves."""
    meta, sbx, vol, snap = MetaRoutes(gw), SandboxRoutes(gw), VolumeRoutes(gw), SnapshotRoutes(gw)
    admin, ssh = AdminRoutes(gw), SshRoutes(gw)
    orgs = OrgRoutes(gw.store, writes=gw, locks=gw, audit=gw, access=gw,
                     holders=(gw.secrets, gw.services, gw.jobs), limits=gw.options)  # fmt: skip
    svc, jobs, secrets = ServiceRoutes(gw), JobRoutes(gw), SecretRoutes(gw)
    ports = PortRoutes(gw, gw.ports) if gw.ports is not None else None
    rows: list[tuple[str, str, Handler | RelayPolicy]] = [
        ("GET", "/openapi.json", meta.openapi),
        ("GET", "/v1/health", meta.health),
        ("GET", "/v1/ready", meta.ready),
        ("GET", "/v1/whoami", meta.whoami),
        ("GET", "/v1/capabilities", meta.capabilities),
        ("GET", "/v1/node", meta.not_node),
        ("POST", "/v1/node/cordon", meta.not_node),
        ("GET", "/v1/images", meta.no_images),
        ("POST", "/v1/images", meta.no_images),
        ("DELETE", "/v1/images", meta.no_images),
        # Sandboxes: made, listed and ended by the service; every call on one relayed to its node.
        ("POST", "/v1/sandboxes", sbx.create),
        ("GET", "/v1/sandboxes", sbx.list),
        ("GET", "/v1/sandboxes/{ref}", "none"),
        ("PATCH", "/v1/sandboxes/{ref}", sbx.patch),
        ("DELETE", "/v1/sandboxes/{ref}", "none"),
        ("POST", "/v1/sandboxes/{ref}/run", "json"),
        ("POST", "/v1/sandboxes/{ref}/processes", "json"),
        ("GET", "/v1/sandboxes/{ref}/processes", "none"),
        ("GET", "/v1/sandboxes/{ref}/processes/{pid}", "none"),
        ("GET", "/v1/sandboxes/{ref}/processes/{pid}/output", "none"),
        ("POST", "/v1/sandboxes/{ref}/processes/{pid}/stdin", "raw"),
        ("POST", "/v1/sandboxes/{ref}/processes/{pid}/signal", "json"),
        ("GET", "/v1/sandboxes/{ref}/processes/{pid}/attach", "none"),
        ("GET", "/v1/sandboxes/{ref}/processes/{pid}/attach/websocket", sbx.attach_websocket),
        ("GET", "/v1/sandboxes/{ref}/tunnel", "none"),
        ("GET", "/v1/sandboxes/{ref}/files", "none"),
        ("PUT", "/v1/sandboxes/{ref}/files", "raw"),
        ("DELETE", "/v1/sandboxes/{ref}/files", "none"),
        ("GET", "/v1/sandboxes/{ref}/dirs", "none"),
        # Exposed ports (docs/ports.md): 501 without --ports-domain.
        ("GET", "/v1/sandboxes/{ref}/ports", ports.list if ports else meta.no_ports),
        ("GET", "/v1/sandboxes/{ref}/ports/{port}", ports.get if ports else meta.no_ports),
        ("PUT", "/v1/sandboxes/{ref}/ports/{port}", ports.put if ports else meta.no_ports),
        ("POST", "/v1/sandboxes/{ref}/ports/{port}/tokens", ports.create_token if ports else meta.no_ports),
        ("GET", "/v1/sandboxes/{ref}/events", "none"),
        ("GET", "/v1/sandboxes/{ref}/metrics", "none"),
        ("POST", "/v1/sandboxes/{ref}/suspend", "json"),
        ("POST", "/v1/sandboxes/{ref}/resume", sbx.resume),
        ("POST", "/v1/sandboxes/{ref}/stop", "json"),
        ("POST", "/v1/sandboxes/{ref}/snapshots", "json"),
        ("PUT", "/v1/sandboxes/{ref}/snapshot-schedule", "json"),
        ("GET", "/v1/snapshots", snap.list),
        ("DELETE", "/v1/snapshots/{id}", snap.delete),
        ("POST", "/v1/volumes", vol.create),
        ("GET", "/v1/volumes", vol.list),
        ("DELETE", "/v1/volumes/{name}", vol.delete),
        # SSH (404 unsupported when the gateway serves none).
        ("GET", "/v1/ssh", ssh.info),
        ("POST", "/v1/ssh-keys", ssh.add_key),
        ("GET", "/v1/ssh-keys", ssh.list_keys),
        ("DELETE", "/v1/ssh-keys/{id}", ssh.delete_key),
        ("POST", "/v1/sandboxes/{ref}/ssh-access", ssh.access),
        ("GET", "/v1/admin/ssh-keys", ssh.admin_list),
        ("DELETE", "/v1/admin/ssh-keys/{id}", ssh.admin_delete),
        # Services, jobs, agent runs and secrets (their controllers: sbx.gateway.services, sbx.gateway.jobs).
        ("POST", "/v1/services", svc.create),
        ("GET", "/v1/services", svc.list),
        ("GET", "/v1/services/{name}", svc.get),
        ("PUT", "/v1/services/{name}", svc.put),
        ("POST", "/v1/services/{name}/scale", svc.scale),
        ("DELETE", "/v1/services/{name}", svc.delete),
        ("POST", "/v1/jobs", jobs.create),
        ("GET", "/v1/jobs", jobs.list),
        ("GET", "/v1/jobs/{id}", jobs.get),
        ("DELETE", "/v1/jobs/{id}", jobs.delete),
        ("GET", "/v1/jobs/{id}/runs/{n}/output", jobs.output),
        ("GET", "/v1/jobs/{id}/runs/{n}/files", jobs.file),
        ("POST", "/v1/agent-runs", jobs.agent_run),
        ("GET", "/v1/agents", jobs.agents),
        ("PUT", "/v1/secrets/{name}", secrets.put),
        ("GET", "/v1/secrets", secrets.list),
        ("DELETE", "/v1/secrets/{name}", secrets.delete),
        # Organisations and admin.
        ("GET", "/v1/orgs", orgs.list),
        ("POST", "/v1/orgs", orgs.create),
        ("GET", "/v1/orgs/{name}/members", orgs.list_members),
        ("POST", "/v1/orgs/{name}/members", orgs.put_member),
        ("DELETE", "/v1/orgs/{name}/members/{user}", orgs.remove_member),
        ("POST", "/v1/admin/keys", admin.create_key),
        ("GET", "/v1/admin/keys", admin.list_keys),
        ("DELETE", "/v1/admin/keys/{id}", admin.delete_key),
        ("GET", "/v1/admin/nodes", admin.list_nodes),
        ("POST", "/v1/admin/nodes", admin.add_node),
        ("DELETE", "/v1/admin/nodes/{name}", admin.remove_node),
        ("POST", "/v1/admin/nodes/{name}/cordon", admin.cordon),
        ("POST", "/v1/admin/nodes/{name}/drain", admin.drain),
        ("GET", "/v1/admin/lost", admin.lost),
        ("GET", "/v1/admin/audit", admin.read_audit),
        ("GET", "/v1/admin/orgs", orgs.admin_list),
        ("GET", "/v1/admin/quotas", admin.list_quotas),
        ("PUT", "/v1/admin/quotas/{tenant}", admin.set_quota),
    ]
    #: What a relayed call teaches the records once its node said yes.
    after = {
        ("DELETE", "/v1/sandboxes/{ref}"): sbx.deleted,
        ("POST", "/v1/sandboxes/{ref}/snapshots"): sbx.snapshot_taken,
        # Whether a persistent sandbox is asleep, as its node says (sbx.gateway.persistent).
        ("GET", "/v1/sandboxes/{ref}"): sbx.learnt,
        ("POST", "/v1/sandboxes/{ref}/suspend"): sbx.learnt,
        ("POST", "/v1/sandboxes/{ref}/stop"): sbx.learnt,
    }
    routes = []
    for method, path, target in rows:
        endpoint = find(method, path)
        if isinstance(target, str):
            wakes = (method, path) in WAKING_ROUTES
            handler = sbx.relay(endpoint, target, after.get((method, path)), wakes)
            routes.append(Route(endpoint, handler, target))
        else:
            routes.append(Route(endpoint, target))
    return routes


def install(app: web.Application, gw: Gateway) -> list[Route]:
    """Register the table on ``app``; the middlewares find a request's row with :func:`route_of`."""
    routes = table(gw)
    served = {ep.key for ep in served_by("gateway")}
    listed = {r.endpoint.key for r in routes}
    if served != listed:  # the catalogue and the table must agree (a test checks this too)
        raise RuntimeError(f"gateway route table and API catalogue differ: {sorted(served ^ listed)}")
    by_route: dict[web.AbstractRoute, Route] = {}
    for row in routes:
        by_route[app.router.add_route(row.endpoint.method, row.endpoint.path, row.handler)] = row
    app[TABLE_KEY] = by_route
    return routes


def route_of(request: web.Request) -> Route | None:
    """The row the request matched; None when no row does (an unknown path, or a known one with another
    method)."""
    return request.app[TABLE_KEY].get(request.match_info.route)
