"""Labels through the gateway: the two the gateway stamps on every sandbox (owner, tenant) and what a client may
send on a create or a PATCH."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from msgspec import UNSET
from msgspec.structs import replace

from sbx.api.errors import Conflict, InvalidRequest
from sbx.api.sandboxes import PatchRequest
from sbx.api.validation import validate_labels
from sbx.gateway.auth import Principal
from sbx.gateway.state import SandboxRecord

#: Labels a client may give through the gateway (the node allows 32; the gateway stamps two of its own).
MAX_CLIENT_LABELS = 30
OWNER_LABEL = "gateway.owner"
TENANT_LABEL = "gateway.tenant"


def check_client_labels(labels: dict[str, str]) -> None:
    """``gateway.*`` labels are the gateway's (400); at most 30 labels through a gateway (400)."""
    for key in labels:
        if key.startswith("gateway."):
            raise InvalidRequest(
                f"label {key!r}: labels beginning gateway. are set by the gateway, not by clients"
            )
    if len(labels) > MAX_CLIENT_LABELS:
        raise InvalidRequest(
            f"labels: {len(labels)} labels given; at most {MAX_CLIENT_LABELS} through a gateway"
        )
    validate_labels(labels)


class SandboxNames(Protocol):
    """Whether a sandbox name is taken among a caller's live sandboxes (``sandboxes.Sandboxes``)."""

    def name_taken(self, principal: Principal, name: str, except_id: str | None = None) -> bool:
        """Whether another live sandbox of ``principal`` (on any node but a lost one) is named ``name``."""


def patch_request(
    names: SandboxNames,
    principal: Principal,
    rec: SandboxRecord,
    req: PatchRequest,
    stamped: Mapping[str, str] = {},
) -> PatchRequest:
    """A PATCH as the node gets it: ``gateway.*`` labels sent back unchanged are kept, others are 400; a new name
    must be free among the caller's sandboxes on every node. ``stamped``: the ``gateway.*`` labels the sandbox
    carries besides owner and tenant (a service's replica, a job's run), kept too."""
    if req.labels is not UNSET:
        ours = {**stamped, OWNER_LABEL: rec.user, **({TENANT_LABEL: rec.tenant} if rec.tenant else {})}
        client = {}
        for key, value in req.labels.items():
            if key.startswith("gateway."):
                if ours.get(key) != value:
                    raise InvalidRequest(
                        f"label {key!r}: gateway. labels are the gateway's; send them back unchanged or leave them out"
                    )
                continue
            client[key] = value
        check_client_labels(client)
        req = replace(req, labels={**client, **ours})
    if req.name and names.name_taken(principal, req.name, except_id=rec.id):
        raise Conflict(f"you already have a live sandbox named {req.name!r}: pick another name")
    return req
