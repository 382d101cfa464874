"""Job notifications' destination rules (sbx.gateway.jobs.notify): the URL checked when a job is given, the
address checked again when connecting (a name that resolves to loopback is refused at connect time), and posts
to a receiver on loopback with --notify-allow-private."""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from sbx.api.errors import InvalidRequest, Unsupported
from sbx.api.jobs import JobNotification
from sbx.gateway.jobs.notify import Notifier, NotifyAddresses, NotifyPolicy, NotifyRefused, body_of, check_url

PUBLIC = NotifyPolicy()
PRIVATE = NotifyPolicy(allow_private=True)
OFF = NotifyPolicy(enabled=False)

URLS = [
    ("https://hooks.example.com/jobs?t=1", PUBLIC, None),
    ("https://203.0.113.9/x", PUBLIC, None),
    ("https://localhost/x", PUBLIC, None),  # a name: judged when connecting
    ("https://127.0.0.1/x", PUBLIC, "private or loopback"),
    ("https://10.1.2.3/x", PUBLIC, "private or loopback"),
    ("https://[::1]/x", PUBLIC, "private or loopback"),
    ("https://[::ffff:127.0.0.1]/x", PUBLIC, "private or loopback"),
    ("https://169.254.169.254/latest", PRIVATE, "link-local, metadata"),
    ("https://100.100.100.200/x", PRIVATE, "link-local, metadata"),
    ("https://127.0.0.1:8443/x", PRIVATE, None),
    ("http://127.0.0.1:8080/x", PRIVATE, None),
    ("http://localhost:8080/x", PRIVATE, None),
    ("http://127.0.0.1:8080/x", PUBLIC, "use https"),
    ("http://10.0.0.1/x", PRIVATE, "use https"),
    ("http://hooks.example.com/x", PRIVATE, "use https"),
    ("ftp://example.com/x", PUBLIC, "give an https URL"),
    ("https:///x", PUBLIC, "give an https URL"),
    ("https://u:p@example.com/x", PUBLIC, "user or password"),
    ("https://example.com/x#frag", PUBLIC, "fragment"),
    ("https://example.com:99999/x", PUBLIC, "is not a URL"),
    ("https://example.com/a b", PUBLIC, "not a URL"),
    ("https://example.com/" + "a" * 2048, PUBLIC, "not a URL"),
]


@pytest.mark.parametrize(("url", "policy", "words"), URLS)
def test_urls(url: str, policy: NotifyPolicy, words: str | None) -> None:
    if words is None:
        assert check_url(url, policy) == url
    else:
        with pytest.raises(InvalidRequest, match=words):
            check_url(url, policy)


def test_no_notify_refuses_any_url_as_unsupported() -> None:
    with pytest.raises(Unsupported, match="--no-notify"):
        check_url("https://hooks.example.com/x", OFF)


class NoHost:
    def get(self) -> set[Any]:
        return set()


ADDRESSES = [
    ("8.8.8.8", False, False, None),
    ("127.0.0.1", False, False, "private or loopback"),
    ("192.168.1.1", False, False, "private or loopback"),
    ("127.0.0.1", True, False, None),
    ("10.0.0.1", True, False, None),
    ("169.254.169.254", True, False, "link-local, metadata"),
    ("fe80::1", True, False, "link-local, metadata"),
    ("127.0.0.1", True, True, None),
    ("::1", True, True, None),
    ("10.0.0.1", True, True, "loopback only"),
    ("8.8.8.8", True, True, "loopback only"),
]


@pytest.mark.parametrize(("address", "allow_private", "loopback_only", "words"), ADDRESSES)
def test_the_address_dialled(
    address: str, allow_private: bool, loopback_only: bool, words: str | None
) -> None:
    guard = NotifyAddresses(allow_private, loopback_only, NoHost())  # type: ignore[arg-type]
    if words is None:
        guard.check("h", 443, ipaddress.ip_address(address))
    else:
        with pytest.raises(NotifyRefused, match=words):
            guard.check("h", 443, ipaddress.ip_address(address))


def test_the_body_is_exactly_the_spec_fields() -> None:
    note = JobNotification(
        event="run.finished", job="job_1", job_state="running", run=2, state="failed", exit_code=1
    )
    assert json.loads(body_of(note)) == {"event": "run.finished", "job": "job_1", "job_state": "running", "run": 2,
                                         "state": "failed", "exit_code": 1}  # fmt: skip
    assert set(JobNotification.__struct_fields__) == {
        "event",
        "job",
        "name",
        "job_state",
        "run",
        "state",
        "exit_code",
    }


async def test_posts_reach_a_loopback_receiver_only_when_private_is_allowed() -> None:
    got: list[bytes] = []

    async def hook(request: web.Request) -> web.Response:
        got.append(await request.read())
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", hook)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    allowed = Notifier(None, None, PRIVATE)  # type: ignore[arg-type]
    refused = Notifier(None, None, PUBLIC)  # type: ignore[arg-type]
    try:
        assert await allowed._post(f"http://127.0.0.1:{server.port}/hook", b"{}") is None
        assert await allowed._post(f"http://localhost:{server.port}/hook", b"{}") is None
        assert got == [b"{}", b"{}"]
        # Without --notify-allow-private a name resolving to loopback is refused when connecting, for good.
        final, why = await refused._post(f"https://localhost:{server.port}/hook", b"{}") or (False, "")
        assert final and "private or loopback" in why
        final, why = await refused._post(f"https://127.0.0.1:{server.port}/hook", b"{}") or (False, "")
        assert final and "private or loopback" in why
        assert len(got) == 2
    finally:
        await allowed.close()
        await refused.close()
        await server.close()
