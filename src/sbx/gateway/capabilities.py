"""The gateway's ``GET /v1/capabilities``: what every answering node offers."""

from __future__ import annotations

from sbx.api.network_policy import NetworkConfig, mode_rank
from sbx.api.node import WEBSOCKET_ATTACH, Capabilities, Limits
from sbx.api.ports import EXPOSED_PORTS


def intersect_capabilities(caps: list[Capabilities], exposed_ports: bool = False) -> Capabilities:
    """What every answering node offers: a flag only if all have it, the smallest limits, the strictest
    network ceiling and default, the ``may_allow`` patterns all share. Images are never offered; the WebSocket
    form of attach always is (the gateway serves it itself, over each node's plain attach); ``exposed_ports``
    is the gateway's own (``--ports-domain``), never a node's."""
    flags: dict[str, bool] = {}
    for name in set().union(*(c.capabilities.keys() for c in caps)):
        flags[name] = all(c.capabilities.get(name, False) for c in caps)
    flags["images"] = False
    flags[WEBSOCKET_ATTACH] = True
    flags[EXPOSED_PORTS] = exposed_ports
    limits = Limits(**{
        name: min(getattr(c.limits, name) for c in caps) for name in Limits.__struct_fields__
    })  # fmt: skip
    networks = [c.network for c in caps]
    ceiling = min((n.ceiling for n in networks), key=mode_rank)
    default = min((n.default for n in networks), key=lambda d: mode_rank(d.mode))
    may_allow = set(networks[0].may_allow)
    for n in networks[1:]:
        may_allow &= set(n.may_allow)
    backends = {c.backend for c in caps}
    return Capabilities(
        api_version="v1",
        backend=backends.pop() if len(backends) == 1 else "mixed",
        capabilities=flags,
        limits=limits,
        network=NetworkConfig(default=default, ceiling=ceiling, may_allow=tuple(sorted(may_allow))),
    )
