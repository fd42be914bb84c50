"""A coding agent's sandbox: its own clone of a repository, merged back through its train.

``async with client.sandbox("app") as box`` asks the repository host (a worker) to make the agent's
sandbox (a clone on branch ``arbiter/<agent>``) and gives its ``path`` and ``base`` commit. The agent edits and
commits there as it likes; ``box.merge(message)`` joins the repository's train (``repo:<name>``: one train
for every process, in the log) under a shared lease the client renews while it waits, and returns when
the merge landed or was refused: a runner checked it on top of the merges ahead of it, and the host landed
exactly what passed. A conflict comes back as ``version_conflict`` with the paths; ``box.rebase()``
rebases the sandbox onto the new head and names what conflicts.

The sandbox is a folder on the repository host's disk: an agent that edits it shares that disk (the
docs' roles say how), and this module's git runs there only, in the agent's own process; the merge, its
check and the landing are the host's and the runner's.
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
from arbiter.streams.tools.git import git

MERGE_TIMEOUT = 3600.0
"""Seconds a merge waits for its answer by default: its check, and the checks of the merges ahead of it."""


class SandboxHost(Protocol):
    """What a ``Sandbox`` needs from the client that runs it (``ArbiterClient`` is one); kept here, below
    the client, so this module never imports it."""

    async def execute(self, lease: Lease | str, tool: str, args: dict[str, Any], *,
                      intent_id: str | None = ..., timeout: float = ...) -> Outcome: ...

    def lease(self, resource: str, *, ttl: float = ..., mode: str = ..., wait: float = ...
              ) -> AbstractAsyncContextManager[Lease]: ...

@dataclass
class Sandbox:
    """One agent's sandbox of one repository."""

    client: SandboxHost
    repository: str
    """The resource: ``repo:<name>``."""
    path: Path
    branch: str
    base: str
    """The commit the sandbox started from."""
    target: str = "main"
    merged: list[Outcome] = field(default_factory=list)

    async def _git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return await asyncio.to_thread(git, self.path, *args, check=check)

    async def head(self) -> str:
        """The target branch's head commit as the repository has it now (fetched from ``origin``, the
        repository the sandbox was cloned from)."""
        fetched = await self._git("fetch", "--quiet", "--no-tags", "origin",
                                  f"+refs/heads/{self.target}:refs/remotes/origin/{self.target}", check=False)
        ref = f"refs/remotes/origin/{self.target}" if fetched.returncode == 0 else f"refs/heads/{self.target}"
        return (await self._git("rev-parse", "--verify", ref)).stdout.strip()

    @property
    def here(self) -> bool:
        """Whether the sandbox's folder is on this machine (an agent through a front door may be elsewhere)."""
        return (self.path / ".git").exists()

    async def merge(self, message: str, *, strategy: str = "merge", ttl: float = 60.0, wait: float = 600.0,
                    intent_id: str | None = None, timeout: float = MERGE_TIMEOUT) -> Outcome:
        """Merge this sandbox's branch into the target through the repository's train; the outcome once it
        landed (``result``: the new head and tree, the verdict it landed on) or was refused (``check_failed``
        with the check's output, ``version_conflict`` with the paths, ...).

        Joins under a shared lease on the repository, renewed while it waits (``ttl``): if this process dies,
        the lease lapses and the merge leaves the train. ``timeout``: how long to wait for the answer."""
        async with self.client.lease(self.repository, ttl=ttl, wait=wait, mode="shared") as lease:
            args: dict[str, Any] = {"message": message, "target": self.target, "strategy": strategy}
            if self.base:
                args["base"] = self.base
            outcome = await self.client.execute(lease, "merge", args, intent_id=intent_id, timeout=timeout)
        if outcome.applied:
            self.merged.append(outcome)
        return outcome

    async def claim(self, paths: Sequence[str], *, ttl: float = 30.0, wait: float = 600.0) -> list[dict[str, Any]]:
        """Announce the paths this agent works on (globs: ``src/auth/**``), replacing its earlier claim;
        ``[]`` withdraws it. Returns the other agents' claims that overlap (``agent``, ``claims``,
        ``paths``). Claims block nothing: they are for an agent to see before it starts, and a merge
        conflict names the claims over its paths."""
        async with self.client.lease(self.repository, ttl=ttl, wait=wait, mode="shared") as lease:
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

    async def commits(self) -> int | None:
        """How many commits the sandbox has that the target lacks (None: its folder is not on this machine)."""
        if not self.here:
            return None
        head = await self.head()
        done = await self._git("rev-list", "--count", f"{head}..refs/heads/{self.branch}")
        return int(done.stdout.strip() or 0)


async def open_sandbox(client: SandboxHost, repository: str, base: str, ttl: float, wait: float) -> Sandbox:
    """Ask the worker to make the agent's sandbox (under the repository's lease)."""
    resource = repository if repository.startswith("repo:") else f"repo:{repository}"
    async with client.lease(resource, ttl=ttl, wait=wait, mode="shared") as lease:
        outcome = await client.execute(lease, "sandbox_create", {"base": base})
    if not outcome.applied:
        raise SandboxRefused(outcome)
    result = outcome.result
    return Sandbox(client, resource, Path(result["path"]), result["branch"], result["base"], target=base)


async def discard_sandbox(box: Sandbox, ttl: float = 30.0, wait: float = 600.0) -> Outcome:
    """Ask the worker to remove the sandbox."""
    async with box.client.lease(box.repository, ttl=ttl, wait=wait, mode="shared") as lease:
        return await box.client.execute(lease, "sandbox_discard", {})


@contextlib.asynccontextmanager
async def sandbox(client: SandboxHost, repository: str, base: str = "main", *, keep: bool | None = None,
                  ttl: float = 60.0, wait: float = 600.0) -> AsyncIterator[Sandbox]:
    """``async with client.sandbox("app") as box``: the agent's sandbox for the block. On leaving, it is
    discarded when everything in it was merged (or it has nothing); kept otherwise, or when its folder is
    not on this machine, so no work is lost (``keep=True`` always keeps it, ``keep=False`` always discards
    it)."""
    box = await open_sandbox(client, repository, base, ttl, wait)
    try:
        yield box
    finally:
        unmerged = await box.commits() if keep is None else 0
        if keep is False or (keep is None and unmerged == 0):  # (None: it cannot be told here, so it is kept)
            await discard_sandbox(box, wait=wait)
