"""Debian's OpenSSH client tools (``ssh``, ``scp``, ``sftp``, ``ssh-keygen``) pointed at a gateway's SSH server.

Every command runs with no user configuration (``-F /dev/null``), trusts only the host keys the gateway reported
(``GET /v1/ssh``, written to a known_hosts file, strict checking), never asks anything (``BatchMode``), and
offers only the identity given (or none, for token logins).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def keygen(directory: Path, name: str, key_type: str, bits: int | None = None) -> Path:
    """A fresh key pair ``directory/name`` (and ``.pub``) without a passphrase; returns the private key."""
    path = directory / name
    args = ["ssh-keygen", "-q", "-t", key_type, "-N", "", "-C", f"{name}@test", "-f", str(path)]
    if bits is not None:
        args[4:4] = ["-b", str(bits)]
    subprocess.run(args, check=True, capture_output=True)
    return path


def public_line(private_key: Path) -> str:
    return Path(f"{private_key}.pub").read_text().strip()


class SshClient:
    """Runs the client tools against ``host:port``, trusting ``host_keys`` only."""

    def __init__(self, workdir: Path, host: str, port: int, host_keys: Sequence[str]) -> None:
        self.host = host
        self.port = port
        self.known_hosts = workdir / "known_hosts"
        self.known_hosts.write_text("".join(f"[{host}]:{port} {line}\n" for line in host_keys))

    def options(self, identity: Path | None) -> list[str]:
        """Options every tool takes: no config, strict host keys, no prompts, only ``identity`` (None: no key
        at all, for a token login)."""
        opts = [
            "-F", "/dev/null", "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", "BatchMode=yes", "-o", "ConnectTimeout=20", "-o", "ServerAliveInterval=5",
        ]  # fmt: skip
        if identity is None:
            return [*opts, "-o", "PubkeyAuthentication=no"]
        return [*opts, "-o", "IdentitiesOnly=yes", "-o", "IdentityAgent=none", "-i", str(identity)]

    def ssh_argv(
        self, user: str, *command: str, identity: Path | None = None, extra: Sequence[str] = ()
    ) -> list[str]:
        return ["ssh", *self.options(identity), "-p", str(self.port), *extra, f"{user}@{self.host}", *command]

    def ssh(
        self, user: str, *command: str, identity: Path | None = None, extra: Sequence[str] = (),
        input: bytes | None = None, timeout: float = 60,
    ) -> subprocess.CompletedProcess[bytes]:  # fmt: skip
        """Run ``ssh USER@HOST COMMAND...`` to completion."""
        return subprocess.run(
            self.ssh_argv(user, *command, identity=identity, extra=extra), input=input, capture_output=True,
            timeout=timeout, check=False, stdin=None if input is not None else subprocess.DEVNULL,
        )  # fmt: skip

    def popen(self, user: str, *command: str, identity: Path | None = None, extra: Sequence[str] = (),
              **kwargs: Any) -> subprocess.Popen[bytes]:  # fmt: skip
        return subprocess.Popen(self.ssh_argv(user, *command, identity=identity, extra=extra), **kwargs)

    def scp(
        self, src: str, dst: str, identity: Path | None = None, legacy: bool = False, timeout: float = 300
    ) -> subprocess.CompletedProcess[bytes]:
        """``scp SRC DST`` (``-O``: the legacy protocol instead of sftp); remote ends are ``USER@:PATH``,
        filled in with the host."""
        args = ["scp", *(["-O"] if legacy else []), *self.options(identity), "-P", str(self.port)]
        fill = [a.replace("@:", f"@{self.host}:") for a in (src, dst)]
        return subprocess.run([*args, *fill], capture_output=True, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL)  # fmt: skip

    def sftp(
        self, user: str, batch: str, identity: Path | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """``sftp -b -`` with ``batch`` (a line starting with ``-`` may fail without ending the batch)."""
        args = ["sftp", *self.options(identity), "-P", str(self.port), "-b", "-", f"{user}@{self.host}"]
        return subprocess.run(args, input=batch, capture_output=True, text=True, timeout=timeout, check=False,
                              env={**os.environ, "LC_ALL": "C"})  # fmt: skip
