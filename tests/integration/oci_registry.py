"""Test helpers for pulling: a real ``docker-registry`` on loopback, an OCI image writer that pushes through
the registry API, a token server for ``auth: token``, and a proxy that can cut blob downloads."""

from __future__ import annotations

import asyncio
import base64
import collections
import gzip
import hashlib
import io
import json
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from sandboxd_harness import free_port

REGISTRY_BIN = shutil.which("docker-registry") or "/usr/bin/docker-registry"
SERVICE = "sbx-test-registry"
ISSUER = "sbx-test-issuer"

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --- the registry --------------------------------------------------------------------------------------------


class Registry:
    """``docker-registry serve`` on 127.0.0.1 with its own config and storage below ``workdir``."""

    def __init__(self, workdir: Path, auth: dict[str, Any] | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host}"
        self.storage = workdir / "storage"
        self.log_path = workdir / "registry.log"
        config: dict[str, Any] = {
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(self.storage)}, "delete": {"enabled": True},
                        "maintenance": {"uploadpurging": {"enabled": False}}},
            "http": {"addr": self.host, "secret": uuid.uuid4().hex},
        }  # fmt: skip
        if auth:
            config["auth"] = auth
        self.config_path = workdir / "config.yml"
        # YAML is a superset of JSON: no YAML library needed.
        self.config_path.write_text(json.dumps(config))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Registry:
        self.storage.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        self.proc = subprocess.Popen([REGISTRY_BIN, "serve", str(self.config_path)], stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"docker-registry exited: {self.log_path.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(
            f"docker-registry did not listen on {self.host}: {self.log_path.read_text()[-2000:]}"
        )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def blob_data_path(self, digest: str) -> Path:
        """Where the filesystem driver keeps blob ``digest`` (to corrupt it behind the registry's back)."""
        hexd = digest.split(":", 1)[1]
        return self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"


@contextmanager
def temporary_registry() -> Iterator[Registry]:
    """A started registry without auth in a fresh temporary directory; stopped and removed on leaving.

    Skips the calling test when Debian's ``docker-registry`` is not installed.
    """
    if shutil.which("docker-registry") is None:
        pytest.skip("needs Debian's docker-registry (scripts/install.sh --test-deps installs it)")
    workdir = Path(tempfile.mkdtemp(prefix="sbx-reg-"))
    registry = Registry(workdir)
    try:
        yield registry.start()
    finally:
        registry.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# --- an OCI image writer -------------------------------------------------------------------------------------


@dataclass
class Entry:
    """A tar entry for :func:`layer`: kind file, dir, symlink or whiteout-as-empty-file."""

    name: str
    data: bytes = b""
    kind: str = "file"
    link: str = ""
    mode: int = 0o644


def layer(entries: list[Entry], compress: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.mode, info.mtime = e.mode, 1_700_000_000
            if e.kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif e.kind == "symlink":
                info.type, info.linkname = tarfile.SYMTYPE, e.link
                tar.addfile(info)
            else:
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
    data = buf.getvalue()
    return gzip.compress(data, mtime=0) if compress else data


@dataclass
class Image:
    """An image ready to push: its manifest, config and layer blobs."""

    manifest: bytes
    media_type: str
    blobs: dict[str, bytes]
    layer_digests: list[str]

    @property
    def digest(self) -> str:
        return sha256(self.manifest)


def build_image(
    layers: list[bytes],
    config: dict[str, Any] | None = None,
    *,
    architecture: str = "amd64",
    variant: str | None = None,
    docker: bool = False,
) -> Image:
    """An image of ``layers`` (each gzip or plain tar bytes); OCI media types unless ``docker``."""
    conf: dict[str, Any] = {
        "architecture": architecture,
        "os": "linux",
        "config": config or {},
        "rootfs": {"type": "layers", "diff_ids": [sha256(gzip.decompress(b) if b[:2] == b"\x1f\x8b" else b)
                                                  for b in layers]},
    }  # fmt: skip
    if variant:
        conf["variant"] = variant
    config_bytes = json.dumps(conf).encode()
    if docker:
        mt, cmt, lgz, ltar = (DOCKER_MANIFEST, "application/vnd.docker.container.image.v1+json",
                              "application/vnd.docker.image.rootfs.diff.tar.gzip",
                              "application/vnd.docker.image.rootfs.diff.tar")  # fmt: skip
    else:
        mt, cmt, lgz, ltar = (OCI_MANIFEST, "application/vnd.oci.image.config.v1+json",
                              "application/vnd.oci.image.layer.v1.tar+gzip", "application/vnd.oci.image.layer.v1.tar")  # fmt: skip
    manifest = {
        "schemaVersion": 2,
        "mediaType": mt,
        "config": {"mediaType": cmt, "digest": sha256(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": lgz if b[:2] == b"\x1f\x8b" else ltar, "digest": sha256(b), "size": len(b)}
                   for b in layers],
    }  # fmt: skip
    blobs = {sha256(config_bytes): config_bytes} | {sha256(b): b for b in layers}
    return Image(json.dumps(manifest).encode(), mt, blobs, [sha256(b) for b in layers])


def build_index(images: list[tuple[Image, dict[str, str]]], *, docker: bool = False) -> Image:
    """A manifest list / OCI index of ``(image, platform)`` pairs; its blobs are the images' blobs."""
    mt = DOCKER_LIST if docker else OCI_INDEX
    index = {
        "schemaVersion": 2,
        "mediaType": mt,
        "manifests": [{"mediaType": img.media_type, "digest": img.digest, "size": len(img.manifest),
                       "platform": plat} for img, plat in images],
    }  # fmt: skip
    blobs: dict[str, bytes] = {}
    for img, _ in images:
        blobs |= img.blobs
    return Image(json.dumps(index).encode(), mt, blobs, [])


async def push(base_url: str, repo: str, tag: str, image: Image, headers: dict[str, str] | None = None,
               children: list[Image] | None = None) -> str:  # fmt: skip
    """Push ``image`` (and, for an index, its ``children`` manifests) as ``repo:tag``; returns its digest."""
    h = headers or {}
    async with aiohttp.ClientSession(auto_decompress=False) as session:
        for digest, data in image.blobs.items():
            async with session.head(f"{base_url}/v2/{repo}/blobs/{digest}", headers=h) as resp:
                if resp.status == 200:
                    continue
            async with session.post(f"{base_url}/v2/{repo}/blobs/uploads/", headers=h) as resp:
                assert resp.status == 202, (resp.status, await resp.text())
                location = resp.headers["Location"]
            if location.startswith("/"):
                location = base_url + location
            sep = "&" if "?" in location else "?"
            async with session.put(f"{location}{sep}digest={digest}", data=data,
                                   headers=h | {"Content-Type": "application/octet-stream"}) as resp:  # fmt: skip
                assert resp.status == 201, (resp.status, await resp.text())
        for m in [*(children or []), image]:
            ref = tag if m is image else m.digest
            async with session.put(f"{base_url}/v2/{repo}/manifests/{ref}", data=m.manifest,
                                   headers=h | {"Content-Type": m.media_type}) as resp:  # fmt: skip
                assert resp.status == 201, (resp.status, await resp.text())
    return image.digest


# --- a token server --------------------------------------------------------------------------------------------


async def serve_on_loopback(app: web.Application, port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on 127.0.0.1 at ``port`` (0: a free one): the runner (``cleanup()`` it when done) and
    the port."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, runner.addresses[0][1]


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenServer:
    """Issues registry tokens (RS256 JWTs signed with ``openssl``) as ``auth: token`` expects.

    Anyone may pull repositories starting with ``public/``; ``users`` (name -> password) may pull and push
    everything. ``requests`` records (scope, user or None) of every token request.
    """

    workdir: Path
    users: dict[str, str] = field(default_factory=dict)
    requests: list[tuple[str, str | None]] = field(default_factory=list)
    port: int = 0

    def __post_init__(self) -> None:
        self.key = self.workdir / "token.key"
        self.cert = self.workdir / "token.crt"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(self.key),
                        "-out", str(self.cert), "-days", "2", "-subj", "/CN=sbx-test-token-issuer"],
                       check=True, capture_output=True)  # fmt: skip
        der = subprocess.run(["openssl", "x509", "-in", str(self.cert), "-outform", "DER"], check=True,
                             capture_output=True).stdout  # fmt: skip
        self.x5c = base64.b64encode(der).decode()
        self._runner: web.AppRunner | None = None

    @property
    def realm(self) -> str:
        return f"http://127.0.0.1:{self.port}/token"

    def registry_auth(self) -> dict[str, Any]:
        return {"token": {"realm": self.realm, "service": SERVICE, "issuer": ISSUER,
                          "rootcertbundle": str(self.cert)}}  # fmt: skip

    def token(self, repo: str, actions: list[str], subject: str) -> str:
        now = int(time.time())
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        claims = {"iss": ISSUER, "sub": subject, "aud": SERVICE, "exp": now + 300, "nbf": now - 10, "iat": now,
                  "jti": uuid.uuid4().hex, "access": [{"type": "repository", "name": repo, "actions": actions}]}  # fmt: skip
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", str(self.key)], input=signing_input.encode(),
                             check=True, capture_output=True).stdout  # fmt: skip
        return f"{signing_input}.{_b64url(sig)}"

    async def _handle(self, request: web.Request) -> web.Response:
        scope = request.query.get("scope", "")
        user: str | None = None
        auth = request.headers.get("Authorization", "")
        if auth.startswith("Basic "):
            name, _, password = base64.b64decode(auth[6:]).decode().partition(":")
            if self.users.get(name) != password:
                self.requests.append((scope, name))
                return web.json_response({"details": "bad login"}, status=401)
            user = name
        self.requests.append((scope, user))
        _, repo, actions = scope.split(":") if scope.count(":") == 2 else ("", "", "")
        wanted = actions.split(",") if actions else []
        if user is None and not repo.startswith("public/"):
            return web.json_response({"details": "login required"}, status=401)
        granted = wanted if user else [a for a in wanted if a == "pull"]
        return web.json_response({"token": self.token(repo, granted, user or "anonymous"), "expires_in": 300})

    async def start(self) -> TokenServer:
        app = web.Application()
        app.router.add_get("/token", self._handle)
        self._runner, self.port = await serve_on_loopback(app)
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


# --- a proxy that counts and cuts ---------------------------------------------------------------------------


@dataclass
class Proxy:
    """An HTTP proxy in front of ``upstream`` that counts blob GETs and can cut chosen ones mid-body.

    ``cuts[digest] = n`` makes the next ``n`` GETs of that blob send half the body and drop the connection;
    ``blob_gets`` counts GETs per digest; ``ranges`` records the Range headers received.
    """

    upstream: str
    cuts: dict[str, int] = field(default_factory=dict)
    blob_gets: collections.Counter[str] = field(default_factory=collections.Counter)
    ranges: list[str] = field(default_factory=list)
    manifest_gets: int = 0
    port: int = 0
    delay_secs: float = 0.0

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        digest = request.path.rsplit("/", 1)[-1]
        is_blob_get = request.method == "GET" and "/blobs/sha256:" in request.path
        if request.method == "GET" and "/manifests/" in request.path:
            self.manifest_gets += 1
        if is_blob_get:
            self.blob_gets[digest] += 1
            if "Range" in request.headers:
                self.ranges.append(request.headers["Range"])
            if self.delay_secs:
                await asyncio.sleep(self.delay_secs)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        body = await request.read()
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                          data=body or None, allow_redirects=False) as up:  # fmt: skip
            data = await up.read()
            out_headers = {k: v for k, v in up.headers.items()
                           if k.lower() not in ("content-length", "transfer-encoding", "connection", "date")}  # fmt: skip
            if is_blob_get and self.cuts.get(digest, 0) > 0 and up.status == 200:
                self.cuts[digest] -= 1
                resp = web.StreamResponse(status=200, headers=out_headers)
                resp.content_length = len(data)
                await resp.prepare(request)
                await resp.write(data[: len(data) // 2])
                await asyncio.sleep(0.05)
                assert request.transport is not None
                request.transport.abort()
                return resp
            return web.Response(
                status=up.status, headers=out_headers, body=data if request.method != "HEAD" else None
            )

    async def start(self) -> Proxy:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner, self.port = await serve_on_loopback(app, self.port)
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()
