"""A coding agent's sandbox: its own git worktree of a repository, merged back through the gateway.

``async with client.sandbox("app") as box`` asks the worker to make the agent's worktree (branch
``arbiter/<agent>``) and gives its ``path`` and ``base`` commit. The agent edits and commits there as
it likes; ``box.merge(message)`` queues for the repository's lease (``repo:<name>``: the merge
queue), runs the repository's check (the operator's configuration, never the caller's) on the merge
result in a scratch folder while it holds the lease, and sends the merge intent with its fencing token.
A conflict comes back as ``version_conflict`` with the paths; ``box.rebase()`` rebases the sandbox onto
the new head and names what conflicts.
``box.merge(message, train=train)`` joins a ``MergeTrain`` (``arbiter.agents.train``) instead: checked
speculatively with the merges ahead of it, landed in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from arbiter.agents.errors import SandboxRefused
from arbiter.agents.leases import Lease
from arbiter.agents.outcomes import Outcome
from arbiter.edge.settings import Repository
from arbiter.streams.tools.checks import CheckResult, run_check
from arbiter.streams.tools.git import git


class SandboxHost(Protocol):
    """What a ``Sandbox`` needs from the client that runs it (``ArbiterClient`` is one); kept here, below
    the client, so this module never imports it."""

    async def execute(self, lease: Lease | str, tool: str, args: dict[str, Any], *,
                      intent_id: str | None = ...) -> Outcome: ...

    def lease(self, resource: str, *, ttl: float = ..., mode: str = ..., wait: float = ...
              ) -> AbstractAsyncContextManager[Lease]: ...

class Train(Protocol):
    """What ``Sandbox.merge(train=...)`` hands a merge to (``MergeTrain`` is one)."""

    async def merge(self, box: Sandbox, message: str, *, strategy: str = ..., intent_id: str | None = ...
                    ) -> Outcome: ...


@dataclass
class Sandbox:
    """One agent's worktree of one repository."""

    client: SandboxHost
    repository: str
    """The resource: ``repo:<name>``."""
    path: Path
    branch: str
    base: str
    """The commit the sandbox started from."""
    target: str = "main"
    config: Repository | None = None
    """The repository as this process's operator configured it (its check); None: not configured here."""
    check_user: str = ""
    merged: list[Outcome] = field(default_factory=list)

    async def _git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(git, self.path, *args, check=check)

    async def head(self) -> str:
        """The target branch's head commit as this machine's repository has it."""
        return (await self._git("rev-parse", "--verify", f"refs/heads/{self.target}")).stdout.strip()

    async def merge(self, message: str, *, strategy: str = "merge", ttl: float = 60.0, wait: float = 600.0,
                    intent_id: str | None = None, train: Train | None = None) -> Outcome:
        """Merge this sandbox's branch into the target, in the repository's queue.

        Holds the lease on the repository (renewed while it works) so nothing else merges meanwhile. When
        the operator configured a check for the repository (``repos.toml``), the merge result is built in a
        scratch folder and the check run there first (``arbiter.streams.tools.checks``): a failing check
        ends with an outcome ``check_failed`` (its output in the diagnostic) and merges nothing. The merge
        that lands is the tree that was checked (``expect_tree``), or none. No caller names a command.

        With ``train`` (a ``MergeTrain``), the merge joins that speculative queue instead: checked in
        parallel with the merges ahead of it, landed in order.
        """
        if train is not None:
            return await train.merge(self, message, strategy=strategy, intent_id=intent_id)
        async with self.client.lease(self.repository, ttl=ttl, wait=wait, mode="exclusive") as lease:
            expect, result = None, None
            if self.config is not None and self.config.check is not None:
                expect = await self.head()
                result = await self.run_check(expect, strategy)
                if result is not None and not result.passed:
                    return check_failed(intent_id or "", self.repository, result)
            args: dict[str, Any] = {"message": message, "target": self.target, "strategy": strategy,
                                    "base": self.base, "expect_head": expect}
            if result is not None:
                args |= {"expect_tree": result.tree, "check": result.command[:2000]}
            outcome = await self.client.execute(lease, "merge", args, intent_id=intent_id)
        if outcome.applied:
            self.merged.append(outcome)
        return outcome

    async def run_check(self, head: str, strategy: str = "merge") -> CheckResult | None:
        """Run the repository's check on the merge of this branch into ``head``, in a scratch folder; None
        when the merge conflicts (the worker will say so, with the paths)."""
        assert self.config is not None
        candidate = await asyncio.to_thread(self.candidate, head, strategy)
        if candidate is None:
            return None
        return await run_check(self.path, candidate[1], self.config, check_user=self.check_user)

    def candidate(self, head: str, strategy: str = "merge") -> tuple[str, str] | None:
        """(tree, commit) of what merging this branch into commit ``head`` would give, as the merge tool
        builds it; None when it conflicts or brings nothing (the tool says which). Blocking."""
        work = git(self.path, "rev-parse", "--verify", f"refs/heads/{self.branch}^{{commit}}").stdout.strip()
        if git(self.path, "merge-base", "--is-ancestor", work, head, check=False).returncode == 0:
            return None
        if strategy == "ff" and git(self.path, "merge-base", "--is-ancestor", head, work, check=False).returncode == 0:
            return git(self.path, "rev-parse", f"{work}^{{tree}}").stdout.strip(), work
        done = git(self.path, "merge-tree", "--write-tree", head, work, check=False)
        if done.returncode != 0:
            return None
        tree = done.stdout.split()[0]
        commit = git(self.path, "commit-tree", tree, "-p", head, "-p", work, stdin="arbiter check\n").stdout.strip()
        return tree, commit

    async def claim(self, paths: Sequence[str], *, ttl: float = 30.0, wait: float = 600.0) -> list[dict[str, Any]]:
        """Announce the paths this agent works on (globs: ``src/auth/**``), replacing its earlier claim;
        ``[]`` withdraws it. Returns the other agents' claims that overlap (``agent``, ``claims``,
        ``paths``). Claims block nothing: they are for an agent to see before it starts, and a merge
        conflict names the claims over its paths."""
        async with self.client.lease(self.repository, ttl=ttl, wait=wait) as lease:
            outcome = await self.client.execute(lease, "claim", {"paths": list(paths)})
        if not outcome.applied:
            raise SandboxRefused(outcome)
        return list(outcome.result["overlapping"])

    async def rebase(self) -> list[str]:
        """Rebase the sandbox onto the target's head. Returns the conflicting paths ([]: done); on a
        conflict the rebase is aborted and the sandbox is as it was."""
        head = await self.head()
        done = await self._git("rebase", head, check=False)
        if done.returncode == 0:
            self.base = head
            return []
        paths = (await self._git("diff", "--name-only", "--diff-filter=U", check=False)).stdout.split()
        await self._git("rebase", "--abort", check=False)
        return sorted(paths) or ["(rebase failed: " + (done.stderr or done.stdout).strip()[:300] + ")"]

    async def commits(self) -> int:
        """How many commits the sandbox has that the target lacks."""
        done = await self._git("rev-list", "--count", f"refs/heads/{self.target}..{self.branch}")
        return int(done.stdout.strip() or 0)


def check_failed(intent_id: str, repository: str, result: CheckResult) -> Outcome:
    """The outcome of a merge whose check failed: nothing merged; the output in the diagnostic."""
    return Outcome(intent_id, repository, "merge", False, reason="check_failed",
                   diagnostic={"reason": "check_failed", "check": result.to_dict(),
                               "what_to_do": "Fix what the check reports in the sandbox, commit, and merge again."})


def repository_config(settings: Any, resource: str) -> tuple[Repository | None, str]:
    """The repository's configuration in ``settings`` (this process's), and the check user (None: none)."""
    if settings is None:
        return None, ""
    return settings.repositories().get(resource.removeprefix("repo:")), settings.check_user


async def open_sandbox(client: SandboxHost, repository: str, base: str, ttl: float, wait: float) -> Sandbox:
    """Ask the worker to make the agent's sandbox (under the repository's lease)."""
    resource = repository if repository.startswith("repo:") else f"repo:{repository}"
    async with client.lease(resource, ttl=ttl, wait=wait) as lease:
        outcome = await client.execute(lease, "sandbox_create", {"base": base})
    if not outcome.applied:
        raise SandboxRefused(outcome)
    result = outcome.result
    config, user = repository_config(getattr(client, "settings", None), resource)
    return Sandbox(client, resource, Path(result["path"]), result["branch"], result["base"], target=base,
                   config=config, check_user=user)


async def discard_sandbox(box: Sandbox, ttl: float = 30.0, wait: float = 600.0) -> Outcome:
    """Ask the worker to remove the sandbox's worktree and branch."""
    async with box.client.lease(box.repository, ttl=ttl, wait=wait) as lease:
        return await box.client.execute(lease, "sandbox_discard", {})


@contextlib.asynccontextmanager
async def sandbox(client: SandboxHost, repository: str, base: str = "main", *, keep: bool | None = None,
                  ttl: float = 60.0, wait: float = 600.0) -> AsyncIterator[Sandbox]:
    """``async with client.sandbox("app") as box``: the agent's worktree for the block. On leaving, it is
    discarded when everything in it was merged (or it has nothing); kept otherwise, so no work is lost
    (``keep=True`` always keeps it, ``keep=False`` always discards it)."""
    box = await open_sandbox(client, repository, base, ttl, wait)
    try:
        yield box
    finally:
        unmerged = await box.commits() if keep is None else 0
        if keep is False or (keep is None and unmerged == 0):
            await discard_sandbox(box, wait=wait)
