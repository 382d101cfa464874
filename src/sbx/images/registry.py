"""An async client of the OCI distribution (Docker registry v2) API: enough to pull images.

- **Transport**: HTTPS with certificate verification. A registry on a loopback address (``localhost``,
  ``127.0.0.0/8``, ``::1``) or named in ``insecure_registries`` (``host[:port]`` as in references) is tried
  over HTTPS without verification and, when that fails to connect, over plain HTTP, as Docker treats
  insecure registries. Nothing else is ever spoken to over plain HTTP, token servers included.
- **Addresses**: every connection (registry, token server, redirects) is checked when it is made, on the
  address connected to (:mod:`sbx.images.addresses`): link-local and metadata addresses never, loopback and
  private ones only for hosts listed in ``allow_private_registries``; a refusal is Refused, never retried.
- **Error messages** never quote what a server sent beyond an escaped status line
  (:mod:`sbx.images.remote_text`).
- **Authentication**: anonymous first; on ``401`` the ``WWW-Authenticate`` challenge decides. ``Bearer``
  (Docker Hub, GHCR, ``auth: token`` registries): a pull token for the repository is fetched from the
  challenge's realm, with the registry's credentials as basic auth when the credentials file has some, and
  cached until it expires. ``Basic``: the registry's credentials are sent with each request.
- **Credentials file**: Docker's ``config.json`` format (see :class:`Credentials`); credential helpers
  (``credsStore``, ``credHelpers``) and identity tokens are not supported.
- **Manifests**: OCI image manifests and indexes and Docker v2 manifests and manifest lists; an index is
  resolved to the entry for this host's platform (:func:`select_platform`). Docker schema 1 is refused.
  Every manifest and config is checked against its digest.
- **Blobs** stream into a :class:`~sbx.images.blobs.BlobWriter` (verified on commit). Connection errors,
  timeouts, truncated bodies, ``429`` and ``5xx`` are retried ``attempts`` times in all, with backoff; a
  retry resumes with a ``Range`` request when the server honours it, and starts over when it does not.

Errors users see are SandboxError subclasses: Refused (access denied; check credentials), NotFound (no such
repository, tag or manifest), Unavailable (registry unreachable or failing; try again), InvalidRequest (the
image is unusable here: no matching platform, unsupported format, content not matching its digest).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import platform as platform_module
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self, TypeVar

import aiohttp
from yarl import URL

from sbx.api.errors import InvalidRequest, NotFound, Refused, SandboxError, Unavailable
from sbx.images.addresses import RegistryAddresses, RegistryAddressRefused
from sbx.images.blobs import BlobWriter, DigestMismatch, digest_hex
from sbx.images.media_types import (
    CONFIG_TYPES,
    INDEX_TYPES,
    LAYER_TYPES,
    MANIFEST_TYPES,
    MEDIA_DOCKER_LIST,
    MEDIA_DOCKER_MANIFEST,
    MEDIA_DOCKER_SCHEMA1,
    MEDIA_OCI_INDEX,
    MEDIA_OCI_MANIFEST,
)
from sbx.images.reference import DEFAULT_REGISTRY, Reference
from sbx.images.remote_text import failure_reason, shown_host, shown_media_type, shown_platform, status_line
from sbx.images.store import ImageConfig
from sbx.net.dial_guard import refusal_behind
from sbx.net.loopback import host_header_name, is_loopback

log = logging.getLogger(__name__)


#: Largest manifest or image config accepted, in bytes (real ones are a few KiB).
MAX_MANIFEST_BYTES = 4 << 20
MAX_CONFIG_BYTES = 16 << 20
DEFAULT_ATTEMPTS = 3
CONNECT_TIMEOUT_SECS = 30.0
#: Longest silence while reading a response before the attempt counts as failed, in seconds.
READ_TIMEOUT_SECS = 60.0
_BACKOFF_SECS = (0.5, 2.0, 5.0)
_ACCEPT = f"{MEDIA_OCI_INDEX}, {MEDIA_OCI_MANIFEST}, {MEDIA_DOCKER_LIST}, {MEDIA_DOCKER_MANIFEST}"
_CHUNK = 1 << 20

T = TypeVar("T")

# --- platforms ---------------------------------------------------------------------------------------------

_MACHINE_TO_GOARCH: dict[str, tuple[str, str | None]] = {
    "x86_64": ("amd64", None),
    "amd64": ("amd64", None),
    "aarch64": ("arm64", "v8"),
    "arm64": ("arm64", "v8"),
    "armv7l": ("arm", "v7"),
    "armv6l": ("arm", "v6"),
    "i386": ("386", None),
    "i686": ("386", None),
    "ppc64le": ("ppc64le", None),
    "s390x": ("s390x", None),
    "riscv64": ("riscv64", None),
}


@dataclass(frozen=True)
class Platform:
    """An OCI platform: ``os`` and ``architecture`` as Go spells them (``linux``, ``amd64``), ``variant``
    for ARM (``v7``, ``v8``)."""

    os: str
    architecture: str
    variant: str | None = None

    def __str__(self) -> str:
        return f"{self.os}/{self.architecture}" + (f"/{self.variant}" if self.variant else "")

    @classmethod
    def from_json(cls, obj: Any) -> Platform | None:
        if not isinstance(obj, dict):
            return None
        return cls(str(obj.get("os") or ""), str(obj.get("architecture") or ""), obj.get("variant") or None)


def host_platform() -> Platform:
    """This machine's platform: ``linux`` and the Go name of :func:`platform.machine`."""
    machine = platform_module.machine().lower()
    arch, variant = _MACHINE_TO_GOARCH.get(machine, (machine, None))
    return Platform("linux", arch, variant)


def platform_rank(candidate: Platform, host: Platform) -> int | None:
    """How well ``candidate`` runs on ``host``: 0 best, larger worse, None not at all.

    The OS and architecture must match. Variants: arm64 takes ``v8`` or none alike; 32-bit arm takes its
    own variant or an older one (v7 runs v6 and v5), preferring the newest; elsewhere a variant is
    accepted only when equal or absent (amd64 ``v2``.. ``v4`` micro-architecture levels are not probed).
    """
    if candidate.os != host.os or candidate.architecture != host.architecture:
        return None
    want, have = host.variant, candidate.variant
    if host.architecture == "arm64":
        return 0 if have in (None, "v8") else None
    if host.architecture == "arm" and want and want.startswith("v") and want[1:].isdigit():
        if have is None:
            return 9
        if have.startswith("v") and have[1:].isdigit() and int(have[1:]) <= int(want[1:]):
            return int(want[1:]) - int(have[1:])
        return None
    if have is None:
        return 0
    return 0 if have == want else None


@dataclass(frozen=True)
class Descriptor:
    """An OCI content descriptor: what to fetch (``digest``), its ``size`` in bytes and ``media_type``."""

    media_type: str
    digest: str
    size: int
    platform: Platform | None = None
    annotations: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Descriptor:
        if not isinstance(obj, dict):
            raise InvalidRequest(f"{where}: a descriptor is not a JSON object")
        try:
            digest, size = str(obj["digest"]), int(obj["size"])
            digest_hex(digest)
        except (KeyError, TypeError, ValueError, InvalidRequest):
            raise InvalidRequest(f"{where}: a descriptor without a valid sha256 digest and size") from None
        if size < 0:
            raise InvalidRequest(f"{where}: descriptor {digest} has a negative size")
        raw_annotations = obj.get("annotations")
        annotations: dict[str, Any] = raw_annotations if isinstance(raw_annotations, dict) else {}
        return cls(
            media_type=str(obj.get("mediaType") or ""),
            digest=digest,
            size=size,
            platform=Platform.from_json(obj.get("platform")),
            annotations={str(k): str(v) for k, v in annotations.items()},
        )


def select_platform(entries: Sequence[Descriptor], host: Platform, where: str) -> Descriptor:
    """The entry of an index that runs best on ``host`` (the first among equals).

    Raises InvalidRequest listing the platforms the index offers when none fits.
    """
    best: tuple[int, int, Descriptor] | None = None
    for index, entry in enumerate(entries):
        if entry.platform is None or entry.media_type in INDEX_TYPES:
            continue
        rank = platform_rank(entry.platform, host)
        if rank is not None and (best is None or (rank, index) < best[:2]):
            best = (rank, index, entry)
    if best is None:
        offered = sorted({
            shown for e in entries
            if e.platform and e.platform.os != "unknown"
            and (shown := shown_platform(e.platform.os, e.platform.architecture, e.platform.variant))
        })  # fmt: skip
        raise InvalidRequest(
            f"{where} has no image for this host's platform {host}; it offers: {', '.join(offered) or 'none'}"
        )
    return best[2]


# --- credentials -------------------------------------------------------------------------------------------


def _registry_key(key: str) -> str:
    """``https://index.docker.io/v1/`` gives ``docker.io``; ``Host:5000/`` gives ``host:5000``."""
    key = re.sub(r"^[a-z]+://", "", key.strip().lower()).split("/", 1)[0]
    return DEFAULT_REGISTRY if key in ("index.docker.io", "registry-1.docker.io", "docker.io") else key


class Credentials:
    """Registry logins read from a Docker ``config.json``-style file::

        {"auths": {
            "registry.example.com:5000": {"auth": "<base64 of user:password>"},
            "https://index.docker.io/v1/": {"username": "me", "password": "<token>"}
        }}

    Keys are registry hosts (with port when not 443); a scheme and path are ignored, and Docker Hub's
    spellings all mean ``docker.io``. An entry has either ``auth`` or ``username`` and ``password``.
    ``docker login`` writes this format to ``~/.docker/config.json`` when no credential helper is set.
    """

    def __init__(self, logins: dict[str, tuple[str, str]], source: str = "credentials") -> None:
        self.source = source
        self._logins = {_registry_key(k): v for k, v in logins.items()}

    @classmethod
    def from_file(cls, path: Path | str) -> Credentials:
        """Read ``path``; raises InvalidRequest naming the file and what to fix."""
        path = Path(path)
        try:
            obj = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise InvalidRequest(f"credentials file {path} does not exist") from None
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"credentials file {path} is not readable JSON: {exc}") from None
        auths = obj.get("auths") if isinstance(obj, dict) else None
        if not isinstance(auths, dict):
            raise InvalidRequest(f'credentials file {path} must be a JSON object with an "auths" object')
        logins: dict[str, tuple[str, str]] = {}
        for key, entry in auths.items():
            where = f"credentials file {path}, entry {key!r}"
            if not isinstance(entry, dict):
                raise InvalidRequest(f"{where} must be an object")
            if entry.get("auth"):
                try:
                    user, sep, password = (
                        base64.b64decode(str(entry["auth"]), validate=True).decode().partition(":")
                    )
                except (binascii.Error, UnicodeDecodeError):
                    raise InvalidRequest(f'{where}: "auth" must be base64 of "user:password"') from None
                if not sep:
                    raise InvalidRequest(
                        f'{where}: "auth" must be base64 of "user:password" (no colon found)'
                    )
            elif entry.get("username") is not None and entry.get("password") is not None:
                user, password = str(entry["username"]), str(entry["password"])
            elif entry.get("identitytoken"):
                log.warning("%s: identity tokens are not supported; the entry is ignored", where)
                continue
            else:
                raise InvalidRequest(f'{where} needs "auth", or "username" and "password"')
            logins[key] = (user, password)
        if not logins and (obj.get("credsStore") or obj.get("credHelpers")):
            log.warning("credentials file %s uses credential helpers, which are not supported", path)
        return cls(logins, source=str(path))

    def for_registry(self, registry: str) -> tuple[str, str] | None:
        """The (user, password) for ``registry`` (as a Reference spells it), or None."""
        return self._logins.get(_registry_key(registry))


# --- resolved images ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedImage:
    """What a reference names right now: the manifest for this host, its layers and its config.

    ``digest`` is the digest of the manifest the reference points at (the index's when it names an index:
    the digest ``docker pull`` prints); ``manifest_digest`` is the platform manifest's (equal when there is
    no index). ``layers`` are in application order; ``config`` is the run configuration.
    """

    reference: Reference
    digest: str
    manifest_digest: str
    platform: Platform | None
    layers: tuple[Descriptor, ...]
    config: ImageConfig
    annotations: dict[str, str]

    @property
    def total_layer_bytes(self) -> int:
        """Sum of the layers' (compressed) sizes as the manifest declares them."""
        return sum(layer.size for layer in self.layers)


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"{what} is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{what} is not a JSON object")
    return obj


def parse_image_config(raw: bytes, where: str) -> tuple[ImageConfig, Platform | None]:
    """The run configuration and platform of an OCI/Docker image config blob."""
    obj = _json_object(raw, f"{where}: the image config")
    raw_conf = obj.get("config")
    conf: dict[str, Any] = raw_conf if isinstance(raw_conf, dict) else {}

    def strings(value: Any) -> tuple[str, ...] | None:
        if value is None:
            return None
        if isinstance(value, str):  # some tools write a bare string; Docker treats it as one argument
            return (value,)
        if not isinstance(value, list):
            raise InvalidRequest(f"{where}: Entrypoint and Cmd must be arrays of strings")
        return tuple(str(v) for v in value)

    env: dict[str, str] = {}
    for item in conf.get("Env") or []:
        name, sep, value = str(item).partition("=")
        if sep and name:
            env[name] = value
    platform = None
    if obj.get("os") or obj.get("architecture"):
        platform = Platform(
            str(obj.get("os") or ""), str(obj.get("architecture") or ""), obj.get("variant") or None
        )
    config = ImageConfig(
        env=env,
        working_dir=str(conf["WorkingDir"]) if conf.get("WorkingDir") else None,
        user=str(conf["User"]) if conf.get("User") else None,
        entrypoint=strings(conf.get("Entrypoint")),
        cmd=strings(conf.get("Cmd")),
    )
    return config, platform


# --- the client ----------------------------------------------------------------------------------------------


class _Retryable(Exception):
    """A failure worth another attempt (5xx, 429, truncated body)."""


def is_loopback_host(host: str) -> bool:
    """Whether ``host[:port]`` names this machine: ``localhost``, 127.0.0.0/8 or ::1."""
    return is_loopback(host_header_name(host))


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="x",service="y"`` gives ``("bearer", {"realm": "x", "service": "y"})``."""
    scheme, _, rest = header.strip().partition(" ")
    params = {
        m.group(1).lower(): (m.group(2).replace('\\"', '"') if m.group(2) is not None else m.group(3))
        for m in re.finditer(r'([A-Za-z_]+)=(?:"((?:[^"\\]|\\.)*)"|([^\s,]+))', rest)
    }
    return scheme.lower(), params


class RegistryClient:
    """Pulls manifests, configs and blobs; one instance may serve many pulls (it caches tokens).

    ``credentials`` are the logins to use; ``insecure_registries`` the ``host[:port]`` names allowed over
    plain HTTP besides loopback ones; ``allow_private_registries`` the ``host[:port]`` names that may be on
    loopback, private or this host's own addresses (:mod:`sbx.images.addresses`); ``attempts`` how many times
    a request is tried in all (at least 1); ``platform`` the platform to select from indexes (this host's by
    default). Close it (``async with``).
    """

    def __init__(
        self,
        *,
        credentials: Credentials | None = None,
        insecure_registries: Iterable[str] = (),
        allow_private_registries: Iterable[str] = (),
        attempts: int = DEFAULT_ATTEMPTS,
        platform: Platform | None = None,
        connect_timeout_secs: float = CONNECT_TIMEOUT_SECS,
        read_timeout_secs: float = READ_TIMEOUT_SECS,
    ) -> None:
        self.credentials = credentials
        self.insecure_registries = frozenset(r.strip().lower() for r in insecure_registries)
        self.addresses = RegistryAddresses(allow_private_registries)
        self.attempts = max(1, attempts)
        self.platform = platform or host_platform()
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_secs,
                                              sock_read=read_timeout_secs)  # fmt: skip
        self._session: aiohttp.ClientSession | None = None
        self._base_urls: dict[str, str] = {}
        self._auth: dict[tuple[str, str], tuple[str, float]] = {}
        self._auth_locks: dict[tuple[str, str], asyncio.Lock] = {}

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the HTTP connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # auto_decompress off: a blob must reach the digest check byte for byte as stored.
            # Every connection goes through the address guard: names through its resolver, every address
            # (literals and redirects too) through its socket factory.
            connector = aiohttp.TCPConnector(
                resolver=self.addresses.resolver(), socket_factory=self.addresses.socket_factory
            )
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, auto_decompress=False,
                headers={"User-Agent": "sbx-sandboxd"},
            )  # fmt: skip
        return self._session

    def is_insecure(self, registry: str) -> bool:
        """Whether ``registry`` may be spoken to over plain HTTP (loopback, or listed as insecure)."""
        return registry.lower() in self.insecure_registries or is_loopback_host(registry)

    # --- public operations ---------------------------------------------------------------------------------

    async def resolve(self, ref: Reference) -> ResolvedImage:
        """Fetch the manifest ``ref`` names (choosing this host's platform from an index) and its config."""
        body, media_type, digest = await self._fetch_manifest(ref, ref.manifest_ref)
        top_digest = digest
        obj = self._parse_manifest(body, media_type, f"{ref}")
        chosen: Platform | None = None
        if self._kind(obj, media_type) == "index":
            entries = [Descriptor.from_json(m, f"index of {ref}") for m in obj.get("manifests") or []]
            entry = select_platform(entries, self.platform, f"image {ref}")
            chosen = entry.platform
            body, media_type, digest = await self._fetch_manifest(ref, entry.digest)
            obj = self._parse_manifest(body, media_type or entry.media_type, f"{ref} ({entry.platform})")
            if self._kind(obj, media_type or entry.media_type) != "manifest":
                raise InvalidRequest(
                    f"image {ref}: the index entry for {entry.platform} is not an image manifest"
                )
        where = f"image {ref}"
        config_desc = Descriptor.from_json(obj.get("config"), where)
        if config_desc.media_type and config_desc.media_type not in CONFIG_TYPES:
            raise InvalidRequest(
                f"{where} is not a container image (its config is {shown_media_type(config_desc.media_type)}); it may be a Helm "
                "chart or other OCI artifact"
            )
        layers = tuple(Descriptor.from_json(layer, where) for layer in obj.get("layers") or [])
        for layer in layers:
            if layer.media_type and layer.media_type not in LAYER_TYPES:
                hint = " (a Windows image)" if "foreign" in layer.media_type else ""
                raise InvalidRequest(
                    f"{where}: layer {layer.digest} has unsupported media type {shown_media_type(layer.media_type)}{hint}"
                )
        raw_config = await self._fetch_small_blob(ref, config_desc, MAX_CONFIG_BYTES)
        config, config_platform = parse_image_config(raw_config, where)
        known = config_platform is not None and bool(config_platform.os and config_platform.architecture)
        if (
            known
            and chosen is None
            and config_platform
            and platform_rank(config_platform, self.platform) is None
        ):
            built_for = (
                shown_platform(config_platform.os, config_platform.architecture, config_platform.variant)
                or "another platform"
            )
            raise InvalidRequest(f"{where} is built for {built_for}; this host runs {self.platform}")
        annotations = {k: str(v) for k, v in (obj.get("annotations") or {}).items()}
        return ResolvedImage(
            reference=ref,
            digest=top_digest,
            manifest_digest=digest,
            platform=chosen or config_platform,
            layers=layers,
            config=config,
            annotations=annotations,
        )

    async def manifest_digest(self, ref: Reference) -> str:
        """The digest ``ref``'s tag points at now (a ``HEAD`` request; a ``GET`` when the registry does not
        send ``Docker-Content-Digest``). Cheap way to tell whether an installed image is current."""
        url = f"{await self._base(ref.registry)}/v2/{ref.repository}/manifests/{ref.manifest_ref}"

        async def head() -> str | None:
            async with await self._send(ref, "HEAD", url, {"Accept": _ACCEPT}) as resp:
                if resp.status != 200:
                    raise await self._status_error(resp, f"manifest {ref}")
                header = resp.headers.get("Docker-Content-Digest", "")
                return header if header.startswith("sha256:") else None

        digest = await self._retrying(f"manifest {ref}", head)
        if digest is None:
            digest = (await self._fetch_manifest(ref, ref.manifest_ref))[2]
        return digest

    async def fetch_blob(
        self,
        ref: Reference,
        desc: Descriptor,
        writer: BlobWriter,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Download blob ``desc`` of ``ref``'s repository into ``writer`` (which the caller commits).

        ``progress(delta_bytes)`` is called as data arrives (negative when a retry has to start over).
        Retries resume where the previous attempt stopped when the server honours ``Range``.
        """
        url = f"{await self._base(ref.registry)}/v2/{ref.repository}/blobs/{desc.digest}"
        report = progress or (lambda _n: None)

        async def attempt() -> None:
            headers = {"Accept-Encoding": "identity"}
            if writer.offset:
                headers["Range"] = f"bytes={writer.offset}-"
            async with await self._send(ref, "GET", url, headers) as resp:
                if resp.status == 206 and writer.offset and self._range_start(resp) == writer.offset:
                    log.info("resuming blob %s at byte %d", desc.digest, writer.offset)
                elif resp.status == 200:
                    if writer.offset:
                        report(-writer.offset)
                        writer.restart()
                else:
                    raise await self._status_error(resp, f"blob {desc.digest} of {ref.name}")
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    writer.write(chunk)
                    report(len(chunk))
            if writer.offset < desc.size:
                raise _Retryable(f"the connection ended after {writer.offset} of {desc.size} bytes")

        await self._retrying(f"blob {desc.digest} of {ref.name}", attempt)

    # --- manifests and small blobs ---------------------------------------------------------------------------

    @staticmethod
    def _kind(obj: dict[str, Any], media_type: str) -> str:
        if media_type in INDEX_TYPES or (not media_type and "manifests" in obj):
            return "index"
        if media_type in MANIFEST_TYPES or (not media_type and "layers" in obj):
            return "manifest"
        raise InvalidRequest(f"unsupported manifest media type ({shown_media_type(media_type)})")

    @staticmethod
    def _parse_manifest(body: bytes, media_type: str, where: str) -> dict[str, Any]:
        if media_type in MEDIA_DOCKER_SCHEMA1:
            raise InvalidRequest(
                f"image {where} uses the Docker schema 1 manifest format, which is not supported; push it again "
                "with a current Docker, buildah or skopeo"
            )
        obj = _json_object(body, f"image {where}: the manifest")
        if obj.get("schemaVersion") == 1:
            raise InvalidRequest(
                f"image {where} uses the Docker schema 1 manifest format, which is not supported"
            )
        return obj

    async def _fetch_manifest(self, ref: Reference, manifest_ref: str) -> tuple[bytes, str, str]:
        """(body, media type, digest) of manifest ``manifest_ref`` (a tag or digest) of ``ref``'s repository."""
        url = f"{await self._base(ref.registry)}/v2/{ref.repository}/manifests/{manifest_ref}"
        what = (
            f"manifest {ref.name}:{manifest_ref}"
            if ":" not in manifest_ref
            else f"manifest {ref.name}@{manifest_ref}"
        )

        async def get() -> tuple[bytes, str, str]:
            async with await self._send(
                ref, "GET", url, {"Accept": _ACCEPT, "Accept-Encoding": "identity"}
            ) as resp:
                if resp.status != 200:
                    raise await self._status_error(resp, what)
                body = await self._read_limited(resp, MAX_MANIFEST_BYTES, what)
                header_digest = resp.headers.get("Docker-Content-Digest", "")
                content_type = resp.headers.get("Content-Type", "").split(";")[0].strip()
            digest = f"sha256:{hashlib.sha256(body).hexdigest()}"
            if manifest_ref.startswith("sha256:") and digest != manifest_ref:
                raise DigestMismatch(f"{what}: the registry sent a manifest with digest {digest}")
            if header_digest.startswith("sha256:") and header_digest != digest:
                said = header_digest if re.fullmatch(r"sha256:[0-9a-f]{64}", header_digest) else "another"
                raise DigestMismatch(f"{what}: the registry says its digest is {said} but it is {digest}")
            try:
                declared = json.loads(body).get("mediaType")
            except (ValueError, AttributeError):
                declared = None
            return body, str(declared or content_type), digest

        return await self._retrying(what, get)

    async def _fetch_small_blob(self, ref: Reference, desc: Descriptor, limit: int) -> bytes:
        if desc.size > limit:
            raise InvalidRequest(
                f"blob {desc.digest} of {ref.name} is {desc.size} bytes; the limit is {limit}"
            )
        url = f"{await self._base(ref.registry)}/v2/{ref.repository}/blobs/{desc.digest}"
        what = f"blob {desc.digest} of {ref.name}"

        async def get() -> bytes:
            async with await self._send(ref, "GET", url, {"Accept-Encoding": "identity"}) as resp:
                if resp.status != 200:
                    raise await self._status_error(resp, what)
                body = await self._read_limited(resp, limit, what)
            digest = f"sha256:{hashlib.sha256(body).hexdigest()}"
            if digest != desc.digest:
                raise DigestMismatch(f"{what}: the registry sent content with digest {digest}")
            return body

        return await self._retrying(what, get)

    @staticmethod
    async def _read_limited(resp: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
        if resp.content_length is not None and resp.content_length > limit:
            raise InvalidRequest(f"{what} is {resp.content_length} bytes; the limit is {limit}")
        body = await resp.content.read(limit + 1)
        while len(body) <= limit and (more := await resp.content.read(limit + 1 - len(body))):
            body += more
        if len(body) > limit:
            raise InvalidRequest(f"{what} is larger than the limit of {limit} bytes")
        return body

    @staticmethod
    def _range_start(resp: aiohttp.ClientResponse) -> int | None:
        match = re.match(r"bytes (\d+)-", resp.headers.get("Content-Range", ""))
        return int(match.group(1)) if match else None

    # --- transport, auth and errors ---------------------------------------------------------------------------

    async def _base(self, registry: str) -> str:
        """``scheme://host`` of ``registry``'s API, probing HTTPS then HTTP for insecure registries."""
        api_host = Reference(registry, "x", "latest").api_host
        cached = self._base_urls.get(registry)
        if cached is not None:
            return cached
        if not self.is_insecure(registry):
            base = f"https://{api_host}"
        else:
            base = f"http://{api_host}"
            try:
                async with self._get_session().get(f"https://{api_host}/v2/", ssl=False,
                                                   timeout=aiohttp.ClientTimeout(total=5)):  # fmt: skip
                    base = f"https://{api_host}"
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
        self._base_urls[registry] = base
        return base

    async def _send(
        self, ref: Reference, method: str, url: str, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """Send a request with this repository's auth; on 401 authenticate as challenged and send it again."""
        session = self._get_session()
        key = (ref.registry, ref.repository)
        ssl = not self.is_insecure(ref.registry)
        for round_ in range(2):
            request_headers = dict(headers)
            auth = self._auth.get(key)
            if auth is not None and auth[1] > time.monotonic():
                request_headers["Authorization"] = auth[0]
            resp = await session.request(method, url, headers=request_headers, ssl=ssl)
            if resp.status != 401:
                return resp
            if round_ == 1:
                resp.release()
                login = self.credentials.for_registry(ref.registry) if self.credentials else None
                raise Refused(self._login_hint(ref, "rejected the login" if login else "needs a login"))
            challenge = resp.headers.get("WWW-Authenticate", "")
            resp.release()
            await self._authenticate(ref, challenge, failed=request_headers.get("Authorization"))
        raise AssertionError("unreachable")

    async def _authenticate(self, ref: Reference, challenge: str, failed: str | None) -> None:
        key = (ref.registry, ref.repository)
        lock = self._auth_locks.setdefault(key, asyncio.Lock())
        async with lock:
            current = self._auth.get(key)
            if current is not None and current[0] != failed and current[1] > time.monotonic():
                return  # another request authenticated meanwhile
            login = self.credentials.for_registry(ref.registry) if self.credentials else None
            scheme, params = _parse_challenge(challenge)
            if scheme == "basic":
                if login is None:
                    raise Refused(self._login_hint(ref, "needs a login"))
                if failed is not None:
                    raise Refused(self._login_hint(ref, "rejected the login"))
                self._auth[key] = (_basic(*login), float("inf"))
            elif scheme == "bearer" and params.get("realm"):
                self._auth[key] = await self._fetch_token(ref, params, login)
            else:
                raise Refused(
                    f"registry {ref.registry} refused access to {ref.repository} with an authentication "
                    "challenge this client does not support (Basic and Bearer are)"
                )

    async def _fetch_token(
        self, ref: Reference, params: dict[str, str], login: tuple[str, str] | None
    ) -> tuple[str, float]:
        realm = URL(params["realm"])
        realm_host = f"{realm.host}:{realm.explicit_port}" if realm.explicit_port else str(realm.host or "")
        if realm.scheme != "https" and not (realm.scheme == "http" and self.is_insecure(realm_host)):
            raise Refused(
                f"registry {ref.registry} sends clients to token server {shown_host(realm_host)} over plain "
                f"HTTP; list {shown_host(realm_host)} in insecure_registries to allow it"
            )
        query = {"scope": f"repository:{ref.repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        headers = {"Authorization": _basic(*login)} if login else {}
        what = f"token for {ref.name} from {shown_host(realm_host)}"

        async def get() -> tuple[str, float]:
            async with self._get_session().get(realm.update_query(query), headers=headers,
                                               ssl=realm.scheme == "https") as resp:  # fmt: skip
                if resp.status in (401, 403):
                    reason = "rejected the login" if login else "needs a login"
                    raise Refused(self._login_hint(ref, reason))
                if resp.status != 200:
                    raise await self._status_error(resp, what)
                try:
                    obj = json.loads(await self._read_limited(resp, 1 << 20, what))
                    token = str(obj.get("token") or obj.get("access_token") or "")
                    expires_in = float(obj.get("expires_in") or 60)
                except (ValueError, AttributeError, TypeError):
                    raise InvalidRequest(f"{what}: the answer is not a token in JSON") from None
            if not token:
                raise InvalidRequest(f"{what}: the answer holds no token")
            # Renew a little early: a token expiring mid-download costs a failed request.
            return f"Bearer {token}", time.monotonic() + max(expires_in - 10, expires_in / 2)

        return await self._retrying(what, get)

    def _login_hint(self, ref: Reference, reason: str) -> str:
        if self.credentials is None:
            fix = f"pass a credentials file with a login for {ref.registry}"
        elif self.credentials.for_registry(ref.registry) is None:
            fix = f"add a login for {ref.registry} to {self.credentials.source}"
        else:
            fix = f"check the login for {ref.registry} in {self.credentials.source}"
        return f"registry {ref.registry} {reason} to pull {ref.repository}: {fix}"

    @staticmethod
    async def _status_error(resp: aiohttp.ClientResponse, what: str) -> Exception:
        """The error for an unexpected status; _Retryable for those worth retrying. Only the status line
        is shown of the answer (see sbx.images.remote_text)."""
        status = status_line(resp)
        host = shown_host(str(resp.url.host or ""))
        if resp.status == 429 or resp.status >= 500:
            return _Retryable(f"{what}: {host} answered {status}")
        if resp.status in (401, 403):
            return Refused(f"{what}: registry {host} refused access ({status})")
        if resp.status == 404:
            return NotFound(f"{what} not found on {host} ({status})")
        return InvalidRequest(f"{what}: {host} answered {status}")

    async def _retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run ``call`` up to ``attempts`` times while it fails in a way worth retrying. A connection the
        address guard refused is Refused at once."""
        reason = "no attempt"
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(_BACKOFF_SECS[min(attempt - 1, len(_BACKOFF_SECS) - 1)])
            try:
                return await call()
            except SandboxError:
                raise
            except (TimeoutError, _Retryable, aiohttp.ClientError, ConnectionError) as exc:
                refusal = _address_refusal(exc)
                if refusal is not None:
                    raise Refused(f"{what}: {refusal}") from None
                reason = str(exc) if isinstance(exc, _Retryable) else failure_reason(exc)
                log.info("%s: attempt %d of %d failed: %s", what, attempt + 1, self.attempts, reason)
        raise Unavailable(f"{what}: failed after {self.attempts} attempt(s): {reason}; try again later")


def _address_refusal(exc: BaseException) -> RegistryAddressRefused | None:
    """The address guard's refusal behind ``exc`` (aiohttp wraps it in a connector error), if any."""
    found = refusal_behind(exc)
    return found if isinstance(found, RegistryAddressRefused) else None
