"""The one parse of ``Authorization`` (sbx.gateway.auth): every spelling authentication accepts is one the
services' proxy keeps from a replica, and what it refuses says why."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from sbx.api.errors import Unauthorized
from sbx.gateway import auth, keys
from sbx.gateway.state import KeyRecord
from sbx.gateway.store import Store
from sbx.gateway.store.sqlite import SqliteStore

SECRET = "sgk_" + "A1b2" * 10


@pytest.fixture
def store(tmp_path: Path) -> tuple[Store, KeyRecord, str]:
    s = SqliteStore.open(tmp_path / "gw.db")
    key, secret = keys.new_key("alice", "acme", {"sandbox:read"})
    s.add_key(key)
    return s, key, secret


ACCEPTED = [
    ("Bearer {k}", "the spec's spelling"),
    ("bearer {k}", "the scheme in lower case (RFC 9110: case-insensitive)"),
    ("BEARER {k}", "upper case"),
    ("BeArEr {k}", "mixed case"),
    ("Bearer  {k}", "two spaces"),
    ("Bearer\t{k}", "a tab"),
    ("Bearer \t {k}", "spaces and a tab"),
    ("Bearer {k}  ", "trailing spaces"),
    ("Bearer {k}\t", "a trailing tab"),
    ("  Bearer {k}", "leading spaces"),
    ("\tbearer\t\t{k}\t ", "tabs everywhere"),
]

REFUSED = [
    (None, "missing API key: send Authorization: Bearer sgk_..."),
    ("", "missing API key: send Authorization: Bearer sgk_..."),
    ("Bearer", "missing API key: send Authorization: Bearer sgk_..."),
    ("Bearer{k}", "missing API key: send Authorization: Bearer sgk_..."),
    ("Basic {k}", "missing API key: send Authorization: Bearer sgk_..."),
    ("Bearerx {k}", "missing API key: send Authorization: Bearer sgk_..."),
    ("Bearer\u00a0{k}", "missing API key: send Authorization: Bearer sgk_..."),  # not a space of HTTP's
    ("Bearer token-of-something-else", "unknown or revoked API key"),
    ("Bearer {k}x", "unknown or revoked API key"),
    ("Bearer {k} {k}", "unknown or revoked API key"),
    ("Bearer sgk_unknown", "unknown or revoked API key"),
]


@pytest.mark.parametrize(("spelling", "why"), ACCEPTED)
def test_spellings_the_gateway_accepts_are_all_kept_from_replicas(
    store: tuple[Store, KeyRecord, str], spelling: str, why: str
) -> None:
    s, key, secret = store
    value = spelling.format(k=secret)
    assert auth.bearer_credential(value) == secret, why
    assert auth.key_from_header(s, value).id == key.id, why
    assert auth.carries_gateway_key(value), why


@pytest.mark.parametrize(("spelling", "message"), REFUSED)
def test_spellings_refused_say_why_and_any_that_holds_a_key_is_kept_from_replicas(
    store: tuple[Store, KeyRecord, str], spelling: str | None, message: str
) -> None:
    s, _, secret = store
    value = spelling.format(k=secret) if spelling is not None else None
    with pytest.raises(Unauthorized) as raised:
        auth.key_from_header(s, value)
    assert raised.value.message == message
    if value is not None:
        assert auth.carries_gateway_key(value) == ("sgk_" in value)


def test_every_combination_of_case_and_blanks_that_authenticates_is_dropped(
    store: tuple[Store, KeyRecord, str],
) -> None:
    """Exhaustive over the scheme's case and the blanks around the credential: whenever the key is accepted,
    the proxy's rule drops the header, and the key is accepted exactly when the scheme is Bearer in any case
    and one or more spaces or tabs follow it."""
    s, key, secret = store
    schemes = ["".join(c) for c in itertools.product(*("Bb", "Ee", "aA", "rR", "Ee", "rR"))]
    blanks = ["", " ", "\t", "  ", " \t", "\t ", "\t\t", "\v", "\u3000"]
    tried = 0
    for scheme, before, between, after in itertools.product(schemes, blanks[:3], blanks, blanks[:3]):
        value = f"{before}{scheme}{between}{secret}{after}"
        tried += 1
        try:
            accepted = auth.key_from_header(s, value).id == key.id
        except Unauthorized:
            accepted = False
        assert accepted == (between != "" and set(between) <= {" ", "\t"}), repr(value)
        assert auth.carries_gateway_key(value), repr(value)
    assert tried == 64 * 3 * 9 * 3


@pytest.mark.parametrize(
    "value", ["Basic dXNlcjpwYXNz", "Bearer app-token", "Bearer eyJhbGciOi.x.y", "Digest username=x"]
)
def test_another_authorization_of_the_application_is_passed_on(value: str) -> None:
    assert not auth.carries_gateway_key(value)
