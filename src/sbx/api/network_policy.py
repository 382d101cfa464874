"""Network policy wire type and its validation rules (spec: Network policy rules 1-8)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

NetworkMode = Literal["none", "allowlist", "open"]

#: Modes ordered from strictest to loosest (rule: none < allowlist < open).
MODE_ORDER: tuple[NetworkMode, ...] = ("none", "allowlist", "open")


@dataclass(frozen=True)
class NetworkPolicy:
    """A resolved network policy: ``allow`` is None only for modes none and open."""

    mode: NetworkMode
    allow: tuple[str, ...] | None = None
    deny: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, object]:
        """The JSON form: ``{mode, allow?, deny?}`` (allow only for allowlist)."""
        body: dict[str, object] = {"mode": self.mode}
        if self.allow is not None:
            body["allow"] = list(self.allow)
        body["deny"] = list(self.deny)
        return body
