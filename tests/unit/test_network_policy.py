"""Network policy rules 1-8: name normalisation, matching, breadth, and resolution against a config."""

from __future__ import annotations

import re
from typing import Any

import pytest
from msgspec import UNSET

from sbx.api.errors import InvalidRequest, Refused, SandboxError
from sbx.api.network_policy import (
    NetworkConfig,
    NetworkPolicy,
    name_matches,
    normalise_name,
    normalise_pattern,
    pattern_covers,
    resolve_policy,
)

LABEL_63 = "a" * 63
NAME_253 = ".".join(["a" * 63, "b" * 63, "c" * 63, "d" * 61])  # 63*3 + 61 + 3 dots = 253


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param("example.com", "example.com", id="plain"),
        pytest.param("Example.COM", "example.com", id="lowercased"),
        pytest.param("example.com.", "example.com", id="trailing-dot-dropped"),
        pytest.param("*.Example.com", "*.example.com", id="wildcard"),
        pytest.param("*.example.com.", "*.example.com", id="wildcard-trailing-dot"),
        pytest.param("localhost", "localhost", id="single-label"),
        pytest.param("xn--mnchen-3ya.de", "xn--mnchen-3ya.de", id="punycode"),
        pytest.param("a-b.c0m", "a-b.c0m", id="hyphen-and-digit"),
        pytest.param("1password.com", "1password.com", id="leading-digit-label"),
        pytest.param(f"{LABEL_63}.com", f"{LABEL_63}.com", id="label-63-chars"),
        pytest.param(NAME_253, NAME_253, id="name-253-chars"),
    ],
)
def test_normalise_name_accepts(raw: str, expected: str) -> None:
    assert normalise_name(raw, "network.allow[0]") == expected


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        pytest.param("https://example.com", "has a scheme", id="scheme"),
        pytest.param("example.com:443", "has a port", id="port"),
        pytest.param("example.com/path", "has a path", id="path"),
        pytest.param("user@example.com", "user part", id="userinfo"),
        pytest.param("1.2.3.4", "IP address", id="ipv4"),
        pytest.param("::1", "IP address", id="ipv6"),
        pytest.param("[2001:db8::1]", "IP address", id="ipv6-bracketed"),
        pytest.param("10.1", "looks like an IP address", id="numeric-last-label"),
        pytest.param("*", "leading", id="bare-star"),
        pytest.param("a.*.com", "leading", id="star-in-middle"),
        pytest.param("*example.com", "leading", id="star-without-dot"),
        pytest.param("*.*.example.com", "leading", id="double-wildcard"),
        pytest.param("", "is empty", id="empty"),
        pytest.param(".", "is empty", id="only-dot"),
        pytest.param("example..com", "invalid label", id="empty-label"),
        pytest.param("example.com..", "invalid label", id="two-trailing-dots"),
        pytest.param("-a.com", "invalid label", id="leading-hyphen"),
        pytest.param("a-.com", "invalid label", id="trailing-hyphen"),
        pytest.param("a_b.com", "invalid label", id="underscore"),
        pytest.param(" example.com", "invalid label", id="space"),
        pytest.param(f"{'a' * 64}.com", "invalid label", id="label-64-chars"),
        pytest.param(NAME_253 + "d", "longer than 253", id="name-254-chars"),
        pytest.param("münchen.de", "xn--", id="non-ascii"),
    ],
)
def test_normalise_name_rejects(raw: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match="network policy rule 7") as info:
        normalise_name(raw, "network.allow[0]")
    assert message in info.value.message
    assert "network.allow[0]" in info.value.message


def test_normalise_name_rejects_non_string() -> None:
    with pytest.raises(InvalidRequest, match=r"rule 7: network.deny\[2\]: expected a string"):
        normalise_name(5, "network.deny[2]")


def test_normalise_pattern_accepts_star_only_as_a_whole_entry() -> None:
    assert normalise_pattern("*", "network.may_allow[0]") == "*"
    assert normalise_pattern("*.Example.com", "network.may_allow[0]") == "*.example.com"
    with pytest.raises(InvalidRequest):
        normalise_pattern("*.*", "network.may_allow[0]")


@pytest.mark.parametrize(
    ("pattern", "host", "matches"),
    [
        pytest.param("example.com", "example.com", True, id="exact"),
        pytest.param("example.com", "EXAMPLE.com", True, id="case-insensitive"),
        pytest.param("example.com", "example.com.", True, id="host-trailing-dot"),
        pytest.param("example.com", "a.example.com", False, id="plain-name-not-subdomain"),
        pytest.param("*.example.com", "a.example.com", True, id="wildcard-subdomain"),
        pytest.param("*.example.com", "a.b.example.com", True, id="wildcard-deep-subdomain"),
        pytest.param("*.example.com", "example.com", False, id="wildcard-not-apex"),
        pytest.param("*.example.com", "badexample.com", False, id="wildcard-not-suffix-of-label"),
        pytest.param("*.example.com", ".example.com", False, id="wildcard-empty-label"),
        pytest.param("*.Example.COM", "A.example.com", True, id="wildcard-case"),
        pytest.param("*", "example.com", False, id="star-is-not-a-pattern"),
        pytest.param("example.com", "", False, id="empty-host"),
    ],
)
def test_name_matches(pattern: str, host: str, matches: bool) -> None:
    assert name_matches(pattern, host) is matches


@pytest.mark.parametrize(
    ("permit", "name", "covered"),
    [
        pytest.param("*", "anything.net", True, id="star-covers-name"),
        pytest.param("*", "*.anything.net", True, id="star-covers-wildcard"),
        pytest.param("a.com", "a.com", True, id="same-name"),
        pytest.param("a.com", "b.a.com", False, id="name-covers-not-subdomain"),
        pytest.param("*.example.com", "a.example.com", True, id="wildcard-covers-subdomain"),
        pytest.param("*.example.com", "example.com", False, id="wildcard-not-apex"),
        pytest.param("*.example.com", "*.example.com", True, id="same-wildcard"),
        pytest.param("*.example.com", "*.a.example.com", True, id="narrower-wildcard"),
        pytest.param("*.a.example.com", "*.example.com", False, id="broader-wildcard"),
        pytest.param("a.example.com", "*.example.com", False, id="name-never-covers-wildcard"),
        pytest.param("a.example.com", "*.a.example.com", False, id="name-never-covers-its-subdomains"),
        pytest.param("*.example.com", "*.badexample.com", False, id="wildcard-label-boundary"),
    ],
)
def test_pattern_covers(permit: str, name: str, covered: bool) -> None:
    assert pattern_covers(permit, name) is covered


# A server whose default is an allowlist, permitting open, with some may_allow patterns.
ALLOWLIST_DEFAULT = NetworkConfig(
    default=NetworkPolicy("allowlist", ("pypi.org", "*.github.com"), ("evil.github.com",)),
    ceiling="open",
    may_allow=("*.example.com", "api.openai.com"),
)
# The built-in default: no egress and nothing looser permitted.
NONE_ONLY = NetworkConfig()
# Default none, but a request may go up to open and allow any name.
NONE_DEFAULT_OPEN_CEILING = NetworkConfig(default=NetworkPolicy("none"), ceiling="open", may_allow=("*",))
# Ceiling allowlist, no may_allow: only the default's names.
ALLOWLIST_CEILING = NetworkConfig(
    default=NetworkPolicy("allowlist", ("pypi.org",)), ceiling="allowlist", may_allow=()
)
NARROW_MAY_ALLOW = NetworkConfig(
    default=NetworkPolicy("none"), ceiling="allowlist", may_allow=("a.example.com",)
)

GITHUB_DENY = ("evil.github.com",)


@pytest.mark.parametrize(
    ("requested", "net", "expected"),
    [
        pytest.param(None, ALLOWLIST_DEFAULT, ALLOWLIST_DEFAULT.default, id="omitted-is-default"),
        pytest.param({}, ALLOWLIST_DEFAULT, ALLOWLIST_DEFAULT.default, id="empty-object-is-default"),
        pytest.param(None, NONE_ONLY, NetworkPolicy("none"), id="builtin-default-none"),
        pytest.param({"mode": "none"}, ALLOWLIST_DEFAULT, NetworkPolicy("none"), id="stricter-mode"),
        pytest.param(
            {"mode": "none", "deny": ["x.com"]},
            ALLOWLIST_DEFAULT,
            NetworkPolicy("none"),
            id="deny-dropped-under-none",
        ),
        pytest.param(
            {"mode": "open"},
            ALLOWLIST_DEFAULT,
            NetworkPolicy("open", UNSET, GITHUB_DENY),
            id="open-keeps-default-deny",
        ),
        pytest.param(
            {"mode": "open", "deny": ["X.com.", "evil.github.com"]},
            ALLOWLIST_DEFAULT,
            NetworkPolicy("open", UNSET, ("evil.github.com", "x.com")),
            id="deny-added-normalised-deduped",
        ),
        pytest.param(
            {"mode": "allowlist"},
            ALLOWLIST_DEFAULT,
            NetworkPolicy("allowlist", ("pypi.org", "*.github.com"), GITHUB_DENY),
            id="allow-absent-is-default-list",
        ),
        pytest.param(
            {"mode": "allowlist", "allow": None},
            ALLOWLIST_DEFAULT,
            NetworkPolicy("allowlist", ("pypi.org", "*.github.com"), GITHUB_DENY),
            id="allow-null-is-default-list",
        ),
        pytest.param(
            {"allow": ["a.example.com"]},
            ALLOWLIST_DEFAULT,
            NetworkPolicy("allowlist", ("a.example.com",), GITHUB_DENY),
            id="mode-omitted-takes-default-mode",
        ),
        pytest.param(
            {"mode": "allowlist", "allow": ["pypi.org"]},
            ALLOWLIST_DEFAULT,
            NetworkPolicy("allowlist", ("pypi.org",), GITHUB_DENY),
            id="subset-of-default-names",
        ),
        pytest.param(
            {"mode": "allowlist", "allow": ["raw.github.com", "*.a.github.com"]},
            ALLOWLIST_DEFAULT,
            NetworkPolicy("allowlist", ("raw.github.com", "*.a.github.com"), GITHUB_DENY),
            id="covered-by-default-wildcard",
        ),
        pytest.param(
            {"mode": "allowlist", "allow": ["*.example.com", "*.b.example.com", "API.openai.com."]},
            ALLOWLIST_DEFAULT,
            NetworkPolicy("allowlist", ("*.example.com", "*.b.example.com", "api.openai.com"), GITHUB_DENY),
            id="within-may-allow",
        ),
        pytest.param(
            {"mode": "allowlist", "allow": ["PyPI.org", "pypi.org."]},
            ALLOWLIST_DEFAULT,
            NetworkPolicy("allowlist", ("pypi.org",), GITHUB_DENY),
            id="allow-deduped",
        ),
        pytest.param(
            {"mode": "allowlist", "allow": ["anything.net", "*.other.org"]},
            NONE_DEFAULT_OPEN_CEILING,
            NetworkPolicy("allowlist", ("anything.net", "*.other.org")),
            id="may-allow-star-permits-any",
        ),
        pytest.param(
            {"mode": "allowlist"},
            ALLOWLIST_CEILING,
            NetworkPolicy("allowlist", ("pypi.org",)),
            id="mode-at-ceiling",
        ),
        pytest.param(
            {"mode": "open"}, NONE_DEFAULT_OPEN_CEILING, NetworkPolicy("open"), id="open-at-ceiling"
        ),
        pytest.param(
            {"mode": "allowlist", "allow": ["a.example.com"]},
            NARROW_MAY_ALLOW,
            NetworkPolicy("allowlist", ("a.example.com",)),
            id="plain-may-allow-permits-itself",
        ),
    ],
)
def test_resolve_policy_accepts(
    requested: dict[str, Any] | None, net: NetworkConfig, expected: NetworkPolicy
) -> None:
    assert resolve_policy(requested, net) == expected


@pytest.mark.parametrize(
    ("requested", "net", "error", "message"),
    [
        # Rule 3: the ceiling.
        pytest.param({"mode": "open"}, ALLOWLIST_CEILING, Refused, "rule 3: mode open is above", id="r3-open-over-allowlist"),
        pytest.param({"mode": "allowlist", "allow": ["a.com"]}, NONE_ONLY, Refused, "rule 3", id="r3-allowlist-over-none"),
        pytest.param({"mode": "open"}, NONE_ONLY, Refused, "pick one of none", id="r3-names-permitted-modes"),
        # Rule 4: names outside the default list and may_allow.
        pytest.param({"mode": "allowlist", "allow": ["example.com"]}, ALLOWLIST_DEFAULT, Refused, "rule 4", id="r4-apex-under-wildcard"),
        pytest.param({"mode": "allowlist", "allow": ["*.com"]}, ALLOWLIST_DEFAULT, Refused, "rule 4", id="r4-broader-wildcard"),
        pytest.param({"mode": "allowlist", "allow": ["evil.org"]}, ALLOWLIST_DEFAULT, Refused, "'evil.org'", id="r4-names-the-name"),
        pytest.param({"mode": "allowlist", "allow": ["pypi.org", "x.openai.com"]}, ALLOWLIST_DEFAULT, Refused, "rule 4", id="r4-plain-may-allow-not-subdomain"),
        pytest.param({"mode": "allowlist", "allow": ["*.example.com"]}, NARROW_MAY_ALLOW, Refused, "rule 4", id="r4-wildcard-under-plain-name"),
        pytest.param({"mode": "allowlist", "allow": ["b.example.com"]}, NARROW_MAY_ALLOW, Refused, "rule 4", id="r4-sibling-of-plain-name"),
        pytest.param({"mode": "allowlist", "allow": ["files.pypi.org"]}, ALLOWLIST_CEILING, Refused, "rule 4", id="r4-empty-may-allow-only-defaults"),
        # Rule 5: an allowlist resolving to nothing.
        pytest.param({"mode": "allowlist", "allow": []}, ALLOWLIST_DEFAULT, Refused, "rule 5: allow: []", id="r5-empty-list"),
        pytest.param({"mode": "allowlist"}, NONE_DEFAULT_OPEN_CEILING, Refused, "rule 5", id="r5-absent-no-default-list"),
        pytest.param({"mode": "allowlist", "allow": None}, NONE_DEFAULT_OPEN_CEILING, Refused, "rule 5", id="r5-null-no-default-list"),
        # Rule 6: allow with none/open (the key's presence, whatever its value).
        pytest.param({"mode": "none", "allow": ["a.com"]}, ALLOWLIST_DEFAULT, InvalidRequest, "rule 6", id="r6-none-with-allow"),
        pytest.param({"mode": "open", "allow": []}, ALLOWLIST_DEFAULT, InvalidRequest, "rule 6", id="r6-open-with-empty-allow"),
        pytest.param({"mode": "open", "allow": None}, ALLOWLIST_DEFAULT, InvalidRequest, "rule 6", id="r6-open-with-null-allow"),
        pytest.param({"allow": ["a.com"]}, NONE_DEFAULT_OPEN_CEILING, InvalidRequest, "mode was omitted", id="r6-default-mode-none"),
        pytest.param({"mode": "open", "allow": ["a.com"]}, NONE_ONLY, InvalidRequest, "rule 6", id="r6-before-r3"),
        # Rule 7: malformed names, in allow and deny, even when deny would be dropped.
        pytest.param({"mode": "allowlist", "allow": ["https://a.example.com"]}, ALLOWLIST_DEFAULT, InvalidRequest, "rule 7", id="r7-allow-scheme"),
        pytest.param({"mode": "open", "deny": ["1.2.3.4"]}, ALLOWLIST_DEFAULT, InvalidRequest, r"network.deny[0]", id="r7-deny-address"),
        pytest.param({"mode": "none", "deny": ["a.com:80"]}, ALLOWLIST_DEFAULT, InvalidRequest, "rule 7", id="r7-deny-under-none"),
        pytest.param({"mode": "allowlist", "allow": ["*"]}, NONE_DEFAULT_OPEN_CEILING, InvalidRequest, "rule 7", id="r7-star-in-request"),
        pytest.param({"mode": "open", "allow": ["a..com"]}, ALLOWLIST_DEFAULT, InvalidRequest, "rule 7", id="r7-before-r6"),
        # Shape.
        pytest.param({"mode": "closed"}, ALLOWLIST_DEFAULT, InvalidRequest, "unknown mode 'closed'", id="unknown-mode"),
        pytest.param({"mode": 1}, ALLOWLIST_DEFAULT, InvalidRequest, "network.mode: expected a string", id="mode-not-string"),
        pytest.param({"mode": None}, ALLOWLIST_DEFAULT, InvalidRequest, "network.mode", id="mode-null"),
        pytest.param({"mode": "open", "allowed": []}, ALLOWLIST_DEFAULT, InvalidRequest, "unknown field 'network.allowed'", id="unknown-key"),
        pytest.param({"mode": "allowlist", "allow": "a.example.com"}, ALLOWLIST_DEFAULT, InvalidRequest, "network.allow: expected an array", id="allow-string"),
        pytest.param({"mode": "open", "deny": None}, ALLOWLIST_DEFAULT, InvalidRequest, "network.deny: expected an array", id="deny-null"),
        pytest.param({"mode": "allowlist", "allow": [3]}, ALLOWLIST_DEFAULT, InvalidRequest, r"network.allow[0]: expected a string", id="allow-item-not-string"),
    ],
)  # fmt: skip
def test_resolve_policy_rejects(
    requested: dict[str, Any], net: NetworkConfig, error: type[SandboxError], message: str
) -> None:
    with pytest.raises(SandboxError) as info:
        resolve_policy(requested, net)
    assert type(info.value) is error
    assert message in info.value.message


def test_resolve_policy_rejects_non_object() -> None:
    with pytest.raises(InvalidRequest, match="network: expected an object"):
        resolve_policy(["open"], ALLOWLIST_DEFAULT)  # type: ignore[arg-type]


def test_every_refusal_names_its_rule() -> None:
    """Rule 8: a refusal always says which rule it applied; nothing is clamped."""
    for requested in (
        {"mode": "open"},
        {"mode": "allowlist", "allow": []},
        {"mode": "allowlist", "allow": ["x.org"]},
    ):
        with pytest.raises(Refused) as info:
            resolve_policy(requested, ALLOWLIST_CEILING)
        assert re.match(r"network policy rule \d: ", info.value.message)


def test_allow_absent_null_and_empty_stay_distinct() -> None:
    """Rule 5: absent and null mean the default list; [] means nothing; with open, any allow key is 400."""
    assert resolve_policy({"mode": "allowlist"}, ALLOWLIST_CEILING).allow == ("pypi.org",)
    assert resolve_policy({"mode": "allowlist", "allow": None}, ALLOWLIST_CEILING).allow == ("pypi.org",)
    with pytest.raises(Refused, match="rule 5"):
        resolve_policy({"mode": "allowlist", "allow": []}, ALLOWLIST_CEILING)
    assert resolve_policy({"mode": "open"}, ALLOWLIST_DEFAULT).allow is UNSET
    with pytest.raises(InvalidRequest, match="rule 6"):
        resolve_policy({"mode": "open", "allow": None}, ALLOWLIST_DEFAULT)


def test_to_wire_round_trips_through_resolve() -> None:
    policy = resolve_policy(
        {"mode": "allowlist", "allow": ["a.example.com"], "deny": ["b.example.com"]}, ALLOWLIST_DEFAULT
    )
    assert resolve_policy(policy.to_wire(), ALLOWLIST_DEFAULT) == policy
    open_policy = resolve_policy({"mode": "open"}, ALLOWLIST_DEFAULT)
    assert resolve_policy(open_policy.to_wire(), ALLOWLIST_DEFAULT) == open_policy


@pytest.mark.parametrize(
    "policy",
    [
        NetworkPolicy("none"),
        NetworkPolicy("open", UNSET, ("bad.example.com",)),
        NetworkPolicy("allowlist", ("a.example.com", "*.b.example.com"), ("c.b.example.com",)),
    ],
)
def test_stored_policies_read_back(policy: NetworkPolicy) -> None:
    assert NetworkPolicy.from_wire(policy.to_wire()) == policy


def test_older_stored_policies_with_allow_null_read_back() -> None:
    assert NetworkPolicy.from_wire({"mode": "none", "allow": None, "deny": []}) == NetworkPolicy("none")
