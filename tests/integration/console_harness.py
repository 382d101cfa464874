"""What the web console's browser tests share: Debian's Chromium driven by Playwright, and a tab that records
what the page reports about the security policy.

    from console_harness import Tab, browser_fixture, needs_browser
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sandboxd_harness import REPO

from sbx.web.console import ASSETS_DIR

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = REPO / "test-artifacts" / "console"

#: Skip a module when the browser or the built console is missing (scripts/install.sh --test-deps gives both).
needs_browser = pytest.mark.skipif(
    not CHROMIUM.exists() or not (ASSETS_DIR / "index.html").exists(),
    reason="needs Debian's chromium and the built console: run scripts/install.sh --no-start --test-deps",
)


@pytest.fixture(scope="module", name="browser")
def browser_fixture() -> Iterator[Any]:
    """One Chromium per test module (import it into the module to use it)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # Playwright cannot download its own browsers here: Debian's Chromium it is.
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            yield browser
        finally:
            browser.close()


class Tab:
    """A browser tab on the console at ``url`` (the gateway's), failing ``close`` if the page reported a
    Content Security Policy violation. ``wait_ms``: how long the page waits for what it shows."""

    def __init__(
        self, browser: Any, url: str, width: int = 1280, height: int = 800, wait_ms: int = 60_000
    ) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": height}, accept_downloads=True)
        self.page = self.context.new_page()
        self.page.set_default_timeout(wait_ms)
        self.url = url
        self.csp_violations: list[str] = []
        self.page.on("console", self._console)

    def _console(self, message: Any) -> None:
        if "Content Security Policy" in message.text or "Content-Security-Policy" in message.text:
            self.csp_violations.append(message.text)

    def sign_in(self, key: str) -> None:
        self.page.goto(self.url + "/console/")
        self.page.fill("#api-key", key)
        self.page.click("button:has-text('Sign in')")
        self.page.wait_for_selector("h1:has-text('Sandboxes')")

    def go(self, hash_path: str) -> None:
        """Open a page afresh (a reload: going to another hash alone would keep a dialog left open)."""
        self.page.goto(f"{self.url}/console/{hash_path}")
        self.page.reload()

    def shot(self, name: str) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)

    def no_markup_ran(self) -> None:
        """Nothing hostile became markup: no <img> or <script> in the app, and no handler ran."""
        assert self.page.evaluate("window.__pwned") is None
        assert self.page.locator("#app img, #app script, dialog img").count() == 0

    def close(self) -> None:
        assert self.csp_violations == [], self.csp_violations
        self.context.close()
