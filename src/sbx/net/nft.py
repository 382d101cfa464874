"""The nftables table that confines every sandbox interface of one sandboxd (docs/network.md, "Rules").

One table per sandboxd (``inet sbx_<tag>``, the tag derived from its state directory so that two sandboxd on
one host never touch each other's rules), matching the host ends of sandbox veths by their name prefix:

- ``guard`` (prerouting, raw priority): a packet whose source address does not route back through the
  interface it came in on is dropped, so a sandbox cannot pose as another (the proxy and the resolver tell
  sandboxes apart by source address);
- ``divert`` (prerouting, dstnat): DNS (port 53, UDP and TCP, to any address) is redirected to the resolver,
  every other TCP connection to the proxy, except to addresses no policy ever reaches (loopback, link-local
  and metadata, multicast, reserved, the sandbox subnet): those go to a port ``admit`` resets, so they are
  refused right at the SYN and never even seem to open;
- ``admit`` (input): from sandbox interfaces only redirected packets reach this host, other TCP is reset at
  once and anything else dropped; from elsewhere the proxy and resolver ports are closed;
- ``nofwd`` (forward): nothing is ever forwarded to or from a sandbox interface (TCP is reset, the rest
  dropped): all egress leaves from the proxy's own sockets on this host, after the policy has been checked.

The whole table is replaced in one ``nft -f`` transaction, so rules are never half applied.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sbx.backends.base import BackendError


@dataclass(frozen=True)
class RulesetParams:
    """``table``: the table name; ``prefix``: the name prefix of the host ends of sandbox veths;
    ``proxy_port``/``resolver_port``: where the proxy and the resolver listen (TCP; UDP and TCP);
    ``subnet``: the sandboxes' subnet."""

    table: str
    prefix: str
    proxy_port: int
    resolver_port: int
    subnet: str


#: Destinations no policy ever reaches (see ranges.py): not worth a trip through the proxy.
_NEVER = "0.0.0.0/8, 127.0.0.0/8, 169.254.0.0/16, 224.0.0.0/4, 240.0.0.0/4"
#: Where connections to those go: a port ``admit`` resets (it accepts only the proxy and resolver ports), so
#: the SYN is answered by a reset whatever the host's routing and forwarding say.
_CLOSED_PORT = 1


def ruleset(p: RulesetParams) -> str:
    """The ``nft -f`` script that (re)creates the table; idempotent (an existing table is replaced)."""
    ifs = f'"{p.prefix}*"'
    ports = f"{{ {p.proxy_port}, {p.resolver_port} }}"
    return f"""table inet {p.table} {{}}
delete table inet {p.table}
table inet {p.table} {{
  chain guard {{
    type filter hook prerouting priority raw; policy accept;
    iifname {ifs} fib saddr . iif oif missing drop
  }}
  chain divert {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname {ifs} meta nfproto ipv4 udp dport 53 redirect to :{p.resolver_port}
    iifname {ifs} meta nfproto ipv4 tcp dport 53 redirect to :{p.resolver_port}
    iifname {ifs} ip daddr {{ {_NEVER}, {p.subnet} }} meta l4proto tcp redirect to :{_CLOSED_PORT}
    iifname {ifs} meta nfproto ipv4 meta l4proto tcp redirect to :{p.proxy_port}
  }}
  chain admit {{
    type filter hook input priority filter; policy accept;
    iifname {ifs} ct status dnat tcp dport {ports} accept
    iifname {ifs} ct status dnat udp dport {p.resolver_port} accept
    iifname {ifs} meta l4proto tcp reject with tcp reset
    iifname {ifs} drop
    iifname != "lo" tcp dport {ports} drop
    iifname != "lo" udp dport {p.resolver_port} drop
  }}
  chain nofwd {{
    type filter hook forward priority filter; policy accept;
    iifname {ifs} meta l4proto tcp reject with tcp reset
    iifname {ifs} drop
    oifname {ifs} drop
  }}
}}
"""


def delete_script(table: str) -> str:
    """The ``nft -f`` script that removes the table (no error when it is absent)."""
    return f"table inet {table} {{}}\ndelete table inet {table}\n"


async def apply(script: str, nft: str = "nft") -> None:
    """Run ``script`` through ``nft -f -`` as one transaction; BackendError with nft's message on failure."""
    proc = await asyncio.create_subprocess_exec(
        nft, "-f", "-",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate(script.encode())
    if proc.returncode != 0:
        detail = (err or out).decode(errors="replace").strip()
        raise BackendError(
            f"nft could not apply the sandbox network rules (exit {proc.returncode}): {detail}"
        )
