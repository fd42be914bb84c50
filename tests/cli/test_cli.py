"""The ``arbiter`` command: clear errors, non-zero exits, nothing changed on bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool, settings_env
from tests.conftest import REPO


def arbiter(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "arbiter", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout, check=False)


def in_tmux(args: list[str], env: dict[str, str], folder: Path, columns: int = 100, rows: int = 50,
            timeout: float = 300) -> tuple[int, str]:
    """Run ``arbiter ARGS`` in a tmux pane of ``columns`` x ``rows`` (a private tmux server, stopped after);
    its exit code and the pane's whole screen and scrollback, wrapped lines joined."""
    import shlex
    import time
    import uuid

    socket, done = f"arbiter-test-{uuid.uuid4().hex[:8]}", folder / "exit-code"
    conf = folder / "tmux.conf"
    conf.write_text("set -g history-limit 100000\nset -g remain-on-exit on\n")
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "arbiter", *args])
    tmux = ["tmux", "-L", socket, "-f", str(conf)]
    subprocess.run([*tmux, "new-session", "-d", "-x", str(columns), "-y", str(rows),
                    f"{command}; echo $? > {shlex.quote(str(done))}"], env={**os.environ, **env}, check=True,
                   cwd=REPO)
    try:
        deadline = time.monotonic() + timeout
        while not done.exists() or not done.read_text().strip():
            assert time.monotonic() < deadline, f"arbiter {' '.join(args)} did not end within {timeout:g} s"
            time.sleep(0.2)  # (the command's own exit is what is waited on)
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-J", "-S", "-", "-E", "-"], capture_output=True,
                                text=True, check=True).stdout
        return int(done.read_text()), screen
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True, check=False)


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
    assert proc.returncode == 3, "every command's exit status when Kafka cannot be reached"
    assert "no Kafka answers at 127.0.0.1:1" in proc.stderr
    assert "arbiter kafka up" in proc.stderr


def test_topics_create_without_kafka_is_a_clear_error() -> None:
    proc = arbiter("--bootstrap", "127.0.0.1:1", "topics", "create")
    assert proc.returncode == 3
    assert "127.0.0.1:1" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.kafka
def test_ping_with_no_worker_times_out_clearly(kafka_settings: Settings) -> None:
    env = {"ARBITER_TOPICS__RESOURCE_COMMANDS": kafka_settings.topics.resource_commands,
           "ARBITER_TOPICS__AGENT_INBOX": kafka_settings.topics.agent_inbox,
           "ARBITER_TOPICS__REGISTRY": kafka_settings.topics.registry,
           "ARBITER_HOME": str(kafka_settings.home), "ARBITER_BOOTSTRAP": kafka_settings.bootstrap}
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

    def lock(*args: str) -> subprocess.CompletedProcess[str]:
        return arbiter("lock", *args, env=env, timeout=120)

    first = lock("acquire", "ticket:cust_8492", "--agent", "shell-a", "--ttl", "30", "--wait", "60")
    assert first.returncode == 0, first.stderr
    token = json.loads(first.stdout)["token"]
    busy = lock("acquire", "ticket:cust_8492", "--agent", "shell-b")
    assert busy.returncode == 1
    assert json.loads(busy.stdout)["reason"] == "busy"
    status = json.loads(lock("status", "ticket:cust_8492", "--agent", "shell-a").stdout)
    assert status["holders"] == [{"agent_id": "shell-a", "token": token, "mode": "exclusive",
                                  "expires_at_ms": json.loads(first.stdout)["expires_at_ms"]}]
    # Another agent sees the lease, not its token.
    seen_by_b = json.loads(lock("status", "ticket:cust_8492", "--agent", "shell-b").stdout)
    assert [h["token"] for h in seen_by_b["holders"]] == [None]
    renewed = lock("renew", "ticket:cust_8492", "--agent", "shell-a", "--token", str(token), "--ttl", "60")
    assert renewed.returncode == 0 and json.loads(renewed.stdout)["token"] == token
    foreign = lock("release", "ticket:cust_8492", "--agent", "shell-b", "--token", str(token))
    assert foreign.returncode == 1 and json.loads(foreign.stdout)["reason"] == "not_holder"
    released = lock("release", "ticket:cust_8492", "--agent", "shell-a", "--token", str(token))
    assert released.returncode == 0, released.stdout + released.stderr
    after = json.loads(lock("status", "ticket:cust_8492").stdout)
    assert after["holders"] == [] and after["high_water_token"] == token


@pytest.mark.e2e
@pytest.mark.kafka
def test_the_main_job_runs_safe_and_unsafe_side_by_side(bootstrap: str, tmp_path: Path) -> None:
    from tests.conftest import isolated_settings

    settings = isolated_settings(bootstrap, tmp_path)
    env = settings_env(settings)
    # In a 100-column terminal (tmux): the live views are drawn, and must leave no fragment behind.
    code, out = in_tmux(["demo", "--workers", "2", "--speed", "100", "--seed", "3", "--unsafe"], env, tmp_path)
    assert code == 0, out
    lines = out.splitlines()
    for frame in ("swarm without Arbiter [", "swarm [", "leases: "):
        drawn = [line for line in lines if line.startswith(frame)]
        assert len(drawn) == 1, f"{len(drawn)} lines of the live view start with {frame!r}, not one:\n{out}"
    assert not [line for line in lines if "held by" in line and not line.startswith("  ")], out
    rows = [[cell.strip() for cell in line.split(" | ")] for line in out.splitlines() if line.count(" | ") == 2]
    unsafe = {name: left for name, left, _right in rows}
    safe = {name: right for name, _left, right in rows}
    # Without Arbiter: at least one corruption of each kind.
    assert int(unsafe["double refunds by racing triage agents"]) >= 1, out
    assert int(unsafe["zombie refunds applied after the TTL"]) >= 1, out
    assert not unsafe["lost updates (document sections lost)"].startswith("0 of"), out
    assert "until a timeout cut it" in unsafe["delegation ring"], out
    assert "ledger invariants (without Arbiter): VIOLATED" in out
    # With Arbiter: none, and the audit of the run's whole log agrees.
    assert safe["double refunds by racing triage agents"] == "0"
    assert safe["zombie refunds applied after the TTL"] == "0"
    assert safe["lost updates (document sections lost)"].startswith("0 of")
    assert safe["delegation ring"] == "1 deadlock detected, victim compensated"
    assert "ledger invariants (with Arbiter): hold" in out
    assert "PASS: no safety rule was broken" in out
    assert re.search(r"live console: http://127\.0\.0\.1:\d+/ ", out) and "front door stopped" in out, out
    assert "deleted the run's" in out, "the run's topics were not deleted"
    assert "zombie writes rejected" in out
    # The victim is the ring's youngest by the log's clock: whoever delegated last.
    assert any(f"victim {name}" in out for name in ("routing", "refactoring", "testing", "documentation")), out
    report = next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("audit report: "))
    assert Path(report).is_file() and "arbiter-log" in Path(report).with_name("log.jsonl").read_text()[:200]
    assert "workers stopped" in out
    # The coding story: without Arbiter changes are lost and main breaks; with it none is lost, the
    # conflict is rebased by path, and the failing change is refused by its check.
    assert "without Arbiter (one working tree on main): 2 of 2 kept changes lost (ada, bo), main broken" in out
    assert "with Arbiter (a sandbox each, one merge queue): 0 lost, main passes its check" in out
    assert "version_conflict in calc.py; rebase names calc.py" in out, out
    assert "cy: check_failed - refused, main unchanged" in out, out


def _processes_with(marker: str) -> list[int]:
    """Pids whose environment contains ``marker`` (this machine's /proc)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.e2e
@pytest.mark.kafka
def test_ctrl_c_stops_the_demo_cleanly_and_audits_the_partial_log(bootstrap: str, tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from tests.conftest import isolated_settings

    env = settings_env(isolated_settings(bootstrap, tmp_path)) | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "arbiter", "demo", "--speed", "2", "--workers", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, cwd=REPO)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # wait until the swarm is running
        lines.append(line)
        if line.startswith("swarm ["):
            break
    run = next(line.split("run ", 1)[1].split(":")[0] for line in lines if "; run " in line)
    assert _processes_with(f"arbiter.demo.{run}.app"), "the workers run"
    # Interrupt mid-swarm, once it has made progress: a step done, as the demo's own progress line says.
    # (Polling the log for a write raced the swarm: a full read of the log under load can take as long
    # as the swarm's last steps, and the demo then ended before it was interrupted.)
    done = 0
    for line in proc.stdout:
        lines.append(line)
        found = re.search(r"^swarm \[[#-]+\] (\d+)/(\d+) steps", line)
        if found:
            done, total = int(found[1]), int(found[2])
            assert done < total, "the swarm ended before it was interrupted:\n" + "".join(lines)
            if done >= 1:
                break
    assert done >= 1 and proc.poll() is None, "the demo ended before it was interrupted:\n" + "".join(lines)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    out = "".join(lines) + rest
    assert proc.returncode == 130, out
    assert "interrupted: stopping the swarm; auditing the partial log" in out
    assert "(partial log)" in out and "audit report: " in out
    assert "workers stopped" in out
    assert _processes_with(f"arbiter.demo.{run}.app") == [], "no worker is left behind"


@pytest.mark.kafka
async def test_the_demo_view_skips_what_it_cannot_decode_and_raises_its_own_bugs(
        kafka_settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from aiokafka import AIOKafkaProducer

    from arbiter.demo.view import SwarmView, follow
    from arbiter.schemas import Cause, SagaFinished, default_codec

    saga_events = kafka_settings.topics.saga_events
    finished = SagaFinished(saga_id="saga:a:1", outcome="COMPLETED", at_ms=1, cause=Cause(topic="x", partition=0,
                                                                                        offset=0))
    producer = AIOKafkaProducer(bootstrap_servers=kafka_settings.bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(saga_events, b"not a record", key=b"saga:a:1")
        await producer.send_and_wait(saga_events, default_codec().encode(finished), key=b"saga:a:1")
    finally:
        await producer.stop()

    async def view(state: SwarmView) -> None:
        caught_up = asyncio.Event()
        caught_up.set()  # read to the end offsets as of now, then return
        await asyncio.wait_for(follow(kafka_settings, state, asyncio.Event(), caught_up), timeout=30)

    state = SwarmView()
    await view(state)
    assert state.counts["messages the view could not decode"] == 1
    assert state.counts["sagas completed"] == 1

    def broken(self: SwarmView, record: object) -> None:
        raise ZeroDivisionError("a bug in the view's fold")

    monkeypatch.setattr(SwarmView, "feed", broken)
    with pytest.raises(ZeroDivisionError, match="a bug in the view's fold"):
        await view(SwarmView())


@pytest.mark.kafka
def test_agents_add_list_rotate_revoke_from_a_shell(kafka_settings: Settings) -> None:
    import json

    env = settings_env(kafka_settings)

    def agents(*args: str) -> subprocess.CompletedProcess[str]:
        return arbiter("agents", *args, env=env, timeout=120)

    added = agents("add", "alice", "--allow", "ticket:,doc:alice", "--tenant", "acme")
    assert added.returncode == 0, added.stderr
    key = kafka_settings.home / "keys" / "alice.key"
    assert key.stat().st_mode & 0o777 == 0o600 and (key.parent.stat().st_mode & 0o777) == 0o700
    assert (kafka_settings.home / "keys" / "admin.pub").exists()  # the admin key, created on first use
    again = agents("add", "alice")
    assert again.returncode == 1 and "already has an active key" in again.stderr
    printed = agents("add", "bob", "--print-key")
    assert printed.returncode == 0 and printed.stdout.startswith("-----BEGIN PRIVATE KEY-----")
    assert not (kafka_settings.home / "keys" / "bob.key").exists()  # shown once, never written
    rotated = agents("rotate", "alice")
    returned_ms = int(time.time() * 1000)
    assert rotated.returncode == 0 and "refused from now on" in rotated.stderr, rotated.stderr
    assert agents("revoke", "bob", "--reason", "left the team").returncode == 0
    rows = [json.loads(line) for line in agents("list", "--json").stdout.splitlines()]
    assert sorted((r["name"], r["status"]) for r in rows) == [("alice", "active"), ("alice", "rotated"),
                                                              ("bob", "revoked")]
    assert all(r["allow"] == ["ticket:", "doc:alice"] and r["tenant"] == "acme" for r in rows if r["name"] == "alice")
    assert [r["reason"] for r in rows if r["name"] == "bob"] == ["left the team"]
    # As docs/security.md says: rotate returns once the old key is refused, not 2 s before it is.
    (old,) = [r for r in rows if r["name"] == "alice" and r["status"] == "rotated"]
    assert old["valid_until_ms"] <= returned_ms, (old, returned_ms)
    bad = agents("add", "saga:x")
    assert bad.returncode == 1 and "reserved" in bad.stderr and "Traceback" not in bad.stderr


def test_ledger_verbs_refuse_edge_values_and_change_nothing(ledger_dsn: str, tmp_path: Path) -> None:
    """Finding: 'arbiter ledger open payouts --balance 0' on a fresh ledger ended in an IntegrityError
    traceback. Each verb, given zero, negative and huge balances, names twice, accounts that exist or do
    not, answers an 'error:' line and a non-zero exit, and the ledger is as it was; never a traceback."""
    from click.testing import CliRunner

    from arbiter.cli import main

    runner = CliRunner(env={"ARBITER_HOME": str(tmp_path), "ARBITER_LEDGER_DSN": ledger_dsn})

    def ledger(*args: str) -> Any:
        result = runner.invoke(main, ["ledger", *args])
        assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exc_info)
        return result

    opened = ledger("open", "payouts", "--balance", "0")
    assert opened.exit_code == 0 and opened.stdout.strip() == \
        '{"opened": [{"resource": "account:payouts", "balance": 0}]}', opened.stderr
    assert ledger("open", "account:cust_1", "cust_2", "--balance", "500").exit_code == 0
    before = ledger("show").stdout
    assert '"cust_1": 500' in before and '"total": 1000' in before, before
    refused = {
        ("open", "payouts", "--balance", "0"): "exist already",
        ("open", "cust_3", "cust_1", "--balance", "1"): "cust_1 exist already",
        ("open", "cust_3", "account:cust_3", "--balance", "1"): "named more than once",
        ("open", "cust_3", "--balance", "-1"): "not in the range",
        ("open", "cust_3", "--balance", str(10**18 + 1)): "an integer of 0 to",
        ("open", "cust_3", "--balance", str(2**64)): "an integer of 0 to",
        ("open", "cust_3", "cust_4", "--balance", str(10**18 // 2)): "more than its",
        ("open", "cust_3", "--balance", "ten"): "is not a valid integer",
        ("open", "bad name", "--balance", "1"): "account id is 1-128",
        ("open", "account:", "--balance", "1"): "account id is 1-128",
        ("open", "x" * 129, "--balance", "1"): "account id is 1-128",
        ("show", "account:nobody"): "no 'account:nobody'",
        ("show", "account:bad name"): "account id is 1-128",
        ("show", "doc:never-written"): "no 'doc:never-written'",
    }
    for args, says in refused.items():
        result = ledger(*args)
        usage = says in ("not in the range", "is not a valid integer")  # click's own refusals: exit 2
        assert result.exit_code == (2 if usage else 1) and says in result.stderr, (args, result.exit_code,
                                                                                   result.stderr)
        assert not result.stdout, (args, result.stdout)
        assert ledger("show").stdout == before, args


KAFKA_VERBS: list[tuple[str, ...]] = [
    ("agents", "add", "carol"), ("agents", "list"), ("agents", "api-key", "carol"), ("agents", "rotate", "carol"),
    ("agents", "revoke", "carol"), ("saga", "abort", "saga:carol/x:1", "--reason", "outage"), ("audit",),
    ("replay", "--at", "0"), ("log", "export", "log.jsonl"), ("ping", "--count", "1"), ("topics", "create"),
    ("topics", "list"), ("topics", "delete", "tzz-none."), ("worker",), ("serve", "--port", "0"),
    ("top", "--once"), ("console", "--port", "0"),
]
"""Verbs that need Kafka and no set-up beyond a home (``tests/stories/test_outage.py`` runs every verb in a real
outage; this says each one's words)."""


def test_every_verb_without_kafka_says_it_in_the_docs_words(tmp_path: Path) -> None:
    """Finding: docs/operations.md says a CLI command prints one 'error: no Kafka answers at ...' line and exits 3;
    the verbs said 'the registry could not be reached', 'cannot reach Kafka at', or logged 'unreachable,
    reconnecting' first. Each now ends with that one line (what the client saw after it) and the hint."""
    from arbiter.processes import free_port

    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {"ARBITER_HOME": str(tmp_path), "ARBITER_BOOTSTRAP": bootstrap}
    for verb in KAFKA_VERBS:
        ran = subprocess.run([sys.executable, "-m", "arbiter", "--bootstrap", bootstrap, *verb], capture_output=True,
                             text=True, env={**os.environ, **env}, timeout=60, check=False, cwd=tmp_path)
        lines = ran.stderr.splitlines()
        assert ran.returncode == 3 and lines, (verb, ran.returncode, ran.stderr)
        said = f"error: no Kafka answers at {bootstrap}"
        assert lines[0] == said or lines[0].startswith(said + ": "), (verb, ran.stderr)
        assert len(lines) == 2 and "arbiter kafka up" in lines[1], (verb, ran.stderr)


@pytest.mark.kafka  # its bootstrap fixture needs a broker that answers
@pytest.mark.parametrize("name", ["admin", "../x", "a/b", "a b", "a\x01", "saga:x", "-x", "x" * 201])
def test_a_worker_or_runner_named_admin_or_a_path_is_refused_and_nothing_is_written(bootstrap: str, tmp_path: Path,
                                                                                    name: str) -> None:
    """Finding: 'arbiter runner --name ../x' (and ARBITER_IDENTITY for a worker) ended in a traceback, and
    'admin' was taken: the process would have signed with the home's admin key, the registry's trust
    anchor, and registered it as a runner or worker. Each is an 'error:' line, a non-zero exit, and the
    home stays as it was."""
    from click.testing import CliRunner

    from arbiter.cli import main

    (tmp_path / "keys").mkdir()
    runner = CliRunner(env={"ARBITER_HOME": str(tmp_path), "ARBITER_BOOTSTRAP": bootstrap})
    for args, env in ((["runner", "--name", name], {}), (["worker"], {"ARBITER_IDENTITY": name})):
        result = runner.invoke(main, args, env=env)
        assert isinstance(result.exception, SystemExit) and result.exit_code == 1, (args, result.exc_info)
        assert "cannot be a" in result.stderr and "Traceback" not in result.stderr, result.stderr
        assert sorted(p.name for p in tmp_path.rglob("*")) == ["keys"], (args, list(tmp_path.rglob("*")))


def test_no_process_signs_as_admin(tmp_path: Path) -> None:
    """The admin key's name is no identity's: an agent called 'admin' does not get its key."""
    from arbiter.edge.keys import signer_for
    from arbiter.schemas.identity import IdentityError

    with pytest.raises(IdentityError, match="admin key"):
        signer_for(tmp_path, "admin")


def test_an_override_without_the_admin_key_is_an_answer_not_a_traceback(tmp_path: Path) -> None:
    """Finding: 'arbiter lock revoke' and 'arbiter saga abort' in a home without the admin key ended in a
    traceback (the operator's signer was made outside the command's error handling)."""
    env = {**os.environ, "ARBITER_HOME": str(tmp_path), "ARBITER_BOOTSTRAP": "127.0.0.1:9"}
    revoke = subprocess.run([sys.executable, "-m", "arbiter", "lock", "revoke", "doc:x", "--agent", "a", "--reason",
                             "stuck"], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert revoke.returncode == 4 and "Traceback" not in revoke.stderr, revoke.stderr
    assert json.loads(revoke.stdout)["reason"] == "no_identity" and "admin key" in revoke.stdout
    abort = subprocess.run([sys.executable, "-m", "arbiter", "saga", "abort", "saga:a/b:1", "--reason", "stuck"],
                           capture_output=True, text=True, env=env, timeout=60, check=False)
    assert abort.returncode == 1 and "Traceback" not in abort.stderr and "no admin key" in abort.stderr, abort.stderr
