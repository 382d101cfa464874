"""Image reference parsing and normalisation, as Docker spells references."""

from __future__ import annotations

import pytest

from sbx.api.errors import InvalidRequest
from sbx.images.reference import Reference, normalize_reference, parse_reference

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest", "canonical"),
    [
        ("python", "docker.io", "library/python", "latest", None, "docker.io/library/python:latest"),
        ("python:3.12", "docker.io", "library/python", "3.12", None, "docker.io/library/python:3.12"),
        ("python:3.12-slim", "docker.io", "library/python", "3.12-slim", None, "docker.io/library/python:3.12-slim"),
        ("library/python:3", "docker.io", "library/python", "3", None, "docker.io/library/python:3"),
        ("docker.io/python", "docker.io", "library/python", "latest", None, "docker.io/library/python:latest"),
        ("index.docker.io/library/python", "docker.io", "library/python", "latest", None,
         "docker.io/library/python:latest"),
        ("registry-1.docker.io/bitnami/redis:7", "docker.io", "bitnami/redis", "7", None,
         "docker.io/bitnami/redis:7"),
        ("bitnami/redis", "docker.io", "bitnami/redis", "latest", None, "docker.io/bitnami/redis:latest"),
        ("ghcr.io/org/team/app:v1.2.3", "ghcr.io", "org/team/app", "v1.2.3", None, "ghcr.io/org/team/app:v1.2.3"),
        ("localhost/app", "localhost", "app", "latest", None, "localhost/app:latest"),
        ("localhost:5000/app", "localhost:5000", "app", "latest", None, "localhost:5000/app:latest"),
        ("127.0.0.1:5000/a/b:t", "127.0.0.1:5000", "a/b", "t", None, "127.0.0.1:5000/a/b:t"),
        ("[::1]:5000/app:1", "[::1]:5000", "app", "1", None, "[::1]:5000/app:1"),
        ("Registry.Example.COM:443/app", "registry.example.com:443", "app", "latest", None,
         "registry.example.com:443/app:latest"),
        (f"python@{D}", "docker.io", "library/python", None, D, f"docker.io/library/python@{D}"),
        (f"python:3.12@{D}", "docker.io", "library/python", "3.12", D, f"docker.io/library/python:3.12@{D}"),
        (f"localhost:5000/app@{D}", "localhost:5000", "app", None, D, f"localhost:5000/app@{D}"),
        ("org/a_b.c__d-e---f:TAG_1.0-x", "docker.io", "org/a_b.c__d-e---f", "TAG_1.0-x", None,
         "docker.io/org/a_b.c__d-e---f:TAG_1.0-x"),
        ("my.host/x", "my.host", "x", "latest", None, "my.host/x:latest"),
        ("foo:5000", "docker.io", "library/foo", "5000", None, "docker.io/library/foo:5000"),
    ],
)  # fmt: skip
def test_parse(
    text: str, registry: str, repository: str, tag: str | None, digest: str | None, canonical: str
) -> None:
    ref = parse_reference(text)
    assert ref == Reference(registry, repository, tag, digest)
    assert str(ref) == normalize_reference(text) == canonical
    assert parse_reference(canonical) == ref, "the canonical form parses to itself"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "non-empty"),
        ("  ", "non-empty"),
        (" python", "spaces"),
        ("py thon", "spaces"),
        ("https://ghcr.io/app", "scheme"),
        ("Python", "lowercase"),
        ("ghcr.io/Org/app", "lowercase"),
        ("python:", "tag"),
        ("python:-x", "tag"),
        ("python:" + "a" * 129, "tag"),
        ("python@sha256:abc", "64 lowercase hex"),
        ("python@sha256:" + "AB" * 32, "64 lowercase hex"),
        ("python@sha512:" + "ab" * 64, "only sha256"),
        ("a//b", "not a valid repository"),
        ("a/", "not a valid repository"),
        ("-a", "not a valid repository"),
        ("a..b", "not a valid repository"),
        ("ghcr.io/", "not a valid repository"),
        ("my_host.com:5000/x", "registry host"),
        ("localhost:99999/x", "out of range"),
        ("a/" + "b" * 260, "at most 255"),
    ],
)
def test_invalid(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_reference(text)


def test_helpers() -> None:
    ref = parse_reference("python:3.12")
    assert ref.name == "docker.io/library/python"
    assert ref.api_host == "registry-1.docker.io"
    assert ref.manifest_ref == "3.12"
    pinned = ref.with_digest(D)
    assert pinned.manifest_ref == D and str(pinned) == f"docker.io/library/python:3.12@{D}"
    assert parse_reference("localhost:5000/app").api_host == "localhost:5000"
