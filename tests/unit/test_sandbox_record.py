"""The node's sandbox record and secret environment (docs/node-api.md, "Secret environment"): the values live in
memory only, never in the on-disk form; a record read back from disk knows the names and that the values are
lost; processes get them above the sandbox's env and below the request's."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sbx.api.codec import encode
from sbx.api.network_policy import NetworkPolicy
from sbx.backends.base import GuestUser
from sbx.node.audit import AuditLog
from sbx.node.records import SandboxRecord, SandboxState, iso_utc
from sbx.node.routes.processes import process_env
from sbx.node.sandbox import Sandbox

SECRET = "s3cret-value-0123456789"


def record(**fields: object) -> SandboxRecord:
    base: dict[str, object] = {
        "id": "sbx_0011223344556677", "state": SandboxState.RUNNING, "image": "default", "cpus": 1,
        "memory_mb": 512, "disk_mb": 2048, "network": NetworkPolicy("none"), "idle_timeout_secs": 600,
        "created_at": "2030-01-01T00:00:00.000Z", "env": {"PLAIN": "p"},
    }  # fmt: skip
    return SandboxRecord(**{**base, **fields})  # type: ignore[arg-type]


def test_the_values_never_reach_the_disk_form_the_wire_or_a_repr() -> None:
    rec = record(secret_env_names=["TOKEN"], secret_env={"TOKEN": SECRET})
    on_disk = json.dumps(rec.to_disk())
    assert SECRET not in on_disk and '"secret_env_names": ["TOKEN"]' in on_disk
    assert 'secret_env"' not in on_disk  # the values' field is left out, not emptied
    wire = rec.wire()
    assert (wire.secret_env_names, wire.secret_env_lost, wire.env_names) == (["TOKEN"], False, ["PLAIN"])
    assert SECRET.encode() not in encode(wire)
    assert SECRET not in repr(rec)
    assert rec.secret_env == {"TOKEN": SECRET}  # still held in memory


def test_read_back_after_a_restart_the_names_stay_and_the_values_are_lost() -> None:
    rec = record(secret_env_names=["TOKEN"], secret_env={"TOKEN": SECRET})
    again = SandboxRecord.from_disk(json.loads(json.dumps(rec.to_disk())))
    assert (again.secret_env_names, again.secret_env, again.secret_env_lost) == (["TOKEN"], {}, True)
    wire = again.wire()
    assert (wire.secret_env_names, wire.secret_env_lost) == (["TOKEN"], True)


def test_a_sandbox_without_secret_env_answers_as_before() -> None:
    rec = SandboxRecord.from_disk(json.loads(json.dumps(record().to_disk())))
    wire = json.loads(encode(rec.wire()))
    assert "secret_env_names" not in wire and "secret_env_lost" not in wire
    # A record written before secret env existed reads back the same.
    older = record().to_disk()
    del older["secret_env_names"]
    assert SandboxRecord.from_disk(older).secret_env_names == []


def test_a_terminated_sandbox_is_not_reported_as_having_lost_them() -> None:
    rec = record(state=SandboxState.TERMINATED, secret_env_names=["TOKEN"])
    assert rec.wire().secret_env_lost is False


def test_processes_get_them_above_the_sandbox_env_and_below_their_own(tmp_path: Path) -> None:
    rec = record(
        env={"A": "env", "B": "env"}, secret_env_names=["B", "C"], secret_env={"B": "secret", "C": "secret"}
    )
    guest = GuestUser(uid=1000, gid=1000, name="user", home="/sandbox/home")
    sandbox = Sandbox(rec, tmp_path, AuditLog(tmp_path / "audit"), guest)
    env = process_env(sandbox, {"C": "request"})
    assert (env["A"], env["B"], env["C"], env["HOME"]) == ("env", "secret", "request", "/sandbox/home")


def test_timestamps_are_written_as_datetime_writes_them() -> None:
    rng = random.Random(31)
    times = [0.0, 1.0000005, 1.0015, 1.9999995, 59.9999999, 1_700_000_000.5, 4102444799.9995]
    times += [round(rng.uniform(0, 4e9), rng.randint(0, 7)) for _ in range(20_000)]
    for t in times:
        assert iso_utc(t) == datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace(
            "+00:00", "Z"
        )


@pytest.mark.parametrize(
    ("persistent", "state", "dormant"),
    [
        (True, SandboxState.RUNNING, False), (True, SandboxState.SUSPENDED, True), (True, SandboxState.STOPPED, True),
        (True, SandboxState.TERMINATED, False), (True, SandboxState.PENDING, False),
        (False, SandboxState.SUSPENDED, False), (False, SandboxState.RUNNING, False),
    ],
)  # fmt: skip
def test_dormant_is_a_persistent_sandbox_asleep(persistent: bool, state: SandboxState, dormant: bool) -> None:
    assert record(persistent=persistent, state=state).dormant is dormant


def test_persistent_and_stopped_reason_on_the_wire_and_on_disk() -> None:
    plain = json.loads(encode(record().wire()))
    assert plain["persistent"] is False and "stopped_reason" not in plain
    stopped = record(persistent=True, state=SandboxState.STOPPED, stopped_reason="crash", name="w")
    wire = json.loads(encode(stopped.wire()))
    assert (wire["persistent"], wire["state"], wire["stopped_reason"]) == (True, "stopped", "crash")
    back = SandboxRecord.from_disk(json.loads(json.dumps(stopped.to_disk())))
    assert back == stopped
    # A record written before persistent sandboxes existed reads back as not persistent.
    old = stopped.to_disk()
    del old["persistent"], old["stopped_reason"]
    assert SandboxRecord.from_disk({**old, "state": "running"}).persistent is False
