"""``arbiter chaos``: every campaign's short form, end to end against real workers (and, for
broker-restart, a private broker it starts, kills and restarts), with a passing audit and
no lost or duplicated effect in the ledger; and the table it prints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from arbiter.chaos.report import plain, render
from arbiter.processes import settings_env
from tests.cli.test_cli import arbiter
from tests.conftest import isolated_settings


def chaos(bootstrap: str, home: Path, campaign: str, *options: str) -> dict[str, Any]:
    """Run ``arbiter chaos CAMPAIGN --short --json`` as docs/operations.md does; its result, checked in common."""
    env = settings_env(isolated_settings(bootstrap, home, auto_enroll=False, partitions=4))
    proc = arbiter("chaos", campaign, "--short", "--workers", "2", "--agents", "4", "--json", *options,
                   env=env, timeout=240)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout)
    failed = [c for c in result["checks"] if not c["ok"]]
    assert proc.returncode == 0 and result["ok"] and not failed, (failed, proc.stderr[-3000:])
    assert result["audit"]["verdict"] == "pass" and result["audit"]["violations"] == 0, result["audit"]
    ledger = result["ledger"]
    assert ledger["ok"] and ledger["lost"] == 0 and ledger["duplicated"] == 0, ledger
    assert ledger["effects"] == ledger["applied_in_log"] >= ledger["seen_applied_by_agents"] > 0, ledger
    phase = result["phases"][-1]
    assert phase["phase"] == campaign and phase["succeeded"] > 0, phase
    assert Path(result["audit"]["archive"]).exists() and Path(result["audit"]["html"]).exists()
    if not result["topics"]["private_broker"]:
        assert result["topics"]["deleted"] >= result["topics"]["created"] > 0, result["topics"]
    return result


def names(result: dict[str, Any]) -> set[str]:
    return {c["name"] for c in result["checks"]}


@pytest.mark.e2e
@pytest.mark.kafka
def test_worker_kill_beside_a_calm_baseline(bootstrap: str, tmp_path: Path) -> None:
    result = chaos(bootstrap, tmp_path, "worker-kill", "--calm")
    assert [p["phase"] for p in result["phases"]] == ["calm", "worker-kill"]
    assert len(result["faults"]) >= 2 and all(f["fault"].startswith("SIGKILL worker-") for f in result["faults"])
    assert result["workers_exited_on_their_own"] == []
    targets = result["targets"]
    assert targets["succeeded_per_s_share_of_calm"] is not None and targets["acquire_p99_s"] is not None
    assert targets["audit_violations"] == 0 and targets["violations_met"]


@pytest.mark.e2e
@pytest.mark.kafka
def test_freeze_agent_writes_on_waking_are_refused(bootstrap: str, tmp_path: Path) -> None:
    result = chaos(bootstrap, tmp_path, "freeze-agent")
    rows = dict(map(tuple, result["campaign_rows"]))
    assert "frozen agent's writes refused" in names(result)
    # Both variants ran: taken over (stale_fencing_token) and expired with nobody newer (lease_not_live).
    assert "stale_fencing_token" in rows["frozen agent's writes on waking"], rows
    assert "lease_not_live" in rows["frozen agent's writes on waking"], rows
    assert "APPLIED" not in rows["frozen agent's writes on waking"], rows


@pytest.mark.e2e
@pytest.mark.kafka
def test_broker_restart_on_a_private_broker(bootstrap: str, tmp_path: Path) -> None:
    result = chaos(bootstrap, tmp_path, "broker-restart")
    assert result["topics"]["private_broker"], "the campaign must never kill the shared broker"
    assert result["options"]["broker"] == "private, killed and restarted"
    (fault, *_) = result["faults"]
    assert fault["fault"].startswith("SIGKILL the broker") and fault["every_partition_served_after_s"] > 0
    assert "grants resume after each broker restart" in names(result)


@pytest.mark.e2e
@pytest.mark.kafka
def test_duplicates_are_decided_once(bootstrap: str, tmp_path: Path) -> None:
    result = chaos(bootstrap, tmp_path, "duplicates")
    assert "each copied id decided once" in names(result) and "every id decided once" in names(result)
    assert sum(int(f["fault"].split()[0]) for f in result["faults"]) >= 10, result["faults"]


@pytest.mark.e2e
@pytest.mark.kafka
def test_malformed_records_are_all_refused_and_no_worker_stops(bootstrap: str, tmp_path: Path) -> None:
    result = chaos(bootstrap, tmp_path, "malformed")
    assert {"every malformed record dead-lettered or refused", "no worker exited on its own",
            "honest operations kept succeeding"} <= names(result)
    phase = result["phases"][-1]
    assert phase["attempted"] == phase["succeeded"] and not phase["refused"] and not phase["timed_out"], phase
    how = dict(map(tuple, result["campaign_rows"]))["how they were refused"]
    for reason in ("unauthenticated", "forbidden", "key_mismatch", "misrouted", "unsupported_command"):
        assert reason in how, how


def test_the_table_puts_the_calm_baseline_beside_the_campaign(capsys: pytest.CaptureFixture[str]) -> None:
    phase = {"seconds": 60.0, "attempted": 100, "succeeded": 99, "success_rate": 0.99, "succeeded_per_s": 1.65,
             "refused": {"wait_timed_out": 1}, "timed_out": 0, "unavailable": 0, "longest_gap_s": 3.2,
             "acquire_p50_s": 0.02, "acquire_p99_s": 4.1}
    result = {
        "campaign": "worker-kill", "ok": False,
        "options": {"workers": 3, "agents": 8, "partitions": 4, "session_timeout_s": 2.0, "seed": 7},
        "phases": [{**phase, "phase": "calm", "longest_gap_s": 0.3, "acquire_p99_s": 0.3},
                   {**phase, "phase": "worker-kill"}],
        "campaign_rows": [("faults injected", "12 SIGKILLs of a worker (every 5 s), each replaced at once")],
        "ledger": {"lost": 0, "duplicated": 0, "effects": 198, "ok": True},
        "audit": {"verdict": "fail", "violations": 1, "messages": 1000, "findings": ["mutual_exclusion: overlap"],
                  "archive": "a/log.jsonl", "html": "a/audit.html"},
        "checks": [{"name": "audit", "ok": False, "detail": "1 violation"}],
        "topics": {"created": 10, "deleted": 14, "kept": False, "private_broker": False},
        "targets": {"succeeded_per_s_share_of_calm": 1.0, "success_rate_share_of_calm": 1.0, "share_target": 0.5,
                    "share_met": True, "acquire_p99_s": 4.1, "p99_target_s": 5.0, "p99_met": True,
                    "audit_violations": 1, "violations_met": False},
    }
    text = plain(result)
    header, *rows = text.splitlines()
    assert header.split() == ["calm", "worker-kill"]
    assert any(r.startswith("acquire latency p50 / p99") and "300 ms" in r and "4.10 s" in r for r in rows), text
    assert any(r.startswith("refused (by reason)") and "wait_timed_out 1" in r for r in rows), text
    assert any(r.startswith("audit verdict") and "FAIL (1 violations" in r for r in rows), text
    render(result, print)
    out = capsys.readouterr().out
    assert "FAIL  audit: 1 violation" in out and "zero audit violations: 1 (MISSED)" in out and "verdict: FAIL" in out


def test_an_id_decided_twice_is_named_and_identical_copies_are_not() -> None:
    from arbiter.audit.log import Entry, Log
    from arbiter.chaos.campaigns import decided_twice
    from arbiter.edge.settings import Topics
    from arbiter.schemas import Cause, LockDenied, LockGranted

    topics = Topics()
    log = Log(topics)

    def add(offset: int, record: object) -> None:
        log.add(Entry(topics.resource_events, 0, offset, 0, b"account:a", record))  # type: ignore[arg-type]

    def grant(request: str, token: int) -> LockGranted:
        return LockGranted(request_id=request, agent_id="a", resource="account:a", token=token, mode="exclusive",
                           expires_at_ms=1, holders=[], resource_version=0, at_ms=0,
                           cause=Cause(topic="c", partition=0, offset=token))

    add(0, grant("once", 1))
    add(1, grant("once", 1))  # a redelivered, identical copy
    add(2, grant("twice", 2))
    add(3, grant("twice", 3))  # granted again: two tokens for one request
    add(4, grant("expired", 4))
    add(5, LockDenied(request_id="expired", agent_id="a", resource="account:a", reason="request_expired",
                      detail="{}", at_ms=0, cause=Cause(topic="c", partition=0, offset=9)))
    add(6, grant("denied-too", 5))
    add(7, LockDenied(request_id="denied-too", agent_id="a", resource="account:a", reason="busy",
                      detail="{}", at_ms=0, cause=Cause(topic="c", partition=0, offset=10)))
    assert decided_twice(log) == ["denied-too", "twice"]
