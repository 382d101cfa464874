"""The gateway's tables, once per dialect: versioned migrations for SQLite and for PostgreSQL, and the column
list and primary key of every table (what ``ops`` writes and ``migrate`` copies).

A migration is applied once, in order; never edit one that has shipped: append the next. Both tuples have the
same length and version ``n`` of each makes the same tables and columns (``tests/unit/test_store_contract.py``
reads both databases' catalogues to hold them to ``TABLES``).

Types: SQLite's ``INTEGER`` is 64-bit, so PostgreSQL uses ``BIGINT`` throughout (a quota of 2**40 MiB round trips
in both); booleans are kept as 0/1 integers in both, times as RFC 3339 text or epoch seconds (``REAL``/``DOUBLE
PRECISION``), sealed secrets as ``BLOB``/``BYTEA``. ``user`` is a reserved word in PostgreSQL, so every statement
quotes its identifiers (``ops``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Table:
    """A table's columns (in the order ``migrate`` copies them) and its primary key (what an upsert conflicts on)."""

    columns: tuple[str, ...]
    key: tuple[str, ...]


TABLES: dict[str, Table] = {
    "keys": Table(("id", "user", "tenant", "scopes", "secret_sha256", "created", "revoked"), ("id",)),
    "nodes": Table(
        ("name", "endpoint", "token_file", "ca_file", "cert_file", "key_file", "added"), ("name",)
    ),
    "node_flags": Table(("name", "cordoned", "drained"), ("name",)),
    "sandboxes": Table(
        ("id", "user", "tenant", "node", "name", "cpus", "memory_mb", "created", "persistent", "asleep"),
        ("id",),
    ),
    "volumes": Table(("name", "user", "tenant", "node", "created"), ("name",)),
    "snapshots": Table(("id", "user", "tenant", "node", "sandbox", "created"), ("id",)),
    "orgs": Table(("name", "created", "created_by", "created_by_tenant"), ("name",)),
    "members": Table(("org", "user", "tenant", "role", "added"), ("org", "user")),
    "quotas": Table(("tenant", "max_cpus", "max_memory_mb", "max_sandboxes"), ("tenant",)),
    "services": Table(
        (
            "id",
            "tenant",
            "name",
            "user",
            "spec",
            "revision",
            "serving",
            "desired",
            "restarts",
            "rollout",
            "created",
            "updated",
        ),
        ("id",),
    ),
    "service_revisions": Table(("service", "revision", "spec"), ("service", "revision")),
    "service_replicas": Table(
        (
            "sandbox",
            "service",
            "node",
            "revision",
            "pid",
            "restarts",
            "ever_healthy",
            "created",
            "state",
            "last_error",
            "checked",
        ),
        ("sandbox",),
    ),
    "jobs": Table(
        ("id", "user", "tenant", "agent", "spec", "prompt", "state", "error", "created", "updated"), ("id",)
    ),
    "job_runs": Table(
        (
            "job",
            "n",
            "state",
            "sandbox",
            "node",
            "pid",
            "exit_code",
            "started",
            "finished",
            "error",
            "truncated",
            "files",
        ),
        ("job", "n"),
    ),
    "secrets": Table(("tenant", "name", "nonce", "ciphertext", "updated"), ("tenant", "name")),
    "notifications": Table(
        ("id", "job", "url", "body", "attempts", "first_try", "next_try", "lease_owner", "lease_until"),
        ("id",),
    ),
    "ssh_keys": Table(
        ("id", "user", "home_tenant", "tenant", "fingerprint", "key", "sandbox", "created"), ("id",)
    ),
    "ssh_tokens": Table(
        ("token_sha256", "user", "tenant", "sandbox", "expires_at", "created"), ("token_sha256",)
    ),
    # v6: what every replica must read alike (docs/ha.md, "Shared by the replicas"). On PostgreSQL the
    # audit log, the jobs' kept output and files, the SSH host keys and the secrets key's check live here; the
    # SQLite gateway keeps its audit log and jobs' output as files and uses only ``gateway_files``.
    "audit": Table(("id", "time_ms", "bytes", "line"), ("id",)),
    "job_output": Table(("job", "n", "stream", "seq", "data"), ("job", "n", "stream", "seq")),
    "gateway_files": Table(("name", "nonce", "data", "created"), ("name",)),
    # v9: exposed ports (issue 33, docs/ports.md): the ports made public, and the port tokens (only the SHA-256
    # of each ``sgp_`` secret) with the key that made them.
    "public_ports": Table(("sandbox", "port", "created"), ("sandbox", "port")),
    "port_tokens": Table(
        ("token_sha256", "sandbox", "port", "key_id", "user", "tenant", "expires_at", "created"),
        ("token_sha256",),
    ),
}

#: Tables of the store's own bookkeeping, not of the gateway's state: made by the migrations, left out of
#: ``TABLES`` (``migrate`` does not copy them: a database keeps its own), never held in memory. v7's
#: ``commit_counter`` (``id``, ``n``): one row, ``id`` 1, whose ``n`` every write transaction on PostgreSQL
#: advances, the replicas' read-your-writes (docs/ha.md); a SQLite gateway (one process) never writes it.
BOOKKEEPING: dict[str, Table] = {"commit_counter": Table(("id", "n"), ("id",))}

SQLITE_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE keys (
        id TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, scopes TEXT NOT NULL,
        secret_sha256 TEXT NOT NULL UNIQUE, created TEXT NOT NULL, revoked TEXT
    );
    CREATE TABLE nodes (
        name TEXT PRIMARY KEY, endpoint TEXT NOT NULL, token_file TEXT, ca_file TEXT, cert_file TEXT,
        key_file TEXT, added TEXT NOT NULL
    );
    CREATE TABLE node_flags (name TEXT PRIMARY KEY, cordoned INTEGER NOT NULL, drained INTEGER NOT NULL);
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, node TEXT NOT NULL, name TEXT,
        cpus INTEGER, memory_mb INTEGER, created TEXT NOT NULL
    );
    CREATE TABLE volumes (
        name TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, node TEXT NOT NULL, created TEXT NOT NULL
    );
    CREATE TABLE snapshots (
        id TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, node TEXT NOT NULL, sandbox TEXT,
        created TEXT NOT NULL
    );
    CREATE TABLE orgs (
        name TEXT PRIMARY KEY, created TEXT NOT NULL, created_by TEXT NOT NULL, created_by_tenant TEXT NOT NULL
    );
    CREATE TABLE members (
        org TEXT NOT NULL, user TEXT NOT NULL, tenant TEXT NOT NULL, role TEXT NOT NULL, added TEXT NOT NULL,
        PRIMARY KEY (org, user)
    );
    CREATE TABLE quotas (
        tenant TEXT PRIMARY KEY, max_cpus INTEGER, max_memory_mb INTEGER, max_sandboxes INTEGER
    );
    """,
    # Services, jobs and agent runs, tenant secrets, job notifications (gateway/services, gateway/jobs,
    # gateway/secrets.py): each module reads and writes its own tables through Store.execute and Store.query.
    """
    CREATE TABLE services (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL, user TEXT NOT NULL, spec TEXT NOT NULL,
        revision INTEGER NOT NULL, serving INTEGER NOT NULL, desired INTEGER NOT NULL, restarts INTEGER NOT NULL,
        rollout TEXT, created TEXT NOT NULL, updated TEXT NOT NULL, UNIQUE (tenant, name)
    );
    CREATE TABLE service_revisions (
        service TEXT NOT NULL, revision INTEGER NOT NULL, spec TEXT NOT NULL, PRIMARY KEY (service, revision)
    );
    CREATE TABLE service_replicas (
        sandbox TEXT PRIMARY KEY, service TEXT NOT NULL, node TEXT NOT NULL, revision INTEGER NOT NULL,
        pid INTEGER, restarts INTEGER NOT NULL, ever_healthy INTEGER NOT NULL, created TEXT NOT NULL
    );
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, agent TEXT, spec TEXT NOT NULL,
        prompt TEXT, state TEXT NOT NULL, error TEXT, created TEXT NOT NULL, updated TEXT NOT NULL
    );
    CREATE TABLE job_runs (
        job TEXT NOT NULL, n INTEGER NOT NULL, state TEXT NOT NULL, sandbox TEXT, node TEXT, pid INTEGER,
        exit_code INTEGER, started TEXT, finished TEXT, error TEXT, truncated INTEGER NOT NULL, files TEXT,
        PRIMARY KEY (job, n)
    );
    CREATE TABLE secrets (
        tenant TEXT NOT NULL, name TEXT NOT NULL, nonce BLOB NOT NULL, ciphertext BLOB NOT NULL,
        updated TEXT NOT NULL, PRIMARY KEY (tenant, name)
    );
    CREATE TABLE notifications (
        id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL, url TEXT NOT NULL, body TEXT NOT NULL,
        attempts INTEGER NOT NULL, first_try REAL NOT NULL, next_try REAL NOT NULL
    );
    """,
    # SSH keys and access tokens (docs/ssh.md).
    """
    CREATE TABLE ssh_keys (
        id TEXT PRIMARY KEY, user TEXT NOT NULL, home_tenant TEXT NOT NULL, tenant TEXT NOT NULL,
        fingerprint TEXT NOT NULL, key TEXT NOT NULL, sandbox TEXT, created TEXT NOT NULL
    );
    CREATE INDEX ssh_keys_fingerprint ON ssh_keys (fingerprint);
    CREATE TABLE ssh_tokens (
        token_sha256 TEXT PRIMARY KEY, user TEXT NOT NULL, tenant TEXT NOT NULL, sandbox TEXT NOT NULL,
        expires_at REAL NOT NULL, created TEXT NOT NULL
    );
    """,
    # v4: the notification outbox's per-row lease (jobs/notify.py; docs/ha.md): which worker claimed
    # a row and until when (the database's clock, epoch seconds). SQLite's one process never reads them.
    """
    ALTER TABLE notifications ADD COLUMN lease_owner TEXT;
    ALTER TABLE notifications ADD COLUMN lease_until REAL;
    """,
    # v5: each replica's health as the leader's checks last found it (state, the last failure, when
    # it changed), written on a change only, so every replica routes service traffic and shows it (docs/ha.md).
    """
    ALTER TABLE service_replicas ADD COLUMN state TEXT NOT NULL DEFAULT 'starting';
    ALTER TABLE service_replicas ADD COLUMN last_error TEXT;
    ALTER TABLE service_replicas ADD COLUMN checked TEXT;
    """,
    # v6: the audit log (one row per JSON line, ``time_ms`` its time in epoch milliseconds, ``bytes``
    # its length), the jobs' kept output and files in chunks (``stream``: ``stdout``, ``stderr`` or ``file/I``),
    # and the gateway's own files (SSH host keys, sealed when a secrets key is given; the secrets key's check).
    """
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT, time_ms INTEGER NOT NULL, bytes INTEGER NOT NULL, line TEXT NOT NULL
    );
    CREATE INDEX audit_time ON audit (time_ms);
    CREATE TABLE job_output (
        job TEXT NOT NULL, n INTEGER NOT NULL, stream TEXT NOT NULL, seq INTEGER NOT NULL, data BLOB NOT NULL,
        PRIMARY KEY (job, n, stream, seq)
    );
    CREATE TABLE gateway_files (name TEXT PRIMARY KEY, nonce BLOB, data BLOB NOT NULL, created TEXT NOT NULL);
    """,
    # v7: the commit counter (see BOOKKEEPING); its row is made by the first write that advances it.
    """
    CREATE TABLE commit_counter (id INTEGER PRIMARY KEY, n INTEGER NOT NULL);
    """,
    # v8: persistent sandboxes (issue 32): whether a sandbox is persistent, and whether it is asleep (suspended
    # or stopped) as the gateway last learnt; a record from before is neither.
    """
    ALTER TABLE sandboxes ADD COLUMN persistent INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN asleep INTEGER NOT NULL DEFAULT 0;
    """,
    # v9: exposed ports (issue 33): public ports, and port tokens (hashed) with the key that made them.
    """
    CREATE TABLE public_ports (
        sandbox TEXT NOT NULL, port INTEGER NOT NULL, created TEXT NOT NULL, PRIMARY KEY (sandbox, port)
    );
    CREATE TABLE port_tokens (
        token_sha256 TEXT PRIMARY KEY, sandbox TEXT NOT NULL, port INTEGER NOT NULL, key_id TEXT NOT NULL,
        user TEXT NOT NULL, tenant TEXT NOT NULL, expires_at REAL NOT NULL, created TEXT NOT NULL
    );
    CREATE INDEX port_tokens_sandbox ON port_tokens (sandbox);
    """,
)

POSTGRES_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE keys (
        id TEXT PRIMARY KEY, "user" TEXT NOT NULL, tenant TEXT NOT NULL, scopes TEXT NOT NULL,
        secret_sha256 TEXT NOT NULL UNIQUE, created TEXT NOT NULL, revoked TEXT
    );
    CREATE TABLE nodes (
        name TEXT PRIMARY KEY, endpoint TEXT NOT NULL, token_file TEXT, ca_file TEXT, cert_file TEXT,
        key_file TEXT, added TEXT NOT NULL
    );
    CREATE TABLE node_flags (name TEXT PRIMARY KEY, cordoned BIGINT NOT NULL, drained BIGINT NOT NULL);
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY, "user" TEXT NOT NULL, tenant TEXT NOT NULL, node TEXT NOT NULL, name TEXT,
        cpus BIGINT, memory_mb BIGINT, created TEXT NOT NULL
    );
    CREATE TABLE volumes (
        name TEXT PRIMARY KEY, "user" TEXT NOT NULL, tenant TEXT NOT NULL, node TEXT NOT NULL, created TEXT NOT NULL
    );
    CREATE TABLE snapshots (
        id TEXT PRIMARY KEY, "user" TEXT NOT NULL, tenant TEXT NOT NULL, node TEXT NOT NULL, sandbox TEXT,
        created TEXT NOT NULL
    );
    CREATE TABLE orgs (
        name TEXT PRIMARY KEY, created TEXT NOT NULL, created_by TEXT NOT NULL, created_by_tenant TEXT NOT NULL
    );
    CREATE TABLE members (
        org TEXT NOT NULL, "user" TEXT NOT NULL, tenant TEXT NOT NULL, role TEXT NOT NULL, added TEXT NOT NULL,
        PRIMARY KEY (org, "user")
    );
    CREATE TABLE quotas (
        tenant TEXT PRIMARY KEY, max_cpus BIGINT, max_memory_mb BIGINT, max_sandboxes BIGINT
    );
    """,
    """
    CREATE TABLE services (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, name TEXT NOT NULL, "user" TEXT NOT NULL, spec TEXT NOT NULL,
        revision BIGINT NOT NULL, serving BIGINT NOT NULL, desired BIGINT NOT NULL, restarts BIGINT NOT NULL,
        rollout TEXT, created TEXT NOT NULL, updated TEXT NOT NULL, UNIQUE (tenant, name)
    );
    CREATE TABLE service_revisions (
        service TEXT NOT NULL, revision BIGINT NOT NULL, spec TEXT NOT NULL, PRIMARY KEY (service, revision)
    );
    CREATE TABLE service_replicas (
        sandbox TEXT PRIMARY KEY, service TEXT NOT NULL, node TEXT NOT NULL, revision BIGINT NOT NULL,
        pid BIGINT, restarts BIGINT NOT NULL, ever_healthy BIGINT NOT NULL, created TEXT NOT NULL
    );
    CREATE TABLE jobs (
        id TEXT PRIMARY KEY, "user" TEXT NOT NULL, tenant TEXT NOT NULL, agent TEXT, spec TEXT NOT NULL,
        prompt TEXT, state TEXT NOT NULL, error TEXT, created TEXT NOT NULL, updated TEXT NOT NULL
    );
    CREATE TABLE job_runs (
        job TEXT NOT NULL, n BIGINT NOT NULL, state TEXT NOT NULL, sandbox TEXT, node TEXT, pid BIGINT,
        exit_code BIGINT, started TEXT, finished TEXT, error TEXT, truncated BIGINT NOT NULL, files TEXT,
        PRIMARY KEY (job, n)
    );
    CREATE TABLE secrets (
        tenant TEXT NOT NULL, name TEXT NOT NULL, nonce BYTEA NOT NULL, ciphertext BYTEA NOT NULL,
        updated TEXT NOT NULL, PRIMARY KEY (tenant, name)
    );
    CREATE TABLE notifications (
        id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, job TEXT NOT NULL, url TEXT NOT NULL,
        body TEXT NOT NULL, attempts BIGINT NOT NULL, first_try DOUBLE PRECISION NOT NULL,
        next_try DOUBLE PRECISION NOT NULL
    );
    """,
    """
    CREATE TABLE ssh_keys (
        id TEXT PRIMARY KEY, "user" TEXT NOT NULL, home_tenant TEXT NOT NULL, tenant TEXT NOT NULL,
        fingerprint TEXT NOT NULL, key TEXT NOT NULL, sandbox TEXT, created TEXT NOT NULL
    );
    CREATE INDEX ssh_keys_fingerprint ON ssh_keys (fingerprint);
    CREATE TABLE ssh_tokens (
        token_sha256 TEXT PRIMARY KEY, "user" TEXT NOT NULL, tenant TEXT NOT NULL, sandbox TEXT NOT NULL,
        expires_at DOUBLE PRECISION NOT NULL, created TEXT NOT NULL
    );
    """,
    # v4
    """
    ALTER TABLE notifications ADD COLUMN lease_owner TEXT, ADD COLUMN lease_until DOUBLE PRECISION;
    """,
    # v5
    """
    ALTER TABLE service_replicas ADD COLUMN state TEXT NOT NULL DEFAULT 'starting';
    ALTER TABLE service_replicas ADD COLUMN last_error TEXT;
    ALTER TABLE service_replicas ADD COLUMN checked TEXT;
    """,
    # v6
    """
    CREATE TABLE audit (
        id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY, time_ms BIGINT NOT NULL, bytes BIGINT NOT NULL,
        line TEXT NOT NULL
    );
    CREATE INDEX audit_time ON audit (time_ms);
    CREATE TABLE job_output (
        job TEXT NOT NULL, n BIGINT NOT NULL, stream TEXT NOT NULL, seq BIGINT NOT NULL, data BYTEA NOT NULL,
        PRIMARY KEY (job, n, stream, seq)
    );
    CREATE TABLE gateway_files (name TEXT PRIMARY KEY, nonce BYTEA, data BYTEA NOT NULL, created TEXT NOT NULL);
    """,
    # v7
    """
    CREATE TABLE commit_counter (id INTEGER PRIMARY KEY, n BIGINT NOT NULL);
    """,
    # v8
    """
    ALTER TABLE sandboxes ADD COLUMN persistent BIGINT NOT NULL DEFAULT 0;
    ALTER TABLE sandboxes ADD COLUMN asleep BIGINT NOT NULL DEFAULT 0;
    """,
    # v9
    """
    CREATE TABLE public_ports (
        sandbox TEXT NOT NULL, port BIGINT NOT NULL, created TEXT NOT NULL, PRIMARY KEY (sandbox, port)
    );
    CREATE TABLE port_tokens (
        token_sha256 TEXT PRIMARY KEY, sandbox TEXT NOT NULL, port BIGINT NOT NULL, key_id TEXT NOT NULL,
        "user" TEXT NOT NULL, tenant TEXT NOT NULL, expires_at DOUBLE PRECISION NOT NULL, created TEXT NOT NULL
    );
    CREATE INDEX port_tokens_sandbox ON port_tokens (sandbox);
    """,
)

#: The schema version this code writes.
SCHEMA_VERSION = len(SQLITE_MIGRATIONS)
