"""The console's Ports tab in Debian's Chromium against a real gateway run with ``--ports-domain`` over a real
sandboxd: the guest's listening port is listed; its "Open" link makes a token URL when clicked and opens it in a
new tab, where the guest's page loads and its WebSocket answers through the cookie the token was traded for (the
browser maps ``*.ports.test`` to 127.0.0.1 with ``--host-resolver-rules``: nothing leaves loopback); the
public/private toggle changes what a browser without credentials gets. Also the Nodes page's drain showing the
persistent sandboxes it suspended."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from console_harness import CHROMIUM, Tab, needs_browser
from ports_world import CHROMIUM_ARGS, ECHO_TEXT, GUEST_PORT, PAGE_TEXT, PortsWorld, ports_world, wait_until
from sandboxd_harness import Sandboxd

WAIT_MS = 60_000

pytestmark = [needs_browser, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def world(sandboxd: Sandboxd) -> Iterator[PortsWorld]:
    with ports_world(sandboxd, prefix="sbxconsole-ports-") as made:
        yield made


@pytest.fixture(scope="module")
def box(world: PortsWorld) -> Iterator[str]:
    sandbox_id = world.sandbox_with_server()
    yield sandbox_id
    world.gw.request("DELETE", f"/v1/sandboxes/{sandbox_id}", key=world.keys["owner"])


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Chromium sending every name under the ports domain to loopback."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


def status_without_credentials(browser: Any, url: str) -> tuple[int, str]:
    """What a browser holding no key and no cookie gets at ``url``: (status, text of the page)."""
    context = browser.new_context()
    try:
        page = context.new_page()
        response = page.goto(url)
        return response.status, page.inner_text("body")
    finally:
        context.close()


def test_open_a_private_port_from_the_page_then_toggle_it(browser: Any, world: PortsWorld, box: str) -> None:
    url = world.port_url(box, GUEST_PORT)
    tab = Tab(browser, world.url, wait_ms=WAIT_MS)
    try:
        tab.sign_in(world.keys["owner"])
        tab.go(f"#/sandboxes/{box}/ports")
        page = tab.page
        row = page.locator("tr", has=page.locator(f"code:text-is('{url}')"))
        row.wait_for()
        assert "private" in row.inner_text() and "yes" in row.inner_text()
        tab.shot("sandbox-ports")
        assert status_without_credentials(browser, url)[0] == 401

        # Open: a token made on the click, opened in a new tab, traded for a cookie and redirected without it.
        with tab.context.expect_page() as opened:
            page.click(f"a[aria-label='Open port {GUEST_PORT}']")
        guest = opened.value
        guest.wait_for_selector(f"#hello:text-is('{PAGE_TEXT}')")
        guest.wait_for_selector(f"#ws:text-is('{ECHO_TEXT}')")  # the WebSocket, with that cookie
        assert guest.url == url, guest.url
        assert guest.evaluate("window.opener") is None
        # The guest's page knows nothing of the console's key.
        assert world.keys["owner"] not in guest.content()
        guest.close()

        # Public: confirmed, then any browser opens it; private again: 401.
        page.click(f"button[aria-label='Make port {GUEST_PORT} public']")
        page.click("dialog button:has-text('Make public')")
        row.locator("span.tag.public").wait_for()
        status, text = status_without_credentials(browser, url)
        assert status == 200 and PAGE_TEXT in text, (status, text[:200])
        page.click(f"button[aria-label='Make port {GUEST_PORT} private']")
        row.locator("span.tag.private").wait_for()
        assert status_without_credentials(browser, url)[0] == 401
        tab.shot("sandbox-ports-private-again")
    finally:
        tab.close()


def test_a_drain_lists_the_persistent_sandboxes_it_suspended(
    browser: Any, world: PortsWorld, box: str
) -> None:
    name = f"keep-{secrets.token_hex(3)}"
    kept = world.ok("POST", "/v1/sandboxes", {"name": name, "persistent": True}, status=201)
    tab = Tab(browser, world.url, wait_ms=WAIT_MS)
    try:
        tab.sign_in(world.keys["admin"])
        tab.go("#/admin/nodes")
        page = tab.page
        page.click("button[aria-label='Drain n']")
        page.click("dialog button:has-text('Drain')")
        page.wait_for_selector("p.drain-result:has-text('1 persistent suspended')")
        listed = page.locator(".drain-suspended a")
        assert listed.all_inner_texts() == [kept["id"]]
        assert listed.get_attribute("href") == f"#/sandboxes/{kept['id']}"
        tab.shot("admin-drain-suspended")
        page.click("dialog button:has-text('Close')")
        wait_until(
            lambda: world.ok("GET", f"/v1/sandboxes/{kept['id']}")["state"] == "suspended",
            "the drained one asleep",
        )
    finally:
        tab.close()
        world.ok("POST", "/v1/admin/nodes/n/cordon", {"cordoned": False}, key="admin")
        world.gw.request("DELETE", f"/v1/sandboxes/{kept['id']}", key=world.keys["owner"])
