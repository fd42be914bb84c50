"""The repository host's tools, as the gateway runs them in a repository's decision order.

- ``sandbox_create`` makes the agent's sandbox, a clone on branch ``arbiter/<agent>``, from ``base``;
- ``sandbox_discard`` removes the agent's sandbox (and its path claim);
- ``claim`` announces the paths the agent works on (advisory: claims block nothing);
- ``merge`` joins the repository's train (``arbiter.streams.tools.merges.join``); the train lands it;
- ``revert_merge`` (the compensation of ``merge``) reverts what a merge brought, as a new commit.

Every tool acts on the sandbox of the intent's agent only (its name is authenticated): an agent cannot
touch another agent's sandbox through the gateway. Each is a function of the repositories and the call,
registered by ``register_git_tools``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from arbiter.schemas.reasons import Reason
from arbiter.streams.cores.train import Entry, Verdict
from arbiter.streams.tools import merges
from arbiter.streams.tools.git import (
    BRANCH_PREFIX,
    SANDBOX_REFS,
    Repos,
    _commit,
    _valid,
    branch_of,
    claims_file,
    git,
    overlapping,
    read_claims,
    sandbox_head,
    write_whole,
)
from arbiter.streams.tools.registry import ToolCall, ToolError, ToolRegistry


class SandboxCreateArgs(BaseModel):
    """Make the agent's sandbox: a clone of the repository on its own branch from ``base``."""

    model_config = ConfigDict(extra="forbid")
    base: str = Field(default="main", min_length=1, max_length=200)


class SandboxDiscardArgs(BaseModel):
    """Remove the agent's sandbox, and what the host kept of its branch."""

    model_config = ConfigDict(extra="forbid")


class MergeArgs(BaseModel):
    """Merge the agent's sandbox branch into ``target``, through the repository's train."""

    model_config = ConfigDict(extra="forbid")
    message: str = Field(min_length=1, max_length=10_000)
    target: str = Field(default="main", min_length=1, max_length=200)
    strategy: Literal["merge", "ff"] = "merge"
    """``merge``: always a merge commit; ``ff``: fast-forward when the target has not moved, else a merge."""
    base: str | None = Field(default=None, pattern=r"^([0-9a-f]{7,64})?$")
    """The commit the agent's work started from (its sandbox's base): conflicts list what landed since."""
    expect_head: str | None = Field(default=None, pattern=r"^[0-9a-f]{7,64}$")
    """Read in logs decided before trains (a merge then checked by its caller); ignored since."""
    expect_tree: str | None = Field(default=None, pattern=r"^[0-9a-f]{40,64}$")
    """As ``expect_head``: a runner's verdict names the tree now."""
    check: str | None = Field(default=None, max_length=2_000)
    """As ``expect_head``: a label a caller once sent; never run, never trusted."""


class ClaimArgs(BaseModel):
    """Announce the paths the agent works on (glob patterns, ``**`` for any depth); [] withdraws."""

    model_config = ConfigDict(extra="forbid")
    paths: list[str] = Field(max_length=200)


class RevertArgs(BaseModel):
    """Revert, as a new commit on the target, what the merge of intent ``merge_intent_id`` brought."""

    model_config = ConfigDict(extra="forbid")
    merge_intent_id: str = Field(min_length=1, max_length=200)
    target: str = Field(default="main", min_length=1, max_length=200)


def read(repos: Repos, resource: str) -> dict[str, Any] | None:
    """A repository's branches' heads, its sandboxes and claims; None for anything else."""
    if not resource.startswith("repo:"):
        return None
    try:
        repo = repos.path(resource)
    except ToolError:
        return None
    heads = dict(line.split(" ", 1)[::-1] for line in git(
        repo, "for-each-ref", "--format=%(objectname) %(refname:short)", "refs/heads/").stdout.splitlines())
    return {"repository": resource, "heads": {k: v for k, v in heads.items() if not k.startswith(BRANCH_PREFIX)},
            "sandboxes": repos.sandboxes(repo, heads=True), "claims": read_claims(repos, repo)}


def sandbox_create(repos: Repos, call: ToolCall) -> dict[str, Any]:
    """Make the agent's sandbox: a clone of the repository on branch arbiter/<agent>, from base."""
    args = call.arguments
    assert isinstance(args, SandboxCreateArgs)
    repo = repos.path(call.resource)
    merges.recover(repos, repo)
    branch, path = branch_of(call.agent_id), repos.sandbox_path(repo, call.agent_id)
    _valid("base", args.base)
    _valid("sandbox branch", branch)
    base = _commit(repo, args.base, "base")
    if os.path.lexists(path):
        mine = {"agent": call.agent_id, "path": str(path), "branch": branch}
        raise ToolError(f"{call.agent_id} has a sandbox of {call.resource} already, at {path}",
                        reason=Reason.SANDBOX_EXISTS, sandbox=mine, advice="Work in it, merge it, or discard it first.")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        make_sandbox(repos, repo, path, branch, base)
    except BaseException:
        _remove_tree(path)  # whole or not at all
        raise
    return {"repository": call.resource, "agent": call.agent_id, "path": str(path), "branch": branch, "base": base,
            "base_ref": args.base}


def make_sandbox(repos: Repos, repo: Path, path: Path, branch: str, base: str) -> None:
    """Clone ``repo`` to ``path`` on ``branch`` at ``base``: a git folder of the sandbox's own, which its agent
    may configure as it likes, since the host reads it only through git's upload-pack. The clone borrows the
    repository's objects (``--shared``), so it costs what the checkout costs; its remote ``origin`` is the
    repository, where the agent fetches the target's new head to rebase."""
    git(repo, "clone", "--quiet", "--shared", "--no-checkout", "--no-tags", "--", str(repo), str(path))
    git(path, "checkout", "--quiet", "-b", branch, base)
    for other in git(path, "for-each-ref", "--format=%(refname)", "refs/heads/").stdout.split():
        if other != f"refs/heads/{branch}":  # a stale copy of the target would be rebased on by mistake
            git(path, "update-ref", "-d", other)
    if repos.sandbox_group:
        share_with_group(path, repos.sandbox_group)


def share_with_group(path: Path, group: str) -> None:
    """Give the sandbox to ``group`` (the agents' users), read-write, new files too."""
    import grp

    gid = grp.getgrnam(group).gr_gid
    git(path, "config", "core.sharedRepository", "group")
    for root, dirs, files in os.walk(path):
        for name in (root, *(os.path.join(root, d) for d in dirs), *(os.path.join(root, f) for f in files)):
            os.lchown(name, -1, gid)
            if not os.path.islink(name):
                mode = os.lstat(name).st_mode
                os.chmod(name, mode | 0o060 | (0o2010 if stat.S_ISDIR(mode) else 0))


def _remove_tree(path: Path) -> None:
    """Remove a sandbox's folder (never following a link out of it)."""
    if os.path.islink(path):
        os.unlink(path)
    elif os.path.lexists(path):
        shutil.rmtree(path)


def remove_sandbox(repos: Repos, repo: Path, agent: str) -> dict[str, Any] | None:
    """Remove ``agent``'s sandbox of ``repo`` and what the host kept of its branch; what it was (None: none)."""
    path = repos.sandbox_path(repo, agent)
    if not os.path.lexists(path):
        return None
    head = sandbox_head(repo, path, branch_of(agent)) or ""
    if os.path.isfile(path / ".git") and not os.path.islink(path / ".git"):
        # A sandbox made by an earlier Arbiter, a worktree of the repository: git removes it.
        git(repo, "worktree", "remove", "--force", str(path), check=False)
        git(repo, "branch", "-D", branch_of(agent), check=False)
    _remove_tree(path)
    git(repo, "worktree", "prune", check=False)
    git(repo, "update-ref", "-d", SANDBOX_REFS + agent, check=False)
    return {"path": str(path), "head": head}


def _write_claims(repos: Repos, repo: Any, claims: dict[str, list[str]]) -> None:
    write_whole(claims_file(repos, repo), json.dumps(claims, sort_keys=True, indent=1))


def sandbox_discard(repos: Repos, call: ToolCall) -> dict[str, Any]:
    """Remove the agent's sandbox, and what the host kept of its branch."""
    repo = repos.path(call.resource)
    merges.recover(repos, repo)
    gone = remove_sandbox(repos, repo, call.agent_id)
    claims = read_claims(repos, repo)
    if claims.pop(call.agent_id, None) is not None:
        _write_claims(repos, repo, claims)
    return {"repository": call.resource, "agent": call.agent_id, "discarded": gone is not None,
            "path": gone["path"] if gone else None, "head": gone["head"] if gone else None}


def claim(repos: Repos, call: ToolCall) -> dict[str, Any]:
    """Announce the paths the agent works on (replacing its earlier claim); answer whose claims overlap.
    Claims never block anything: git decides conflicts."""
    args = call.arguments
    assert isinstance(args, ClaimArgs)
    repo = repos.path(call.resource)
    patterns = sorted({p.strip() for p in args.paths if p.strip()})
    if any(len(p) > 500 or p.startswith("-") or "\0" in p or p.count("*") > 8 for p in patterns):
        raise ToolError("a claimed path is a glob pattern of at most 500 characters and 8 wildcards, not starting "
                        "with '-'", reason=Reason.INVALID_ARGUMENTS)
    claims = read_claims(repos, repo)
    if patterns:
        claims[call.agent_id] = patterns
    else:
        claims.pop(call.agent_id, None)
    _write_claims(repos, repo, claims)
    return {"repository": call.resource, "agent": call.agent_id, "claims": patterns,
            "overlapping": overlapping(claims, patterns, but=call.agent_id)}


class HostTrains:
    """The repository host's side of a train (``TrainTools``), over ``repos``."""

    def __init__(self, repos: Repos, failpoint: merges.Failpoint = merges.no_failpoint) -> None:
        self.repos = repos
        self.failpoint = failpoint

    def join(self, call: ToolCall) -> dict[str, Any]:
        return merges.join(self.repos, call)

    def land(self, resource: str, entry: Entry, head: str, verdict: Verdict | None) -> dict[str, Any]:
        return merges.land(self.repos, resource, entry, head, verdict, self.failpoint)


def _async(fn: Callable[[Repos, ToolCall], dict[str, Any]], repos: Repos) -> Callable[[ToolCall], Any]:
    async def run(call: ToolCall) -> dict[str, Any]:
        return await asyncio.to_thread(fn, repos, call)

    run.__doc__ = fn.__doc__
    return run


def _merge_outside_a_train(call: ToolCall) -> dict[str, Any]:
    raise ToolError("a merge joins its repository's train: the worker decides it there, not as a tool run")


def register_git_tools(registry: ToolRegistry, repos: Repos, failpoint: merges.Failpoint = merges.no_failpoint
                       ) -> None:
    """Register the repository tools against ``repos``, their reader, and the host's train work."""

    async def reader(resource: str) -> dict[str, Any] | None:
        return await asyncio.to_thread(read, repos, resource)

    registry.reader(reader)
    registry.register("sandbox_create", SandboxCreateArgs, compensation="sandbox_discard")(
        _async(sandbox_create, repos))
    registry.register("sandbox_discard", SandboxDiscardArgs)(_async(sandbox_discard, repos))
    registry.register("claim", ClaimArgs)(_async(claim, repos))
    registry.register("merge", MergeArgs, compensation="revert_merge")(
        _async(lambda _repos, call: _merge_outside_a_train(call), repos))
    registry.register("revert_merge", RevertArgs)(
        _async(functools.partial(merges.revert, failpoint=failpoint), repos))
    registry.trains = HostTrains(repos, failpoint)
