"""The network policy rules applied to one name on the wire (spec: Network policy rules 1 and 2).

Both the resolver (dns.py) and the proxy (proxy.py) ask these, so a name the resolver answers is exactly a
name the proxy lets through, and a PATCH changes both at once.
"""

from __future__ import annotations

from sbx.api.network_policy import NetworkPolicy, name_matches
from sbx.net.ranges import Kind


def name_permitted(policy: NetworkPolicy, name: str) -> bool:
    """Rule 1: may a sandbox under ``policy`` reach the host name ``name``? ``none``: never; ``allowlist``:
    when an allow entry matches and no deny entry does; ``open``: when no deny entry matches."""
    if policy.mode == "none" or not name:
        return False
    if any(name_matches(pattern, name) for pattern in policy.deny):
        return False
    if policy.mode == "open":
        return True
    return any(name_matches(pattern, name) for pattern in policy.allow or ())


def address_permitted(policy: NetworkPolicy, kind: Kind, *, named: bool) -> bool:
    """May a connection go to an address of ``kind``? Forbidden never; private only for a connection whose
    name an ``allowlist`` permitted (someone explicitly named a host there); public always, except that an
    ``allowlist`` never lets a connection without a name through (that is checked by the caller first)."""
    if kind == "forbidden" or policy.mode == "none":
        return False
    if kind == "private":
        return named and policy.mode == "allowlist"
    return named or policy.mode == "open"
