"""Wire types of the node's image store (spec: Image, Images)."""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType


class ImageProgress(msgspec.Struct):
    """An install under way: ``done`` and ``total`` are bytes while pulling."""

    phase: Literal["pulling", "building"]
    done: int
    total: int


class Image(msgspec.Struct, kw_only=True):
    """The spec's Image. ``bytes`` is the root disk's size (0 until installed); ``in_use`` counts sandboxes
    starting, running or suspended from it; ``progress`` only while installing, ``error`` only when
    failed, ``digest`` and ``installed_at`` once installed."""

    image: str
    state: Literal["installed", "installing", "failed"]
    digest: str | UnsetType = UNSET
    bytes: int
    installed_at: str | UnsetType = UNSET
    in_use: int
    default: bool
    pooled: bool
    progress: ImageProgress | UnsetType = UNSET
    error: str | UnsetType = UNSET


class ImageList(msgspec.Struct):
    """``GET /v1/images``: by name."""

    images: list[Image]


class ImageRequest(msgspec.Struct):
    """``POST /v1/images``: the reference to install."""

    required_hints: ClassVar[dict[str, str]] = {
        "image": "image is required: a reference such as 'python:3.12'"
    }

    image: str


class ImageRemoved(msgspec.Struct):
    """``DELETE /v1/images``: what went, and the bytes freed."""

    image: str
    freed_bytes: int
