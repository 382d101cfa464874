"""The gateway's ``GET /v1/capabilities``: what every answering node offers."""

from __future__ import annotations

from typing import Any

from sbx.api.network_policy import mode_rank


def intersect_capabilities(caps: list[dict[str, Any]]) -> dict[str, Any]:
    """What every answering node offers: a flag only if all have it, the smallest limits, the strictest
    network ceiling and default, the ``may_allow`` patterns all share. Images are never offered."""
    flags: dict[str, bool] = {}
    for name in set().union(*(c.get("capabilities", {}).keys() for c in caps)):
        flags[name] = all(bool(c.get("capabilities", {}).get(name)) for c in caps)
    flags["images"] = False
    limits: dict[str, int] = {}
    for name in set().union(*(c.get("limits", {}).keys() for c in caps)):
        values = [c["limits"][name] for c in caps if isinstance(c.get("limits", {}).get(name), int)]
        if values:
            limits[name] = min(values)
    networks = [c.get("network") or {} for c in caps]
    ceiling = min((n.get("ceiling", "none") for n in networks), key=mode_rank)
    default = min(
        (n.get("default") or {"mode": "none"} for n in networks),
        key=lambda d: mode_rank(d.get("mode", "none")),
    )
    may_allow = set(networks[0].get("may_allow") or [])
    for n in networks[1:]:
        may_allow &= set(n.get("may_allow") or [])
    backends = {c.get("backend") for c in caps}
    return {
        "api_version": "v1",
        "backend": backends.pop() if len(backends) == 1 else "mixed",
        "capabilities": flags,
        "limits": limits,
        "network": {"default": default, "ceiling": ceiling, "may_allow": sorted(may_allow)},
    }
