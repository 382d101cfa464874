"""Registry client rules that need no registry: platforms, credentials, challenges, plain-HTTP policy."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from sbx.api.errors import InvalidRequest
from sbx.images.registry import (
    Credentials,
    Descriptor,
    Platform,
    RegistryClient,
    _parse_challenge,
    is_loopback_host,
    parse_image_config,
    platform_rank,
    select_platform,
)

AMD64 = Platform("linux", "amd64")
ARM64 = Platform("linux", "arm64", "v8")
ARMV7 = Platform("linux", "arm", "v7")


@pytest.mark.parametrize(
    ("candidate", "host", "rank"),
    [
        (Platform("linux", "amd64"), AMD64, 0),
        (Platform("linux", "amd64", "v2"), AMD64, None),
        (Platform("linux", "arm64"), AMD64, None),
        (Platform("windows", "amd64"), AMD64, None),
        (Platform("unknown", "unknown"), AMD64, None),
        (Platform("linux", "arm64"), ARM64, 0),
        (Platform("linux", "arm64", "v8"), ARM64, 0),
        (Platform("linux", "arm64", "v9"), ARM64, None),
        (Platform("linux", "arm", "v7"), ARMV7, 0),
        (Platform("linux", "arm", "v6"), ARMV7, 1),
        (Platform("linux", "arm", "v5"), ARMV7, 2),
        (Platform("linux", "arm", "v8"), ARMV7, None),
        (Platform("linux", "arm"), ARMV7, 9),
    ],
)
def test_platform_rank(candidate: Platform, host: Platform, rank: int | None) -> None:
    assert platform_rank(candidate, host) == rank


def _entry(n: int, os_: str, arch: str, variant: str | None = None) -> Descriptor:
    return Descriptor(
        "application/vnd.oci.image.manifest.v1+json", f"sha256:{n:064x}", 1, Platform(os_, arch, variant)
    )


def test_select_platform_prefers_the_best_then_the_first() -> None:
    entries = [
        _entry(1, "linux", "arm", "v6"),
        _entry(2, "linux", "arm", "v7"),
        _entry(3, "linux", "arm", "v7"),
    ]
    assert select_platform(entries, ARMV7, "x").digest == f"sha256:{2:064x}"
    with pytest.raises(InvalidRequest, match=r"platform linux/amd64; it offers: linux/arm/v6, linux/arm/v7"):
        select_platform([*entries, _entry(4, "unknown", "unknown")], AMD64, "image x")


def test_credentials_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    auths = {
        "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:pw:with:colons").decode()},
        "Registry.Example.com:5000": {"username": "u", "password": "p"},
        "http://127.0.0.1:5000/v2/": {"auth": base64.b64encode(b"a:b").decode()},
        "token.example": {"identitytoken": "ignored"},
    }
    path.write_text(json.dumps({"auths": auths, "credsStore": "desktop"}))
    creds = Credentials.from_file(path)
    assert creds.for_registry("docker.io") == ("hub", "pw:with:colons")
    assert creds.for_registry("registry.example.com:5000") == ("u", "p")
    assert creds.for_registry("127.0.0.1:5000") == ("a", "b")
    assert creds.for_registry("token.example") is None
    assert creds.for_registry("ghcr.io") is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "does not exist"),
        ("{", "not readable JSON"),
        ("[]", '"auths" object'),
        ('{"auths": {"r": 1}}', "must be an object"),
        ('{"auths": {"r": {"auth": "***"}}}', "base64"),
        ('{"auths": {"r": {"auth": "bm9jb2xvbg=="}}}', "no colon"),
        ('{"auths": {"r": {"username": "u"}}}', "needs"),
    ],
)
def test_bad_credentials_files(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InvalidRequest, match=message) as info:
        Credentials.from_file(path)
    assert str(path) in info.value.message


@pytest.mark.parametrize(
    ("header", "scheme", "params"),
    [
        (
            'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:x:pull"',
            "bearer",
            {
                "realm": "https://auth.docker.io/token",
                "service": "registry.docker.io",
                "scope": "repository:x:pull",
            },
        ),
        ('Basic realm="Registry Realm"', "basic", {"realm": "Registry Realm"}),
        ("Bearer realm=https://t/x, service=s", "bearer", {"realm": "https://t/x", "service": "s"}),
        ('Bearer realm="a \\"q\\" b"', "bearer", {"realm": 'a "q" b'}),
    ],
)
def test_parse_challenge(header: str, scheme: str, params: dict[str, str]) -> None:
    assert _parse_challenge(header) == (scheme, params)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("localhost:5000", True),
        ("127.0.0.1:5000", True),
        ("127.1.2.3", True),
        ("[::1]:5000", True),
        ("10.0.0.1:5000", False),
        ("registry.example.com", False),
        ("localhost.example.com:5000", False),
    ],
)
def test_loopback_and_insecure(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback
    client = RegistryClient(insecure_registries=["Registry.Example.com"])
    assert client.is_insecure(host) is (loopback or host == "registry.example.com")


def test_image_config() -> None:
    raw = json.dumps(
        {
            "architecture": "arm",
            "os": "linux",
            "variant": "v7",
            "config": {
                "Env": ["A=1", "B=x=y", "junk", "=bad"],
                "Entrypoint": "/bin/sh",
                "Cmd": None,
                "User": "",
            },
        }
    ).encode()
    config, platform = parse_image_config(raw, "x")
    assert config.env == {"A": "1", "B": "x=y"}
    assert config.entrypoint == ("/bin/sh",) and config.cmd is None
    assert config.user is None and config.working_dir is None
    assert platform == ARMV7
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_image_config(b"{", "x")
