"""Image references: parse what users type and normalise it the way Docker does.

``python:3.12`` means ``docker.io/library/python:3.12``; ``ghcr.io/org/app`` means ``ghcr.io/org/app:latest``;
``localhost:5000/app@sha256:<64 hex>`` names one manifest by digest; ``name:tag@digest`` keeps the tag for
display and fetches by the digest. The grammar is the one of ``github.com/distribution/reference``:

- the first path component is a registry when it contains ``.`` or ``:``, is ``localhost``, or is a
  bracketed IPv6 address (``[::1]:5000``); otherwise the registry is ``docker.io``;
- ``index.docker.io`` and ``registry-1.docker.io`` are spelled ``docker.io``; a one-component repository on
  ``docker.io`` gets the ``library/`` prefix;
- repository components are lowercase ``[a-z0-9]`` runs joined by ``.``, ``_``, ``__`` or dashes;
  the whole name is at most 255 characters;
- a tag is ``[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}``; without tag or digest the tag is ``latest``;
- a digest is ``sha256:<64 lowercase hex>`` (the only algorithm the puller can verify).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sbx.api.errors import InvalidRequest

#: Registry that references without one name, as Docker spells it.
DEFAULT_REGISTRY = "docker.io"
#: Host that actually serves ``docker.io`` (the name ``docker.io`` itself has no registry API).
DOCKER_HUB_API_HOST = "registry-1.docker.io"
DEFAULT_TAG = "latest"
MAX_NAME_CHARS = 255

_DOCKER_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_PATH = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_HOST_LABEL = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_REGISTRY = re.compile(rf"^(?:{_HOST_LABEL}(?:\.{_HOST_LABEL})*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{{1,5}})?$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_ANY_DIGEST = re.compile(r"^[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9A-Fa-f]{32,}$")


@dataclass(frozen=True)
class Reference:
    """A normalised image reference.

    ``registry`` is ``host[:port]`` (``docker.io`` for Docker Hub); ``repository`` is the path inside it
    (``library/python``); at least one of ``tag`` and ``digest`` is set.
    """

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def name(self) -> str:
        """``registry/repository``, without tag or digest."""
        return f"{self.registry}/{self.repository}"

    @property
    def api_host(self) -> str:
        """The ``host[:port]`` whose ``/v2/`` API serves this registry."""
        return DOCKER_HUB_API_HOST if self.registry == DEFAULT_REGISTRY else self.registry

    @property
    def manifest_ref(self) -> str:
        """What to ask the registry's manifests endpoint for: the digest when there is one, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    def with_digest(self, digest: str) -> Reference:
        """This reference pinned to ``digest`` (the tag is kept for display)."""
        return Reference(self.registry, self.repository, self.tag, digest)

    def __str__(self) -> str:
        text = self.name
        if self.tag is not None:
            text += f":{self.tag}"
        if self.digest is not None:
            text += f"@{self.digest}"
        return text


def parse_reference(text: str) -> Reference:
    """Parse and normalise ``text``; raises InvalidRequest saying what is wrong with it."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest("an image reference must be a non-empty string such as 'python:3.12'")
    if text != text.strip() or any(c.isspace() or ord(c) < 0x20 for c in text):
        raise InvalidRequest(f"image reference {text!r} must not contain spaces or control characters")
    if "://" in text:
        raise InvalidRequest(
            f"image reference {text!r} must not have a scheme: write {text.split('://', 1)[1]!r}"
        )
    rest = text
    digest: str | None = None
    if "@" in rest:
        rest, digest = rest.split("@", 1)
        if not _DIGEST.match(digest):
            if _ANY_DIGEST.match(digest) and not digest.startswith("sha256:"):
                raise InvalidRequest(f"image reference {text!r}: only sha256 digests are supported")
            raise InvalidRequest(
                f"image reference {text!r}: the digest must be 'sha256:' followed by 64 lowercase hex digits"
            )
    tag: str | None = None
    # A tag follows the last ':' unless that ':' belongs to a registry port (it is then before a '/').
    last_colon = rest.rfind(":")
    if last_colon > rest.rfind("/"):
        rest, tag = rest[:last_colon], rest[last_colon + 1 :]
        if not _TAG.match(tag):
            raise InvalidRequest(
                f"image reference {text!r}: tag {tag!r} must be 1-128 of [A-Za-z0-9_.-], not starting with . or -"
            )
    registry, repository = _split_registry(rest, text)
    if not _PATH.match(repository):
        hint = " (repository names are lowercase)" if repository.lower() != repository else ""
        raise InvalidRequest(
            f"image reference {text!r}: {repository!r} is not a valid repository name{hint}; components are "
            "[a-z0-9] separated by '.', '_', '__' or '-', joined by '/'"
        )
    if tag is None and digest is None:
        tag = DEFAULT_TAG
    ref = Reference(registry, repository, tag, digest)
    if len(ref.name) > MAX_NAME_CHARS:
        raise InvalidRequest(
            f"image reference {text!r}: the name must be at most {MAX_NAME_CHARS} characters"
        )
    return ref


def normalize_reference(text: str) -> str:
    """The canonical spelling of ``text``: ``python`` gives ``docker.io/library/python:latest``."""
    return str(parse_reference(text))


def _split_registry(name: str, text: str) -> tuple[str, str]:
    first, slash, remainder = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        if not _REGISTRY.match(first):
            raise InvalidRequest(f"image reference {text!r}: {first!r} is not a valid registry host[:port]")
        port = first.rsplit(":", 1)[1] if ":" in first and not first.endswith("]") else None
        if port is not None and not 0 < int(port) < 65536:
            raise InvalidRequest(f"image reference {text!r}: port {port} is out of range")
        registry, repository = first, remainder
        if registry.lower() in _DOCKER_HUB_ALIASES:
            registry = DEFAULT_REGISTRY
        else:
            # Host names are case-insensitive; the store keys images by the canonical string.
            registry = registry.lower()
    else:
        registry, repository = DEFAULT_REGISTRY, name
    if registry == DEFAULT_REGISTRY and "/" not in repository:
        repository = f"library/{repository}"
    return registry, repository
