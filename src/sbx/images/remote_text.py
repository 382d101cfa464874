"""What of a registry's answers an error message may show (docs/images.md, "Errors").

Error messages of a pull go back to whoever asked for the image, who may not be the operator. A message
therefore never carries bytes a remote server chose, except a short escaped status line: otherwise a
reference naming some service (``127.0.0.1:8080/x``) would read that service's answer out through sandboxd.
Values from a registry's answers (media types, platforms, host names) are shown only when they are one of
the values this code knows, or have the shape of a host name; anything else is described, not quoted.
"""

from __future__ import annotations

import re
from typing import Final

import aiohttp

from sbx.images.media_types import (
    CONFIG_TYPES,
    INDEX_TYPES,
    LAYER_TYPES,
    MANIFEST_TYPES,
    MEDIA_DOCKER_SCHEMA1,
)

#: Longest reason phrase shown after a status code.
MAX_REASON_CHARS: Final = 40

#: Media types a message may name: those the puller handles, and others of OCI and Docker images, the
#: foreign (Windows) layers and common artifacts.
KNOWN_MEDIA_TYPES: Final = (
    INDEX_TYPES | MANIFEST_TYPES | CONFIG_TYPES | LAYER_TYPES | frozenset(MEDIA_DOCKER_SCHEMA1)
    | frozenset({
        "application/vnd.oci.empty.v1+json",
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
        "application/vnd.cncf.helm.config.v1+json",
        "application/vnd.cncf.helm.chart.content.v1.tar+gzip",
        "application/vnd.in-toto+json",
    })
)  # fmt: skip
_GOOS: Final = frozenset({
    "aix", "android", "darwin", "dragonfly", "freebsd", "illumos", "ios", "js", "linux", "netbsd", "openbsd",
    "plan9", "solaris", "wasip1", "windows", "unknown",
})  # fmt: skip
_GOARCH: Final = frozenset({
    "386", "amd64", "arm", "arm64", "loong64", "mips", "mips64", "mips64le", "mipsle", "ppc64", "ppc64le",
    "riscv64", "s390x", "wasm", "unknown",
})  # fmt: skip
_VARIANT: Final = re.compile(r"v[1-9]")
_HOST: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?(?::[0-9]{1,5})?")


def escaped(text: str, limit: int) -> str:
    """``text`` with everything but printable ASCII escaped (``\\xNN``), cut to ``limit`` characters."""
    out = "".join(
        c if " " <= c <= "~" and c != "\\" else f"\\x{ord(c) & 0xFF:02x}" for c in text[: limit * 4]
    )
    return out if len(out) <= limit else out[:limit] + "..."


def status_line(resp: aiohttp.ClientResponse) -> str:
    """``404 Not Found``: the status and its reason phrase, escaped and cut to MAX_REASON_CHARS."""
    return f"{resp.status} {escaped(resp.reason or '', MAX_REASON_CHARS)}".rstrip()


def shown_media_type(media_type: str) -> str:
    """``media_type`` when it is a known one, else a description."""
    return media_type if media_type in KNOWN_MEDIA_TYPES else "a media type this puller does not know"


def shown_platform(os: str, architecture: str, variant: str | None) -> str | None:
    """``os/architecture[/variant]`` when each part is a known value, else None (not to be shown)."""
    if os not in _GOOS or architecture not in _GOARCH or (variant and not _VARIANT.fullmatch(variant)):
        return None
    return f"{os}/{architecture}" + (f"/{variant}" if variant else "")


def shown_host(host: str) -> str:
    """``host[:port]`` when it has the shape of one, else a description."""
    return host if _HOST.fullmatch(host) else "a host with an invalid name"


def failure_reason(exc: BaseException) -> str:
    """Why a request failed, in words of this code (and the OS's), never the server's: aiohttp's messages
    quote what the server sent (a status line that is no HTTP, a certificate's names)."""
    if isinstance(exc, (TimeoutError, aiohttp.ServerTimeoutError)):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        # The host may come from a redirect: shown only when it has the shape of a host name.
        where = shown_host(f"{exc.host}:{exc.port}")
        if isinstance(exc, aiohttp.ClientConnectorCertificateError):
            return f"the TLS certificate of {where} was not accepted"
        if isinstance(exc, aiohttp.ClientConnectorSSLError):
            return f"the TLS handshake with {where} failed"
        return f"cannot connect to {where}: {exc.os_error.strerror or type(exc.os_error).__name__}"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the answer's body was cut off or malformed"
    if isinstance(exc, aiohttp.ClientResponseError):
        return "the server's answer is not valid HTTP"
    if isinstance(exc, OSError):
        return f"connection error: {exc.strerror or type(exc).__name__}"
    return type(exc).__name__
