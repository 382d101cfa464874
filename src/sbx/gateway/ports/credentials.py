"""The credentials of a port URL besides the owner's key (docs/ports.md, "Port tokens and the cookie"): the
port token (``sgp_`` + 48 hex, 192 random bits) carried in the URL's query as ``sbx_port_token``, and the cookie it
is traded for.

The cookie is ``__Host-sbx-port`` over https (browsers refuse that name from a response without ``Secure`` or
``Path=/`` or with a ``Domain``, so no other host, a sibling port's guest included, can set it for this one) and
``sbx-port`` over http (there the prefix is not allowed); it holds the token itself, bound to its one host by
having no ``Domain`` attribute, and is checked against the port its token names on every request.

One parse per place decides both what authenticates and what the guest is not given (as ``auth.bearer_credential``
does for the key): :func:`split_cookies` for the ``Cookie`` header (a cookie of either name in any case, or whose
value holds ``sgp_``, is ours and dropped), :func:`split_query` for the query (the parameter in any case, or any
value holding ``sgp_``).
"""

from __future__ import annotations

import secrets
from urllib.parse import quote, unquote

from sbx.gateway.keys import SECRET_PREFIX

#: What a port token begins with (never a key's ``sgk_``: a port token is no API key).
TOKEN_PREFIX = "sgp_"
#: The query parameter a token URL carries the token in.
TOKEN_PARAM = "sbx_port_token"
#: The cookie's name over https, and over http (where the ``__Host-`` prefix needs ``Secure``, so is refused).
SECURE_COOKIE = "__Host-sbx-port"
PLAIN_COOKIE = "sbx-port"
_OURS = frozenset({SECURE_COOKIE.lower(), PLAIN_COOKIE.lower()})


def new_token() -> str:
    return TOKEN_PREFIX + secrets.token_hex(24)


def cookie_name(scheme: str) -> str:
    return SECURE_COOKIE if scheme == "https" else PLAIN_COOKIE


def set_cookie_header(scheme: str, token: str, max_age_secs: int) -> str:
    """The ``Set-Cookie`` value trading ``token`` for a cookie of this one host (no ``Domain``): HttpOnly,
    SameSite=Lax, ``Secure`` over https, gone when the token expires."""
    secure = "; Secure" if scheme == "https" else ""
    return f"{cookie_name(scheme)}={token}; Path=/; Max-Age={max(0, max_age_secs)}; HttpOnly; SameSite=Lax{secure}"


def _is_ours(name: str, value: str) -> bool:
    return name.strip().lower() in _OURS or TOKEN_PREFIX in value or TOKEN_PREFIX in name


def split_cookies(header: str) -> tuple[list[str], str]:
    """``(our cookies' values, the header without them)`` of one ``Cookie`` header; the rest is kept as sent,
    pair by pair."""
    ours: list[str] = []
    rest: list[str] = []
    for pair in header.split(";"):
        name, sep, value = pair.partition("=")
        if not pair.strip():
            continue
        if sep and _is_ours(name, value):
            ours.append(value.strip().strip('"'))
        elif not sep and TOKEN_PREFIX in pair:
            ours.append(pair.strip())
        else:
            rest.append(pair.strip())
    return ours, "; ".join(rest)


def split_query(raw_query: str) -> tuple[list[str], str]:
    """``(the tokens the query carries, the raw query without them)``: the other parameters stay as sent."""
    tokens: list[str] = []
    rest: list[str] = []
    for part in raw_query.split("&") if raw_query else []:
        name, _, value = part.partition("=")
        decoded_name, decoded = unquote(name.replace("+", " ")), unquote(value.replace("+", " "))
        if decoded_name.lower() == TOKEN_PARAM or TOKEN_PREFIX in decoded or TOKEN_PREFIX in decoded_name:
            tokens.append(decoded)
        else:
            rest.append(part)
    return tokens, "&".join(rest)


def carries_credential(authorization: str) -> bool:
    """Whether an ``Authorization`` value must not reach a guest: it holds a gateway key (``sgk_``) or a port
    token (``sgp_``) anywhere, under any scheme."""
    return SECRET_PREFIX in authorization or TOKEN_PREFIX in authorization


def token_url(url: str, token: str) -> str:
    return f"{url}?{TOKEN_PARAM}={quote(token)}"


__all__ = [
    "PLAIN_COOKIE",
    "SECURE_COOKIE",
    "TOKEN_PARAM",
    "TOKEN_PREFIX",
    "carries_credential",
    "cookie_name",
    "new_token",
    "set_cookie_header",
    "split_cookies",
    "split_query",
    "token_url",
]
