"""Prometheus metrics: a real worker's ``/metrics`` after a known workload, checked against the audit's own
counts of the same log (grants, denials by reason, deadlocks, compensations); the label sets stay bounded."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from arbiter.agents import ArbiterClient, LeaseDenied
from arbiter.agents.identities import Registrar
from arbiter.audit.log import read_log
from arbiter.edge.settings import Settings
from arbiter.processes import DoorProcess, WorkerPool
from arbiter.schemas import LockDenied
from arbiter.streams.runtime.metrics import NAMES, Prefixes, WorkerMetrics
from arbiter.streams.runtime.topics import ensure_topics
from arbiter.streams.tools.ledger import Ledger
from tests.conftest import assert_clean_audit, isolated_settings
from tests.streams.shells.test_gateway_kafka import start_worker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items() if n == name and all((k, v2) in ls for k, v2 in labels.items()))


def test_labels_stay_bounded_and_every_name_is_exported() -> None:
    prefix = Prefixes(limit=3)
    assert [prefix(r) for r in ("doc:1", "doc:2", "account:a", "file:x", "repo:y", "<script>:1", "noprefix")] == [
        "doc", "doc", "account", "file", "other", "other", "other"]
    metrics = WorkerMetrics()
    metrics.lag("t.commands", 0, 3, 1)
    exported = {family.name for family in metrics.registry.collect()}
    # prometheus_client names a counter's family without its _total
    assert {n.removesuffix("_total") for n in NAMES} == exported, exported ^ {n.removesuffix("_total") for n in NAMES}


@pytest.mark.kafka
async def test_the_metrics_of_a_known_workload_match_the_audit(bootstrap: str, tmp_path: Path) -> None:
    settings = isolated_settings(bootstrap, tmp_path)
    await ensure_topics(settings)
    Ledger(settings.ledger_url()).seed({"ann": 1_000})
    port = free_port()
    pool = WorkerPool(settings)
    await start_worker(settings, pool, {"ARBITER_METRICS_PORT": str(port)})
    try:
        async with contextlib.AsyncExitStack() as stack:
            ann, bob = [await stack.enter_async_context(ArbiterClient(n, settings)) for n in ("ann", "bob")]
            for i in range(5):  # five grants, five busy denials
                lease = await ann.acquire(f"doc:m{i}", ttl=30)
                with pytest.raises(LeaseDenied):
                    await bob.acquire(f"doc:m{i}", ttl=30, wait=0)
                await ann.release(lease)
            with pytest.raises(LeaseDenied):
                await bob.acquire("doc:bad", ttl=-1)  # invalid_ttl
            # A deadlock: each waits on the other.
            async with ann.delegate(to="bob", task="review"), bob.delegate(to="ann", task="merge"):
                await asyncio.wait({asyncio.ensure_future(ann.wait_for_deadlock()),
                                    asyncio.ensure_future(bob.wait_for_deadlock())}, timeout=60,
                                   return_when=asyncio.FIRST_COMPLETED)
            # A saga that compensates its step.
            with pytest.raises(RuntimeError, match="abort"):
                async with ann.saga("undo") as saga:
                    async with saga.lease("account:ann", ttl=30) as lease:
                        base = (await ann.snapshot("account:ann")).version
                        await saga.step(lease, "refund", {"order_id": "m-1", "amount": 100}, base_version=base,
                                        compensate=lambda o: ("reverse_refund", {"refund_intent_id": o.intent_id}))
                    raise RuntimeError("abort")
        report = await assert_clean_audit(settings)
        stats = report["stats"]
        assert isinstance(stats, dict)
        # Denials by reason as the audit counts them (docs/metrics.md: metrics agree with the audit on them).
        denials = {key.removeprefix("lease_denials:"): n for key, n in stats.items()
                   if key.startswith("lease_denials:")}
        log = await read_log(settings)
        assert denials == Counter(e.record.reason for e in log.of(settings.topics.resource_events)
                                  if isinstance(e.record, LockDenied)), denials
        assert stats["lease_denials"] == sum(denials.values()), stats
        expected = {"grants": stats["grants"], "deadlocks": stats["deadlocks"], "compensations": stats[
            "compensated_steps"]}
        assert expected["grants"] >= 6 and expected["deadlocks"] == 1 and expected["compensations"] == 1, stats

        async def matches() -> bool:
            got = await asyncio.to_thread(scrape, port)
            seen = {name: total(got, "arbiter_lease_denials_total", reason=name) for name in denials}
            return (total(got, "arbiter_lease_grants_total") == expected["grants"]
                    and total(got, "arbiter_deadlocks_total") == expected["deadlocks"]
                    and total(got, "arbiter_saga_compensations_total") == expected["compensations"]
                    and seen == denials)

        for _ in range(50):  # the scrape follows the decisions the audit read (both come from one worker)
            if await matches():
                break
            await asyncio.sleep(0.1)
        got = await asyncio.to_thread(scrape, port)
        assert await matches(), {k: v for k, v in got.items() if "lease_" in k[0] or "deadlock" in k[0]}
        assert denials["busy"] == 5 and denials["invalid_ttl"] == 1, denials
        assert total(got, "arbiter_lease_grants_total", prefix="doc", mode="exclusive") == 5
        assert total(got, "arbiter_sagas_finished_total", outcome="COMPENSATED") == 1
        assert total(got, "arbiter_decision_latency_seconds_count") >= expected["grants"]
        assert total(got, "arbiter_lease_hold_seconds_count", end="released") >= 5
        assert total(got, "arbiter_partitions_owned") == 3 * settings.partitions  # (three input topics)
        assert {ls for (n, ls), _v in got.items() if n == "arbiter_partition_lag_messages"}, "lag per partition"
        assert all(v == 0 for (n, _l), v in got.items() if n == "arbiter_partition_lag_messages")
        assert not any("doc:m" in str(labels) for (_n, labels) in got), "never one series per resource"
    finally:
        pool.stop()


@pytest.mark.kafka
async def test_the_door_counts_its_calls_by_route_template(kafka_settings: Settings, door: DoorProcess) -> None:
    registrar = Registrar(kafka_settings)
    await registrar.add("ann")
    key = (await registrar.issue_credential("ann", label="metrics"))[0].api_key()

    def get(path: str, auth: bool = True) -> int:
        request = urllib.request.Request(door.url + path, headers={"Authorization": f"Bearer {key}"} if auth else {})
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return int(answer.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    assert await asyncio.to_thread(get, "/v1/resources/doc:<script>x") == 200
    assert await asyncio.to_thread(get, "/v1/status") == 200
    assert await asyncio.to_thread(get, "/v1/status", False) == 401
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(door.url + "/metrics", timeout=10).read().decode())
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in text_string_to_metric_families(text) for s in family.samples}
    assert total(got, "arbiter_door_requests_total", route="/v1/status", status="200") == 1
    assert total(got, "arbiter_door_requests_total", route="/v1/status", status="401") == 1
    assert total(got, "arbiter_door_requests_total", route="/v1/resources/{resource:path}", status="200") == 1
    assert "<script>" not in text and total(got, "arbiter_door_agents") == 1


def test_the_grafana_dashboard_queries_only_metrics_that_are_exported() -> None:
    import json
    import re

    from arbiter.door.metrics import NAMES as DOOR_NAMES
    from arbiter.streams.runtime import metrics

    board = json.loads((Path(metrics.__file__).parent / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in board["panels"] for t in panel["targets"]]
    named = {re.sub(r"_(bucket|count|sum)$", "", n) for e in exprs for n in re.findall(r"\barbiter_[a-z_]+", e)}
    assert named and named <= set(NAMES) | set(DOOR_NAMES), named - set(NAMES) - set(DOOR_NAMES)
    titles = " ".join(panel["title"] for panel in board["panels"]).lower()
    assert all(word in titles for word in ("leases", "refusals", "lag", "latency")), titles


@pytest.mark.parametrize(("host", "allowed", "status"), [
    ("127.0.0.1:{port}", "", 200),
    ("localhost:{port}", "", 200),
    ("10.1.2.3:{port}", "", 200),  # a Prometheus scraping by address
    ("[::1]:{port}", "", 200),
    ("attacker.example:{port}", "", 421),  # a rebound name
    ("worker-1:{port}", "", 421),
    ("worker-1:{port}", "worker-1,worker-2", 200),
    ("worker-3:{port}", "worker-1,worker-2", 421),
    ("anything.example", "*", 200),
    ("", "", 421),
    ("bad host:1:2", "", 421),
])
def test_a_workers_metrics_answer_only_the_names_they_are_reached_by(host: str, allowed: str, status: int) -> None:
    """DNS rebinding: a page whose name resolves to the worker's address still says its own name."""
    port = free_port()
    server = WorkerMetrics().serve(port, "127.0.0.1", allowed)
    try:
        connection = socket.create_connection(("127.0.0.1", port), timeout=10)
        with connection:
            header = f"Host: {host.format(port=port)}\r\n" if host else ""
            connection.sendall(f"GET /metrics HTTP/1.1\r\n{header}Connection: close\r\n\r\n".encode())
            answer = b""
            while chunk := connection.recv(65536):
                answer += chunk
        assert answer.split(b" ", 2)[1] == str(status).encode(), answer[:200]
        assert (b"arbiter_" in answer) == (status == 200)
    finally:
        server.shutdown()
        server.server_close()
