"""Caps on what sandboxes may hold of sandboxd's egress resources (docs/network.md, "Limits").

Every connection to the proxy or the resolver and every DNS query waiting on the upstream holds host file
descriptors and event-loop time of sandboxd, the process that also answers the API. Each kind of resource
has a :class:`~sbx.slots.Slots`: a cap per sandbox, so that one sandbox cannot take what others need, and a cap for all
sandboxes together, so that many cannot exhaust sandboxd's descriptors between them.
:meth:`EgressLimits.for_descriptors` sizes the totals from sandboxd's open-file limit.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass
from typing import Final

from sbx.slots import Slots, open_file_limit

log = logging.getLogger(__name__)

#: Descriptors one relayed proxy connection holds: two sockets and a pipe (two ends) per direction.
PROXY_DESCRIPTORS: Final = 6
#: Descriptors one resolver TCP connection holds at most: its socket, and one upstream socket while a
#: forwarded query waits.
DNS_TCP_DESCRIPTORS: Final = 2
#: Share of the open-file limit the egress resources may hold together; the rest stays for the API,
#: agents, logs and images.
EGRESS_SHARE: Final = 0.6


@dataclass(frozen=True)
class EgressLimits:
    """The caps of the proxy and the resolver, per sandbox and in all.

    ``proxy_*``: connections through the proxy, being admitted or relayed. ``dns_tcp_*``: TCP connections to
    the resolver. ``dns_pending_*``: UDP queries being answered (TCP queries are answered one at a time per
    connection, so ``dns_tcp_*`` bounds them).
    """

    proxy_per_sandbox: int = 512
    proxy_total: int = 4096
    dns_tcp_per_sandbox: int = 16
    dns_tcp_total: int = 512
    dns_pending_per_sandbox: int = 64
    dns_pending_total: int = 1024

    @classmethod
    def for_descriptors(cls, open_files: int | None = None) -> EgressLimits:
        """The defaults, with totals lowered so that together they hold at most EGRESS_SHARE of
        ``open_files`` (default: this process's soft RLIMIT_NOFILE, read now) descriptors. Per-sandbox caps
        are never above the totals."""
        if open_files is None:
            open_files = open_file_limit()
        default = cls()
        budget = int(open_files * EGRESS_SHARE)
        # A fifth for the resolver (its connections and the queries waiting on the upstream), the rest for
        # the proxy, whose connections cost most.
        dns_budget = budget // 5
        dns_tcp_total = max(1, min(default.dns_tcp_total, dns_budget // 2 // DNS_TCP_DESCRIPTORS))
        dns_pending_total = max(1, min(default.dns_pending_total, dns_budget // 2))
        proxy_total = max(1, min(default.proxy_total, (budget - dns_budget) // PROXY_DESCRIPTORS))
        return cls(
            proxy_per_sandbox=min(default.proxy_per_sandbox, proxy_total),
            proxy_total=proxy_total,
            dns_tcp_per_sandbox=min(default.dns_tcp_per_sandbox, dns_tcp_total),
            dns_tcp_total=dns_tcp_total,
            dns_pending_per_sandbox=min(default.dns_pending_per_sandbox, dns_pending_total),
            dns_pending_total=dns_pending_total,
        )

    def proxy_slots(self) -> Slots:
        return Slots(self.proxy_per_sandbox, self.proxy_total)

    def dns_tcp_slots(self) -> Slots:
        return Slots(self.dns_tcp_per_sandbox, self.dns_tcp_total)

    def dns_pending_slots(self) -> Slots:
        return Slots(self.dns_pending_per_sandbox, self.dns_pending_total)


def raise_descriptor_limit() -> None:
    """Raise this process's soft limit on open files to the hard one: relays hold descriptors (systemd
    starts services with a soft limit of 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            log.warning("could not raise the open file limit", extra={"soft": soft, "hard": hard})
