"""The web console in a real browser (Debian's Chromium driven by Playwright) against a real sandbox-gateway in
front of a real sandboxd: sign in, create a sandbox, a terminal (echo hi), files (drag-and-drop upload, download,
delete), processes, a metrics chart, events, snapshots, a persistent sandbox (its idle suspend shown live, stop,
resume), the admin pages (cordon a node, create and revoke a key) and a revoked key's terminal cut. A screenshot of each page goes to test-artifacts/console/ (1280x800, and phone
width for two pages). Also, without a browser: the console's security headers, and the gateway's Origin guard
still refusing a foreign Origin on the console and the API."""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from console_harness import Tab, needs_browser
from gateway_harness import FAST_ARGS, GatewayProcess
from sandboxd_harness import Sandboxd

#: Milliseconds the browser waits for what a page shows (a sandbox boots, a shell starts).
WAIT_MS = 60_000

pytestmark = needs_browser


class Fleet:
    def __init__(self, gw: GatewayProcess, node: Sandboxd, keys: dict[str, str]) -> None:
        self.gw, self.node, self.keys = gw, node, keys
        self.url = f"http://127.0.0.1:{gw.port}"


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxconsole-", dir="/var/tmp"))
    (workdir / "n1").mkdir()
    (workdir / "gw").mkdir()
    node = Sandboxd(workdir / "n1", args=["--node-id", "c"]).start()
    gw = GatewayProcess(workdir / "gw", [("n1", node)], [*FAST_ARGS])
    keys = {"admin": gw.create_key("root", "admin")}
    gw.start()
    try:
        yield Fleet(gw, node, keys)
    finally:
        gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def admin_tab(browser: Any, fleet: Fleet) -> Iterator[Tab]:
    tab = Tab(browser, fleet.url, wait_ms=WAIT_MS)
    yield tab
    tab.close()


def terminal_text(tab: Tab) -> str:
    return str(tab.page.inner_text(".xterm-rows"))


def wait_for_terminal(tab: Tab, pattern: str) -> None:
    tab.page.wait_for_function(
        "pattern => new RegExp(pattern, 'm').test(document.querySelector('.xterm-rows')?.innerText ?? '')",
        arg=pattern,
    )


# -- without a browser: headers and the guard ---------------------------------------------------------------------


def test_console_answers_carry_the_security_headers(fleet: Fleet) -> None:
    page = fleet.gw.request("GET", "/console/")
    assert page.status == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    nonce = re.search(rb'nonce="([^"]+)"', page.body)
    assert nonce is not None and b"__CSP_NONCE__" not in page.body
    csp = page.headers["content-security-policy"]
    assert f"style-src 'self' 'nonce-{nonce.group(1).decode()}'" in csp
    for directive in ("default-src 'none'", "script-src 'self';", "frame-ancestors 'none'", "base-uri 'none'",
                      "connect-src 'self'", "object-src 'none'", "form-action 'none'"):  # fmt: skip
        assert directive in csp, (directive, csp)
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "http" not in csp
    again = fleet.gw.request("GET", "/console/")
    assert re.search(rb'nonce="([^"]+)"', again.body).group(1) != nonce.group(1)  # type: ignore[union-attr]
    for path in ("/console/", "/console/console.js", "/console/console.css", "/console/nothing", "/console"):
        resp = fleet.gw.request("GET", path)
        assert resp.headers["x-frame-options"] == "DENY", path
        assert resp.headers["x-content-type-options"] == "nosniff", path
        assert resp.headers["referrer-policy"] == "no-referrer", path
        assert "frame-ancestors 'none'" in resp.headers["content-security-policy"], path
    script = fleet.gw.request("GET", "/console/console.js")
    assert script.headers["content-type"] == "text/javascript; charset=utf-8" and "etag" in script.headers
    same = fleet.gw.request("GET", "/console/console.js", headers={"If-None-Match": script.headers["etag"]})
    assert same.status == 304
    assert fleet.gw.request("GET", "/console").headers["location"] == "/console/"
    missing = fleet.gw.request("GET", "/console/nothing")
    assert (missing.status, *missing.error) == (404, "not_found", "the console has no file 'nothing'")
    posted = fleet.gw.request("POST", "/console/", {"x": 1})
    assert (posted.status, posted.error[0]) == (405, "invalid_request")
    licences = fleet.gw.request("GET", "/console/THIRD-PARTY-LICENSES.txt").body.decode()
    assert "@xterm/xterm" in licences and "uplot" in licences and "MIT" in licences


@pytest.mark.parametrize("path", ["/console/", "/console/console.js", "/v1/sandboxes", "/v1/whoami"])
def test_the_guard_still_refuses_a_foreign_origin(fleet: Fleet, path: str) -> None:
    resp = fleet.gw.request("GET", path, key=fleet.keys["admin"], headers={"Origin": "http://evil.example"})
    assert (resp.status, resp.error[0]) == (403, "forbidden_origin")
    own = fleet.gw.request("GET", path, key=fleet.keys["admin"], headers={"Origin": fleet.url})
    assert own.status == 200


def test_the_api_still_needs_a_key(fleet: Fleet) -> None:
    assert fleet.gw.request("GET", "/v1/sandboxes").status == 401
    assert fleet.gw.request("GET", "/consolex").status == 401  # only /console and below are open


# -- in the browser -----------------------------------------------------------------------------------------------


def test_sign_in(admin_tab: Tab, fleet: Fleet) -> None:
    page = admin_tab.page
    page.goto(fleet.url + "/console/")
    admin_tab.shot("signin")
    page.fill("#api-key", "sgk_not-a-key")
    page.click("button:has-text('Sign in')")
    page.wait_for_selector("text=401 unauthorized: unknown or revoked API key")
    assert page.evaluate("sessionStorage.getItem('sbx.key')") is None
    admin_tab.sign_in(fleet.keys["admin"])
    assert page.evaluate("document.cookie") == ""  # the key is in session storage only
    admin_tab.shot("sandboxes-empty")


def test_create_a_sandbox_and_type_in_its_terminal(admin_tab: Tab, fleet: Fleet) -> None:
    page = admin_tab.page
    page.click("button:has-text('Create sandbox')")
    page.fill("dialog input[name=name]", "web1")
    page.fill("dialog textarea[name=labels]", "team=web")
    admin_tab.shot("create-form")
    page.click("dialog button:has-text('Create')")
    page.wait_for_selector("h1:has-text('web1')")
    admin_tab.shot("sandbox-overview")
    page.click("nav.tabs >> text=Terminal")
    page.click("#new-shell")
    page.wait_for_selector(".term-status:has-text('attached to process')")
    wait_for_terminal(admin_tab, r"\$\s*$")  # the prompt: input typed while bash starts may be dropped
    page.click(".terminal")
    page.keyboard.type("echo hi\n")
    wait_for_terminal(admin_tab, r"^hi\s*$")
    assert "echo hi" in terminal_text(admin_tab)
    admin_tab.shot("terminal")
    page.goto(fleet.url + "/console/#/sandboxes")
    page.wait_for_selector("td >> text=web1")
    page.fill("#label-filter", "team=web")
    page.press("#label-filter", "Enter")
    page.wait_for_selector("td >> text=team=web")
    admin_tab.shot("sandboxes")


def _sandbox_id(fleet: Fleet, name: str) -> str:
    listed = fleet.gw.request("GET", "/v1/sandboxes", key=fleet.keys["admin"]).json()["sandboxes"]
    return str(next(s["id"] for s in listed if s["name"] == name))


def test_files_upload_by_drop_download_and_delete(admin_tab: Tab, fleet: Fleet) -> None:
    page, ref = admin_tab.page, _sandbox_id(fleet, "web1")
    page.goto(f"{fleet.url}/console/#/sandboxes/{ref}/files")
    page.wait_for_selector(".files table, .files .empty")
    dropped = page.evaluate_handle(
        "() => { const t = new DataTransfer();"
        " t.items.add(new File(['hello from the browser\\n'], 'greeting.txt', {type: 'text/plain'})); return t; }"
    )
    page.dispatch_event(".files", "drop", {"dataTransfer": dropped})
    page.wait_for_selector(".files td >> text=greeting.txt")
    stored = fleet.gw.request(
        "GET", f"/v1/sandboxes/{ref}/files?path=/sandbox/home/greeting.txt", key=fleet.keys["admin"]
    )
    assert stored.body == b"hello from the browser\n"
    admin_tab.shot("files")
    with page.expect_download() as download:
        page.click("button[aria-label='Download greeting.txt']")
    assert Path(download.value.path()).read_bytes() == b"hello from the browser\n"
    assert download.value.suggested_filename == "greeting.txt"
    page.click("button[aria-label='Delete greeting.txt']")
    page.click("dialog button:has-text('Delete')")
    page.wait_for_selector(".files td >> text=greeting.txt", state="detached")
    gone = fleet.gw.request(
        "GET", f"/v1/sandboxes/{ref}/files?path=/sandbox/home/greeting.txt", key=fleet.keys["admin"]
    )
    assert (gone.status, gone.error[0]) == (404, "not_found")


def test_processes_metrics_events_and_snapshots(admin_tab: Tab, fleet: Fleet) -> None:
    page, ref = admin_tab.page, _sandbox_id(fleet, "web1")
    page.goto(f"{fleet.url}/console/#/sandboxes/{ref}/processes")
    page.click("button:has-text('Start process')")
    page.fill("dialog input[name=command]", "echo from-a-process")
    page.click("dialog button:has-text('Start')")
    page.wait_for_selector("pre.output >> text=from-a-process")
    page.wait_for_selector("pre.output >> text=exited with code 0")
    admin_tab.shot("processes")
    page.click("nav.tabs >> text=Metrics")
    # A chart drawn from at least one sample (one every 5 s while the sandbox runs).
    page.wait_for_selector("text=/[1-9][0-9]* samples?, one every 5 s/")
    assert page.locator(".chart canvas").count() == 4
    admin_tab.shot("metrics")
    page.click("nav.tabs >> text=Events")
    page.wait_for_selector("code >> text=sandbox.created")
    page.wait_for_selector("code >> text=file.written")
    admin_tab.shot("events")
    page.click("nav.tabs >> text=Snapshots")
    page.wait_for_selector("text=No snapshots of this sandbox.")
    admin_tab.shot("snapshots")


def test_admin_pages_and_cordon_a_node(admin_tab: Tab, fleet: Fleet) -> None:
    page = admin_tab.page
    page.click("header nav >> text=Nodes")
    page.wait_for_selector("td >> text=n1")
    page.click("button[aria-label='Cordon n1']")
    page.wait_for_selector("button[aria-label='Uncordon n1']")
    node = fleet.gw.request("GET", "/v1/admin/nodes", key=fleet.keys["admin"]).json()["nodes"][0]
    assert node["cordoned"] is True
    admin_tab.shot("admin-nodes")
    page.click("button[aria-label='Uncordon n1']")
    page.wait_for_selector("button[aria-label='Cordon n1']")
    # The node itself takes sandboxes again, as the gateway sees it on its polls (0.3 s apart).
    deadline = time.monotonic() + 10
    while (node := fleet.gw.request("GET", "/v1/admin/nodes", key=fleet.keys["admin"]).json()["nodes"][0])[
        "status"
    ]["cordoned"]:
        assert time.monotonic() < deadline, f"the node stays cordoned after an uncordon: {node}"
        time.sleep(0.1)
    for link, shown, name in [
        ("Lost", "text=No sandbox is on a lost node.", "admin-lost"),
        ("Keys", "td >> text=root", "admin-keys"),
        ("All orgs", "h1:has-text('All organisations')", "admin-orgs"),
        ("Audit", "code >> text=api.request", "admin-audit"),
        ("Quotas", "h1:has-text('Tenant quotas')", "admin-quotas"),
        ("Organisations", "h1:has-text('Organisations')", "orgs"),
    ]:
        page.click(f"header nav >> text={link}")
        page.wait_for_selector(shown)
        admin_tab.shot(name)


def test_a_revoked_keys_terminal_is_cut(admin_tab: Tab, browser: Any, fleet: Fleet) -> None:
    page = admin_tab.page
    page.click("header nav >> text=Keys")
    page.click("button:has-text('Create key')")
    page.fill("dialog input[name=user]", "eve")
    page.click("dialog button:has-text('Create')")
    secret = page.input_value("#new-secret")
    assert secret.startswith("sgk_")
    admin_tab.shot("admin-key-created")
    page.click("dialog button:has-text('Done')")
    eve = Tab(browser, fleet.url, wait_ms=WAIT_MS)
    made: dict[str, Any] | None = None
    try:
        eve.sign_in(secret)
        made = fleet.gw.create(secret, name="eve1")
        eve.page.goto(f"{fleet.url}/console/#/sandboxes/{made['id']}/terminal")
        eve.page.click("#new-shell")
        eve.page.wait_for_selector(".term-status:has-text('attached to process')")
        wait_for_terminal(eve, r"\$\s*$")
        key_id = next(k["id"] for k in fleet.gw.request("GET", "/v1/admin/keys", key=fleet.keys["admin"]).json()["keys"]
                      if k["user"] == "eve")  # fmt: skip
        page.click(f"button[aria-label='Revoke {key_id}']")
        page.click("dialog button:has-text('Revoke')")
        page.wait_for_selector("td >> text=/revoked/")
        eve.page.wait_for_selector(
            ".term-status:has-text('terminal cut: this request was ended because its API key was revoked')"
        )
        assert "terminal cut" in terminal_text(eve)
        eve.shot("terminal-cut")
    finally:
        eve.close()
        if made is not None:
            fleet.gw.request("DELETE", f"/v1/sandboxes/{made['id']}", key=fleet.keys["admin"])


def test_a_persistent_sandbox_sleeps_stops_and_resumes_on_the_page(browser: Any, fleet: Fleet) -> None:
    """A persistent sandbox created from the form: its badge, its idle suspend shown on the open page without a
    reload, Stop (confirmed) shown as stopped, Resume shown as running, then suspended again. On the list: the badge,
    Stop only for a persistent one, and a run through the API waking a stopped one shown live. Its idle timeout (8 s)
    is longer than the page's look (every 5 s), so a page whose look counted as activity would fail here."""
    key = fleet.keys["admin"]
    tab = Tab(browser, fleet.url, wait_ms=WAIT_MS)
    plain = fleet.gw.create(key, name="plain1")
    # The default idle timeout: it stays running while the test looks at it.
    other = fleet.gw.create(key, name="keeper2", persistent=True)
    made: list[str] = [plain["id"], other["id"]]
    try:
        tab.sign_in(key)
        page = tab.page
        page.click("button:has-text('Create sandbox')")
        page.fill("dialog input[name=name]", "keeper")
        page.fill("dialog input[name=idle_timeout_secs]", "8")
        page.check("dialog input[name=persistent]")
        page.click("dialog button:has-text('Create')")
        page.wait_for_selector("h1:has-text('keeper') .badge.persistent")
        ref = _sandbox_id(fleet, "keeper")
        made.append(ref)
        record = fleet.gw.request("GET", f"/v1/sandboxes/{ref}", key=key).json()
        assert (record["persistent"], record["idle_timeout_secs"]) == (True, 8), record
        page.wait_for_selector("dd >> text=/^yes: suspended, not terminated/")
        # A mark in the page's window: a reload would wipe it.
        page.evaluate("window.__same_page = true")
        page.wait_for_selector(".sandbox-head .state.suspended")
        page.wait_for_selector('dd >> text="suspended"')  # the overview follows the state too
        assert fleet.gw.request("GET", f"/v1/sandboxes/{ref}", key=key).json()["state"] == "suspended"
        tab.shot("sandbox-persistent-suspended")
        head = page.locator(".sandbox-head")
        assert head.locator("button", has_text="Suspend").count() == 0
        head.locator("button", has_text="Stop").click()
        page.click("dialog button:has-text('Stop')")
        page.wait_for_selector(".sandbox-head .state.stopped")
        page.wait_for_selector(".sandbox-head >> text=(request)")
        assert head.locator("button", has_text="Stop").count() == 0
        stopped = fleet.gw.request("GET", f"/v1/sandboxes/{ref}", key=key).json()
        assert (stopped["state"], stopped["stopped_reason"]) == ("stopped", "request"), stopped
        tab.shot("sandbox-persistent-stopped")
        head.locator("button", has_text="Resume").click()
        page.wait_for_selector(".sandbox-head .state.running")
        # Idle 8 s again: suspended again, on the same page.
        page.wait_for_selector(".sandbox-head .state.suspended")
        assert page.evaluate("window.__same_page") is True, "the page was reloaded"

        page.click("header nav >> text=Sandboxes")
        row = page.locator("tr", has=page.locator("a", has_text="keeper2"))
        row.locator(".badge.persistent").wait_for()
        row.locator(".state.running").wait_for()
        plain_row = page.locator("tr", has=page.locator("a", has_text="plain1"))
        plain_row.locator(".state.running").wait_for()
        assert plain_row.locator(".badge").count() == 0
        assert plain_row.locator("button", has_text="Stop").count() == 0
        row.locator("button", has_text="Stop").click()
        page.click("dialog button:has-text('Stop')")
        row.locator(".state.stopped").wait_for()
        assert row.locator("button", has_text="Resume").count() == 1
        assert fleet.gw.request("GET", f"/v1/sandboxes/{other['id']}", key=key).json()["state"] == "stopped"
        tab.shot("sandboxes-persistent")
        # A command through the API wakes it; the list shows it running at its next refresh, without a reload.
        page.evaluate("window.__same_page = true")
        woken = fleet.gw.request("POST", f"/v1/sandboxes/{other['id']}/run", {"argv": ["true"]}, key=key)
        assert (woken.status, woken.json()["exit_code"]) == (200, 0), woken.body
        row.locator(".state.running").wait_for()
        assert page.evaluate("window.__same_page") is True, "the page was reloaded"
    finally:
        tab.close()
        for sandbox_id in made:
            fleet.gw.request("DELETE", f"/v1/sandboxes/{sandbox_id}", key=key)


def test_readable_at_phone_width(browser: Any, fleet: Fleet) -> None:
    phone = Tab(browser, fleet.url, width=390, height=844, wait_ms=WAIT_MS)
    try:
        phone.sign_in(fleet.keys["admin"])
        phone.page.wait_for_selector("td >> text=web1")
        phone.shot("phone-sandboxes")
        ref = _sandbox_id(fleet, "web1")
        phone.page.goto(f"{fleet.url}/console/#/sandboxes/{ref}/overview")
        phone.page.wait_for_selector("dl.details")
        phone.shot("phone-sandbox")
        overflow = phone.page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"the page is {overflow}px wider than a phone"
    finally:
        phone.close()


def test_without_the_console_its_path_needs_a_key_like_any_other(tmp_path: Path, fleet: Fleet) -> None:
    gw = GatewayProcess(tmp_path, [("n1", fleet.node)], ["--no-console"])
    key = gw.create_key("root", "admin")
    gw.start()
    try:
        assert gw.request("GET", "/console/").status == 401
        resp = gw.request("GET", "/console/", key=key)
        assert (resp.status, resp.error[0]) == (404, "not_found")
    finally:
        gw.stop()
