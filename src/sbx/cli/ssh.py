"""``ssh``: OpenSSH's ``ssh`` into a sandbox through a gateway's SSH server, with a short-lived token.

Asks the gateway for a token login to the sandbox (``POST .../ssh-access``) and for its host keys (``GET
/v1/ssh``), writes them to a known_hosts file of its own (so the host key is checked strictly, without a first
"are you sure" question and without touching ``~/.ssh/known_hosts``), and runs ``ssh`` with them; it exits
with ssh's status (the remote command's, or 255 for ssh's own failures). Everything ``ssh`` offers works:
``-L`` forwards, ``-t``, a command.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from sbx.api.ssh import SshAccess, SshInfo
from sbx.cli._common import Options, call, pass_options, print_json
from sbx.client import AsyncClient


def known_hosts_line(host: str, port: int, key: str) -> str:
    """A known_hosts line for ``host:port`` (``[host]:port`` unless the port is 22)."""
    name = host if port == 22 else f"[{host}]:{port}"
    return f"{name} {key}\n"


def ssh_argv(
    access: SshAccess, known_hosts: Path, options: tuple[str, ...], command: tuple[str, ...]
) -> list[str]:
    """The ``ssh`` command line of a token login: strict host keys from ``known_hosts``, no key offered (the
    token is the whole credential), the user's ``-o``/``-L``-style options, then the command."""
    return [
        "ssh", "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
        "-o", "PubkeyAuthentication=no", "-o", "PasswordAuthentication=no", "-o", "KbdInteractiveAuthentication=no",
        "-p", str(access.port), *options, f"{access.user}@{access.host}", *command,
    ]  # fmt: skip


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("ref")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
@click.option("--ttl", "ttl_secs", type=click.IntRange(1, 86400), default=None,
              help="Seconds the login token stays good for new logins (default 15 minutes).")  # fmt: skip
@click.option("-L", "forwards", multiple=True, metavar="[LOCAL:]PORT:HOST:PORT",
              help="A local forward, as ssh -L (HOST must be localhost: the sandbox's loopback).")  # fmt: skip
@click.option("-o", "ssh_options", multiple=True, metavar="OPTION", help="An ssh -o option (repeatable).")
@click.option("-t", "tty", is_flag=True, help="Ask for a terminal even with a command (ssh -t).")
@pass_options
def ssh(
    opts: Options, ref: str, command: tuple[str, ...], ttl_secs: int | None, forwards: tuple[str, ...],
    ssh_options: tuple[str, ...], tty: bool,
) -> None:  # fmt: skip
    """Log in to sandbox REF through the gateway's SSH server: sandbox-cli ssh REF [COMMAND...]

    Without COMMAND, an interactive shell. Needs OpenSSH's ssh (apt install openssh-client). With --json,
    prints the login (its token is the whole credential) and the server's host keys instead of connecting.
    """
    program = shutil.which("ssh")
    if program is None and not opts.as_json:
        raise click.UsageError(
            "sandbox-cli ssh runs OpenSSH's ssh, which is not on PATH: apt install openssh-client"
        )

    async def ask(client: AsyncClient) -> tuple[SshAccess, SshInfo]:
        return await client.ssh.access(ref, ttl_secs), await client.ssh.info()

    access, info = call(opts, ask)
    if opts.as_json:
        print_json({"access": access, "info": info})
        return
    options = (*(a for o in ssh_options for a in ("-o", o)), *(a for f in forwards for a in ("-L", f)))
    options += ("-t",) if tty else ()
    with tempfile.TemporaryDirectory(prefix="sbx-ssh-") as tmp:
        known_hosts = Path(tmp) / "known_hosts"
        known_hosts.write_text("".join(known_hosts_line(access.host, access.port, k) for k in info.host_keys))
        argv = ssh_argv(access, known_hosts, options, command)
        argv[0] = program or "ssh"
        try:
            status = subprocess.run(argv, check=False).returncode
        except KeyboardInterrupt:
            status = 130
    sys.exit(status)
