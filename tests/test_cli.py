"""The ``arbiter`` command: clear errors, non-zero exits, nothing changed on bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from arbiter.processes import WorkerPool, settings_env
from arbiter.settings import Settings


def arbiter(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "arbiter", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, check=False)


def test_help_lists_every_command() -> None:
    out = arbiter("--help").stdout
    for command in ("kafka", "topics", "worker", "ping", "demo"):
        assert command in out


@pytest.mark.parametrize("bootstrap", ["no-port", "host:notaport"])
def test_bad_bootstrap_is_a_clear_error(bootstrap: str) -> None:
    proc = arbiter("--bootstrap", bootstrap, "topics", "create")
    assert proc.returncode == 1
    assert "invalid settings: bootstrap" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_environment_value_is_a_clear_error() -> None:
    proc = arbiter("topics", "create", env={"ARBITER_PARTITIONS": "zero"})
    assert proc.returncode == 1
    assert "invalid settings: partitions" in proc.stderr


def test_worker_without_kafka_says_how_to_get_one(tmp_path: Path) -> None:
    proc = arbiter("--bootstrap", "127.0.0.1:1", "--home", str(tmp_path), "worker")
    assert proc.returncode == 1
    assert "no Kafka answers at 127.0.0.1:1" in proc.stderr
    assert "arbiter kafka up" in proc.stderr


def test_topics_create_without_kafka_is_a_clear_error() -> None:
    proc = arbiter("--bootstrap", "127.0.0.1:1", "topics", "create")
    assert proc.returncode == 1
    assert "127.0.0.1:1" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.kafka
def test_ping_with_no_worker_times_out_clearly(kafka_settings: Settings) -> None:
    env = {"ARBITER_TOPICS__RESOURCE_COMMANDS": kafka_settings.topics.resource_commands,
           "ARBITER_TOPICS__AGENT_INBOX": kafka_settings.topics.agent_inbox,
           "ARBITER_BOOTSTRAP": kafka_settings.bootstrap}
    proc = arbiter("ping", "--count", "1", "--timeout", "2", env=env)
    assert proc.returncode == 1
    assert "no Pong within 2.0s: is a worker running?" in proc.stderr


@pytest.mark.kafka
def test_kafka_status_reports_the_broker(bootstrap: str) -> None:
    host, _, port = bootstrap.rpartition(":")
    proc = arbiter("--kafka-port", port, "kafka", "status", env={"ARBITER_BOOTSTRAP": ""})
    if host == "127.0.0.1":
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "answers" in proc.stdout


@pytest.mark.kafka
def test_lock_commands_from_a_shell(kafka_settings: Settings, workers: WorkerPool) -> None:
    import json

    workers.start(1)
    env = settings_env(kafka_settings)
    env.pop("ARBITER_HOME", None)

    def lock(*args: str) -> subprocess.CompletedProcess[str]:
        return arbiter("lock", *args, env=env, timeout=120)

    first = lock("acquire", "ticket:cust_8492", "--agent", "shell-a", "--ttl", "30", "--wait", "60")
    assert first.returncode == 0, first.stderr
    token = json.loads(first.stdout)["token"]
    busy = lock("acquire", "ticket:cust_8492", "--agent", "shell-b")
    assert busy.returncode == 1
    assert json.loads(busy.stdout)["reason"] == "busy"
    status = json.loads(lock("status", "ticket:cust_8492").stdout)
    assert status["holders"] == [{"agent_id": "shell-a", "token": token, "mode": "exclusive",
                                  "expires_at_ms": json.loads(first.stdout)["expires_at_ms"]}]
    renewed = lock("renew", "ticket:cust_8492", "--agent", "shell-a", "--token", str(token), "--ttl", "60")
    assert renewed.returncode == 0 and json.loads(renewed.stdout)["token"] == token
    foreign = lock("release", "ticket:cust_8492", "--agent", "shell-b", "--token", str(token))
    assert foreign.returncode == 1 and json.loads(foreign.stdout)["reason"] == "not_holder"
    released = lock("release", "ticket:cust_8492", "--agent", "shell-a", "--token", str(token))
    assert released.returncode == 0, released.stdout + released.stderr
    after = json.loads(lock("status", "ticket:cust_8492").stdout)
    assert after["holders"] == [] and after["high_water_token"] == token


@pytest.mark.kafka
def test_the_main_job_runs_end_to_end(bootstrap: str, tmp_path: Path) -> None:
    from .conftest import isolated_settings

    settings = isolated_settings(bootstrap, tmp_path)
    env = settings_env(settings)
    proc = arbiter("demo", "--workers", "2", "--rounds", "20", env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "round trips through the workers: 20" in proc.stdout
    assert "malformed message dead-lettered: reason=unknown_fingerprint" in proc.stdout
    assert "refused, stale_fencing_token" in proc.stdout
    assert "refused, version_conflict" in proc.stdout
    assert "refunds for order-8492: 1; ledger invariants: hold" in proc.stdout
    assert "workers stopped" in proc.stdout
