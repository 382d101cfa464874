"""Egress for one sandboxd: the resolver, the proxy, the nftables table and the sandbox address plan.

Addressing: the configured subnet (``[network] subnet``, default 10.200.0.0/16) is cut into /30 slots; slot
``n`` covers ``subnet + 4n``: ``+1`` is the host end of the sandbox's veth (the sandbox's gateway and DNS
server), ``+2`` the sandbox. The host end is named ``<prefix><n in hex>``, where the prefix (``sx`` and five hex
digits of a hash of the state directory) is what the nftables rules match, so two sandboxd on one host each
confine their own interfaces only (they must be given different subnets).

The backend calls :meth:`Egress.attach` when a sandbox with a network boots or is taken back after a restart,
:meth:`Egress.detach` when it is destroyed, and :meth:`Egress.set_policy` for a PATCH. The nftables table
exists while at least one sandbox is attached, and is removed with the last one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import ipaddress
import logging
from dataclasses import dataclass, field
from typing import Final

from sbx.api.network_policy import NetworkPolicy
from sbx.backends.base import BackendError
from sbx.net import nft
from sbx.net.attachment import Attachment
from sbx.net.dns import Resolver, Server, Upstream, system_servers
from sbx.net.limits import EgressLimits, raise_descriptor_limit
from sbx.net.proxy import EgressProxy

log = logging.getLogger(__name__)

DEFAULT_SUBNET: Final = ipaddress.IPv4Network("10.200.0.0/16")
#: The smallest subnet accepted: 64 slots.
MIN_SUBNET_PREFIX: Final = 24


@dataclass(frozen=True)
class EgressConfig:
    """``[network]`` settings for enforcement: ``subnet`` (IPv4, prefix length 24 or less) is cut into
    sandbox /30s; ``upstream_dns`` are the servers the resolver and proxy ask (empty: those of
    /etc/resolv.conf, read when sandboxd starts)."""

    subnet: ipaddress.IPv4Network = DEFAULT_SUBNET
    upstream_dns: tuple[Server, ...] = ()


@dataclass(frozen=True)
class Slot:
    """One sandbox's place in the address plan."""

    index: int
    host: ipaddress.IPv4Address
    sandbox: ipaddress.IPv4Address
    interface: str

    @property
    def prefix_len(self) -> int:
        return 30


def instance_tag(state_key: str) -> str:
    """Five hex digits naming one sandboxd (its state directory) in table and interface names."""
    return hashlib.sha256(state_key.encode()).hexdigest()[:5]


@dataclass
class Egress:
    """See the module docstring. ``tag`` comes from :func:`instance_tag`."""

    config: EgressConfig
    tag: str
    nft_binary: str = "nft"
    _attachments: dict[str, tuple[Slot, Attachment]] = field(default_factory=dict)
    _by_address: dict[str, Attachment] = field(default_factory=dict)
    _table_applied: bool = False
    _rules_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def __post_init__(self) -> None:
        if self.config.subnet.prefixlen > MIN_SUBNET_PREFIX:
            raise BackendError(
                f"[network] subnet {self.config.subnet} is too small; give a /{MIN_SUBNET_PREFIX} or larger"
            )
        self.table = f"sbx_{self.tag}"
        self.prefix = f"sx{self.tag}"
        servers = self.config.upstream_dns or system_servers()
        self.upstream = Upstream(servers)
        raise_descriptor_limit()  # first: the caps are sized from the limit
        self.limits = EgressLimits.for_descriptors()
        self.resolver = Resolver(self.upstream, self._by_address.get, self.limits)
        self.proxy = EgressProxy(self.upstream, self._by_address.get, self.config.subnet, limits=self.limits)

    @property
    def slots(self) -> int:
        """How many sandboxes the subnet has room for."""
        return self.config.subnet.num_addresses // 4

    def slot(self, index: int) -> Slot:
        base = self.config.subnet.network_address + 4 * index
        return Slot(index, base + 1, base + 2, f"{self.prefix}{index:x}")

    def free_slot(self) -> Slot:
        """The lowest slot no attached sandbox holds; BackendError when the subnet is full."""
        taken = {slot.index for slot, _ in self._attachments.values()}
        for index in range(self.slots):
            if index not in taken:
                return self.slot(index)
        raise BackendError(
            f"no free sandbox address: all {self.slots} of [network] subnet {self.config.subnet} are in use"
        )

    async def start(self) -> None:
        """Listen (proxy and resolver, on free ports). The caller then attaches the sandboxes it takes back
        (which replaces the table atomically with one naming the new ports) and calls :meth:`settle`."""
        await self.resolver.start()
        await self.proxy.start()
        log.info(
            "egress listening",
            extra={"proxy_port": self.proxy.port, "resolver_port": self.resolver.port, "table": self.table,
                   "limits": dataclasses.asdict(self.limits)},
        )  # fmt: skip

    async def settle(self) -> None:
        """With no sandbox attached, remove the table a killed predecessor may have left behind."""
        async with self._rules_lock:
            if not self._attachments:
                await nft.apply(nft.delete_script(self.table), self.nft_binary)

    async def close(self) -> None:
        """Stop listening; the table stays (running sandboxes keep their confinement until a restart)."""
        await self.proxy.close()
        await self.resolver.close()

    async def attach(self, sandbox_id: str, slot: Slot, policy: NetworkPolicy) -> None:
        """Admit ``sandbox_id`` at ``slot`` under ``policy``; the rules are in place when this returns."""
        attachment = Attachment(sandbox_id, slot.sandbox, policy)
        self._attachments[sandbox_id] = (slot, attachment)
        self._by_address[str(slot.sandbox)] = attachment
        async with self._rules_lock:
            if not self._table_applied:
                params = nft.RulesetParams(
                    self.table, self.prefix, self.proxy.port, self.resolver.port, str(self.config.subnet)
                )
                await nft.apply(nft.ruleset(params), self.nft_binary)
                self._table_applied = True

    async def detach(self, sandbox_id: str) -> None:
        """Forget ``sandbox_id`` and cut its connections; the last one out removes the table."""
        entry = self._attachments.pop(sandbox_id, None)
        if entry is not None:
            slot, attachment = entry
            self._by_address.pop(str(slot.sandbox), None)
            attachment.set_policy(NetworkPolicy("none"))
        async with self._rules_lock:
            if not self._attachments and self._table_applied:
                await nft.apply(nft.delete_script(self.table), self.nft_binary)
                self._table_applied = False

    def set_policy(self, sandbox_id: str, policy: NetworkPolicy) -> int:
        """Apply ``policy`` to an attached sandbox at once; returns how many connections were cut."""
        entry = self._attachments.get(sandbox_id)
        if entry is None:
            raise BackendError(f"sandbox {sandbox_id} has no network interface")
        return entry[1].set_policy(policy)

    def slot_of(self, sandbox_id: str) -> Slot | None:
        entry = self._attachments.get(sandbox_id)
        return entry[0] if entry is not None else None
