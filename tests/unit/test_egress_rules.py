"""The egress rules off the wire: policy per name, address kinds, the resolver's answers, the nftables script,
the address plan, the [network] enforcement keys and the ceiling lowered to what a backend enforces."""

from __future__ import annotations

import ipaddress
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from msgspec import UNSET

from sbx.api.network_policy import NetworkConfig, NetworkPolicy
from sbx.backends.base import BackendError
from sbx.net import nft
from sbx.net.attachment import Attachment
from sbx.net.dns import LookupFailed, Resolver, Upstream, parse_server, system_servers
from sbx.net.egress import Egress, EgressConfig, instance_tag
from sbx.net.ranges import classify
from sbx.net.rules import address_permitted, name_permitted
from sbx.node.config import ConfigError, NodeConfig, ParkingConfig, config_from_mapping
from sbx.node.server import parking_within_backend, within_backend

OPEN = NetworkPolicy("open", UNSET, ("denied.test", "*.evil.test"))
ALLOW = NetworkPolicy("allowlist", ("allowed.test", "*.wild.test"), ("bad.wild.test",))
NONE = NetworkPolicy("none")


@pytest.mark.parametrize(
    ("policy", "name", "permitted"),
    [
        (NONE, "allowed.test", False),
        (ALLOW, "allowed.test", True),
        (ALLOW, "ALLOWED.test.", True),
        (ALLOW, "sub.allowed.test", False),  # a plain name is no pattern
        (ALLOW, "a.wild.test", True),
        (ALLOW, "a.b.wild.test", True),
        (ALLOW, "wild.test", False),  # *.d matches subdomains only
        (ALLOW, "bad.wild.test", False),  # deny wins over allow
        (ALLOW, "other.test", False),
        (ALLOW, "", False),
        (OPEN, "anything.test", True),
        (OPEN, "denied.test", False),
        (OPEN, "sub.denied.test", True),  # deny "denied.test" is that name only
        (OPEN, "x.evil.test", False),
        (OPEN, "evil.test", True),
    ],
)
def test_name_permitted(policy: NetworkPolicy, name: str, permitted: bool) -> None:
    assert name_permitted(policy, name) is permitted


SUBNET = ipaddress.IPv4Network("10.200.0.0/16")


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "forbidden"),
        ("127.1.2.3", "forbidden"),
        ("169.254.169.254", "forbidden"),
        ("0.0.0.0", "forbidden"),
        ("224.0.0.1", "forbidden"),
        ("255.255.255.255", "forbidden"),
        ("10.200.3.6", "forbidden"),  # another sandbox
        ("192.0.2.2", "forbidden"),  # this host's own address (given below)
        ("::1", "forbidden"),
        ("fe80::1", "forbidden"),
        ("::ffff:127.0.0.1", "forbidden"),
        ("::ffff:169.254.169.254", "forbidden"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("100.64.0.1", "private"),
        ("fd00::1", "private"),
        ("198.51.100.20", "public"),  # documentation ranges are deliberate test hosts
        ("93.184.216.34", "public"),
        ("2001:4860::8888", "public"),
    ],
)
def test_classify(address: str, kind: str) -> None:
    host = {ipaddress.ip_address("192.0.2.2")}
    assert classify(ipaddress.ip_address(address), (SUBNET,), host) == kind


@pytest.mark.parametrize(
    ("policy", "kind", "named", "permitted"),
    [
        (ALLOW, "public", True, True),
        (ALLOW, "public", False, False),  # an allowlist admits names only
        (ALLOW, "private", True, True),  # a name someone allowed explicitly
        (ALLOW, "forbidden", True, False),
        (OPEN, "public", False, True),
        (OPEN, "private", True, False),
        (OPEN, "private", False, False),
        (OPEN, "forbidden", True, False),
        (NONE, "public", True, False),
    ],
)
def test_address_permitted(policy: NetworkPolicy, kind: str, named: bool, permitted: bool) -> None:
    assert address_permitted(policy, kind, named=named) is permitted  # type: ignore[arg-type]


# -- resolver ----------------------------------------------------------------------------------------------


class FakeUpstream(Upstream):
    """Answers from a table; records what was asked (so a test sees what would have left the host)."""

    def __init__(self) -> None:
        super().__init__((("192.0.2.53", 53),))
        self.asked: list[str] = []

    async def lookup(self, name: str) -> tuple[ipaddress.IPv4Address, ...]:
        self.asked.append(name)
        if name == "nowhere.test":
            raise LookupFailed("nowhere.test: NXDOMAIN", RCODE.NXDOMAIN)
        if name == "broken.test":
            raise LookupFailed("no upstream DNS server answered")
        return (ipaddress.IPv4Address("198.51.100.10"),)

    async def exchange(self, packet: bytes, *, tcp: bool = False) -> bytes:
        query = DNSRecord.parse(packet)
        self.asked.append(f"{query.q.qname}/{QTYPE[query.q.qtype]}")
        reply = query.reply()
        reply.add_answer(RR(query.q.qname, QTYPE.A, rdata=A("198.51.100.99"), ttl=30))
        return bytes(reply.pack())


def ask(
    name: str, qtype: str, policy: NetworkPolicy | None
) -> tuple[DNSRecord | None, FakeUpstream, Attachment]:
    import asyncio

    upstream = FakeUpstream()
    attachment = Attachment("sbx_1", ipaddress.IPv4Address("10.200.0.2"), policy or NONE)
    resolver = Resolver(
        upstream, lambda source: attachment if policy is not None and source == "10.200.0.2" else None
    )
    query = DNSRecord.question(name, qtype)
    answer = asyncio.run(resolver.answer(query.pack(), "10.200.0.2"))
    parsed = DNSRecord.parse(answer) if answer is not None else None
    if parsed is not None:
        assert parsed.header.id == query.header.id
    return parsed, upstream, attachment


@pytest.mark.parametrize("qtype", ["A", "AAAA", "TXT", "MX", "ANY", "SRV", "CNAME", "HTTPS"])
@pytest.mark.parametrize(
    ("policy", "name"),
    [(NONE, "allowed.test"), (ALLOW, "other.test"), (ALLOW, "bad.wild.test"), (ALLOW, "c2VjcmV0.exfil.test"),
     (OPEN, "denied.test"), (OPEN, "data.x.evil.test")],
)  # fmt: skip
def test_names_not_permitted_get_nxdomain_and_nothing_leaves(
    policy: NetworkPolicy, name: str, qtype: str
) -> None:
    answer, upstream, _ = ask(name, qtype, policy)
    assert answer is not None
    assert answer.header.rcode == RCODE.NXDOMAIN
    assert answer.rr == [] and answer.auth == [] and answer.ar == []
    assert upstream.asked == []


def test_a_for_a_permitted_name_is_the_proxy_lookup_and_is_remembered() -> None:
    answer, upstream, attachment = ask("Allowed.Test", "A", ALLOW)
    assert answer is not None and answer.header.rcode == RCODE.NOERROR
    assert [str(rr.rdata) for rr in answer.rr] == ["198.51.100.10"]
    assert upstream.asked == ["allowed.test"]
    assert attachment.addresses_given("allowed.test") == {ipaddress.IPv4Address("198.51.100.10")}


def test_aaaa_for_a_permitted_name_is_empty() -> None:
    answer, upstream, _ = ask("allowed.test", "AAAA", ALLOW)
    assert answer is not None and answer.header.rcode == RCODE.NOERROR and answer.rr == []
    assert upstream.asked == []


def test_other_types_for_a_permitted_name_are_forwarded() -> None:
    answer, upstream, _ = ask("x.wild.test", "TXT", ALLOW)
    assert answer is not None and answer.header.rcode == RCODE.NOERROR and len(answer.rr) == 1
    assert upstream.asked == ["x.wild.test./TXT"]


@pytest.mark.parametrize(
    ("name", "rcode"), [("nowhere.test", RCODE.NXDOMAIN), ("broken.test", RCODE.SERVFAIL)]
)
def test_upstream_failures(name: str, rcode: int) -> None:
    answer, _, _ = ask(name, "A", OPEN)
    assert answer is not None and answer.header.rcode == rcode


def test_queries_from_no_sandbox_get_no_answer() -> None:
    answer, upstream, _ = ask("allowed.test", "A", None)
    assert answer is None and upstream.asked == []


def test_malformed_queries() -> None:
    import asyncio

    attachment = Attachment("sbx_1", ipaddress.IPv4Address("10.200.0.2"), OPEN)
    resolver = Resolver(FakeUpstream(), lambda source: attachment)
    assert asyncio.run(resolver.answer(b"\x00\x01garbage", "10.200.0.2")) is None
    two = DNSRecord.question("a.test", "A")
    two.add_question(DNSRecord.question("b.test", "A").q)
    answer = asyncio.run(resolver.answer(two.pack(), "10.200.0.2"))
    assert answer is not None and DNSRecord.parse(answer).header.rcode == RCODE.FORMERR
    chaos = DNSRecord.question("version.bind", "TXT", "CH")
    answer = asyncio.run(resolver.answer(chaos.pack(), "10.200.0.2"))
    assert answer is not None and DNSRecord.parse(answer).header.rcode == RCODE.REFUSED


def test_resolver_finds_a_port_free_for_udp_and_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import errno

    from sbx.net import dns

    real = dns.listen_tcp
    refused: list[int] = []

    def taken_once(port: int, backlog: int = 1024) -> socket.socket:
        if not refused:  # the TCP twin of the first UDP port is someone else's
            refused.append(port)
            raise OSError(errno.EADDRINUSE, "Address already in use")
        return real(port, backlog)

    async def go() -> int:
        monkeypatch.setattr(dns, "listen_tcp", taken_once)
        resolver = Resolver(FakeUpstream(), lambda source: None)
        await resolver.start()
        port = resolver.port
        await resolver.close()
        return port

    port = asyncio.run(go())
    assert refused and port > 0 and port != refused[0]


@pytest.mark.parametrize(
    ("text", "server"),
    [("192.0.2.53", ("192.0.2.53", 53)), ("127.0.0.1:5353", ("127.0.0.1", 5353)), ("[::1]:54", ("::1", 54)),
     ("2001:db8::1", ("2001:db8::1", 53))],
)  # fmt: skip
def test_parse_server(text: str, server: tuple[str, int]) -> None:
    assert parse_server(text) == server


@pytest.mark.parametrize("text", ["dns.example", "1.2.3.4:0", "1.2.3.4:99999", "1.2.3.4:x", ""])
def test_parse_server_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_server(text)


def test_system_servers(tmp_path: Path) -> None:
    conf = tmp_path / "resolv.conf"
    conf.write_text("# c\nnameserver 192.0.2.53\nnameserver fe80::1%eth0\nnameserver bogus\nsearch x\n")
    assert system_servers(conf) == (("192.0.2.53", 53), ("fe80::1", 53))
    assert system_servers(tmp_path / "missing") == ()


# -- nftables and the address plan -------------------------------------------------------------------------

PARAMS = nft.RulesetParams("sbx_abcde", "sxabcde", 40001, 40002, "10.200.0.0/16")


def test_ruleset_confines_sandbox_interfaces() -> None:
    script = nft.ruleset(PARAMS)
    # Replaced whole in one transaction: created empty, deleted, created again.
    assert script.startswith("table inet sbx_abcde {}\ndelete table inet sbx_abcde\ntable inet sbx_abcde {")
    lines = [line.strip() for line in script.splitlines()]
    assert 'iifname "sxabcde*" fib saddr . iif oif missing drop' in lines
    assert 'iifname "sxabcde*" meta nfproto ipv4 udp dport 53 redirect to :40002' in lines
    assert 'iifname "sxabcde*" meta nfproto ipv4 tcp dport 53 redirect to :40002' in lines
    assert 'iifname "sxabcde*" meta nfproto ipv4 meta l4proto tcp redirect to :40001' in lines
    assert 'iifname "sxabcde*" ct status dnat tcp dport { 40001, 40002 } accept' in lines
    assert 'iifname "sxabcde*" drop' in lines
    assert 'oifname "sxabcde*" drop' in lines
    # Destinations no policy reaches go to a port admit resets: refused at the SYN, not via the proxy.
    never = 'iifname "sxabcde*" ip daddr { 0.0.0.0/8, 127.0.0.0/8, 169.254.0.0/16, 224.0.0.0/4, 240.0.0.0/4, 10.200.0.0/16 } meta l4proto tcp redirect to :1'
    assert never in lines
    assert lines.index(never) < lines.index(
        'iifname "sxabcde*" meta nfproto ipv4 meta l4proto tcp redirect to :40001'
    )
    assert lines.index(never) > lines.index(
        'iifname "sxabcde*" meta nfproto ipv4 tcp dport 53 redirect to :40002'
    )
    assert lines.count('iifname "sxabcde*" meta l4proto tcp reject with tcp reset') == 2
    # DNS is diverted before the catch-all TCP redirect.
    assert lines.index('iifname "sxabcde*" meta nfproto ipv4 tcp dport 53 redirect to :40002') < lines.index(
        'iifname "sxabcde*" meta nfproto ipv4 meta l4proto tcp redirect to :40001'
    )


@pytest.mark.skipif(shutil.which("nft") is None, reason="nft (nftables) is not installed")
def test_ruleset_is_valid_nft() -> None:
    for script in (nft.ruleset(PARAMS), nft.delete_script(PARAMS.table)):
        check = subprocess.run(
            ["nft", "--check", "-f", "-"], input=script.encode(), capture_output=True, check=False
        )
        assert check.returncode == 0, check.stderr.decode()


def test_address_plan() -> None:
    egress = Egress(EgressConfig(ipaddress.IPv4Network("10.200.0.0/16")), instance_tag("/var/lib/sandboxd"))
    assert egress.slots == 16384
    slot = egress.slot(0x1A3)
    assert (str(slot.host), str(slot.sandbox)) == ("10.200.6.141", "10.200.6.142")
    assert slot.interface == f"sx{egress.tag}1a3" and len(egress.slot(egress.slots - 1).interface) <= 15
    assert egress.free_slot().index == 0
    assert instance_tag("/a") != instance_tag("/b") and len(instance_tag("/a")) == 5


def test_small_subnet_is_refused() -> None:
    with pytest.raises(BackendError, match="too small"):
        Egress(EgressConfig(ipaddress.IPv4Network("10.0.0.0/25")), "abcde")


# -- configuration -----------------------------------------------------------------------------------------


def test_network_enforcement_keys() -> None:
    config = config_from_mapping(
        {"network": {"subnet": "10.99.0.0/20", "upstream_dns": ["127.0.0.1:5353", "192.0.2.53"]}}
    )
    assert config.egress == EgressConfig(
        ipaddress.IPv4Network("10.99.0.0/20"), (("127.0.0.1", 5353), ("192.0.2.53", 53))
    )
    assert config_from_mapping({}).egress == EgressConfig()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"subnet": "10.99.0.1/20"}, "network.subnet '10.99.0.1/20': 10.99.0.1/20 has host bits set"),
        ({"subnet": "10.99.0.0/25"}, "network.subnet 10.99.0.0/25 is too small; give a /24 or larger"),
        ({"subnet": "fd00::/64"}, "network.subnet 'fd00::/64'"),
        ({"subnet": 10}, 'network.subnet: expected a string such as "10.200.0.0/16", got number 10'),
        ({"upstream_dns": ["dns.example"]}, "network.upstream_dns[0] 'dns.example'"),
        ({"upstream_dns": "127.0.0.1"}, "network.upstream_dns: expected an array of strings"),
    ],
)
def test_network_enforcement_keys_refused(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"network": section})
    assert message in str(info.value)


def test_ceiling_lowered_to_what_a_backend_enforces() -> None:
    config = NodeConfig(network=NetworkConfig(NetworkPolicy("none"), "open", ("*",)))
    assert within_backend(config, frozenset({"none", "allowlist", "open"})) is config
    lowered = within_backend(config, frozenset({"none"}))
    assert lowered.network.ceiling == "none"
    strict = NodeConfig(network=NetworkConfig(NetworkPolicy("open"), "open"))
    with pytest.raises(BackendError, match="not enforced by this backend"):
        within_backend(strict, frozenset({"none"}))


def test_parking_off_where_the_backend_refuses_it() -> None:
    config = NodeConfig(parking=ParkingConfig(park_after_secs=30))
    assert parking_within_backend(config, None) is config
    off = parking_within_backend(config, "freezing breaks this runtime")
    assert off.parking.park_after_secs == 0 and off.network == config.network
    never = NodeConfig(parking=ParkingConfig(park_after_secs=0))
    assert parking_within_backend(never, "freezing breaks this runtime") is never


def test_a_host_that_refuses_the_rules_offers_mode_none_only(tmp_path: Path) -> None:
    from sbx.backends.gvisor_net import SandboxNetworks

    refusing = tmp_path / "nft"
    refusing.write_text(
        "#!/bin/sh\necho 'Error: Could not process rule: No such file or directory' >&2\nexit 1\n"
    )
    refusing.chmod(0o755)
    networks = SandboxNetworks(tmp_path, Egress(EgressConfig(), "abcde", nft_binary=str(refusing)))
    assert networks.usable() is False and networks.enabled is False
    with pytest.raises(BackendError, match="not available on this host"):
        import asyncio

        asyncio.run(networks.create("sbx_x", OPEN))


@pytest.mark.skipif(shutil.which("nft") is None, reason="nft (nftables) is not installed")
def test_this_host_takes_the_rules(tmp_path: Path) -> None:
    from sbx.backends.gvisor_net import SandboxNetworks

    config = EgressConfig(ipaddress.IPv4Network("10.251.0.0/16"))  # a subnet nothing here routes
    assert SandboxNetworks(tmp_path, Egress(config, "abcde")).usable() is True


def test_a_subnet_the_host_routes_elsewhere_is_refused(tmp_path: Path) -> None:
    import json as json_module

    from sbx.backends.gvisor_net import SandboxNetworks

    routes = json_module.loads(
        subprocess.run(["ip", "-4", "-j", "route", "show"], capture_output=True, check=True).stdout
    )
    taken = [r for r in routes if r.get("dst", "default") != "default" and "/" in r["dst"]]
    if not taken:
        pytest.skip("no routed IPv4 network on this host (ip route shows none)")
    clash = ipaddress.IPv4Network(taken[0]["dst"], strict=False).supernet(new_prefix=16)
    networks = SandboxNetworks(tmp_path, Egress(EgressConfig(clash), "abcde"))
    assert networks.usable() is False
