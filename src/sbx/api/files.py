"""Wire types of guest files and directories (spec: Files, Directory entry)."""

from __future__ import annotations

from typing import Literal

import msgspec


class DirEntry(msgspec.Struct, frozen=True):
    """One entry of a guest directory; ``size`` in bytes."""

    name: str
    type: Literal["file", "dir"]
    size: int


class DirListing(msgspec.Struct):
    """``GET .../dirs``: the entries, by name."""

    entries: list[DirEntry]
