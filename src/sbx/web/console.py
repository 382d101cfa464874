"""The web console's assets, served at ``/console/`` with strict security headers (docs/console.md).

The console is a single-page app built from ``console/`` at the repository's root by ``npm ci`` and ``npm run
build`` (scripts/install.sh does both) into ``sbx/web/console_assets``; the files are read once when the server
starts. They are no secret and need no key: the app signs in by itself, with the key the user pastes, against
the public API. What a browser is told, on every answer under ``/console``:

- ``Content-Security-Policy``: scripts, stylesheets, images and connections from this origin only (no inline
  script, nothing from elsewhere); ``<style>`` elements only with the nonce made for this answer (xterm.js makes
  them; the app stamps the nonce on them, see ``console/src/csp.js``); no plugins, no ``<base>``, no form posts,
  no framing (``frame-ancestors 'none'``).
- ``X-Frame-Options: DENY``, ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: no-referrer``,
  ``Cross-Origin-Opener-Policy: same-origin``, ``Cross-Origin-Resource-Policy: same-origin``, a
  ``Permissions-Policy`` that turns off what the console never uses.
- ``Cache-Control: no-store`` for the page (its nonce is new each time), ``no-cache`` with an ``ETag`` for the
  rest (revalidated, so a rebuilt console is picked up at once).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from aiohttp import web

from sbx.api.errors import InvalidRequest, NotFound, SandboxError
from sbx.web.http import error_response

log = logging.getLogger(__name__)

#: Where the build puts the assets (``console/build.mjs``).
ASSETS_DIR: Final = Path(__file__).resolve().parent / "console_assets"
#: The path the console is served under, and the label of its answers in metrics.
PREFIX: Final = "/console"
#: The placeholder ``index.html`` carries for this answer's nonce.
NONCE_PLACEHOLDER: Final = b"__CSP_NONCE__"

_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".map": "application/json",
    ".txt": "text/plain; charset=utf-8",
}
_NOT_BUILT: Final = (
    "the web console is not built: run scripts/install.sh (it runs npm ci and npm run build in console/)"
)


def content_security_policy(nonce: str | None) -> str:
    """The policy of a console answer; ``nonce`` allows the page's ``<style>`` elements (None: none at all)."""
    styles = f"'self' 'nonce-{nonce}'" if nonce else "'self'"
    return (
        "default-src 'none'; script-src 'self'; "
        f"style-src {styles}; img-src 'self' data: blob:; font-src 'self'; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'; object-src 'none'"
    )


def security_headers(nonce: str | None = None) -> dict[str, str]:
    """Every header a console answer carries besides its type and caching."""
    return {
        "Content-Security-Policy": content_security_policy(nonce),
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cross-Origin-Opener-Policy": "same-origin",
        "Cross-Origin-Resource-Policy": "same-origin",
        "Permissions-Policy": "camera=(), microphone=(), geolocation=(), payment=(), usb=()",
    }


def is_console_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


class Console:
    """The built assets, read at start (a missing build leaves the console answering 404 saying how to build
    it)."""

    def __init__(self, assets_dir: Path = ASSETS_DIR) -> None:
        self.assets: dict[str, Asset] = {}
        if not (assets_dir / "index.html").is_file():
            log.warning("web console not built; /console/ answers 404", extra={"assets_dir": str(assets_dir)})
            return
        for path in sorted(assets_dir.iterdir()):
            if path.is_file() and path.suffix in _TYPES:
                body = path.read_bytes()
                etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
                self.assets[path.name] = Asset(body, _TYPES[path.suffix], etag)

    def routes(self) -> list[web.RouteDef]:
        return [web.route("*", PREFIX, self.handle), web.route("*", PREFIX + "/{name:.*}", self.handle)]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One console answer, with the security headers whatever it is (the page, a file, an error)."""
        nonce = None
        response: web.StreamResponse
        try:
            if request.method not in ("GET", "HEAD"):
                response = error_response(InvalidRequest(
                    f"{request.method} is not allowed on {request.path}: the console is read-only"
                ))  # fmt: skip
                response.set_status(405)
                response.headers["Allow"] = "GET, HEAD"
            elif request.path == PREFIX:
                response = web.Response(status=308, headers={"Location": PREFIX + "/"})
            else:
                response, nonce = self._asset(request)
        except SandboxError as exc:
            response = error_response(exc)
        response.headers.update(security_headers(nonce))
        return response

    def _asset(self, request: web.Request) -> tuple[web.Response, str | None]:
        """The file the path names (the page with a fresh nonce), and that nonce."""
        name = request.match_info.get("name", "") or "index.html"
        if not self.assets:
            raise NotFound(_NOT_BUILT)
        asset = self.assets.get(name)
        if asset is None:
            raise NotFound(f"the console has no file {name!r}")
        if name == "index.html":
            nonce = secrets.token_urlsafe(18)
            body = asset.body.replace(NONCE_PLACEHOLDER, nonce.encode())
            return web.Response(
                body=body, headers={"Content-Type": asset.content_type, "Cache-Control": "no-store"}
            ), nonce
        if request.headers.get("If-None-Match") == asset.etag:
            return web.Response(status=304, headers={"ETag": asset.etag, "Cache-Control": "no-cache"}), None
        headers = {"Content-Type": asset.content_type, "ETag": asset.etag, "Cache-Control": "no-cache"}
        return web.Response(body=asset.body, headers=headers), None
