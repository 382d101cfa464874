"""Network policy wire type and its validation rules (spec: Network policy rules 1-8).

The server holds a :class:`NetworkConfig` (default policy, ceiling, ``may_allow``); a request's
``network`` object is turned into a resolved :class:`NetworkPolicy` by :func:`resolve_policy`, which
applies the rules in this order so that a malformed request is always 400 before any 403:

1. shape (unknown keys, types) and rule 7 name normalisation: 400 ``InvalidRequest``;
2. rule 6 (``allow`` given with mode ``none`` or ``open``): 400;
3. rule 3 (mode above the ceiling): 403 ``Refused``;
4. rule 5 (an allowlist resolving to nothing): 403;
5. rule 4 (an allow name outside the default list and ``may_allow``): 403.

Every message names the rule it applies ("network policy rule 4: ..."). Nothing is ever clamped
(rule 8): a request asking for more than the server permits is refused, never quietly narrowed.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal

import msgspec
from msgspec import UNSET, UnsetType

from sbx.api.codec import convert_request, to_builtins
from sbx.api.errors import InvalidRequest, Refused

NetworkMode = Literal["none", "allowlist", "open"]

#: Modes ordered from strictest to loosest (rule: none < allowlist < open).
MODE_ORDER: tuple[NetworkMode, ...] = ("none", "allowlist", "open")

#: The ``may_allow`` entry that permits any name (config only; never valid in a request's allow list).
ANY_NAME: Final = "*"

_MAX_NAME_CHARS: Final = 253
_LABEL_RE: Final = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")


class NetworkPolicy(msgspec.Struct, frozen=True):
    """A resolved network policy, as the wire shows it: ``{mode, allow?, deny}``; ``allow`` is present (set)
    only for mode allowlist, so a policy read back from a sandbox can be sent again unchanged."""

    mode: NetworkMode
    allow: tuple[str, ...] | UnsetType = UNSET
    deny: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """The JSON form (for files this server keeps, e.g. a backend's own copy of the policy)."""
        return dict(to_builtins(self))

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> NetworkPolicy:
        """Inverse of :meth:`to_wire` for a policy this server stored itself (already validated); also reads
        ``"allow": null``, as older state files hold."""
        allow = data.get("allow")
        return cls(data["mode"], tuple(allow) if allow is not None else UNSET, tuple(data.get("deny") or ()))


class NetworkRequest(msgspec.Struct, frozen=True):
    """A request's ``network`` object (create, PATCH): every field optional. ``allow`` null (the default list)
    and absent are the same; ``allow: []`` (nothing) is kept distinct and refused by rule 5."""

    mode: str | UnsetType = UNSET
    allow: list[str] | None | UnsetType = UNSET
    deny: list[str] | UnsetType = UNSET


class NetworkConfig(msgspec.Struct, frozen=True):
    """The server's network settings (config section ``[network]``; the ``network`` object of capabilities).

    ``default`` applies when a request omits ``network``; ``ceiling`` is the loosest mode a request may
    pick; ``may_allow`` lists names and ``*.domain`` patterns a request may put in its allow list beyond
    the default's names (``"*"`` permits any name; empty permits only the default's names).
    """

    default: NetworkPolicy = NetworkPolicy("none")
    ceiling: NetworkMode = "none"
    may_allow: tuple[str, ...] = ()


def mode_rank(mode: NetworkMode) -> int:
    """Position of ``mode`` in MODE_ORDER: 0 for none, 1 for allowlist, 2 for open."""
    return MODE_ORDER.index(mode)


def parse_mode(value: object, where: str) -> NetworkMode:
    """Check that ``value`` is one of the three mode strings; 400 naming ``where`` otherwise."""
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}: expected a string, one of none, allowlist, open")
    for mode in MODE_ORDER:
        if value == mode:
            return mode
    raise InvalidRequest(f"{where}: unknown mode {value!r}; use one of none, allowlist, open")


def normalise_name(value: object, where: str) -> str:
    """Rule 7: a host name or ``*.domain`` pattern, lowercased with a trailing dot removed.

    Refused with 400 (naming ``where``): anything not a string, a scheme, port, path, user part, an IP
    address, ``*`` anywhere but a leading ``*.``, a non-ASCII name (give its ``xn--`` form), an empty or
    over-long label, or a name over 253 characters.
    """
    if not isinstance(value, str):
        raise InvalidRequest(f"network policy rule 7: {where}: expected a string host name")
    raw = value
    name = value.lower()
    prefix = f"network policy rule 7: {where} {raw!r}"
    if name.endswith(".") and not name.endswith(".."):
        name = name[:-1]
    if not name:
        raise InvalidRequest(f"{prefix} is empty; give a host name such as 'example.com'")
    if "://" in name:
        raise InvalidRequest(f"{prefix} has a scheme; give the bare host name, e.g. 'example.com'")
    if "/" in name:
        raise InvalidRequest(f"{prefix} has a path; give only the host name")
    if "@" in name:
        raise InvalidRequest(f"{prefix} has a user part; give only the host name")
    if _is_address(name):
        raise InvalidRequest(f"{prefix} is an IP address; policies match host names only")
    if ":" in name:
        raise InvalidRequest(f"{prefix} has a port; policies match host names on every port")
    if not name.isascii():
        raise InvalidRequest(f"{prefix} is not ASCII; give the internationalised name in its xn-- form")
    body = name
    if name.startswith("*."):
        body = name[2:]
    if "*" in body:
        raise InvalidRequest(
            f"{prefix}: '*' is allowed only as a leading '*.' (e.g. '*.example.com' for its subdomains)"
        )
    if len(body) > _MAX_NAME_CHARS:
        raise InvalidRequest(f"{prefix} is longer than {_MAX_NAME_CHARS} characters")
    labels = body.split(".")
    for label in labels:
        if not _LABEL_RE.fullmatch(label):
            raise InvalidRequest(
                f"{prefix} has an invalid label {label!r}; each dot-separated label is 1 to 63 of a-z, "
                "0-9 and '-', not starting or ending with '-'"
            )
    if labels[-1].isdigit():
        # An all-digit last label is an address in disguise (e.g. '10.1'), never a real domain.
        raise InvalidRequest(f"{prefix} looks like an IP address; policies match host names only")
    return name


def normalise_pattern(value: object, where: str) -> str:
    """A ``may_allow`` entry: ``"*"`` or anything :func:`normalise_name` accepts."""
    if value == ANY_NAME:
        return ANY_NAME
    return normalise_name(value, where)


def name_matches(pattern: str, host: str) -> bool:
    """Rule 2: does ``host`` match the allow or deny entry ``pattern``?

    Compared by name, case-insensitively, a trailing dot on either side ignored. ``*.example.com``
    matches every subdomain of example.com at any depth but not ``example.com`` itself; any other
    pattern matches only the identical name (``*`` alone matches nothing here).
    """
    p = _fold(pattern)
    h = _fold(host)
    if not h:
        return False
    if p.startswith("*."):
        return h.endswith(p[1:]) and len(h) > len(p) - 1
    return p == h


def pattern_covers(permit: str, name: str) -> bool:
    """Rule 4: may a request put ``name`` in its allow list under the permitting entry ``permit``?

    ``*`` covers everything; a plain name covers only itself; ``*.d`` covers any subdomain of ``d`` and
    any wildcard at most as broad (``*.d`` itself, ``*.a.d``), never ``d`` itself. Both arguments are
    expected normalised (:func:`normalise_pattern`, :func:`normalise_name`).
    """
    if permit == ANY_NAME:
        return True
    if name.startswith("*."):
        if not permit.startswith("*."):
            return False  # a plain name never permits a wildcard, however close
        domain = name[2:]
        return domain == permit[2:] or domain.endswith(permit[1:])
    return name_matches(permit, name)


def resolve_policy(requested: NetworkRequest | Mapping[str, Any] | None, net: NetworkConfig) -> NetworkPolicy:
    """Turn a request's ``network`` object (None when omitted; a decoded JSON object is checked as a
    request's would be) into the policy to apply.

    Omitted entirely: the server default. Given: ``mode`` defaults to the default's mode; ``allow``
    absent or null means the default's allow list, ``[]`` means nothing (refused, rule 5); ``deny`` is
    added to the default's deny entries (which a request can never remove) and dropped under ``none``.
    Raises InvalidRequest (400) for malformed names, Refused (403) for rules 3, 4 and 5.
    """
    if requested is None:
        return net.default
    if not isinstance(requested, NetworkRequest):
        requested = convert_request(requested, NetworkRequest, "network.")
    mode = parse_mode(requested.mode, "network.mode") if requested.mode is not UNSET else net.default.mode
    allow_given = requested.allow is not UNSET
    allow = _parse_names(requested.allow, "network.allow") if requested.allow else None
    if requested.allow == []:
        allow = ()
    deny = _parse_names(requested.deny, "network.deny") if requested.deny else ()

    if mode != "allowlist" and allow_given:
        how = "" if requested.mode is not UNSET else " (mode was omitted, so the server default applies)"
        raise InvalidRequest(
            f"network policy rule 6: allow is only meaningful with mode allowlist, not {mode}{how}; "
            "remove allow or set mode to allowlist"
        )
    if mode_rank(mode) > mode_rank(net.ceiling):
        permitted = ", ".join(MODE_ORDER[: mode_rank(net.ceiling) + 1])
        raise Refused(
            f"network policy rule 3: mode {mode} is above this server's ceiling {net.ceiling}; "
            f"pick one of {permitted}"
        )
    if mode == "none":
        return NetworkPolicy("none")
    merged_deny = _dedupe((*net.default.deny, *deny))
    if mode == "open":
        return NetworkPolicy("open", UNSET, merged_deny)
    return NetworkPolicy("allowlist", _resolve_allow(allow, net), merged_deny)


def _resolve_allow(allow: tuple[str, ...] | None, net: NetworkConfig) -> tuple[str, ...]:
    default_names = net.default.allow or ()
    if allow is None:
        if not default_names:
            raise Refused(
                "network policy rule 5: the allowlist resolves to nothing: allow was omitted and this "
                "server's default policy has no allow list; send allow with at least one name"
            )
        return default_names
    if not allow:
        raise Refused(
            "network policy rule 5: allow: [] permits no name; send at least one name, omit allow for "
            "the server's default list, or use mode none"
        )
    permits = (*default_names, *net.may_allow)
    for name in allow:
        if not any(pattern_covers(p, name) for p in permits):
            shown = ", ".join(permits) if permits else "nothing beyond the default (which is empty)"
            raise Refused(
                f"network policy rule 4: allow name {name!r} is neither in this server's default list "
                f"nor within its may_allow patterns; permitted: {shown}"
            )
    return allow


def _parse_names(value: Iterable[str], where: str) -> tuple[str, ...]:
    return _dedupe(normalise_name(v, f"{where}[{i}]") for i, v in enumerate(value))


def _dedupe(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def _fold(name: str) -> str:
    name = name.lower()
    return name.removesuffix(".")


def _is_address(name: str) -> bool:
    candidate = name[1:-1] if name.startswith("[") and name.endswith("]") else name
    try:
        ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return True
