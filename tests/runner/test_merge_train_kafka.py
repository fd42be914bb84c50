"""One merge train per repository, in the log, shared by coding agents that are separate processes, checked
by a separate check runner (``arbiter runner``), against a real worker and real git. Merges land in the
order they joined, checked speculatively; a failing check evicts only its culprit; a conflict is answered
with its paths and the rebased work lands; an agent that dies leaves the train; nothing lands without a
runner's pass, whatever an agent sends. The audit passes on every log, every landing matched to its verdict."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from arbiter.agents.identities import ensure_identity
from arbiter.audit.log import Log, read_log
from arbiter.edge.clock import now_ms
from arbiter.edge.settings import Settings
from arbiter.processes import RunnerProcess, WorkerPool, settings_env
from arbiter.schemas import CheckVerdict, DeadLetter, LockExpired, MergeQueued, ToolApplied, ToolRejected, default_codec
from arbiter.streams.runtime.topics import ensure_topics
from tests.agents.test_sandbox_kafka import repos_file
from tests.conftest import assert_clean_audit, isolated_settings
from tests.streams.shells.test_gateway_kafka import start_worker
from tests.streams.tools.test_git_tools import make_repo, sh

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]

AGENT = """
import asyncio, json, os, subprocess, sys
from pathlib import Path
from arbiter.agents import ArbiterClient
name, files, ttl = sys.argv[1], json.loads(sys.argv[2]), float(sys.argv[3])

def git(path, *args):
    subprocess.run(["git", "-C", str(path), "-c", f"user.name={name}", "-c", f"user.email={name}@example.com",
                    *args], check=True, capture_output=True)

async def main():
    async with ArbiterClient(name) as client, client.sandbox("app", keep=True) as box:
        for path, text in files.items():
            (box.path / path).write_text(text)
            git(box.path, "add", path)
        git(box.path, "commit", "-qm", f"{name}: work")
        print(json.dumps({"ready": str(box.path)}), flush=True)
        outcome = await box.merge(f"{name}: merge", ttl=ttl, timeout=300)
        print(json.dumps({"applied": outcome.applied, "reason": outcome.reason, "result": outcome.result,
                          "diagnostic": outcome.diagnostic, "intent_id": outcome.intent_id}), flush=True)

asyncio.run(main())
"""

CHECK = """\
import json, os, sys, time
started = time.time()
time.sleep(float(sys.argv[2]))
passed = not os.path.exists("bad.txt")
with open(sys.argv[1], "a") as log:
    log.write(json.dumps({"start": started, "end": time.time(), "passed": passed, "files": sorted(os.listdir("."))})
              + "\\n")
sys.exit(0 if passed else 1)
"""


@dataclass
class Stack:
    settings: Settings
    repo: Path
    pool: WorkerPool
    checks: Path

    def agent(self, name: str, files: dict[str, str], ttl: float = 30.0) -> subprocess.Popen[str]:
        """A coding agent of its own: a process, as each Claude Code or Codex session is."""
        return subprocess.Popen([sys.executable, "-c", AGENT, name, json.dumps(files), str(ttl)],
                                env=settings_env(self.settings), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    def runner(self, depth: int = 4) -> RunnerProcess:
        return RunnerProcess(self.settings, depth=depth, trusted_agents=True).start()

    async def log(self) -> Log:
        return await read_log(self.settings)


@pytest.fixture
async def stack(bootstrap: str, tmp_path: Path, shared: Path) -> AsyncIterator[Stack]:
    repo = make_repo(tmp_path)
    checks = shared / "open" / "checks.jsonl"
    (shared / "check.py").write_text(CHECK)
    config = repos_file(tmp_path, repo, f"python3 {shared / 'check.py'} {checks} 0.8", check_timeout_seconds=60)
    settings = isolated_settings(bootstrap, tmp_path, repos_file=config)
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    await start_worker(settings, pool)
    try:
        yield Stack(settings, repo, pool, checks)
    finally:
        pool.stop()


async def answer(proc: subprocess.Popen[str], timeout: float = 240) -> dict[str, Any]:
    """The agent's merge outcome (its last line)."""
    out, err = await asyncio.wait_for(asyncio.to_thread(proc.communicate), timeout)
    assert proc.returncode == 0, err[-3000:]
    return dict(json.loads(out.strip().splitlines()[-1]))


async def ready(proc: subprocess.Popen[str]) -> str:
    """Wait for the agent's sandbox work to be committed (its first line); its sandbox's path."""
    assert proc.stdout is not None
    line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)
    assert line, proc.stderr.read() if proc.stderr else ""
    return str(json.loads(line)["ready"])


async def expired(stack: Stack, agent: str, timeout: float = 60) -> LockExpired:
    """The agent's repository lease, once the log says it lapsed."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        log = await stack.log()
        lapsed = [e.record for e in log.of(stack.settings.topics.resource_events)
                  if isinstance(e.record, LockExpired) and e.record.agent_id == agent]
        if lapsed:
            return lapsed[0]  # type: ignore[return-value]
        assert asyncio.get_running_loop().time() < deadline, f"{agent}'s lease did not lapse in {timeout} s"
        await asyncio.sleep(0.2)


async def joined(stack: Stack, count: int, timeout: float = 60) -> list[MergeQueued]:
    """The merges that joined the train, in the order they joined, once there are ``count``."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        log = await stack.log()
        queued = [e.record for e in log.of(stack.settings.topics.resource_events) if isinstance(e.record, MergeQueued)]
        if len(queued) >= count or asyncio.get_running_loop().time() > deadline:
            assert len(queued) >= count, f"{len(queued)} of {count} merges joined"
            return queued  # type: ignore[return-value]
        await asyncio.sleep(0.2)


def _most_at_once(runs: list[dict[str, Any]]) -> int:
    return max(sum(1 for other in runs if other["start"] < run["end"] and run["start"] < other["end"]) for run in runs)


async def test_agent_processes_share_one_train_land_in_join_order_and_only_the_culprit_is_evicted(
        stack: Stack) -> None:
    names = [f"coder-{i}" for i in range(4)]
    procs = {n: stack.agent(n, {f"{n}.txt": n, **({"bad.txt": "breaks"} if n == "coder-1" else {})}) for n in names}
    runner = stack.runner(depth=4)
    try:
        outcomes = {n: await answer(p) for n, p in procs.items()}
    finally:
        runner.stop()
    assert [n for n in names if outcomes[n]["applied"]] == ["coder-0", "coder-2", "coder-3"], outcomes
    culprit = outcomes["coder-1"]
    assert culprit["reason"] == "check_failed" and culprit["diagnostic"]["check"]["exit_code"] == 1, culprit
    log = await stack.log()
    events = [e.record for e in log.of(stack.settings.topics.resource_events)]
    order = [r.agent_id for r in events if isinstance(r, MergeQueued)]
    landed = [r.agent_id for r in events if isinstance(r, ToolApplied) and r.tool == "merge"]
    assert landed == [n for n in order if n != "coder-1"], (order, landed)
    first_parent = sh(stack.repo, "log", "--first-parent", "--format=%an", "main").splitlines()
    assert first_parent[:3] == landed[::-1], "main has each merge once, in the order they landed"
    assert not (stack.repo / "bad.txt").exists() and all((stack.repo / f"{n}.txt").exists() for n in landed)
    runs = [json.loads(line) for line in stack.checks.read_text().splitlines()]
    assert _most_at_once(runs) >= 2, "checks ran speculatively, at once"
    behind = [run for run in runs if "coder-3.txt" in run["files"]]
    assert len(runs) >= 4 and behind, runs
    report = await assert_clean_audit(stack.settings)
    assert report["stats"]["merges_landed"] == 3 and report["stats"]["merges_checked"] == 3, report["stats"]


async def test_a_conflict_between_processes_is_answered_with_its_paths_and_the_rebased_work_lands(
        stack: Stack) -> None:
    runner = stack.runner()
    try:
        first = stack.agent("ann", {"auth.py": "def login():\n    return 2\n"})
        second = stack.agent("bob", {"auth.py": "def login():\n    return 3\n"})
        outcomes = {"ann": await answer(first), "bob": await answer(second)}
        won = "ann" if outcomes["ann"]["applied"] else "bob"
        lost = "bob" if won == "ann" else "ann"
        assert outcomes[won]["applied"] and outcomes[lost]["reason"] == "version_conflict", outcomes
        assert outcomes[lost]["diagnostic"]["conflicts"] == ["auth.py"], outcomes[lost]
        env = settings_env(stack.settings)

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "arbiter", "sandbox", *args, "--repo", "app", "--agent", lost],
                                  env=env, capture_output=True, text=True, timeout=300)

        rebase = await asyncio.to_thread(cli, "rebase")
        assert rebase.returncode == 1 and json.loads(rebase.stdout)["conflicts"] == ["auth.py"], rebase.stdout
        listed = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "arbiter", "sandbox", "list", "--repo",
                                                          "app"], env=env, capture_output=True, text=True, check=True)
        box = next(Path(b["path"]) for b in json.loads(listed.stdout)["sandboxes"] if b["agent"] == lost)
        sh(box, "fetch", "-q", "origin", "main")
        sh(box, "reset", "-q", "--hard", "origin/main")
        (box / "auth.py").write_text("def login():\n    return 2 + 3\n")
        sh(box, "-c", "user.name=x", "-c", "user.email=x@example.com", "commit", "-qam", f"{lost}: on the new head")
        merged = await asyncio.to_thread(cli, "merge", "-m", f"{lost}: again")
        assert merged.returncode == 0 and json.loads(merged.stdout)["merged"], merged.stdout + merged.stderr
    finally:
        runner.stop()
    assert (stack.repo / "auth.py").read_text() == "def login():\n    return 2 + 3\n"
    await assert_clean_audit(stack.settings)


async def test_an_agent_that_dies_in_the_train_leaves_it_and_the_next_lands(stack: Stack) -> None:
    doomed = stack.agent("dan", {"dan.txt": "dan"}, ttl=2.0)
    await ready(doomed)
    await joined(stack, 1)
    os.killpg(doomed.pid, signal.SIGKILL)  # its process dies while its merge waits: its lease will lapse
    doomed.wait()
    await expired(stack, "dan")  # no runner yet: a runner's pass inside the lease's last 2 s would land it, rightly
    alive = stack.agent("eve", {"eve.txt": "eve"})
    runner = stack.runner()
    try:
        landed = await answer(alive)
    finally:
        runner.stop()
    assert landed["applied"], landed
    log = await stack.log()
    left = [e.record for e in log.of(stack.settings.topics.resource_events)
            if isinstance(e.record, ToolRejected) and e.record.agent_id == "dan"]
    assert [r.reason for r in left] == ["lease_not_live"], left
    assert not (stack.repo / "dan.txt").exists() and (stack.repo / "eve.txt").exists()
    await assert_clean_audit(stack.settings)


async def test_nothing_lands_without_a_runners_pass_whatever_an_agent_sends(stack: Stack) -> None:
    """No runner runs: the merge waits in its train. Verdicts forged by the agent (signed by its own key, and
    unsigned) and a merge intent that claims a check (as the HTTP API takes one) are refused or ignored:
    main does not move. Then a runner checks it, and it lands."""
    settings = stack.settings
    waiting = stack.agent("fay", {"fay.txt": "fay"})
    await ready(waiting)
    (queued,) = await joined(stack, 1)
    head = sh(stack.repo, "rev-parse", "main")
    fay = await ensure_identity(settings, "fay")
    lie = CheckVerdict(verdict_id="forged", runner_id="fay", resource="repo:app", intent_id=queued.intent_id,
                       base=head, commit="0" * 40, tree="0" * 40, check_digest=queued.check_digest or "",
                       passed=True, exit_code=0, stopped="", output_digest="", output_bytes=0, output_tail="",
                       seconds_ms=0, at_ms=now_ms())
    codec = default_codec(settings.max_message_bytes)
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all")
    await producer.start()
    try:
        for signer, verdict in ((fay, lie), (None, lie.model_copy(update={"verdict_id": "forged-2",
                                                                          "runner_id": "runner"}))):
            value = codec.encode(verdict)
            headers = signer.sign(settings.topics.resource_commands, b"repo:app", value, now_ms()) if signer else None
            await producer.send_and_wait(settings.topics.resource_commands, value, key=b"repo:app", headers=headers)
    finally:
        await producer.stop()
    deadline = asyncio.get_running_loop().time() + 60
    while True:
        log = await stack.log()
        letters = [e.record.reason for e in log.of(settings.topics.dead_letter) if isinstance(e.record, DeadLetter)]
        if len(letters) >= 2 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.2)
    assert sorted(letters) == ["forbidden", "unauthenticated"], letters
    assert not any(isinstance(e.record, ToolApplied) and e.record.tool == "merge"
                   for e in log.of(settings.topics.resource_events)), "a forged verdict landed a merge"
    assert sh(stack.repo, "rev-parse", "main") == head
    runner = stack.runner()
    try:
        landed = await answer(waiting)
    finally:
        runner.stop()
    assert landed["applied"] and landed["result"]["verdict"] not in ("forged", "forged-2"), landed
    await assert_clean_audit(settings)


async def test_a_runner_started_before_its_repository_exists_checks_it_once_it_does(stack: Stack) -> None:
    """A repository the runner cannot read yet (or that git fails on) is tried again, and stops no other."""
    aside = stack.repo.with_name("app-not-yet")
    stack.repo.rename(aside)
    runner = stack.runner()
    try:
        assert runner.log is not None
        deadline = asyncio.get_running_loop().time() + 60
        while "checks repo:app" not in runner.log.read_text():
            assert runner.proc is not None and runner.proc.poll() is None, runner.log.read_text()[-3000:]
            assert asyncio.get_running_loop().time() < deadline, runner.log.read_text()[-3000:]
            await asyncio.sleep(0.1)
        aside.rename(stack.repo)
        outcome = await answer(stack.agent("late", {"late.txt": "late"}))
        assert outcome["applied"], outcome
        assert runner.proc is not None and runner.proc.poll() is None, "the runner is still running"
    finally:
        runner.stop()
    assert (stack.repo / "late.txt").exists()
    await assert_clean_audit(stack.settings)


def _checks_running(stack: Stack) -> list[int]:
    """The pids of the stack's check command running now (from /proc: what a runner left behind is here)."""
    script = str(stack.checks.parent.parent / "check.py").encode()
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                    if script in cmdline.read():
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


async def _until(condition: Any, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await asyncio.to_thread(condition):
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.05)


async def test_a_runner_killed_mid_check_leaves_nothing_running_and_the_next_runner_lands_the_merge_once(
        stack: Stack) -> None:
    """A runner killed (SIGKILL) while its check runs: the check dies with it (nothing runs on past its limits
    with nobody to stop it), and a runner started after reads the train from the log and lands the merge
    once, on a check of its own."""
    agent = stack.agent("ann", {"ann.txt": "ann"})
    await ready(agent)
    await joined(stack, 1)
    runner = stack.runner(depth=1)
    await _until(lambda: _checks_running(stack), 60, "the runner never started the check")
    runner.kill()
    await _until(lambda: not _checks_running(stack), 10, "the check outlived its runner")
    second = stack.runner(depth=1)
    try:
        outcome = await answer(agent)
    finally:
        second.stop()
    assert outcome["applied"], outcome
    assert sh(stack.repo, "log", "--first-parent", "--format=%s", "main").splitlines()[0] == "ann: merge"
    runs = [json.loads(line) for line in stack.checks.read_text().splitlines()]
    assert len(runs) == 1 and runs[0]["passed"], "only the second runner's check ran to its end"
    report = await assert_clean_audit(stack.settings)
    assert report["stats"]["merges_landed"] == 1, report["stats"]
