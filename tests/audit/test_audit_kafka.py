"""Audit and replay over a real recorded log: a clean run passes, tampered copies fail.

One worker, one small multi-agent scenario (grants with queueing and hand-off, an
expiry, a zombie write refused by its stale token, applied refunds and a version
conflict), read back from Kafka and archived. Each tamper test edits its own copy of
the archive (JSON lines, offsets renumbered after an inserted line, nothing else
adjusted) and expects the audit, in Python and through the CLI, to name the position.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from arbiter.agents import ArbiterClient
from arbiter.audit import audit
from arbiter.audit.log import load_archive, read_log
from arbiter.cli import main as arbiter_cli
from arbiter.edge.keys import read_private_key
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool, wait_until_served
from arbiter.schemas import default_codec
from arbiter.schemas.partitioning import key_for_partition
from arbiter.streams.runtime.topics import ensure_topics
from arbiter.streams.tools.ledger import Ledger
from tests.conftest import assert_clean_audit, isolated_settings

pytestmark = pytest.mark.kafka

Row = dict[str, Any]


@dataclass
class Recording:
    """The scenario's log, archived, and the facts the tests tamper with."""

    settings: Settings
    archive: Path
    zombie_token: int
    """alpha's token on account:a, expired and then used for a write."""
    holder_token: int
    """beta's token on account:a, granted when alpha's lease expired."""


# -- the scenario ----------------------------------------------------------------------------


async def _scenario(settings: Settings) -> None:
    async with ArbiterClient("alpha", settings) as alpha, ArbiterClient("beta", settings) as beta, \
            ArbiterClient("gamma", settings) as gamma, ArbiterClient("delta", settings) as delta:
        # account:a: alpha's 0.5 s lease expires unrenewed, beta (queued) gets it, alpha writes as a zombie.
        base = (await alpha.snapshot("account:a")).version
        stalled = await alpha.acquire("account:a", ttl=0.5, wait=0)
        fresh = await beta.acquire("account:a", ttl=30, wait=20)
        assert fresh.token == stalled.token + 1
        assert await asyncio.wait_for(stalled.wait_lost(), 10) == "expired"
        zombie = await alpha.execute(stalled, "refund", {"order_id": "zombie-1", "amount": 100}, base_version=base)
        assert zombie.reason == "stale_fencing_token", zombie
        first = await beta.execute(fresh, "refund", {"order_id": "order-1", "amount": 250}, base_version=base)
        assert first.applied, first
        conflict = await beta.execute(fresh, "refund", {"order_id": "order-2", "amount": 50}, base_version=base)
        assert conflict.reason == "version_conflict", conflict
        second = await beta.execute(fresh, "refund", {"order_id": "order-2", "amount": 50},
                                    base_version=base + 1)
        assert second.applied and second.version == base + 2, second
        await asyncio.sleep(0.3)  # held long enough that a 100 ms TTL would have expired it
        await beta.release(fresh)

        # ticket:t1: gamma holds, delta queues, gamma's release hands it to delta.
        held = await gamma.acquire("ticket:t1", ttl=30, wait=0)
        queued = asyncio.Event()
        waiting = asyncio.create_task(delta.acquire("ticket:t1", ttl=30, wait=20,
                                                    on_queued=lambda _event: queued.set()))
        await asyncio.wait_for(queued.wait(), 10)
        await asyncio.sleep(0.3)
        await gamma.release(held)
        handed = await asyncio.wait_for(waiting, 20)
        assert handed.token == held.token + 1
        await asyncio.sleep(0.3)
        await delta.release(handed)

        # account:b: gamma writes under a lease, then beta takes its turn.
        async with gamma.lease("account:b", ttl=30) as lease:
            version = (await gamma.snapshot("account:b")).version
            refund = await gamma.execute(lease, "refund", {"order_id": "order-3", "amount": 75},
                                         base_version=version)
            assert refund.applied, refund
            await asyncio.sleep(0.3)
        async with beta.lease("account:b", ttl=30):
            await asyncio.sleep(0.3)


async def _record(settings: Settings, archive: Path) -> dict[str, Any]:
    await ensure_topics(settings)
    ledger = Ledger(settings.ledger_dsn)
    ledger.seed({"a": 5_000, "b": 5_000})
    pool = WorkerPool(settings)
    pool.start(1)
    try:
        keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
        async with ArbiterClient("warmup", settings) as warm:
            await wait_until_served(warm, pool, keys)
        await _scenario(settings)
        assert ledger.invariants()["ok"]
    finally:
        pool.stop()  # nothing is decided while the log is read
        ledger.close()
    return await assert_clean_audit(settings, archive)


@pytest.fixture(scope="module")
def recording(bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recording]:
    home = tmp_path_factory.mktemp("audit")
    settings = isolated_settings(bootstrap, home, ledger_dsn=str(home / "ledger.sqlite3"))
    archive = home / "recorded.jsonl"
    asyncio.run(_record(settings, archive))
    rows = _rows(archive)
    grants = [r for r in _events(rows, "LockGranted") if r["record"]["resource"] == "account:a"]
    alpha = next(r for r in grants if r["record"]["agent_id"] == "alpha")
    beta = next(r for r in grants if r["record"]["agent_id"] == "beta")
    with pytest.MonkeyPatch.context() as env:
        # The run's signatures check out only against its own admin key (the trust anchor), which
        # the audit takes from the environment, as an auditor away from the admin's home would.
        env.setenv("ARBITER_ADMIN_PUBLIC_KEYS", (home / "keys" / "admin.pub").read_text().strip())
        yield Recording(settings, archive, alpha["record"]["token"], beta["record"]["token"])


# -- archive editing -------------------------------------------------------------------------


def _rows(path: Path) -> list[Row]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write(path: Path, rows: list[Row]) -> Path:
    path.write_text("".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def _where(row: Row) -> str:
    return f"{row['topic']}[{row['partition']}]@{row['offset']}"


def _events(rows: list[Row], kind: str, topic: str = "resource_events") -> list[Row]:
    """Rows of one record type on one topic (the agents' inboxes hold copies of many events)."""
    name = rows[0]["topics"][topic]
    return [r for r in rows[1:] if r["topic"] == name and r.get("type") == kind]


def _find(rows: list[Row], kind: str, topic: str = "resource_events", **fields: Any) -> Row:
    found = [r for r in _events(rows, kind, topic) if all(r["record"][k] == v for k, v in fields.items())]
    assert len(found) == 1, f"{len(found)} {kind} with {fields}"
    return found[0]


def _insert_after(rows: list[Row], anchor: Row, forged: Row) -> Row:
    """Insert ``forged`` right after ``anchor`` in its topic partition; later offsets move up by one."""
    forged = {**forged, "topic": anchor["topic"], "partition": anchor["partition"], "offset": anchor["offset"] + 1}
    for row in rows[1:]:
        if (row["topic"], row["partition"]) == (anchor["topic"], anchor["partition"]) \
                and row["offset"] > anchor["offset"]:
            row["offset"] += 1
    rows.insert(rows.index(anchor) + 1, forged)
    return forged


def _tampered(recording: Recording, tmp_path: Path, edit: Callable[[list[Row]], Row]) -> tuple[Path, str]:
    """A copy of the archive changed by ``edit``; returns it and the position of the changed line.

    The changed line is signed again with the workers' own key: what a buggy or compromised worker
    would write, which only the invariant checks and the replay can catch. (A forgery signed by anyone
    else is ``authenticated``'s alone: ``tests/streams/shells/test_safety_kafka.py``.)"""
    rows = _rows(recording.archive)
    changed = edit(rows)
    path = _write(tmp_path / "tampered.jsonl", rows)
    entry = load_archive(path).find(changed["topic"], changed["partition"], changed["offset"])
    assert entry is not None
    worker = read_private_key(recording.settings.home / "keys" / "worker.key", "worker")
    value = entry.value_bytes(default_codec())
    changed["headers"] = [[name, {"$bytes": base64.b64encode(data).decode()}]
                          for name, data in worker.sign(entry.topic, entry.key, value, entry.timestamp_ms)]
    return _write(path, rows), _where(changed)


def _audit_file(path: Path) -> dict[str, Any]:
    """``audit`` of an archive, with the topics and partition count it was recorded with."""
    log = load_archive(path)
    return asyncio.run(audit(log, Settings(topics=log.topics, partitions=log.partition_count or 1)))


def _cli(*args: str) -> Result:
    return CliRunner().invoke(arbiter_cli, list(args), catch_exceptions=False)


def _findings(report: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["check"] == check]


def _assert_caught(path: Path, position: str, checks: tuple[str, ...]) -> dict[str, Any]:
    """The audit fails with each of ``checks`` naming ``position``, in Python and through the CLI."""
    report = _audit_file(path)
    assert report["verdict"] == "fail"
    for check in checks:
        assert any(position in f["where"] for f in _findings(report, check)), (check, report["findings"])
    text = _cli("audit", "--log", str(path))
    assert text.exit_code == 1, text.output
    assert position in text.output and "FAIL" in text.output
    as_json = _cli("audit", "--log", str(path), "--json")
    assert as_json.exit_code == 1
    parsed = json.loads(as_json.stdout)
    assert parsed["verdict"] == "fail"
    for check in checks:
        assert any(position in f["where"] for f in parsed["findings"] if f["check"] == check), check
    return report


# -- the clean run ---------------------------------------------------------------------------


def test_the_recorded_run_audits_clean(recording: Recording) -> None:
    report = _audit_file(recording.archive)
    assert report["verdict"] == "pass" and report["findings"] == []
    stats = report["stats"]
    assert stats["grants"] >= 6 and stats["writes"] == 3 and stats["expiries"] == 1
    assert stats["rejected_writes"] == 2  # the zombie and the version conflict
    assert all(row["violations"] == 0 and row["open"] == 0 for row in report["checks"].values())
    result = _cli("audit", "--log", str(recording.archive))
    assert result.exit_code == 0, result.output
    assert "verdict: PASS" in result.output


def test_the_archive_is_the_log(recording: Recording) -> None:
    """Reading the topics again gives what the archive holds, message for message."""
    log = asyncio.run(read_log(recording.settings))
    archived = load_archive(recording.archive)
    assert log.partition_count == archived.partition_count and log.topics == archived.topics
    assert list(log.entries()) == list(archived.entries())


# -- tampered copies -------------------------------------------------------------------------


def test_a_forged_grant_during_a_live_lease_breaks_mutual_exclusion(recording: Recording, tmp_path: Path) -> None:
    def forge(rows: list[Row]) -> Row:
        real = _find(rows, "LockGranted", resource="account:a", agent_id="beta")
        released = _find(rows, "LockReleased", resource="account:a", agent_id="beta")
        top = max(r["record"]["token"] for r in _events(rows, "LockGranted") if r["record"]["resource"] == "account:a")
        start, end = real["record"]["at_ms"], released["record"]["at_ms"]
        assert end - start > 2
        record = {**real["record"], "agent_id": "mallory", "request_id": uuid.uuid4().hex, "token": top + 1,
                  "at_ms": start + 1}
        record["holders"] = [{**record["holders"][0], "agent_id": "mallory", "request_id": record["request_id"],
                              "token": top + 1}]
        return _insert_after(rows, real, {**real, "ts": real["ts"] + 1, "record": record})

    path, position = _tampered(recording, tmp_path, forge)
    report = _assert_caught(path, position, ("mutual_exclusion", "determinism"))
    (clash,) = _findings(report, "mutual_exclusion")
    assert "mallory" in clash["message"] and "beta" in clash["message"]
    # The forgery is named where it is, once per rule it breaks; the real decisions after it (beta's
    # writes with its lower token, the later grants) are judged against the real state, not the forgery.
    assert all(position in f["where"] for f in report["findings"]), report["findings"]


def test_a_lower_token_after_a_release_breaks_monotonic_tokens(recording: Recording, tmp_path: Path) -> None:
    def forge(rows: list[Row]) -> Row:
        earlier = _find(rows, "LockGranted", resource="ticket:t1", agent_id="delta")
        released = _find(rows, "LockReleased", resource="ticket:t1", agent_id="delta")
        token = earlier["record"]["token"] - 1
        record = {**earlier["record"], "agent_id": "mallory", "request_id": uuid.uuid4().hex, "token": token,
                  "at_ms": released["record"]["at_ms"] + 1,
                  "expires_at_ms": released["record"]["at_ms"] + 30_000}
        record["holders"] = [{**record["holders"][0], "agent_id": "mallory", "request_id": record["request_id"],
                              "token": token, "expires_at_ms": record["expires_at_ms"]}]
        return _insert_after(rows, released, {**released, "type": "LockGranted", "record": record})

    path, position = _tampered(recording, tmp_path, forge)
    report = _assert_caught(path, position, ("monotonic_tokens",))
    (regression,) = _findings(report, "monotonic_tokens")
    assert regression["where"][0] == position and "mallory" in regression["message"]
    assert not _findings(report, "mutual_exclusion"), "nobody held ticket:t1 then"


def test_an_accepted_stale_write_breaks_fenced_writes(recording: Recording, tmp_path: Path) -> None:
    def accept(rows: list[Row]) -> Row:
        rejected = _find(rows, "ToolRejected", resource="account:a", reason="stale_fencing_token")
        intent = _find(rows, "ToolIntent", "resource_commands", intent_id=rejected["record"]["intent_id"])
        assert intent["record"]["token"] == recording.zombie_token
        old = rejected["record"]
        rejected["type"] = "ToolApplied"
        rejected["record"] = {
            "intent_id": old["intent_id"], "agent_id": old["agent_id"], "resource": old["resource"],
            "tool": old["tool"], "token": recording.zombie_token, "arguments_json": intent["record"]["arguments_json"],
            "version": intent["record"]["base_version"] + 1, "content_hash": "f" * 32,
            "result_json": json.dumps({"account": "a", "order_id": "zombie-1", "amount": 100}),
            "at_ms": old["at_ms"], "cause": old["cause"],
        }
        return rejected

    path, position = _tampered(recording, tmp_path, accept)
    report = _assert_caught(path, position, ("fenced_writes", "determinism"))
    fenced = [f for f in _findings(report, "fenced_writes") if position in f["where"]]
    assert any(f"stale token {recording.zombie_token}" in f["message"] for f in fenced), fenced


def test_the_html_report_shows_where_the_violations_are(recording: Recording, tmp_path: Path) -> None:
    def forge(rows: list[Row]) -> Row:
        real = _find(rows, "LockGranted", resource="account:a", agent_id="beta")
        record = {**real["record"], "agent_id": "mallory", "request_id": uuid.uuid4().hex,
                  "token": real["record"]["token"] + 100, "at_ms": real["record"]["at_ms"] + 1}
        return _insert_after(rows, real, {**real, "record": record})

    path, position = _tampered(recording, tmp_path, forge)
    page = tmp_path / "out" / "report.html"
    result = _cli("audit", "--log", str(path), "--html", str(page))
    assert result.exit_code == 1
    html = page.read_text(encoding="utf-8")
    report = _audit_file(path)
    violations = {w for f in report["findings"] if f["severity"] == "violation" for w in f["where"]}
    assert position in violations
    for where in violations:
        assert where in html
    assert "VIOLATIONS" in html or "FAIL" in html


def test_a_broken_archive_is_a_clear_error(recording: Recording, tmp_path: Path) -> None:
    rows = _rows(recording.archive)
    bad = tmp_path / "bad.jsonl"
    lines = [json.dumps(r, sort_keys=True) for r in rows]
    lines[3] = lines[3][:-5]
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    result = _cli("audit", "--log", str(bad))
    assert result.exit_code == 2
    assert f"{bad}:4:" in result.output and "Traceback" not in result.output


# -- replay ----------------------------------------------------------------------------------


def test_time_travel_to_the_zombie_write_shows_the_new_holder(recording: Recording) -> None:
    rows = _rows(recording.archive)
    rejected = _find(rows, "ToolRejected", resource="account:a", reason="stale_fencing_token")
    result = _cli("replay", "--log", str(recording.archive), "--at", _where(rejected))
    assert result.exit_code == 0, result.output
    state = json.loads(result.stdout)
    (account,) = [r for r in state["resources"] if r["resource"] == "account:a"]
    assert account["high_water_token"] == recording.holder_token > recording.zombie_token
    assert [h["agent_id"] for h in account["holders"]] == ["beta"]
    assert account["holders"][0]["token"] == recording.holder_token


def test_time_travel_by_time(recording: Recording) -> None:
    log = load_archive(recording.archive)
    start, end = log.span_ms()
    before = json.loads(_cli("replay", "--log", str(recording.archive), "--at", str(start)).stdout)
    after = json.loads(_cli("replay", "--log", str(recording.archive), "--at", str(end)).stdout)
    assert all(not r["holders"] for r in after["resources"]), "every lease was given back"
    assert len(after["resources"]) >= 3 > len(before["resources"])
    relative = json.loads(_cli("replay", "--log", str(recording.archive), "--at",
                               f"+{(end - start) / 1000 + 1:.3f}s").stdout)
    assert relative["resources"] == after["resources"]


def test_what_if_a_short_ttl_expires_more_leases(recording: Recording) -> None:
    result = _cli("replay", "--log", str(recording.archive), "--policy", "ttl=100ms")
    assert result.exit_code == 0, result.output
    compared = json.loads(result.stdout)
    assert compared["policy"]["ttl_ms"] == 100
    assert compared["recorded"]["expiries"] == 1
    assert compared["what_if"]["expiries"] > compared["recorded"]["expiries"]
    assert "expiries" in compared["differences"]


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--policy", "ttl=abc", "duration 'abc'"),
    ("--policy", "speed=2", "unknown policy 'speed'"),
    ("--at", "nonsense", "moment 'nonsense'"),
    ("--at", "nowhere[0]@99999999", "is not in the log"),
])
def test_bad_replay_options_are_clear_errors(recording: Recording, option: str, value: str, says: str) -> None:
    result = CliRunner().invoke(arbiter_cli, ["replay", "--log", str(recording.archive), option, value])
    assert result.exit_code == 2, result.output
    assert says in result.output and "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_log_export_writes_the_same_archive(recording: Recording, tmp_path: Path) -> None:
    out = tmp_path / "exported.jsonl"
    env = {"ARBITER_TOPICS__" + name.upper(): topic for name, topic in recording.settings.topics.model_dump().items()}
    env["ARBITER_PARTITIONS"] = str(recording.settings.partitions)
    result = CliRunner(env=env).invoke(arbiter_cli, ["--bootstrap", recording.settings.bootstrap, "log", "export",
                                                     str(out)])
    assert result.exit_code == 0, result.output
    count = int(re.search(r"wrote (\d+) messages", result.output).group(1))  # type: ignore[union-attr]
    assert count == len(_rows(recording.archive)) - 1
    assert load_archive(out).partitions == load_archive(recording.archive).partitions
