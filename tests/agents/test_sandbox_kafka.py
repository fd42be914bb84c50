"""Coding agents end to end: each in its own git worktree, merging through a real worker in the
repository's lease order, on real repositories made by the tests; the audit passes on each log."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from arbiter.agents import ArbiterClient, SandboxRefused
from arbiter.edge.settings import Settings
from arbiter.processes import RunnerProcess, WorkerPool
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import assert_clean_audit, isolated_settings
from tests.streams.shells.test_gateway_kafka import start_worker
from tests.streams.tools.test_git_tools import commit, make_repo, sh

pytestmark = pytest.mark.kafka


def repos_file(home: Path, repo: Path, check: str | None = None, **options: object) -> Path:
    """The operator's configuration of ``app`` at ``repo``, with its check."""
    lines = ["[repos.app]", f"path = {json.dumps(str(repo))}"]
    if check is not None:
        lines.append(f"check = {json.dumps(check)}")
    lines += [f"{name} = {json.dumps(value)}" for name, value in options.items()]
    path = home / "repos.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


async def _stack(bootstrap: str, tmp_path: Path, env: dict[str, str] | None = None,
                 partitions: int = 2, check: str | None = None) -> tuple[Settings, WorkerPool, Path]:
    repo = make_repo(tmp_path)
    settings = isolated_settings(bootstrap, tmp_path, repos_file=repos_file(tmp_path, repo, check),
                                 partitions=partitions)
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    await start_worker(settings, pool, env)
    return settings, pool, repo


@pytest.fixture
async def stack(bootstrap: str, tmp_path: Path, request: pytest.FixtureRequest
                ) -> AsyncIterator[tuple[Settings, Path]]:
    """A worker serving ``app``; a test marked ``repository_check(command)`` configures that check, and a
    check runner runs it."""
    marker = request.node.get_closest_marker("repository_check")
    settings, pool, repo = await _stack(bootstrap, tmp_path, check=marker.args[0] if marker else None)
    runner = RunnerProcess(settings, trusted_agents=True).start() if marker else None
    try:
        yield settings, repo
    finally:
        if runner is not None:
            runner.stop()
        pool.stop()


async def test_agents_merge_in_queue_order_each_once_and_a_second_sandbox_is_refused(
        stack: tuple[Settings, Path]) -> None:
    settings, repo = stack
    agents = [f"coder-{i}" for i in range(3)]

    async def work(name: str) -> str:
        async with ArbiterClient(name, settings) as client, client.sandbox("app") as box:
            with pytest.raises(SandboxRefused, match="already"):
                async with client.sandbox("app"):
                    pass
            commit(box.path, f"{name}.txt", f"{name}\n", f"{name}: its own file")
            outcome = await box.merge(f"{name}: merge")
            assert outcome.applied, outcome.diagnostic
            return str(outcome.result["head"])

    heads = await asyncio.gather(*(work(name) for name in agents))
    log = sh(repo, "log", "--first-parent", "--format=%H %s", "main").splitlines()
    merged = [line.split(" ", 1) for line in log[:3]]
    assert {h for h, _ in merged} == set(heads), "each merge moved main once, one after another"
    assert all((repo / f"{name}.txt").read_text() == f"{name}\n" for name in agents)
    assert sh(repo, "worktree", "list").count("\n") == 0, "merged sandboxes are discarded on leaving"
    await assert_clean_audit(settings)


async def test_a_conflict_names_its_paths_the_rebase_says_so_and_the_redone_work_merges(
        stack: tuple[Settings, Path]) -> None:
    settings, repo = stack
    async with ArbiterClient("ann", settings) as ann, ArbiterClient("bob", settings) as bob, \
            ann.sandbox("app") as a, bob.sandbox("app") as b:
        assert await a.claim(["auth.py"]) == []
        seen = await b.claim(["*.py"])  # before bob starts: ann works there
        assert [c["agent"] for c in seen] == ["ann"], seen
        await b.claim([])
        commit(a.path, "auth.py", "def login():\n    return 2\n", "ann: login returns 2")
        commit(b.path, "auth.py", "def login():\n    return 3\n", "bob: login returns 3")
        assert (await a.merge("ann")).applied
        conflict = await b.merge("bob")
        assert not conflict.applied and conflict.reason == "version_conflict", conflict.diagnostic
        assert conflict.diagnostic["conflicts"] == ["auth.py"]
        assert [c["agent"] for c in conflict.diagnostic["claimed_by"]] == ["ann"]
        assert "ann: login returns 2" in [c["subject"] for c in conflict.diagnostic["landed"]]
        assert await b.rebase() == ["auth.py"]
        sh(b.path, "reset", "-q", "--hard", await b.head())  # bob redoes his change on the new head
        commit(b.path, "auth.py", "def login():\n    return 2 + 3\n", "bob: on top of ann")
        assert await b.rebase() == []
        assert (await b.merge("bob, again")).applied
    assert (repo / "auth.py").read_text() == "def login():\n    return 2 + 3\n"
    await assert_clean_audit(settings)


@pytest.mark.repository_check("python3 broken.py && echo fine")
async def test_a_failing_check_merges_nothing_and_a_passing_one_merges(stack: tuple[Settings, Path]) -> None:
    settings, repo = stack
    head = sh(repo, "rev-parse", "main")
    async with ArbiterClient("cat", settings) as cat, cat.sandbox("app", keep=False) as box:
        commit(box.path, "broken.py", "raise SystemExit(3)\n", "cat: breaks the build")
        failed = await box.merge("cat")
        assert not failed.applied and failed.reason == "check_failed"
        assert failed.diagnostic["check"]["exit_code"] == 3
        assert failed.diagnostic["check"]["command"] == "python3 broken.py && echo fine"
        assert sh(repo, "rev-parse", "main") == head, "nothing merged"
        commit(box.path, "broken.py", "print('fixed')\n", "cat: fixes it")
        passed = await box.merge("cat")
        assert passed.applied and passed.result["checked"] == "python3 broken.py && echo fine", passed.diagnostic
    await assert_clean_audit(settings)


async def test_a_saga_reverts_its_merge_and_a_dead_lease_cannot_merge(stack: tuple[Settings, Path]) -> None:
    settings, repo = stack
    async with ArbiterClient("dan", settings) as dan, dan.sandbox("app", keep=True) as box:
        commit(box.path, "feature.py", "on = True\n", "dan: feature")
        with pytest.raises(RuntimeError, match="changed my mind"):
            async with dan.saga("ship") as saga:
                async with dan.lease("repo:app", ttl=30) as lease:
                    await saga.step(lease, "merge", {"message": "dan: ship", "base": box.base},
                                    compensate=lambda done: ("revert_merge", {"merge_intent_id": done.intent_id}))
                assert (repo / "feature.py").exists()
                raise RuntimeError("changed my mind")
        assert not (repo / "feature.py").exists(), "the saga's undo reverted the merge"
        assert sh(repo, "log", "-1", "--format=%s", "main").startswith("Revert")
        # A zombie: its lease expired while it thought; its merge is refused and merges nothing.
        head = sh(repo, "rev-parse", "main")
        commit(box.path, "late.py", "late = 1\n", "dan: late")
        stale = await dan.acquire("repo:app", ttl=0.3, wait=10)
        await asyncio.sleep(0.6)
        zombie = await dan.execute(stale, "merge", {"message": "dan: late"})
        assert not zombie.applied and zombie.reason in ("lease_not_live", "stale_fencing_token"), zombie.reason
        assert sh(repo, "rev-parse", "main") == head
        # The same intent twice merges once.
        async with dan.lease("repo:app", ttl=30) as lease:
            intent = uuid.uuid4().hex
            first = await dan.execute(lease, "merge", {"message": "dan: late, live"}, intent_id=intent)
            again = await dan.execute(lease, "merge", {"message": "dan: late, live"}, intent_id=intent)
        assert first.applied and again.applied and again.result["head"] == first.result["head"]
        assert sh(repo, "rev-list", "--first-parent", "--count", f"{head}..main") == "1"
    await assert_clean_audit(settings)


def test_the_repository_setting_is_checked(tmp_path: Path) -> None:
    assert Settings(repos=f"app={tmp_path}").repositories()["app"].path == tmp_path
    with pytest.raises(ValueError, match="name=path"):
        Settings(repos="app")
    with pytest.raises(ValueError, match="letters, digits"):
        Settings(repos="a b=/x")
    assert Settings(repos=f"app={tmp_path}, docs=/src/docs").parse_repos(f"app={tmp_path}") == {"app": tmp_path}
    assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0


async def test_the_cli_answers_one_object_refuses_a_second_sandbox_and_collects_a_revoked_agents(
        stack: tuple[Settings, Path]) -> None:
    import json

    from arbiter.agents.identities import Registrar
    from arbiter.processes import settings_env

    settings, repo = stack
    env = {**settings_env(settings), "ARBITER_AUTO_ENROLL": "false"}
    await Registrar(settings).add("fay")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        import sys

        return subprocess.run([sys.executable, "-m", "arbiter", "sandbox", *args], env=env, capture_output=True,
                              text=True, timeout=120)

    made = await asyncio.to_thread(cli, "create", "--repo", str(repo), "--agent", "fay")  # by path, too
    assert made.returncode == 0, made.stderr
    again = await asyncio.to_thread(cli, "create", "--repo", "app", "--agent", "fay")
    assert again.returncode == 1 and "already" in json.loads(again.stdout)["error"], again.stdout
    nothing = await asyncio.to_thread(cli, "merge", "--repo", "app", "--agent", "fay", "-m", "empty")
    assert nothing.returncode == 1 and "nothing to merge" in json.loads(nothing.stdout)["error"]
    claims = await asyncio.to_thread(cli, "claims", "--repo", "app", "--paths", "src/x.py")
    assert claims.returncode == 0 and json.loads(claims.stdout)["overlapping"] == [], claims.stdout
    unknown = await asyncio.to_thread(cli, "list", "--repo", "nope")
    assert unknown.returncode == 1 and "no repository 'nope'" in unknown.stderr
    await Registrar(settings).revoke("fay", "left")
    listed = await asyncio.to_thread(cli, "gc", "--repo", "app")
    assert [b["agent"] for b in json.loads(listed.stdout)["gone"]] == ["fay"] and "would remove" in listed.stderr
    sandbox = Path(json.loads(made.stdout)["path"])
    assert await asyncio.to_thread(sandbox.is_dir), "listed, not removed"
    removed = await asyncio.to_thread(cli, "gc", "--repo", "app", "--yes")
    assert removed.returncode == 0 and not await asyncio.to_thread(sandbox.exists)


async def test_claude_codes_worktree_hook_gets_only_the_sandbox_path(stack: tuple[Settings, Path]) -> None:
    """The WorktreeCreate hook's contract: a JSON payload on stdin, only the worktree's absolute path on stdout."""
    import json
    import sys

    from arbiter.agents.identities import Registrar
    from arbiter.processes import settings_env

    settings, repo = stack
    env = {**settings_env(settings), "ARBITER_AUTO_ENROLL": "false"}
    await Registrar(settings).add("claude-1")
    payload = {"hook_event_name": "WorktreeCreate", "session_id": "s-1", "name": "feature-x",
               "cwd": str(repo), "transcript_path": "/dev/null"}

    def hook(stdin: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "arbiter", "sandbox", "hook", "--agent", "claude-1"], env=env,
                              input=stdin, capture_output=True, text=True, timeout=120)

    made = await asyncio.to_thread(hook, json.dumps(payload))
    assert made.returncode == 0, made.stderr
    lines = made.stdout.splitlines()
    assert len(lines) == 1 and Path(lines[0]).is_absolute(), made.stdout
    assert sh(Path(lines[0]), "rev-parse", "--abbrev-ref", "HEAD") == "arbiter/claude-1"
    bad = await asyncio.to_thread(hook, "not json")
    assert bad.returncode == 1 and bad.stdout == "" and "not JSON" in bad.stderr
    again = await asyncio.to_thread(hook, json.dumps(payload))
    assert again.returncode == 1 and again.stdout == "" and "already" in again.stderr


async def test_a_cli_conflict_names_what_landed_and_the_cli_rebases(stack: tuple[Settings, Path]) -> None:
    """From a shell: the conflict lists the merge that landed since the sandbox's base (it answered [] when
    the CLI sent no base), its advice names a rebase the CLI has, and ``arbiter sandbox rebase`` does it."""
    import sys

    from arbiter.agents.identities import Registrar
    from arbiter.processes import settings_env

    settings, _ = stack
    env = {**settings_env(settings), "ARBITER_AUTO_ENROLL": "false"}
    for name in ("fay", "gus"):
        await Registrar(settings).add(name)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "arbiter", "sandbox", *args], env=env, capture_output=True,
                              text=True, timeout=120)

    boxes = {}
    for name in ("fay", "gus"):
        made = await asyncio.to_thread(cli, "create", "--repo", "app", "--agent", name)
        assert made.returncode == 0, made.stderr
        boxes[name] = Path(json.loads(made.stdout)["path"])
        commit(boxes[name], "auth.py", f"def login():\n    return '{name}'\n", f"{name}: login")
    assert (await asyncio.to_thread(cli, "merge", "--repo", "app", "--agent", "fay", "-m", "fay")).returncode == 0
    conflict = await asyncio.to_thread(cli, "merge", "--repo", "app", "--agent", "gus", "-m", "gus")
    answer = json.loads(conflict.stdout)
    assert conflict.returncode == 1 and answer["reason"] == "version_conflict" and answer["conflicts"] == ["auth.py"]
    assert "fay: login" in [c["subject"] for c in answer["landed"]], answer["landed"]
    assert "arbiter sandbox rebase" in answer["advice"], answer["advice"]
    rebase = await asyncio.to_thread(cli, "rebase", "--repo", "app", "--agent", "gus")
    assert rebase.returncode == 1 and json.loads(rebase.stdout)["conflicts"] == ["auth.py"], rebase.stdout
    assert sh(boxes["gus"], "status", "--porcelain") == "", "the rebase was undone"
    sh(boxes["gus"], "fetch", "-q", "origin", "main")
    sh(boxes["gus"], "reset", "-q", "--hard", "origin/main")
    commit(boxes["gus"], "gus.txt", "gus\n", "gus: on the new head")
    rebased = await asyncio.to_thread(cli, "rebase", "--repo", "app", "--agent", "gus")
    assert rebased.returncode == 0 and json.loads(rebased.stdout)["rebased"], rebased.stdout
    merged = await asyncio.to_thread(cli, "merge", "--repo", "app", "--agent", "gus", "-m", "gus, again")
    assert merged.returncode == 0, merged.stdout
