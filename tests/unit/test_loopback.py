"""Loopback rules shared by the request guard, --listen and --metrics-listen."""

from __future__ import annotations

import pytest

from sbx.net.loopback import host_header_name, is_loopback


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("localhost", True),
        ("LOCALHOST.", True),
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("[::1]", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("10.0.0.1", False),
        ("::", False),
        ("example.com", False),
        ("localhost.example.com", False),
        ("", False),
    ],
)
def test_is_loopback(host: str, expected: bool) -> None:
    assert is_loopback(host) is expected


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost", "localhost"),
        ("localhost:8080", "localhost"),
        ("Example.COM:443", "example.com"),
        ("[::1]:7000", "::1"),
        ("[::1]", "::1"),
        ("::1", "::1"),
        ("127.0.0.1:1", "127.0.0.1"),
        # Anything but a host and an optional port is no host at all (issue: a suffix after brackets passed).
        ("[::1].evil.example", ""),
        ("[::1]evil", ""),
        ("[::1]:", ""),
        ("[::1]:80x", ""),
        ("[evil.example]", ""),
        ("[::1", ""),
        ("localhost:80:80", ""),
        ("localhost:x", ""),
        ("local host", ""),
        ("localhost/", ""),
        ("", ""),
    ],
)
def test_host_header_name(header: str, name: str) -> None:
    assert host_header_name(header) == name
