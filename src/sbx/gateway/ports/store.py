"""Exposed ports in the gateway's state (tables ``public_ports`` and ``port_tokens``, schema v9): which ports are
public, and the port tokens, of which only the SHA-256 of each ``sgp_`` secret is kept, with the key that made
it (docs/ports.md, "State").

Both are held in memory (the ports front reads memory only) and kept in step with other replicas' writes
through ``Store.mirror``, so a token made through one replica opens its port through every other one. A write
commits first and changes memory after, off the event loop (``write``, the gateway's ``write``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sbx.gateway.store import TABLES, Delete, Store, Upsert

Writer = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class PortTokenRecord:
    """A port token: it opens ``port`` of ``sandbox`` until ``expires_at`` (epoch seconds) while the key
    ``key_id`` (of ``user`` acting in ``tenant``) stays good."""

    token_sha256: str
    sandbox: str
    port: int
    key_id: str
    user: str
    tenant: str
    expires_at: float
    created: str

    def opens(self, sandbox: str, port: int, now: float) -> bool:
        return self.sandbox == sandbox and self.port == port and now < self.expires_at


class PortStore:
    """The public ports and port tokens, in memory and in the store."""

    def __init__(self, store: Store, write: Writer) -> None:
        self.store = store
        self._write = write
        #: ``(sandbox, port)`` of every public port, with when it was made public (RFC 3339).
        self.public: dict[tuple[str, int], str] = {}
        self.tokens: dict[str, PortTokenRecord] = {}

        def put_public(r: tuple[Any, ...]) -> None:
            self.public[(r[0], int(r[1]))] = r[2]

        def put_token(r: tuple[Any, ...]) -> None:
            self.tokens[r[0]] = PortTokenRecord(r[0], r[1], int(r[2]), r[3], r[4], r[5], float(r[6]), r[7])

        store.mirror("public_ports", put_public, lambda k: self.public.pop((k[0], int(k[1])), None),
                     self.public.clear)  # fmt: skip
        store.mirror("port_tokens", put_token, lambda k: self.tokens.pop(k[0], None), self.tokens.clear)
        for table in ("public_ports", "port_tokens"):
            for row in store.query(table, TABLES[table].columns):
                store.mirrors[table].put(row)

    def is_public(self, sandbox: str, port: int) -> bool:
        return (sandbox, port) in self.public

    def public_of(self, sandbox: str) -> list[int]:
        return sorted(p for s, p in list(self.public) if s == sandbox)

    async def set_public(self, sandbox: str, port: int, public: bool, created: str) -> None:
        if public == self.is_public(sandbox, port):
            return
        if public:
            op: Upsert | Delete = Upsert(
                "public_ports", {"sandbox": sandbox, "port": port, "created": created}
            )
        else:
            op = Delete("public_ports", {"sandbox": sandbox, "port": port})
        await self._write(self.store.execute, [op])
        if public:
            self.public[(sandbox, port)] = created
        else:
            self.public.pop((sandbox, port), None)

    async def add_token(self, token: PortTokenRecord) -> None:
        row = {name: getattr(token, name) for name in TABLES["port_tokens"].columns}
        await self._write(self.store.execute, [Upsert("port_tokens", row)])
        self.tokens[token.token_sha256] = token

    async def forget(self, sandboxes: set[str], now: float | None = None) -> None:
        """Drop the public flags and tokens of ``sandboxes`` (ended), and every expired token."""
        moment = time.time() if now is None else now
        ops: list[Upsert | Delete] = [Delete("public_ports", {"sandbox": s, "port": p})
                                      for s, p in list(self.public) if s in sandboxes]  # fmt: skip
        gone = [t.token_sha256 for t in list(self.tokens.values())
                if t.sandbox in sandboxes or t.expires_at <= moment]  # fmt: skip
        ops += [Delete("port_tokens", {"token_sha256": h}) for h in gone]
        if not ops:
            return
        await self._write(self.store.execute, ops)
        for key in [k for k in self.public if k[0] in sandboxes]:
            self.public.pop(key, None)
        for h in gone:
            self.tokens.pop(h, None)
