"""Node metrics: the spec's series and nothing else, values from the snapshot, loopback-only endpoint."""

from __future__ import annotations

import dataclasses

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sbx.node.metrics import NodeMetrics, NodeSnapshot
from sbx.web.serve import check_loopback, start_metrics_server

SNAPSHOT = NodeSnapshot(
    sandboxes_by_state={"pending": 1, "running": 3, "terminated": 7},
    processes_running=5,
    pool_target={"python:3.12": 4},
    pool_ready={"python:3.12": 2},
    pool_booting={"python:3.12": 1},
    capacity_cpus=16,
    capacity_memory_mb=65536,
    capacity_disk_mb=500000,
    free_cpus=10,
    free_memory_mb=40000,
    free_disk_mb=400000,
    cordoned=True,
    sandboxes_parked=2,
    parks=9,
    unparks=6,
)

SPEC_FAMILIES = {
    "sandboxd_sandboxes",
    "sandboxd_processes_running",
    "sandboxd_pool_target",
    "sandboxd_pool_ready",
    "sandboxd_pool_booting",
    "sandboxd_capacity_cpus",
    "sandboxd_capacity_memory_bytes",
    "sandboxd_capacity_disk_bytes",
    "sandboxd_free_cpus",
    "sandboxd_free_memory_bytes",
    "sandboxd_free_disk_bytes",
    "sandboxd_cordoned",
    "sandboxd_creates",  # exposed as sandboxd_creates_total
    "sandboxd_create_seconds",
    # additions: parking (docs/node-api.md, "Parking")
    "sandboxd_sandboxes_parked",
    "sandboxd_parks",  # sandboxd_parks_total
    "sandboxd_unparks",  # sandboxd_unparks_total
}


def _samples(metrics: NodeMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, _ = metrics.render()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def test_exactly_the_spec_families_and_no_identity_labels() -> None:
    metrics = NodeMetrics(lambda: SNAPSHOT)
    metrics.observe_create("created", 0.2)
    body, content_type = metrics.render()
    families = list(text_string_to_metric_families(body.decode()))
    assert {f.name for f in families} == SPEC_FAMILIES
    assert content_type.startswith("text/plain")
    assert b"sandboxd_creates_total" in body
    assert b"_created" not in body  # no extra *_created series beside the spec's
    label_names = {name for f in families for s in f.samples for name in s.labels}
    assert label_names == {"state", "image", "status", "le"}


def test_gauge_values_come_from_the_snapshot() -> None:
    metrics = NodeMetrics(lambda: SNAPSHOT)
    samples = _samples(metrics)
    expected = {
        ("sandboxd_sandboxes", (("state", "running"),)): 3,
        ("sandboxd_sandboxes", (("state", "terminated"),)): 7,
        ("sandboxd_processes_running", ()): 5,
        ("sandboxd_pool_target", (("image", "python:3.12"),)): 4,
        ("sandboxd_pool_ready", (("image", "python:3.12"),)): 2,
        ("sandboxd_pool_booting", (("image", "python:3.12"),)): 1,
        ("sandboxd_capacity_cpus", ()): 16,
        ("sandboxd_capacity_memory_bytes", ()): 65536 * 2**20,
        ("sandboxd_capacity_disk_bytes", ()): 500000 * 2**20,
        ("sandboxd_free_cpus", ()): 10,
        ("sandboxd_free_memory_bytes", ()): 40000 * 2**20,
        ("sandboxd_free_disk_bytes", ()): 400000 * 2**20,
        ("sandboxd_cordoned", ()): 1,
        ("sandboxd_sandboxes_parked", ()): 2,
        ("sandboxd_parks_total", ()): 9,
        ("sandboxd_unparks_total", ()): 6,
    }
    for key, value in expected.items():
        assert samples[key] == value, key


def test_gauges_are_read_at_each_scrape() -> None:
    current = [SNAPSHOT]
    metrics = NodeMetrics(lambda: current[0])
    assert _samples(metrics)[("sandboxd_cordoned", ())] == 1
    current[0] = dataclasses.replace(SNAPSHOT, cordoned=False, free_cpus=2, pool_ready={})
    samples = _samples(metrics)
    assert samples[("sandboxd_cordoned", ())] == 0
    assert samples[("sandboxd_free_cpus", ())] == 2
    assert ("sandboxd_pool_ready", (("image", "python:3.12"),)) not in samples


def test_creates_counter_and_histogram() -> None:
    metrics = NodeMetrics(lambda: SNAPSHOT)
    for status, secs in [
        ("created", 0.04),
        ("created", 0.05),
        ("created", 2.5),
        ("unavailable", 0.001),
        ("created", 30),
    ]:
        metrics.observe_create(status, secs)
    samples = _samples(metrics)
    assert samples[("sandboxd_creates_total", (("status", "created"),))] == 4
    assert samples[("sandboxd_creates_total", (("status", "unavailable"),))] == 1

    def bucket(le: str) -> float:
        return samples[("sandboxd_create_seconds_bucket", (("le", le),))]

    assert bucket("0.05") == 3  # 0.001, 0.04 and 0.05 (a bound is inclusive)
    assert bucket("2.0") == 3
    assert bucket("3.0") == 4
    assert bucket("10.0") == 4
    assert bucket("+Inf") == 5
    assert samples[("sandboxd_create_seconds_count", ())] == 5
    assert samples[("sandboxd_create_seconds_sum", ())] == pytest.approx(32.591)


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LocalHost", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.1", False),
        ("192.168.1.5", False),
        ("128.0.0.1", False),
        ("example.com", False),
        ("localhost.example.com", False),
        ("::ffff:10.0.0.1", False),
    ],
)
def test_check_loopback(host: str, ok: bool) -> None:
    if ok:
        check_loopback(host)
    else:
        with pytest.raises(ValueError, match="not loopback"):
            check_loopback(host)


async def test_server_serves_metrics_on_loopback() -> None:
    metrics = NodeMetrics(lambda: SNAPSHOT)
    runner = await start_metrics_server(metrics, "127.0.0.1", 0)
    try:
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{host}:{port}/metrics") as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/plain")
                assert "sandboxd_processes_running 5.0" in await resp.text()
            async with session.get(f"http://{host}:{port}/other") as resp:
                assert resp.status == 404
    finally:
        await runner.cleanup()


async def test_server_answers_500_when_the_snapshot_fails() -> None:
    def broken() -> NodeSnapshot:
        raise RuntimeError("boom")

    runner = await start_metrics_server(NodeMetrics(broken), "127.0.0.1", 0)
    try:
        host, port = runner.addresses[0][:2]
        async with aiohttp.ClientSession() as session, session.get(f"http://{host}:{port}/metrics") as resp:
            assert resp.status == 500
    finally:
        await runner.cleanup()


async def test_server_refuses_a_non_loopback_address() -> None:
    with pytest.raises(ValueError, match="not loopback"):
        await start_metrics_server(NodeMetrics(lambda: SNAPSHOT), "0.0.0.0", 0)
