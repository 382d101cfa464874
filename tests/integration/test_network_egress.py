"""Network policy on the wire (issue 6): sandboxes with modes none, allowlist and open against a small test
internet (net_world.py), checked from inside the sandboxes with net_probe.py.

Every namespace, interface and nftables table made here is removed at the end, even when a test fails; the
last test checks that.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from net_world import ZONE, World, free_subnet, leftovers
from sandboxd_harness import RUNSC, Sandboxd, missing_requirements

from sbx.net.ranges import read_host_addresses

pytestmark = pytest.mark.skipif(missing_requirements() is not None, reason=str(missing_requirements()))

PROBE = Path(__file__).with_name("net_probe.py").read_text()
A, AAAA, TXT = 1, 28, 16


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    w = World()
    try:
        yield w.start()
    finally:
        w.close()


@contextlib.contextmanager
def started_node(world: World, request: pytest.FixtureRequest) -> Iterator[Sandboxd]:
    """A sandboxd with every mode, its own subnet and the test internet's DNS upstream; whatever it made is
    removed afterwards (sandboxes, namespaces, interfaces, its nftables table), even when a test failed."""
    workdir = Path(tempfile.mkdtemp(prefix="sbxd-net-", dir="/var/tmp"))
    config = (
        "[network]\n"
        'ceiling = "open"\n'
        'default = {mode = "none"}\n'
        'may_allow = ["*"]\n'
        f'subnet = "{free_subnet()}"\n'
        f'upstream_dns = ["127.0.0.1:{world.dns_port}"]\n'
    )
    server = Sandboxd(workdir, config)
    try:
        server.start()
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            _delete_all(server)
        server.teardown()
        if request.session.testsfailed:
            server.save_evidence(Path("test-artifacts") / "test_network_egress" / workdir.name)
        _remove_network_leftovers(server)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def node(world: World, request: pytest.FixtureRequest) -> Iterator[Sandboxd]:
    with started_node(world, request) as server:
        yield server


def _delete_all(server: Sandboxd) -> None:
    """Delete every sandbox through the API and wait for the teardowns (they remove the namespaces)."""
    try:
        listing = server.request("GET", "/v1/sandboxes").json()["sandboxes"]
    except Exception:  # noqa: BLE001 - the server may be gone; the leftovers sweep follows
        return
    for sandbox in listing:
        server.request("DELETE", f"/v1/sandboxes/{sandbox['id']}")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        (server.state_dir / "gvisor" / s["id"]).exists() for s in listing
    ):
        time.sleep(0.1)


def _tag(server: Sandboxd) -> str:
    from sbx.net.egress import instance_tag

    return instance_tag(str((server.state_dir).resolve()))


def _remove_network_leftovers(server: Sandboxd) -> None:
    """Whatever a failed test left: the sandboxes (runsc inside their namespaces), the namespaces, veths and
    the nftables table."""
    gvisor = server.state_dir / "gvisor"
    for directory in gvisor.glob("sbx_*") if gvisor.is_dir() else []:
        netns = Path(f"/var/run/netns/sbx-{directory.name}")
        if netns.exists():
            runsc = ["nsenter", f"--net={netns}", RUNSC, "--root", str(gvisor / "runsc")]
            subprocess.run([*runsc, "kill", directory.name, "KILL"], capture_output=True, check=False)
            subprocess.run([*runsc, "delete", "-force", directory.name], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", f"sbx-{directory.name}"], capture_output=True, check=False)
    tag = _tag(server)
    for name in leftovers((f"sx{tag}",)):
        subprocess.run(["ip", "link", "del", name], capture_output=True, check=False)
    subprocess.run(["nft", "delete", "table", "inet", f"sbx_{tag}"], capture_output=True, check=False)


def probe(node: Sandboxd, sandbox_id: str, **args: Any) -> dict[str, Any]:
    result = node.run(sandbox_id, ["python3", "-c", PROBE, json.dumps(args)], timeout_secs=60)
    lines = result["stdout"].decode().strip().splitlines()
    assert lines, result
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def create(server: Sandboxd, **network: Any) -> str:
    return server.create(network=network)["id"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def open_box(node: Sandboxd) -> str:
    return create(node, mode="open", deny=["denied.test", "*.denied.test"])


@pytest.fixture(scope="module")
def allow_box(node: Sandboxd) -> str:
    return create(node, mode="allowlist", allow=["allowed.test", "*.allowed.test", "private.test"])


# -- open --------------------------------------------------------------------------------------------------


def test_open_reaches_names_over_http_and_https(node: Sandboxd, world: World, open_box: str) -> None:
    for port, tls in ((80, False), (443, True)):
        got = probe(node, open_box, op="http", host="allowed.test", port=port, tls=tls, ca=world.ca_pem)
        assert got["ok"], got
        assert got["body"] == ZONE["allowed.test"]


def test_open_reaches_a_public_address_without_a_name(node: Sandboxd, open_box: str) -> None:
    got = probe(node, open_box, op="tcp", addr=ZONE["other.test"], port=80)
    assert got["ok"], got


def test_open_refuses_denied_names_fast(node: Sandboxd, world: World, open_box: str) -> None:
    got = probe(node, open_box, op="http", host="denied.test", port=80)
    assert not got["ok"] and "gaierror" in got["error"], got  # the resolver has no address for it
    for port, tls in ((80, False), (443, True)):
        got = probe(node, open_box, op="http", host="denied.test", addr=ZONE["denied.test"], port=port, tls=tls,
                    ca=world.ca_pem)  # fmt: skip
        assert not got["ok"] and "ConnectionResetError" in got["error"], got
        assert got["secs"] < 2, got


def test_a_name_and_an_address_that_disagree_go_nowhere(
    node: Sandboxd, world: World, open_box: str, allow_box: str
) -> None:
    for box in (open_box, allow_box):
        # SNI allowed.test, dialled to denied.test's address: reset, and denied.test's server sees nothing.
        got = probe(node, box, op="http", host="allowed.test", addr=ZONE["denied.test"], port=443, tls=True,
                    ca=world.ca_pem)  # fmt: skip
        assert not got["ok"] and "ConnectionResetError" in got["error"], (box, got)
        got = probe(node, box, op="http", host="allowed.test", addr=ZONE["denied.test"], port=80)
        assert not got["ok"] and "ConnectionResetError" in got["error"], (box, got)


def test_names_resolving_to_forbidden_ranges_are_refused_under_open(node: Sandboxd, open_box: str) -> None:
    # Link-local (metadata) is refused by the rules at the SYN: the connection never seems to open.
    got = probe(node, open_box, op="http", host="metadata.test", port=80)
    assert not got["ok"] and "ConnectionRefusedError" in got["error"], got
    # A private address is the proxy's call (an allowlist naming the host may reach it): reset at once.
    got = probe(node, open_box, op="http", host="private.test", port=80)
    assert not got["ok"] and "ConnectionResetError" in got["error"], got
    assert got["secs"] < 2, got
    # 127.0.0.1 is the sandbox's own loopback: refused inside the sandbox, never leaving it.
    got = probe(node, open_box, op="http", host="loopback.test", port=80)
    assert not got["ok"] and "ConnectionRefusedError" in got["error"], got


# -- allowlist ---------------------------------------------------------------------------------------------


def test_allowlist_reaches_allowed_names_over_http_and_https(
    node: Sandboxd, world: World, allow_box: str
) -> None:
    for name in ("allowed.test", "sub.allowed.test"):
        for port, tls in ((80, False), (443, True)):
            got = probe(node, allow_box, op="http", host=name, port=port, tls=tls, ca=world.ca_pem)
            assert got["ok"], (name, port, got)
            assert got["body"] == ZONE[name]


def test_allowlist_refuses_other_names_and_direct_addresses_fast(
    node: Sandboxd, world: World, allow_box: str
) -> None:
    got = probe(node, allow_box, op="http", host="other.test", port=80)
    assert not got["ok"] and "gaierror" in got["error"], got
    cases = [
        {
            "host": "other.test",
            "addr": ZONE["other.test"],
            "port": 443,
            "tls": True,
            "ca": world.ca_pem,
        },  # by SNI
        {"host": "other.test", "addr": ZONE["other.test"], "port": 80},  # by Host
        {"host": ZONE["other.test"], "addr": ZONE["other.test"], "port": 80},  # Host is an address
    ]
    for case in cases:
        got = probe(node, allow_box, op="http", **case)
        assert not got["ok"] and "ConnectionResetError" in got["error"], (case, got)
        assert got["secs"] < 2, got
    # A protocol naming nothing (a direct-IP connection): reset, and no faster route than the name wait.
    got = probe(node, allow_box, op="tcp", addr=ZONE["other.test"], port=80)
    assert not got["ok"], got


@pytest.mark.parametrize(
    ("mode", "name", "qtype"),
    [(m, n, q) for m in ("allowlist", "open") for n in ("denied.test", "exfil-c2VjcmV0.denied.test")
     for q in (A, AAAA, TXT)] + [("allowlist", "other.test", q) for q in (A, AAAA, TXT)],
)  # fmt: skip
def test_dns_for_names_not_permitted_gets_nothing_and_never_leaves(
    node: Sandboxd, world: World, open_box: str, allow_box: str, mode: str, name: str, qtype: int
) -> None:
    box = allow_box if mode == "allowlist" else open_box
    got = probe(node, box, op="dns", name=name, qtype=qtype)
    assert got == {"rcode": 3, "answers": 0}, got
    assert world.asked(name) == 0


def test_dns_for_permitted_names(node: Sandboxd, world: World, allow_box: str) -> None:
    assert probe(node, allow_box, op="dns", name="allowed.test", qtype=A) == {"rcode": 0, "answers": 1}
    # IPv4 only: an empty AAAA answer, so clients use the A record at once.
    assert probe(node, allow_box, op="dns", name="allowed.test", qtype=AAAA) == {"rcode": 0, "answers": 0}
    assert probe(node, allow_box, op="dns", name="allowed.test", qtype=TXT) == {"rcode": 0, "answers": 1}
    # Over TCP too, with the same answers.
    assert probe(node, allow_box, op="dns", name="allowed.test", qtype=A, tcp=True) == {
        "rcode": 0,
        "answers": 1,
    }
    assert probe(node, allow_box, op="dns", name="other.test", qtype=TXT, tcp=True) == {
        "rcode": 3,
        "answers": 0,
    }
    assert world.asked("other.test") == 0
    # Any server address: port 53 always reaches our resolver.
    got = probe(node, allow_box, op="dns", name="allowed.test", qtype=A, server=ZONE["other.test"])
    assert got == {"rcode": 0, "answers": 1}


def test_udp_other_than_dns_is_dropped(node: Sandboxd, open_box: str) -> None:
    echo = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    echo.settimeout(2)
    echo.sendto(b"x", (ZONE["other.test"], 7))
    assert echo.recv(9) == b"x"  # the echo answers the host
    echo.close()
    got = probe(node, open_box, op="udp", addr=ZONE["other.test"], port=7)
    assert not got["ok"], got


# -- what no sandbox reaches -------------------------------------------------------------------------------


def _sandbox_address(node: Sandboxd, sandbox_id: str) -> tuple[str, str]:
    """(sandbox address, host end address) from the backend's network file."""
    data = json.loads((node.state_dir / "gvisor" / sandbox_id / "network.json").read_text())
    subnet = ipaddress.ip_network(
        next(
            line.split('"')[1]
            for line in node.config_path.read_text().splitlines()
            if line.startswith("subnet")
        )
    )
    base = subnet.network_address + 4 * data["slot"]
    return str(base + 2), str(base + 1)


def test_no_sandbox_reaches_another_the_host_or_metadata(
    node: Sandboxd, open_box: str, allow_box: str
) -> None:
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", 0))
    listener.listen()
    listener.settimeout(0)
    port = listener.getsockname()[1]
    other, _ = _sandbox_address(node, allow_box)
    _, gateway = _sandbox_address(node, open_box)
    # Every IPv4 address of this host, the sandbox's own gateway (host end of its veth) among them.
    host_addresses = {str(a) for a in read_host_addresses() if a.version == 4} | {gateway}
    try:
        targets = [(a, port) for a in sorted(host_addresses)] + [
            (other, 80),
            (other, 22),
            ("169.254.169.254", 80),
        ]
        for address, target_port in targets:
            got = probe(node, open_box, op="tcp", addr=address, port=target_port, timeout=5)
            assert not got["ok"], (address, got)
            assert got["secs"] < 2, (address, got)
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection ever reached the host's listener
        got = probe(node, open_box, op="udp", addr=other, port=7)
        assert not got["ok"], got
    finally:
        listener.close()


def test_mode_none_has_no_network(node: Sandboxd) -> None:
    box = create(node, mode="none")
    got = probe(node, box, op="tcp", addr=ZONE["other.test"], port=80, timeout=3)
    assert not got["ok"], got
    assert not (node.state_dir / "gvisor" / box / "network.json").exists()
    assert not Path(f"/var/run/netns/sbx-{box}").exists()


# -- PATCH -------------------------------------------------------------------------------------------------


def test_capabilities_offer_every_mode_and_live_updates(node: Sandboxd) -> None:
    caps = node.request("GET", "/v1/capabilities").json()
    assert caps["capabilities"]["network_policy_update"] is True
    assert caps["network"]["ceiling"] == "open"


def test_patch_open_to_none_cuts_an_open_connection(node: Sandboxd, world: World) -> None:
    box = create(node, mode="open")
    argv = ["python3", "-c", PROBE, json.dumps({"op": "hold", "host": "allowed.test", "port": 80})]
    started = node.request("POST", f"/v1/sandboxes/{box}/processes", {"argv": argv})
    assert started.status in (200, 201), started.body
    events = node.follow(box, started.json()["pid"])
    stdout = ""
    for event in events:
        stdout += base64.b64decode(event.get("data", "")).decode()
        if "holding" in stdout:
            break
    time.sleep(0.5)  # some bytes flow
    patched = node.request("PATCH", f"/v1/sandboxes/{box}", {"network": {"mode": "none"}})
    assert patched.status == 200, patched.body
    assert patched.json()["network"]["mode"] == "none"
    cut_at = time.monotonic()
    for event in events:  # to the process's exit
        stdout += base64.b64decode(event.get("data", "")).decode()
    assert time.monotonic() - cut_at < 5
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["read"] > 0 and "ConnectionResetError" in result["error"], result
    # And nothing new gets out.
    got = probe(node, box, op="http", host="allowed.test", addr=ZONE["allowed.test"], port=80)
    assert not got["ok"], got
    events_body = node.request("GET", f"/v1/sandboxes/{box}/events").json()
    updates = [e for e in events_body["events"] if e["type"] == "sandbox.network_updated"]
    assert [u["network"] for u in updates] == [{"mode": "none", "deny": []}]
    # Narrowed to none, it keeps its interface: widening it again works.
    patched = node.request(
        "PATCH", f"/v1/sandboxes/{box}", {"network": {"mode": "open", "deny": ["denied.test"]}}
    )
    assert patched.status == 200, patched.body
    assert probe(node, box, op="http", host="allowed.test", port=80)["ok"]
    assert not probe(node, box, op="http", host="denied.test", addr=ZONE["denied.test"], port=80)["ok"]


def test_patch_allowlist_narrowing_cuts_only_what_it_no_longer_permits(node: Sandboxd, world: World) -> None:
    box = create(node, mode="allowlist", allow=["allowed.test", "sub.allowed.test"])
    patched = node.request("PATCH", f"/v1/sandboxes/{box}",
                           {"network": {"mode": "allowlist", "allow": ["sub.allowed.test"]}})  # fmt: skip
    assert patched.status == 200, patched.body
    assert probe(node, box, op="http", host="sub.allowed.test", port=80)["ok"]
    got = probe(node, box, op="http", host="allowed.test", addr=ZONE["allowed.test"], port=80)
    assert not got["ok"] and "ConnectionResetError" in got["error"], got


def test_patch_breaking_a_policy_rule_is_refused_and_changes_nothing(node: Sandboxd, world: World) -> None:
    """PATCH rule 1: the create rules apply; a refused PATCH leaves the policy, the name and the live
    enforcement as they were."""
    box = node.create(network={"mode": "allowlist", "allow": ["allowed.test"]}, name="kept")["id"]
    before = node.request("GET", f"/v1/sandboxes/{box}").json()
    for body, status, code, message in [
        ({"network": {"mode": "allowlist", "allow": []}}, 403, "refused", "network policy rule 5: allow: []"),
        ({"network": {"mode": "open", "allow": ["allowed.test"]}}, 400, "invalid_request",
         "network policy rule 6"),
        ({"network": {"mode": "allowlist", "allow": ["http://allowed.test"]}}, 400, "invalid_request",
         "has a scheme"),
        ({"network": {"mode": "allowlist", "allow": ["10.1.2.3"]}}, 400, "invalid_request", "IP address"),
        ({"network": {"mode": "open"}, "name": "Bad Name"}, 400, "invalid_request",
         "is not a valid sandbox name"),
    ]:  # fmt: skip
        resp = node.request("PATCH", f"/v1/sandboxes/{box}", body)
        assert resp.status == status, (body, resp.body)
        assert resp.error[0] == code and message in resp.error[1], (body, resp.error)
    after = node.request("GET", f"/v1/sandboxes/{box}").json()
    assert (after["network"], after["name"]) == (before["network"], "kept")
    events = node.request("GET", f"/v1/sandboxes/{box}/events").json()["events"]
    assert not [e for e in events if e["type"] in ("sandbox.network_updated", "sandbox.updated")]
    # Still the allowlist it had: the allowed name gets through, another does not.
    assert probe(node, box, op="http", host="allowed.test", port=80)["ok"]
    assert not probe(node, box, op="http", host="denied.test", addr=ZONE["denied.test"], port=80)["ok"]


def test_patch_a_sandbox_created_without_network_is_409_and_changes_nothing(node: Sandboxd) -> None:
    box = node.create(network={"mode": "none"}, name="netless")["id"]
    resp = node.request("PATCH", f"/v1/sandboxes/{box}", {"network": {"mode": "open"}, "name": "renamed"})
    assert resp.status == 409, resp.body
    code, message = resp.error
    assert code == "conflict"
    assert "created with network mode none" in message
    after = node.request("GET", f"/v1/sandboxes/{box}").json()
    assert after["network"]["mode"] == "none" and after["name"] == "netless"


# -- cleanup -----------------------------------------------------------------------------------------------


def test_delete_removes_the_namespace_and_the_interface(node: Sandboxd) -> None:
    box = create(node, mode="open")
    _, _ = _sandbox_address(node, box)
    assert Path(f"/var/run/netns/sbx-{box}").exists()
    data = json.loads((node.state_dir / "gvisor" / box / "network.json").read_text())
    interface = f"sx{_tag(node)}{data['slot']:x}"
    assert interface in leftovers((interface,))
    assert node.request("DELETE", f"/v1/sandboxes/{box}").status == 204
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and Path(f"/var/run/netns/sbx-{box}").exists():
        time.sleep(0.1)
    assert not Path(f"/var/run/netns/sbx-{box}").exists()
    assert interface not in leftovers((interface,))


# -- restarts ----------------------------------------------------------------------------------------------


def test_a_restart_takes_networks_back_and_clears_those_of_sandboxes_that_ended(
    world: World, request: pytest.FixtureRequest
) -> None:
    with started_node(world, request) as server:
        kept = create(server, mode="allowlist", allow=["allowed.test"])
        ended = create(server, mode="open")
        server.signal(signal.SIGKILL)
        # While sandboxd is down, one sandbox ends behind its back.
        netns = f"/var/run/netns/sbx-{ended}"
        runsc = ["nsenter", f"--net={netns}", RUNSC, "--root", str(server.state_dir / "gvisor" / "runsc")]
        subprocess.run([*runsc, "kill", ended, "KILL"], capture_output=True, check=True)
        server.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and Path(netns).exists():
            time.sleep(0.1)
        assert not Path(netns).exists()
        assert server.request("GET", f"/v1/sandboxes/{ended}").json()["state"] == "terminated"
        # The kept one works under its policy, through the new proxy and resolver ports.
        got = probe(server, kept, op="http", host="allowed.test", port=443, tls=True, ca=world.ca_pem)
        assert got["ok"] and got["body"] == ZONE["allowed.test"], got
        got = probe(server, kept, op="http", host="other.test", addr=ZONE["other.test"], port=80)
        assert not got["ok"] and "ConnectionResetError" in got["error"], got
        assert probe(server, kept, op="dns", name="other.test", qtype=A) == {"rcode": 3, "answers": 0}


def test_nothing_is_left_behind(world: World, request: pytest.FixtureRequest) -> None:
    with started_node(world, request) as server:
        tag = _tag(server)
        box = create(server, mode="open")
        assert leftovers((f"sx{tag}", f"sbx_{tag}"))  # an interface and the table while a sandbox runs
        assert server.request("DELETE", f"/v1/sandboxes/{box}").status == 204
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and leftovers((f"sx{tag}", f"sbx_{tag}", f"sbx-{box}")):
            time.sleep(0.1)
        assert leftovers((f"sx{tag}", f"sbx_{tag}", f"sbx-{box}")) == []


def test_suspend_and_resume_keep_the_network(node: Sandboxd, world: World) -> None:
    if not node.request("GET", "/v1/capabilities").json()["capabilities"].get("suspend"):
        pytest.skip("this node has no suspend capability (checkpoints)")
    box = create(node, mode="allowlist", allow=["allowed.test"])
    assert probe(node, box, op="http", host="allowed.test", port=80)["ok"]
    for action, state in (("suspend", "suspended"), ("resume", "running")):
        resp = node.request("POST", f"/v1/sandboxes/{box}/{action}")
        assert resp.status == 200 and resp.json()["state"] == state, resp.body
    # The restored sandbox has its address and route again, and the same policy.
    got = probe(node, box, op="http", host="allowed.test", port=443, tls=True, ca=world.ca_pem)
    assert got["ok"] and got["body"] == ZONE["allowed.test"], got
    got = probe(node, box, op="http", host="other.test", addr=ZONE["other.test"], port=80)
    assert not got["ok"] and "ConnectionResetError" in got["error"], got


def test_metrics_count_the_sandbox_interface(node: Sandboxd) -> None:
    box = create(node, mode="allowlist", allow=["allowed.test"])
    got = probe(node, box, op="http", host="allowed.test", port=80, path="/bytes/3000000")
    assert got["ok"], got
    deadline = time.monotonic() + 12  # two sampling intervals and a bit
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        samples = node.request("GET", f"/v1/sandboxes/{box}/metrics").json()["samples"]
        last = samples[-1] if samples else {}
        if last.get("net_rx_bytes", 0) >= 3_000_000:
            break
        time.sleep(0.5)
    assert last["net_rx_bytes"] >= 3_000_000 and 0 < last["net_tx_bytes"] < 1_000_000, last
