"""A private PostgreSQL cluster for tests: Debian's PostgreSQL 15 binaries, ``initdb`` into a temporary directory,
run by an unprivileged user (``nobody`` when the tests run as root), listening only on a unix socket in that
directory, removed at the end. Never the system's cluster, never a mock.

Authentication is real: the superuser ``sbx`` has a random password (SCRAM), which clients get from the
environment (``env()``: ``SANDBOX_GATEWAY_DATABASE_PASSWORD``), so every test also goes through the path an
operator's gateway takes. Each test asks for a database of its own (``create_database``).

    cluster = PgCluster.start()
    url = cluster.create_database()        # postgresql://sbx@/db_1?host=/tmp/sbx-pg-.../sock
    ...
    cluster.stop()
"""

from __future__ import annotations

import itertools
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

#: Where Debian's PostgreSQL 15 server binaries are (package postgresql-15); SBX_PG_BIN overrides.
PG_BIN = Path(os.environ.get("SBX_PG_BIN", "/usr/lib/postgresql/15/bin"))
SUPERUSER = "sbx"
PASSWORD_ENV = "SANDBOX_GATEWAY_DATABASE_PASSWORD"


def missing() -> str | None:
    """Why a cluster cannot be started here (None when it can)."""
    for tool in ("initdb", "pg_ctl", "postgres"):
        if not (PG_BIN / tool).exists():
            return f"{PG_BIN / tool} is missing: install Debian's postgresql (scripts/install.sh --test-deps)"
    return None


class PgCluster:
    """One running cluster; ``stop`` ends it and removes its directory."""

    def __init__(self, root: Path, password: str, user: str | None, durable: bool = False) -> None:
        self.durable = durable
        self.root = root
        self.data = root / "data"
        self.socket_dir = root / "sock"
        self.log = root / "postgres.log"
        self.password = password
        self._user = user
        self._names = itertools.count(1)

    @classmethod
    def start(cls, durable: bool = False) -> PgCluster:
        """Init and start a cluster. ``durable=False`` runs it with ``fsync=off``: the tests kill gateways and
        PostgreSQL processes, never the machine, so nothing they check depends on the disk, and each
        ``CREATE DATABASE`` takes a tenth of the time. Give ``durable=True`` to measure (bench/)."""
        reason = missing()
        if reason is not None:
            raise RuntimeError(reason)
        # PostgreSQL refuses to run as root: the cluster belongs to nobody (the directory is made for it, 0700).
        user = "nobody" if os.geteuid() == 0 else None
        root = Path(tempfile.mkdtemp(prefix="sbx-pg-"))
        password = secrets.token_urlsafe(24)
        cluster = cls(root, password, user, durable)
        try:
            cluster.socket_dir.mkdir()
            pwfile = root / "pwfile"
            pwfile.write_text(password + "\n")
            if user is not None:
                entry = pwd.getpwnam(user)
                for path in (root, cluster.socket_dir, pwfile):
                    os.chown(path, entry.pw_uid, entry.pw_gid)
            cluster._run(
                str(PG_BIN / "initdb"), "-D", str(cluster.data), "-U", SUPERUSER, "--pwfile", str(pwfile),
                "--auth-local=scram-sha-256", "--auth-host=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8",
                "--no-sync",
            )  # fmt: skip
            pwfile.unlink()
            cluster.resume()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def resume(self) -> None:
        """Start the server (again, after ``pause``), waiting until it accepts connections."""
        self._run(
            str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-w", "-t", "120",
            "-o", f"-c listen_addresses='' -c unix_socket_directories='{self.socket_dir}' "
                  f"-c max_connections=200 -c fsync={'on' if self.durable else 'off'}",
            "start",
        )  # fmt: skip

    def pause(self) -> None:
        """Stop the server as a crash would (immediate: every connection cut), keeping the data for ``resume``."""
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "-t", "60", "stop")

    def standby(self, name: str = "standby", synchronous: bool = True) -> PgCluster:
        """A streaming standby of this cluster, started: ``pg_basebackup -R`` into a directory of its own, on a
        unix socket of its own, the same password. ``synchronous``: this cluster then waits at each commit until
        the standby has it on disk (``synchronous_standby_names``), as docs/ha.md configures a synchronous
        standby. Stop it with its own ``stop``; ``promote`` makes it a primary."""
        root = Path(tempfile.mkdtemp(prefix="sbx-pg-standby-"))
        other = PgCluster(root, self.password, self._user, self.durable)
        try:
            other.socket_dir.mkdir()
            if self._user is not None:
                entry = pwd.getpwnam(self._user)
                for path in (root, other.socket_dir):
                    os.chown(path, entry.pw_uid, entry.pw_gid)
            other._run(
                str(PG_BIN / "pg_basebackup"), "-d",
                f"host={self.socket_dir} user={SUPERUSER} application_name={name}",
                "-D", str(other.data), "-X", "stream", "-R",
                # An immediate checkpoint: the default (spread over checkpoint_completion_target of
                # checkpoint_timeout) made the base backup wait 90 s on an idle cluster.
                "--checkpoint=fast", env={"PGPASSWORD": self.password},
            )  # fmt: skip
            other.resume()
            if synchronous:
                with self.connect() as conn:
                    conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 ({name})'")
                    conn.execute("SELECT pg_reload_conf()")
        except BaseException:
            other.stop()
            raise
        return other

    def promote(self) -> None:
        """Make this standby a primary (``pg_ctl promote``), waiting until it takes writes."""
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-w", "-t", "120", "promote")

    def _run(self, *command: str, env: dict[str, str] | None = None) -> None:
        result = subprocess.run(
            command,
            user=self._user,
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
            env={**os.environ, **(env or {})},
        )
        if result.returncode != 0:
            log = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
            raise RuntimeError(
                f"{command[0]} failed ({result.returncode}):\n{result.stdout}{result.stderr}\n{log}"
            )

    def url(self, dbname: str = "postgres") -> str:
        """The URL of ``dbname``, without the password (which ``env()`` gives)."""
        return f"postgresql://{SUPERUSER}@/{dbname}?host={self.socket_dir}"

    def env(self) -> dict[str, str]:
        """The environment a client of this cluster needs (the password)."""
        return {PASSWORD_ENV: self.password}

    def connect(self, dbname: str = "postgres") -> psycopg.Connection[Any]:
        """An autocommit connection as the superuser (for the tests' own checks)."""
        return psycopg.connect(self.url(dbname), password=self.password, autocommit=True)

    def create_database(self) -> str:
        """A new empty database; its URL."""
        name = f"db_{next(self._names)}"
        with self.connect() as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        """Stop the server and remove the directory. Immediate: nothing of a throwaway cluster needs the
        shutdown checkpoint, and a fast shutdown waits for every client still connected."""
        try:
            if (self.data / "postmaster.pid").exists():
                self._run(
                    str(PG_BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "-t", "60", "stop"
                )
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session", name="pg_cluster")
def pg_cluster_fixture() -> Iterator[PgCluster]:
    """One cluster for the whole test session (import this into a conftest to use it)."""
    cluster = PgCluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
