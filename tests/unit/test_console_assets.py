"""The web console's assets as ``sbx.web.console`` serves them: the page with a fresh nonce in its policy, files
with an ETag, a missing build or file answered 404 saying what to do, no method but GET and HEAD, and the security
headers on every answer, errors included."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from sbx.web.console import Console, security_headers


async def client_of(console: Console) -> TestClient:
    app = web.Application()
    app.add_routes(console.routes())
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


@pytest.fixture
async def built(tmp_path: Path) -> AsyncIterator[TestClient]:
    (tmp_path / "index.html").write_bytes(b'<script src="console.js" nonce="__CSP_NONCE__"></script>')
    (tmp_path / "console.js").write_bytes(b"export {};")
    (tmp_path / ".sbx-build-stamp").write_text("x")
    (tmp_path / "notes.md").write_text("not served")
    client = await client_of(Console(tmp_path))
    yield client
    await client.close()


async def test_the_page_carries_a_new_nonce_each_time(built: TestClient) -> None:
    nonces = []
    for _ in range(2):
        resp = await built.get("/console/")
        body = await resp.text()
        nonce = body.split('nonce="')[1].split('"')[0]
        assert "__CSP_NONCE__" not in body and len(nonce) >= 20
        assert f"'nonce-{nonce}'" in resp.headers["Content-Security-Policy"]
        assert resp.headers["Cache-Control"] == "no-store"
        nonces.append(nonce)
    assert nonces[0] != nonces[1]


async def test_a_file_is_revalidated_by_its_etag(built: TestClient) -> None:
    resp = await built.get("/console/console.js")
    assert resp.headers["Content-Type"] == "text/javascript; charset=utf-8"
    assert "nonce" not in resp.headers["Content-Security-Policy"]
    again = await built.get("/console/console.js", headers={"If-None-Match": resp.headers["ETag"]})
    assert again.status == 304


@pytest.mark.parametrize(
    ("method", "path", "status", "code", "message"),
    [
        ("GET", "/console/notes.md", 404, "not_found", "the console has no file 'notes.md'"),
        ("GET", "/console/.sbx-build-stamp", 404, "not_found", "the console has no file '.sbx-build-stamp'"),
        ("GET", "/console/sub%2Findex.html", 404, "not_found", "the console has no file 'sub/index.html'"),
        ("POST", "/console/", 405, "invalid_request", "POST is not allowed on /console/: the console is read-only"),
        ("DELETE", "/console/console.js", 405, "invalid_request",
         "DELETE is not allowed on /console/console.js: the console is read-only"),
    ],
)  # fmt: skip
async def test_refusals_carry_the_error_body_and_the_headers(
    built: TestClient, method: str, path: str, status: int, code: str, message: str
) -> None:
    resp = await built.request(method, path)
    assert resp.status == status
    assert await resp.json() == {"error": {"code": code, "message": message}}
    for name, value in security_headers().items():
        assert resp.headers[name] == value


async def test_the_bare_prefix_redirects(built: TestClient) -> None:
    resp = await built.get("/console", allow_redirects=False)
    assert (resp.status, resp.headers["Location"]) == (308, "/console/")
    assert resp.headers["X-Frame-Options"] == "DENY"


async def test_a_missing_build_says_how_to_build(tmp_path: Path) -> None:
    client = await client_of(Console(tmp_path / "nothing"))
    try:
        resp = await client.get("/console/")
        assert resp.status == 404
        assert (await resp.json())["error"]["message"] == (
            "the web console is not built: run scripts/install.sh (it runs npm ci and npm run build in console/)"
        )
    finally:
        await client.close()
