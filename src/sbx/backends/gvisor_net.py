"""Network namespaces for gVisor sandboxes with egress (modes ``allowlist`` and ``open``; docs/network.md).

A sandbox with egress runs in its own network namespace ``/var/run/netns/sbx-<id>`` holding one end of a veth
pair (``eth0``, the sandbox's /30 address and a default route to the host end); runsc runs with
``--network=sandbox``, gVisor's own network stack, which takes the interface's addresses over (so they are
put back before a restore, :meth:`SandboxNetworks.prepare_for_restore`). Mode ``none`` keeps
``--network=none`` and no namespace at all: its creates stay as fast as before.

runsc before release 20240807 (Debian 12's 20221219 and bookworm-backports' 20240729 included) refuses
``--network=sandbox`` when ``/proc/sys/net/core/rmem_default`` exists (its test for "still in the root network
namespace", wrong on current kernels), so the runsc process that starts a sandbox runs in a private mount
namespace with a tmpfs over /proc/sys/net (:meth:`SandboxNetworks.process_argv`; not for later releases).
Every other runsc command about such a sandbox (state, kill, delete, checkpoint) enters its network namespace
first: runsc's control socket is abstract, so it exists only there (:meth:`SandboxNetworks.command_argv`).

Per sandbox, ``<state>/gvisor/<id>/network.json`` keeps its slot and current policy, so a restarted sandboxd
takes the sandbox's network back (:meth:`SandboxNetworks.start`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any, Final

from sbx.api.network_policy import NetworkPolicy
from sbx.backends.base import BackendError
from sbx.backends.layers import run_tool
from sbx.net import nft
from sbx.net.egress import Egress, Slot

log = logging.getLogger(__name__)

NETNS_DIR: Final = Path("/var/run/netns")
NETWORK_FILE: Final = "network.json"
RESOLV_CONF_FILE: Final = "resolv.conf"
GUEST_INTERFACE: Final = "eth0"


class SandboxNetworks:
    """The network namespaces of one gVisor backend; ``base`` is its state directory (``<state>/gvisor``)."""

    def __init__(self, base: Path, egress: Egress) -> None:
        self.base = base
        self.egress = egress
        #: False when this host cannot enforce egress (see :meth:`usable`): no new sandbox gets a network,
        #: while namespaces left by an earlier run are still entered and removed.
        self.enabled = True
        #: Whether runsc needs the tmpfs over /proc/sys/net (set from its release by the backend).
        self.procfs_mask = True

    def usable(self) -> bool:
        """Whether the tools are installed and the kernel takes our nftables rules (``nft --check``, which
        changes nothing). When not, the reason is logged and :attr:`enabled` turns false."""
        problem = None
        missing = [tool for tool in ("nft", "ip", "nsenter", "unshare") if shutil.which(tool) is None]
        if missing:
            problem = f"{', '.join(missing)} not found (install nftables, iproute2 and util-linux)"
        else:
            script = nft.ruleset(
                nft.RulesetParams(self.egress.table, self.egress.prefix, 1, 2, str(self.egress.config.subnet))
            )
            try:
                check = subprocess.run(
                    [self.egress.nft_binary, "--check", "-f", "-"],
                    input=script.encode(), capture_output=True, timeout=10, check=False,
                )  # fmt: skip
            except (OSError, subprocess.SubprocessError) as exc:
                problem = f"nft could not be run: {exc}"
            else:
                if check.returncode != 0:
                    problem = f"the kernel refuses the egress rules: {check.stderr.decode(errors='replace').strip()}"
        if problem is None:
            problem = self._subnet_clash()
        if problem is not None:
            log.warning("network modes allowlist and open are not available", extra={"reason": problem})
            self.enabled = False
        return self.enabled

    @staticmethod
    def netns_name(sandbox_id: str) -> str:
        return f"sbx-{sandbox_id}"

    def netns_path(self, sandbox_id: str) -> Path:
        return NETNS_DIR / self.netns_name(sandbox_id)

    def has_netns(self, sandbox_id: str) -> bool:
        """Whether the sandbox runs in a namespace of ours (a stat; true after a restart too)."""
        return self.netns_path(sandbox_id).exists()

    def _file(self, sandbox_id: str) -> Path:
        return self.base / sandbox_id / NETWORK_FILE

    def resolv_conf(self, sandbox_id: str) -> Path:
        return self.base / sandbox_id / RESOLV_CONF_FILE

    # -- runsc argv ------------------------------------------------------------------------------------

    def command_argv(self, sandbox_id: str, runsc_argv: list[str]) -> list[str]:
        """``runsc_argv`` run inside the sandbox's network namespace when it has one."""
        if not self.has_netns(sandbox_id):
            return runsc_argv
        return ["nsenter", f"--net={self.netns_path(sandbox_id)}", *runsc_argv]

    def process_argv(self, sandbox_id: str, runsc_argv: list[str]) -> list[str]:
        """The argv that runs ``runsc_argv`` (a ``run`` or ``restore`` without a ``--network`` flag) so that
        it starts the sandbox: ``--network=none`` without a namespace; with one, ``--network=sandbox`` in
        it, behind a private tmpfs over /proc/sys/net when runsc needs one (see the module docstring)."""
        runsc, *rest = runsc_argv
        if not self.has_netns(sandbox_id):
            return [runsc, "--network=none", *rest]
        if not self.procfs_mask:
            return ["nsenter", f"--net={self.netns_path(sandbox_id)}", runsc, "--network=sandbox", *rest]
        script = (
            f'mount -t tmpfs none /proc/sys/net && exec nsenter --net="{self.netns_path(sandbox_id)}" "$@"'
        )
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
                runsc, "--network=sandbox", *rest]  # fmt: skip

    def configure_spec(self, sandbox_id: str, spec: dict[str, Any]) -> None:
        """Point the OCI spec at the sandbox's namespace and give it our resolver in /etc/resolv.conf."""
        if not self.has_netns(sandbox_id):
            return
        for namespace in spec["linux"]["namespaces"]:
            if namespace["type"] == "network":
                namespace["path"] = str(self.netns_path(sandbox_id))
        spec["mounts"].append(
            {
                "destination": "/etc/resolv.conf",
                "type": "bind",
                "source": str(self.resolv_conf(sandbox_id)),
                "options": ["rbind", "ro"],
            }
        )

    # -- lifecycle -------------------------------------------------------------------------------------

    def _subnet_clash(self) -> str | None:
        """Why the configured subnet cannot be ours: a route of this host into it through an interface that is
        not one of our sandbox interfaces (the host's own network, or another sandboxd using the same subnet)."""
        subnet = self.egress.config.subnet
        try:
            routes = json.loads(
                subprocess.run(
                    ["ip", "-4", "-j", "route", "show", "table", "all"],
                    capture_output=True,
                    timeout=10,
                    check=True,
                ).stdout
            )
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            return f"the host's routes could not be read: {exc}"
        for route in routes:
            dst, dev = route.get("dst", ""), route.get("dev", "")
            if dst == "default" or dev.startswith(self.egress.prefix):
                continue
            try:
                network = ipaddress.IPv4Network(dst, strict=False)
            except ValueError:
                continue
            if network.overlaps(subnet) and network.prefixlen > 0:
                return (
                    f"[network] subnet {subnet} overlaps the route to {dst} via {dev}; "
                    "give sandboxd a subnet of its own"
                )
        return None

    async def start(self) -> None:
        """Take back the networks of sandboxes a previous sandboxd made (their namespace still exists)."""
        if not self.enabled:
            return
        await self.egress.start()
        for path in sorted(self.base.glob(f"*/{NETWORK_FILE}")):
            sandbox_id = path.parent.name
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                slot = self.egress.slot(int(data["slot"]))
                policy = NetworkPolicy.from_wire(data["policy"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning(
                    "unreadable sandbox network file", extra={"sandbox": sandbox_id, "error": str(exc)}
                )
                continue
            if self.has_netns(sandbox_id):
                await self.egress.attach(sandbox_id, slot, policy)
                log.info("sandbox network taken back", extra={"sandbox": sandbox_id, "mode": policy.mode})
        await self.egress.settle()

    async def close(self) -> None:
        if self.enabled:
            await self.egress.close()

    async def create(self, sandbox_id: str, policy: NetworkPolicy) -> None:
        """The sandbox's namespace, veth pair, addresses, route and resolv.conf; admitted under ``policy``.
        On failure whatever was made is removed again (by the caller's destroy)."""
        if not self.enabled:
            raise BackendError(
                "network modes allowlist and open are not available on this host (see the log)"
            )
        slot = self.egress.free_slot()
        self._save(sandbox_id, slot, policy)
        self.resolv_conf(sandbox_id).write_text(
            f"# written by sandboxd: every DNS query goes to its resolver\nnameserver {slot.host}\n",
            encoding="utf-8",
        )
        await self.egress.attach(sandbox_id, slot, policy)
        name = self.netns_name(sandbox_id)
        await run_tool("ip", "netns", "add", name)
        host_batch = (
            f"link add {slot.interface} type veth peer name {GUEST_INTERFACE} netns {name}\n"
            f"link set {slot.interface} addrgenmode none\n"
            f"addr add {slot.host}/{slot.prefix_len} dev {slot.interface}\n"
            f"link set {slot.interface} up\n"
        )
        await _ip_batch(host_batch)
        await _ip_batch(
            f"link set {GUEST_INTERFACE} addrgenmode none\n"
            f"link set lo up\n"
            f"link set {GUEST_INTERFACE} up\n" + self._guest_addresses(slot),
            netns=name,
        )

    async def ensure(self, sandbox_id: str, policy: NetworkPolicy | None = None) -> None:
        """Make the sandbox's namespace again when a reboot took it (under ``policy``, default the one last
        saved; its address may change); nothing when it exists or the sandbox never had one."""
        if self.has_netns(sandbox_id):
            return
        if policy is None:
            try:
                data = json.loads(self._file(sandbox_id).read_text(encoding="utf-8"))
                policy = NetworkPolicy.from_wire(data["policy"])
            except (OSError, ValueError, KeyError, TypeError):
                return  # mode none: no namespace to make
        await self.destroy(sandbox_id)
        await self.create(sandbox_id, policy)

    @staticmethod
    def _guest_addresses(slot: Slot) -> str:
        return (
            f"addr replace {slot.sandbox}/{slot.prefix_len} dev {GUEST_INTERFACE}\n"
            f"route replace default via {slot.host} dev {GUEST_INTERFACE}\n"
        )

    async def prepare_for_restore(self, sandbox_id: str) -> None:
        """Put the guest end's address and route back into the namespace (runsc moved them into the sandbox
        it checkpointed; a restore without them has no route). Idempotent; nothing without a namespace."""
        slot = self.egress.slot_of(sandbox_id)
        if slot is None or not self.has_netns(sandbox_id):
            return
        await _ip_batch(self._guest_addresses(slot), netns=self.netns_name(sandbox_id))

    async def set_policy(self, sandbox_id: str, policy: NetworkPolicy) -> int:
        """Apply ``policy`` at once (connections it no longer permits are cut; returns how many)."""
        slot = self.egress.slot_of(sandbox_id)
        if slot is None:
            raise BackendError(f"sandbox {sandbox_id} has no network interface")
        self._save(sandbox_id, slot, policy)
        return self.egress.set_policy(sandbox_id, policy)

    def host_interface(self, sandbox_id: str) -> str | None:
        slot = self.egress.slot_of(sandbox_id)
        return slot.interface if slot is not None else None

    async def destroy(self, sandbox_id: str) -> None:
        """Remove the namespace, the veth pair and the sandbox from the rules; idempotent. Call after runsc
        has stopped the sandbox (its processes hold the namespace)."""
        slot = self.egress.slot_of(sandbox_id)
        if slot is None:
            try:
                data = json.loads(self._file(sandbox_id).read_text(encoding="utf-8"))
                slot = self.egress.slot(int(data["slot"]))
            except (OSError, ValueError, KeyError, TypeError):
                slot = None
        if slot is not None:
            try:
                await run_tool("ip", "link", "del", slot.interface)
            except BackendError:
                pass  # already gone with the namespace
        if self.has_netns(sandbox_id):
            await run_tool("ip", "netns", "del", self.netns_name(sandbox_id))
        if self.enabled:
            await self.egress.detach(sandbox_id)
        self._file(sandbox_id).unlink(missing_ok=True)

    def _save(self, sandbox_id: str, slot: Slot, policy: NetworkPolicy) -> None:
        self._file(sandbox_id).write_text(
            json.dumps({"slot": slot.index, "policy": policy.to_wire()}), encoding="utf-8"
        )


async def _ip_batch(commands: str, netns: str | None = None) -> None:
    """Run ``ip -batch -`` (inside ``netns`` when given): one process for several changes."""
    argv = ["ip", *(["-n", netns] if netns else []), "-batch", "-"]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate(commands.encode())
    if proc.returncode != 0:
        detail = (err or out).decode(errors="replace").strip()
        raise BackendError(f"ip could not set up the sandbox network (exit {proc.returncode}): {detail}")
