"""Typed values the SDK returns: run results, output events, directory entries, event lists.

Each is a frozen dataclass built from the spec's wire form by ``from_wire``; a malformed answer
raises ``Internal`` (the server broke the contract, the caller did nothing wrong).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from sbx.api.errors import Internal


def as_object(body: Any, what: str = "a JSON object") -> dict[str, Any]:
    """``body`` if it is a JSON object; ``Internal`` saying ``what`` was expected otherwise."""
    if not isinstance(body, dict):
        raise Internal(f"the server answered {type(body).__name__} where {what} was expected")
    return body


def array_field(body: Any, key: str) -> list[Any]:
    """``body[key]`` when ``body`` is a JSON object with an array there; ``Internal`` otherwise."""
    found = body.get(key) if isinstance(body, dict) else None
    if not isinstance(found, list):
        raise Internal(f"the server's answer has no {key!r} array")
    return found


@dataclass(frozen=True)
class RunResult:
    """The outcome of ``run``: output bytes (decoded from the wire's base64) and how it ended.

    ``exit_code`` is -1 when ``timed_out``; ``truncated`` says an output stream passed 8 MiB.
    """

    exit_code: int
    stdout: bytes
    stderr: bytes
    truncated: bool
    timed_out: bool

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> RunResult:
        """Build from the spec's run result ``{exit_code, stdout, stderr, truncated, timed_out}``."""
        try:
            return cls(
                exit_code=int(body["exit_code"]),
                stdout=base64.b64decode(body.get("stdout") or "", validate=True),
                stderr=base64.b64decode(body.get("stderr") or "", validate=True),
                truncated=bool(body.get("truncated", False)),
                timed_out=bool(body.get("timed_out", False)),
            )
        except (KeyError, TypeError, ValueError, binascii.Error) as exc:
            raise Internal(f"the server sent a malformed run result: {exc}") from exc

    def to_wire(self) -> dict[str, Any]:
        """The spec's wire form again (output base64), e.g. for printing as JSON."""
        return {
            "exit_code": self.exit_code,
            "stdout": base64.b64encode(self.stdout).decode("ascii"),
            "stderr": base64.b64encode(self.stderr).decode("ascii"),
            "truncated": self.truncated,
            "timed_out": self.timed_out,
        }


@dataclass(frozen=True)
class OutputEvent:
    """A piece of a process's output: which stream and the bytes (a tty process has only stdout)."""

    stream: Literal["stdout", "stderr"]
    data: bytes


@dataclass(frozen=True)
class DirEntry:
    """One entry of a guest directory listing; ``size`` in bytes."""

    name: str
    type: Literal["file", "dir"]
    size: int

    @classmethod
    def from_wire(cls, body: Any) -> DirEntry:
        """Build from ``{name, type, size}``."""
        try:
            kind = body["type"]
            if kind not in ("file", "dir"):
                raise ValueError(f"type {kind!r}")
            return cls(name=str(body["name"]), type=kind, size=int(body["size"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise Internal(f"the server sent a malformed directory entry: {exc}") from exc


@dataclass(frozen=True)
class EventList:
    """A sandbox's audit events, oldest first; ``truncated`` when only the newest 5000 came."""

    events: list[dict[str, Any]]
    truncated: bool

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> EventList:
        """Build from ``{events, truncated}``."""
        return cls(events=array_field(body, "events"), truncated=bool(body.get("truncated", False)))
