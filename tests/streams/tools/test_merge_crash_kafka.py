"""A repository host killed (with its git) at every step of a merge's landing, against a real worker and real
git: after a restart the merge is landed once or not at all, the main checkout matches its branch, no stale
lock is left, the next merge needs nobody, and the audit passes on the log."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from arbiter.agents import ArbiterClient
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool
from arbiter.streams.runtime.topics import ensure_topics
from arbiter.streams.tools.merges import STEPS
from tests.agents.test_sandbox_kafka import repos_file
from tests.conftest import assert_clean_audit, isolated_settings
from tests.streams.shells.test_gateway_kafka import start_worker
from tests.streams.tools.test_git_tools import commit, make_repo, sh

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]

FAILPOINTS = [f"merge_{step}" for step in STEPS] + ["crash_after_tool"]
"""Each step of a landing (journal written; inside git's ref transaction; branch moved; checkout synced), and
after the landing, before its answer is recorded."""


def _locks(repo: Path) -> list[str]:
    return sorted(str(p.relative_to(repo / ".git")) for p in (repo / ".git").rglob("*.lock"))


async def _merge(client: ArbiterClient, intent_id: str) -> object:
    lease = await client.acquire("repo:app", ttl=120, wait=30, mode="shared")
    return await client.execute(lease, "merge", {"message": f"{client.agent_id}: merge"}, intent_id=intent_id,
                                timeout=180)


@pytest.mark.parametrize("failpoint", FAILPOINTS)
async def test_a_host_killed_at_any_step_of_a_merge_ends_merged_once_with_the_checkout_in_step(
        bootstrap: str, tmp_path: Path, failpoint: str) -> None:
    repo = make_repo(tmp_path)
    settings: Settings = isolated_settings(bootstrap, tmp_path, repos_file=repos_file(tmp_path, repo), partitions=1)
    await ensure_topics(settings)
    intent = f"crash-{uuid.uuid4().hex}"
    pool = WorkerPool(settings)
    await start_worker(settings, pool, {"ARBITER_FAILPOINT": f"{failpoint}:{intent}"})
    try:
        async with ArbiterClient("eve", settings) as eve, eve.sandbox("app", keep=True) as box:
            commit(box.path, "x.py", "x = 1\n", "eve: x")
            head = sh(repo, "rev-parse", "main")
            pending = asyncio.create_task(_merge(eve, intent))
            crashed = pool.workers[0].proc
            await asyncio.wait_for(asyncio.to_thread(crashed.wait), 90)
            assert crashed.returncode == -9, "the failpoint should have killed the worker"
            journal = repo / ".git" / "arbiter" / "landing.json"
            if failpoint != "crash_after_tool":
                assert journal.exists(), "killed mid-landing: its journal is there for the next host"
            if failpoint == "merge_prepared":
                assert "refs/heads/main.lock" in _locks(repo), "killed inside git's ref transaction"
                assert sh(repo, "rev-parse", "main") == head
            if failpoint == "merge_moved":
                assert sh(repo, "rev-parse", "main") != head and sh(repo, "status", "--porcelain"), \
                    "the branch moved and the checkout did not follow: what a person had to repair"
                # A checkout killed midway leaves git's index lock too: the next host clears it, not a person.
                (repo / ".git" / "index.lock").write_text("")
            pool.workers.clear()
            pool.start(1)  # no failpoint: the landing is decided again
            outcome = await asyncio.wait_for(pending, 180)
            assert outcome.applied, outcome.diagnostic["error"]  # type: ignore[attr-defined]
            merged = outcome.result["head"]  # type: ignore[attr-defined]
            assert sh(repo, "rev-parse", "main") == merged
            assert sh(repo, "rev-list", "--first-parent", "--count", f"{head}..main") == "1", "merged once"
            assert sh(repo, "status", "--porcelain") == "" and (repo / "x.py").read_text() == "x = 1\n", \
                "the main checkout matches its branch"
            assert _locks(repo) == [] and not journal.exists()
        async with ArbiterClient("fay", settings) as fay, fay.sandbox("app", keep=True) as other:
            commit(other.path, "y.py", "y = 1\n", "fay: y")
            nxt = await other.merge("fay: next", timeout=120)
            assert nxt.applied, nxt.diagnostic
            assert sh(repo, "status", "--porcelain") == "" and (repo / "y.py").exists()
        await assert_clean_audit(settings)
    finally:
        pool.stop()


@pytest.mark.parametrize("failpoint", ["merge_prepared", "merge_moved"])
async def test_a_host_killed_landing_a_checked_merge_lands_it_once_on_its_verdict(
        bootstrap: str, tmp_path: Path, failpoint: str) -> None:
    """The landing a runner's verdict started is decided again from the log after the crash: the verdict's
    input is redelivered, and what lands is still the commit it checked, once."""
    from arbiter.processes import RunnerProcess

    repo = make_repo(tmp_path)
    settings = isolated_settings(bootstrap, tmp_path, repos_file=repos_file(tmp_path, repo, "test -f x.py"),
                                 partitions=1)
    await ensure_topics(settings)
    intent = f"crash-{uuid.uuid4().hex}"
    pool = WorkerPool(settings)
    await start_worker(settings, pool, {"ARBITER_FAILPOINT": f"{failpoint}:{intent}"})
    runner = RunnerProcess(settings, trusted_agents=True).start()
    try:
        async with ArbiterClient("eve", settings) as eve, eve.sandbox("app", keep=True) as box:
            commit(box.path, "x.py", "x = 1\n", "eve: x")
            head = sh(repo, "rev-parse", "main")
            pending = asyncio.create_task(_merge(eve, intent))
            crashed = pool.workers[0].proc
            await asyncio.wait_for(asyncio.to_thread(crashed.wait), 90)
            assert crashed.returncode == -9
            pool.workers.clear()
            pool.start(1)
            outcome = await asyncio.wait_for(pending, 180)
            assert outcome.applied, outcome.diagnostic  # type: ignore[attr-defined]
            assert sh(repo, "rev-list", "--first-parent", "--count", f"{head}..main") == "1"
            assert sh(repo, "status", "--porcelain") == "" and _locks(repo) == []
        report = await assert_clean_audit(settings)
        assert report["stats"]["merges_checked"] == 1, report["stats"]
    finally:
        runner.stop()
        pool.stop()
