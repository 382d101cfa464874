"""Wire types of volumes (spec: Volume, Volumes)."""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType


class Volume(msgspec.Struct):
    """The spec's Volume: ``size_mb`` in MiB; ``attached_to`` names one live holder (the writer if there is
    one, else the first reader by sandbox id), null when no live sandbox holds it."""

    name: str
    size_mb: int
    created_at: str
    attached_to: str | None


class VolumeList(msgspec.Struct):
    """``GET /v1/volumes``."""

    volumes: list[Volume]


class VolumeCreateRequest(msgspec.Struct):
    """``POST /v1/volumes``: ``size_mb`` defaults to the server's default disk size."""

    name: str
    size_mb: int | UnsetType = UNSET
