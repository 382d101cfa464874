"""Exposed ports' rules as tables: the label of a port (made and parsed strictly), the credentials found in and
dropped from a request (cookies, query, headers), the path's port, token lifetimes and ``--ports-domain``."""

from __future__ import annotations

import click
import pytest

from sbx.api.errors import InvalidRequest
from sbx.gateway.main import check_ports_domain
from sbx.gateway.ports import credentials
from sbx.gateway.ports.front import keep_for_guest
from sbx.gateway.ports.labels import label_for, parse_label
from sbx.gateway.routes.ports import check_ttl, parse_port

HEX = "0123456789abcdef"


@pytest.mark.parametrize(("sandbox", "port", "label"), [
    (f"sbx_{HEX}", 8080, f"8080-{HEX}"),
    (f"sbx_n1_{HEX}", 1, f"1-n1-{HEX}"),
    (f"sbx_abcdefghij012345_{HEX}", 65535, f"65535-abcdefghij012345-{HEX}"),
    (f"sbx_{HEX}", 0, None),
    (f"sbx_{HEX}", 65536, None),
    ("sbx_0123456789ABCDEF", 80, None),  # a node never makes upper case
    (f"sbx_a-b_{HEX}", 80, None),  # nor a node id with "-"
    (f"sbx_{HEX}0", 80, None),
    (f"sbx__{HEX}", 80, None),
    ("job_0123456789abcdef", 80, None),
])  # fmt: skip
def test_a_ports_label(sandbox: str, port: int, label: str | None) -> None:
    assert label_for(sandbox, port) == label
    if label is not None:
        assert parse_label(label) == (sandbox, port)
        assert len(label) <= 63


@pytest.mark.parametrize("label", [
    f"08080-{HEX}", f"0-{HEX}", f"65536-{HEX}", f"99999-{HEX}", f"8080--{HEX}", f"8080-{HEX}-", f"-8080-{HEX}",
    f"8080-{HEX.upper()}", f"8080-n_1-{HEX}", f"8080_{HEX}", f"8080-{HEX}0", f"8080-{HEX[:-1]}", f"8080-a-b-{HEX}",
    f"8080-abcdefghij0123456-{HEX}", f"+8080-{HEX}", f"８０８０-{HEX}", "", "8080", f"{HEX}", "web--acme", "web",
])  # fmt: skip
def test_a_label_spelled_otherwise_names_nothing(label: str) -> None:
    assert parse_label(label) is None


@pytest.mark.parametrize(("header", "ours", "rest"), [
    ("a=1; b=2", [], "a=1; b=2"),
    ("a=1; sbx-port=sgp_x; b=2", ["sgp_x"], "a=1; b=2"),
    ("__Host-sbx-port=sgp_y", ["sgp_y"], ""),
    ("SBX-PORT=sgp_z;a=1", ["sgp_z"], "a=1"),
    (" __host-SBX-port = sgp_q ", ["sgp_q"], ""),
    ('sbx-port="sgp_quoted"', ["sgp_quoted"], ""),
    ("other=sgp_hidden; keep=1", ["sgp_hidden"], "keep=1"),  # a token under another name is still a token
    ("sgp_bare; keep=1", ["sgp_bare"], "keep=1"),
    ("sbx-port=; keep=1", [""], "keep=1"),
    ("", [], ""),
])  # fmt: skip
def test_the_cookies_of_a_request(header: str, ours: list[str], rest: str) -> None:
    assert credentials.split_cookies(header) == (ours, rest)


@pytest.mark.parametrize(("query", "tokens", "rest"), [
    ("", [], ""),
    ("a=1&b=2", [], "a=1&b=2"),
    ("sbx_port_token=sgp_1&a=1", ["sgp_1"], "a=1"),
    ("a=1&SBX_PORT_TOKEN=sgp_2", ["sgp_2"], "a=1"),
    ("sbx%5Fport%5Ftoken=sgp_3", ["sgp_3"], ""),
    ("x=sgp%5F4&y=%20", ["sgp_4"], "y=%20"),  # a token under another name is still a token
    ("sbx_port_token=nope&q=a+b", ["nope"], "q=a+b"),
])  # fmt: skip
def test_the_query_of_a_request(query: str, tokens: list[str], rest: str) -> None:
    assert credentials.split_query(query) == (tokens, rest)


@pytest.mark.parametrize(("name", "value", "kept"), [
    ("authorization", "Bearer sgk_secret", None),
    ("authorization", "bearer \t sgk_secret ", None),
    ("authorization", "Basic c2drXw==sgk_", None),
    ("authorization", "Bearer sgp_token", None),
    ("authorization", "Token sgp_token", None),
    ("authorization", "Basic dXNlcjpwYXNz", "Basic dXNlcjpwYXNz"),
    ("authorization", "Bearer app-token", "Bearer app-token"),
    ("x-sandbox-org", "acme", None),
    ("cookie", "sbx-port=sgp_x", None),
    ("cookie", "theme=dark; sbx-port=sgp_x", "theme=dark"),
    ("cookie", "theme=dark", "theme=dark"),
    ("x-custom", "kept as sent", "kept as sent"),
])  # fmt: skip
def test_what_a_guest_is_given(name: str, value: str, kept: str | None) -> None:
    assert keep_for_guest(name, value) == kept


def test_the_cookie_is_of_its_one_host() -> None:
    https = credentials.set_cookie_header("https", "sgp_t", 3600)
    assert https == "__Host-sbx-port=sgp_t; Path=/; Max-Age=3600; HttpOnly; SameSite=Lax; Secure"
    plain = credentials.set_cookie_header("http", "sgp_t", -5)
    assert plain == "sbx-port=sgp_t; Path=/; Max-Age=0; HttpOnly; SameSite=Lax"
    assert "domain" not in (https + plain).lower()
    token = credentials.new_token()
    assert (
        token.startswith("sgp_")
        and len(token) == 52
        and credentials.split_query(credentials.token_url("http://x/", token).partition("?")[2])
        == ([token], "")
    )


@pytest.mark.parametrize(("raw", "port"), [("1", 1), ("8080", 8080), ("65535", 65535)])
def test_a_port_of_the_path(raw: str, port: int) -> None:
    assert parse_port(raw) == port


@pytest.mark.parametrize("raw", ["0", "65536", "-1", "08080", "+80", "８０", "80a", "", "1e3", " 80"])
def test_a_port_of_the_path_out_of_range(raw: str) -> None:
    with pytest.raises(InvalidRequest, match=r"must be an integer from 1 to 65535"):
        parse_port(raw)


@pytest.mark.parametrize(("ttl", "ok"), [(1, True), (3600, True), (86400, True), (0, False), (-1, False),
                                         (86401, False)])  # fmt: skip
def test_a_token_lifetime(ttl: int, ok: bool) -> None:
    if ok:
        assert check_ttl(ttl) == ttl
    else:
        with pytest.raises(InvalidRequest, match=r"ttl_secs must be from 1 to 86400"):
            check_ttl(ttl)


@pytest.mark.parametrize(("domain", "services", "result"), [
    (None, None, None),
    ("ports.example.com", None, "ports.example.com"),
    ("Ports.Example.COM.", "svc.example.com", "ports.example.com"),
    ("ports.example.com:8443", None, "ports.example.com:8443"),
    ("ports.test", "ports.test:8443", "it is also --services-domain"),
    ("ports..example", None, "is no DNS name"),
    ("ports.example.com:x", None, "is no DNS name"),
    ("*.example.com", None, "is no DNS name"),
    ("-a.example", None, "is no DNS name"),
])  # fmt: skip
def test_the_ports_domain(domain: str | None, services: str | None, result: str | None) -> None:
    if result is None or "." in result and " " not in result:
        assert check_ports_domain(domain, services) == result
    else:
        with pytest.raises(click.BadParameter, match=result):
            check_ports_domain(domain, services)
