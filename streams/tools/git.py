"""Git repositories behind the gateway: a sandbox (git worktree) per agent, and merges in the
repository's own decision order.

Resource ``repo:<name>`` is the repository configured as ``name=path`` (``ARBITER_REPOS``). Its
tools run in the worker, in the order the gateway decides that resource's intents, each under the
intent's fencing token (``repo:`` is pessimistic): the lease queue on ``repo:<name>`` *is* the merge
queue, and a writer whose lease died is refused before any git command runs.

- ``sandbox_create`` makes the agent's worktree, on branch ``arbiter/<agent>``, from ``base``.
- ``sandbox_discard`` removes the agent's worktree and branch.
- ``merge`` merges the agent's branch into ``target``: refs are validated first, the target branch
  must not be checked out in a linked worktree nor dirty in the main one, ``git merge-tree
  --write-tree`` (git 2.39: no ``--merge-base``) decides it without touching a worktree, and the
  target moves to the new commit in one ref transaction together with ``refs/arbiter/intents/<id>``,
  so a redelivered intent finds its merge done and never merges twice. A conflict is
  ``version_conflict`` naming the paths and the commits that landed since the agent's base.
- ``revert_merge`` (the compensation of ``merge``) reverts what a merge brought, as a new commit.

Every tool acts on the sandbox of the intent's agent only (its name is authenticated): an agent
cannot touch another agent's sandbox through the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from arbiter.schemas.reasons import Reason
from arbiter.streams.cores.trust import owned_saga_prefix
from arbiter.streams.tools.registry import ToolCall, ToolError, ToolRegistry

BRANCH_PREFIX = "arbiter/"
INTENT_REFS = "refs/arbiter/intents/"
_REF_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")
GIT_TIMEOUT = 60.0
"""Seconds any one git command may take before the tool fails (nothing half-done: refs move last)."""


class GitFailed(ToolError):
    """A git command failed."""


SAFE_GIT = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false")
"""Options every git command of Arbiter's runs with. A sandbox is a worktree of the repository, so its agent
can write the repository's git folder: no hook planted there, and no fsmonitor command, runs with the
host's authority."""


def git(repo: Path, *args: str, check: bool = True, stdin: str | None = None,
        timeout: float = GIT_TIMEOUT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``git -C repo args`` (with ``SAFE_GIT``); with ``check``, a failure raises ``GitFailed`` with
    git's message. ``env``: variables added to git's environment."""
    full = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C",
            "GIT_AUTHOR_NAME": os.environ.get("GIT_AUTHOR_NAME", "arbiter"),
            "GIT_AUTHOR_EMAIL": os.environ.get("GIT_AUTHOR_EMAIL", "arbiter@localhost"),
            "GIT_COMMITTER_NAME": os.environ.get("GIT_COMMITTER_NAME", "arbiter"),
            "GIT_COMMITTER_EMAIL": os.environ.get("GIT_COMMITTER_EMAIL", "arbiter@localhost"), **(env or {})}
    try:
        done = subprocess.run(["git", *SAFE_GIT, "-C", str(repo), *args], input=stdin, capture_output=True,
                              text=True, env=full, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise GitFailed(f"git {args[0]} took over {timeout:g} s") from exc
    except FileNotFoundError as exc:
        raise GitFailed("git is not installed on this worker") from exc
    if check and done.returncode != 0:
        raise GitFailed(f"git {' '.join(args[:2])}: {(done.stderr or done.stdout).strip()[:500]}")
    return done


def branch_of(agent: str) -> str:
    """The sandbox branch of ``agent``."""
    return f"{BRANCH_PREFIX}{agent}"


def valid_ref_name(name: str) -> bool:
    """A branch name this module accepts (no options, no ``..``, no odd characters)."""
    return bool(_REF_NAME.match(name)) and ".." not in name and not name.endswith((".lock", "/", "."))


class SandboxCreateArgs(BaseModel):
    """Make the agent's sandbox: a worktree on its own branch from ``base``."""

    model_config = ConfigDict(extra="forbid")
    base: str = Field(default="main", min_length=1, max_length=200)


class SandboxDiscardArgs(BaseModel):
    """Remove the agent's sandbox: its worktree and its branch."""

    model_config = ConfigDict(extra="forbid")


class MergeArgs(BaseModel):
    """Merge the agent's sandbox branch into ``target``."""

    model_config = ConfigDict(extra="forbid")
    message: str = Field(min_length=1, max_length=10_000)
    target: str = Field(default="main", min_length=1, max_length=200)
    strategy: Literal["merge", "ff"] = "merge"
    """``merge``: always a merge commit; ``ff``: fast-forward when the target has not moved, else a merge."""
    base: str | None = Field(default=None, pattern=r"^([0-9a-f]{7,64})?$")
    """The commit the agent's work started from (its sandbox's base): conflicts list what landed since."""
    expect_head: str | None = Field(default=None, pattern=r"^[0-9a-f]{7,64}$")
    """Refuse (``version_conflict``) unless the target is still at this commit: what the agent checked."""
    expect_tree: str | None = Field(default=None, pattern=r"^[0-9a-f]{40,64}$")
    """Refuse (``version_conflict``) unless the merge result is exactly this tree: the one the check ran on."""
    check: str | None = Field(default=None, max_length=2_000)
    """The command that passed on ``expect_tree`` (recorded with the intent: the audit shows what was checked)."""


class ClaimArgs(BaseModel):
    """Announce the paths the agent works on (glob patterns, ``**`` for any depth); [] withdraws."""

    model_config = ConfigDict(extra="forbid")
    paths: list[str] = Field(max_length=200)


class RevertArgs(BaseModel):
    """Revert, as a new commit on the target, what the merge of intent ``merge_intent_id`` brought."""

    model_config = ConfigDict(extra="forbid")
    merge_intent_id: str = Field(min_length=1, max_length=200)
    target: str = Field(default="main", min_length=1, max_length=200)


class Repos:
    """The repositories a worker serves, by name."""

    def __init__(self, repos: dict[str, Path], sandbox_root: str = "") -> None:
        self.repos = repos
        self.sandbox_root = sandbox_root

    def path(self, resource: str) -> Path:
        """The repository ``repo:<name>`` names; ``ToolError`` when it is not configured."""
        prefix, _, name = resource.partition(":")
        if prefix != "repo" or not name:
            raise ToolError(f"{resource!r} is not a repository resource ('repo:<name>')",
                            reason=Reason.UNKNOWN_REPOSITORY)
        path = self.repos.get(name)
        if path is None:
            known = ", ".join(sorted(self.repos)) or "none"
            raise ToolError(f"no repository {name!r} on this worker (configured: {known})",
                            reason=Reason.UNKNOWN_REPOSITORY)
        return path

    def git_dir(self, repo: Path) -> Path:
        """The repository's common git directory."""
        out = git(repo, "rev-parse", "--path-format=absolute", "--git-common-dir").stdout.strip()
        return Path(out)

    def sandbox_path(self, repo: Path, agent: str) -> Path:
        """Where ``agent``'s sandbox of ``repo`` lives."""
        root = Path(self.sandbox_root).expanduser() / repo.name if self.sandbox_root else \
            self.git_dir(repo) / "arbiter" / "sandboxes"
        return root / agent

    def worktrees(self, repo: Path) -> list[dict[str, str]]:
        """``git worktree list --porcelain`` as dicts (``worktree``, ``HEAD``, ``branch``...)."""
        out: list[dict[str, str]] = []
        current: dict[str, str] = {}
        for line in git(repo, "worktree", "list", "--porcelain").stdout.splitlines():
            if not line:
                if current:
                    out.append(current)
                current = {}
                continue
            key, _, value = line.partition(" ")
            current[key] = value
        if current:
            out.append(current)
        return out

    def sandboxes(self, repo: Path) -> list[dict[str, Any]]:
        """Every sandbox of ``repo``: agent, path, branch, head."""
        found = []
        for tree in self.worktrees(repo):
            branch = tree.get("branch", "").removeprefix("refs/heads/")
            if branch.startswith(BRANCH_PREFIX):
                found.append({"agent": branch.removeprefix(BRANCH_PREFIX), "path": tree["worktree"],
                              "branch": branch, "head": tree.get("HEAD", "")})
        return found


def _commit(repo: Path, ref: str, what: str, missing: Reason = Reason.BRANCH_MISSING) -> str:
    """The commit ``ref`` names; ``ToolError`` (``missing``) saying which ref is missing (never a conflict)."""
    done = git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    if done.returncode != 0 or not done.stdout.strip():
        raise ToolError(f"{what} {ref!r} does not exist in {repo.name}", reason=missing)
    return done.stdout.strip()


def _valid(kind: str, name: str) -> None:
    if not valid_ref_name(name):
        raise ToolError(f"{kind} {name!r} is not a branch name this tool accepts", reason=Reason.INVALID_REF)


def intent_ref(intent_id: str) -> str:
    """The ref that records where intent ``intent_id`` left the target (an intent id may hold any character;
    a ref name may not, so it is named by a digest of the id)."""
    return INTENT_REFS + hashlib.sha256(intent_id.encode()).hexdigest()[:40]


def _recorded(repo: Path, intent_id: str) -> str | None:
    done = git(repo, "rev-parse", "--verify", "--quiet", intent_ref(intent_id), check=False)
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _check_target(repos: Repos, repo: Path, target: str) -> Path | None:
    """Refuse a target branch checked out in a linked worktree, or dirty in the main one. Returns the main
    worktree when it has the target checked out (clean): it is moved along with the branch."""
    trees = repos.worktrees(repo)
    main = Path(trees[0]["worktree"]) if trees and "bare" not in trees[0] else None
    for index, tree in enumerate(trees):
        if tree.get("branch") != f"refs/heads/{target}":
            continue
        if index > 0:
            raise ToolError(f"branch {target!r} is checked out in the worktree {tree['worktree']}: a merge would "
                            "leave its files behind the branch", reason=Reason.TARGET_CHECKED_OUT_ELSEWHERE,
                            advice=f"The operator switches that worktree to another branch (git -C "
                                   f"{tree['worktree']} switch --detach); or merge into another target.")
        assert main is not None
        status = [line for line in git(main, "status", "--porcelain", "--untracked-files=no").stdout.splitlines()
                  if line.strip()]
        if status:
            paths = [line[3:] for line in status[:50]]
            raise ToolError(f"branch {target!r} is checked out in {main} with uncommitted changes: "
                            f"{', '.join(paths[:10])}", reason=Reason.TARGET_DIRTY, paths=paths,
                            advice=f"The operator commits or stashes them in {main}; then merge again.")
        return main
    return None


def _fits_checkout(main: Path | None, old: str, new: str) -> None:
    """Refuse, before anything moves, a merge the main checkout cannot follow (an untracked file where the
    merge adds one): the branch and the checkout move together or not at all."""
    if main is None:
        return
    done = git(main, "read-tree", "-n", "-m", "-u", old, new, check=False)
    if done.returncode == 0:
        return
    text = done.stderr or done.stdout
    # One "file 'x' would be overwritten" line per path, or (other git versions) a list of tab-led lines.
    paths = sorted({*re.findall(r"file '(.+?)' would be overwritten", text),
                    *(line.strip() for line in text.splitlines() if line.startswith("\t"))})
    raise ToolError(f"the main checkout {main} cannot follow the merge: {text.strip()[:500]}",
                    reason=Reason.UNTRACKED_IN_THE_WAY, paths=paths,
                    advice=f"The operator moves those files out of {main}; then merge again.")


def _conflicts(repo: Path, head: str, branch: str) -> tuple[str | None, list[str]]:
    """(merged tree, []) or (None, conflicting paths), by ``git merge-tree --write-tree``."""
    done = git(repo, "merge-tree", "--write-tree", "--name-only", "-z", head, branch, check=False)
    if done.returncode == 0:
        return done.stdout.split("\0")[0].strip(), []
    if done.returncode == 1 and done.stdout:
        _tree, _, rest = done.stdout.partition("\0")
        paths = rest.split("\0\0")[0].split("\0")
        return None, sorted({p for p in paths if p})
    raise GitFailed(f"git merge-tree: {(done.stderr or done.stdout).strip()[:500]}")


def _landed(repo: Path, base: str | None, head: str) -> list[dict[str, str]]:
    if not base:
        return []
    done = git(repo, "log", "--format=%H%x00%s%x00%an", f"{base}..{head}", "--max-count=50", check=False)
    return [dict(zip(("commit", "subject", "author"), line.split("\0"), strict=False))
            for line in done.stdout.splitlines() if line]


def glob_match(pattern: str, path: str) -> bool:
    """``path`` matches ``pattern``: ``*`` within one segment, ``**`` across any number, a trailing ``/`` a folder."""
    pattern = pattern.strip().lstrip("./") or "**"
    if pattern.endswith("/"):
        pattern += "**"
    while "**/**" in pattern:  # the same set, and no regex that backtracks for ever
        pattern = pattern.replace("**/**", "**")
    regex, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            regex, i = regex + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            regex, i = regex + ".*", i + 2
        elif pattern[i] == "*":
            regex, i = regex + "[^/]*", i + 1
        elif pattern[i] == "?":
            regex, i = regex + "[^/]", i + 1
        else:
            regex, i = regex + re.escape(pattern[i]), i + 1
    return re.fullmatch(regex, path) is not None


def claims_file(repos: Repos, repo: Path) -> Path:
    """Where a repository's path claims are kept (beside its sandboxes)."""
    return repos.git_dir(repo) / "arbiter" / "claims.json"


def read_claims(repos: Repos, repo: Path) -> dict[str, list[str]]:
    """Every agent's claimed patterns."""
    path = claims_file(repos, repo)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): [str(p) for p in v] for k, v in data.items() if isinstance(v, list)} if isinstance(data, dict) \
        else {}


def _literal(pattern: str) -> str:
    """A pattern's part before its first wildcard."""
    return re.split(r"[*?\[]", pattern.strip().lstrip("./"), maxsplit=1)[0]


def patterns_overlap(a: str, b: str) -> bool:
    """Whether two claims (globs, or plain paths) may name a common path. A path is matched exactly; two
    globs overlap when one's fixed beginning starts the other's (conservative: they may)."""
    a_glob, b_glob = _literal(a) != a.strip().lstrip("./"), _literal(b) != b.strip().lstrip("./")
    if not a_glob:
        return glob_match(b, a.strip().lstrip("./")) or (not b_glob and a.strip() == b.strip())
    if not b_glob:
        return glob_match(a, b.strip().lstrip("./"))
    pa, pb = _literal(a), _literal(b)
    return pa.startswith(pb) or pb.startswith(pa)


def overlapping(claims: dict[str, list[str]], items: list[str], but: str = "") -> list[dict[str, Any]]:
    """The claims of agents other than ``but`` that may cover any of ``items`` (paths or patterns)."""
    out = []
    for agent, patterns in sorted(claims.items()):
        if agent == but:
            continue
        hits = sorted({item for item in items for pattern in patterns if patterns_overlap(pattern, item)})
        if hits:
            out.append({"agent": agent, "claims": patterns, "paths": hits})
    return out


MERGE_RECORDS = "refs/arbiter/merges/"


def merge_record_ref(intent_id: str) -> str:
    """The ref that keeps who made the merge of intent ``intent_id`` (a blob: JSON)."""
    return MERGE_RECORDS + hashlib.sha256(intent_id.encode()).hexdigest()[:40]


def _move(repo: Path, target: str, new: str, old: str, intent_id: str, main: Path | None,
          record: dict[str, Any] | None = None) -> None:
    """Move ``target`` from ``old`` to ``new`` and record the intent (and, for a merge, who made it), in one
    ref transaction; then bring the main worktree's files along when it has the target checked out."""
    lines = [f"update refs/heads/{target} {new} {old}", f"create {intent_ref(intent_id)} {new}"]
    if record is not None:
        blob = git(repo, "hash-object", "-w", "--stdin", stdin=json.dumps(record, sort_keys=True)).stdout.strip()
        lines.append(f"create {merge_record_ref(intent_id)} {blob}")
    git(repo, "update-ref", "--stdin", stdin="start\n" + "\n".join(lines) + "\nprepare\ncommit\n")
    if main is not None:
        git(main, "read-tree", "-m", "-u", old, new)


def merged_by(repo: Path, intent_id: str, merge: str) -> str | None:
    """The agent that made the merge of ``intent_id`` (its record; for merges made before records were kept, the
    merge commit's ``Arbiter-Agent`` trailer); None when it cannot be told."""
    done = git(repo, "cat-file", "blob", merge_record_ref(intent_id), check=False)
    if done.returncode == 0:
        with contextlib.suppress(ValueError, AttributeError):
            return str(json.loads(done.stdout)["agent_id"])
    trailer = git(repo, "log", "-1", "--format=%(trailers:key=Arbiter-Agent,valueonly)", merge, check=False)
    return trailer.stdout.strip() or None


def _may_revert(repo: Path, call: ToolCall, merge_intent_id: str, merged: str) -> None:
    """Only the compensation of a saga owned by the agent that merged reverts a merge (an operator aborts that
    saga, or reverts by hand): no agent undoes another's work through the gateway."""
    owner = merged_by(repo, merge_intent_id, merged)
    if call.is_compensation and owner is not None and (call.saga_id or "").startswith(owned_saga_prefix(owner)):
        return
    who = "a saga's compensation" if call.is_compensation else f"{call.agent_id}, outside a saga's compensation"
    raise ToolError(f"the merge of {merge_intent_id} was made by {owner or 'an agent this repository cannot tell'}; "
                    f"{who} may not revert it", reason=Reason.NOT_YOUR_MERGE, merged_by=owner)


def register_git_tools(registry: ToolRegistry, repos: Repos) -> None:
    """Register sandbox_create, sandbox_discard, merge and revert_merge against ``repos``, and its reader."""

    @registry.reader
    async def read(resource: str) -> dict[str, Any] | None:
        """A repository's branches' heads and its sandboxes; None for anything else."""
        if not resource.startswith("repo:"):
            return None

        def work() -> dict[str, Any]:
            repo = repos.path(resource)
            heads = dict(line.split(" ", 1)[::-1] for line in git(
                repo, "for-each-ref", "--format=%(objectname) %(refname:short)", "refs/heads/").stdout.splitlines())
            return {"repository": resource, "heads": {k: v for k, v in heads.items()
                                                      if not k.startswith(BRANCH_PREFIX)},
                    "sandboxes": repos.sandboxes(repo), "claims": read_claims(repos, repo)}

        try:
            return await asyncio.to_thread(work)
        except ToolError:
            return None

    @registry.register("sandbox_create", SandboxCreateArgs, compensation="sandbox_discard")
    async def sandbox_create(call: ToolCall) -> dict[str, Any]:
        """Make the agent's worktree on branch arbiter/<agent>, from base."""
        args = call.arguments
        assert isinstance(args, SandboxCreateArgs)

        def work() -> dict[str, Any]:
            repo = repos.path(call.resource)
            branch, path = branch_of(call.agent_id), repos.sandbox_path(repo, call.agent_id)
            _valid("base", args.base)
            _valid("sandbox branch", branch)
            base = _commit(repo, args.base, "base")
            mine = next((s for s in repos.sandboxes(repo) if s["agent"] == call.agent_id), None)
            if mine is not None:
                raise ToolError(f"{call.agent_id} has a sandbox of {call.resource} already, at {mine['path']}",
                                reason=Reason.SANDBOX_EXISTS, sandbox=mine,
                                advice="Work in it, merge it, or discard it first.")
            if git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}", check=False).returncode == 0:
                raise ToolError(f"branch {branch!r} exists without a sandbox", reason=Reason.SANDBOX_EXISTS,
                                advice="Discard it (sandbox_discard, arbiter sandbox discard), then make the sandbox.")
            path.parent.mkdir(parents=True, exist_ok=True)
            git(repo, "worktree", "add", "-b", branch, str(path), base)
            return {"repository": call.resource, "agent": call.agent_id, "path": str(path), "branch": branch,
                    "base": base, "base_ref": args.base}

        return await asyncio.to_thread(work)

    @registry.register("sandbox_discard", SandboxDiscardArgs)
    async def sandbox_discard(call: ToolCall) -> dict[str, Any]:
        """Remove the agent's worktree and its branch."""

        def work() -> dict[str, Any]:
            repo = repos.path(call.resource)
            branch = branch_of(call.agent_id)
            mine = next((s for s in repos.sandboxes(repo) if s["agent"] == call.agent_id), None)
            if mine is not None:
                git(repo, "worktree", "remove", "--force", mine["path"])
            had_branch = git(repo, "branch", "-D", branch, check=False).returncode == 0
            git(repo, "worktree", "prune")
            claims = read_claims(repos, repo)
            if claims.pop(call.agent_id, None) is not None:
                path = claims_file(repos, repo)
                path.with_suffix(".tmp").write_text(json.dumps(claims, sort_keys=True, indent=1))
                os.replace(path.with_suffix(".tmp"), path)
            return {"repository": call.resource, "agent": call.agent_id, "discarded": mine is not None or had_branch,
                    "path": mine["path"] if mine else None, "head": mine["head"] if mine else None}

        return await asyncio.to_thread(work)

    @registry.register("claim", ClaimArgs)
    async def claim(call: ToolCall) -> dict[str, Any]:
        """Announce the paths the agent works on (replacing its earlier claim); answer whose claims overlap.
        Claims never block anything: git decides conflicts."""
        args = call.arguments
        assert isinstance(args, ClaimArgs)

        def work() -> dict[str, Any]:
            repo = repos.path(call.resource)
            patterns = sorted({p.strip() for p in args.paths if p.strip()})
            if any(len(p) > 500 or p.startswith("-") or "\0" in p or p.count("*") > 8 for p in patterns):
                raise ToolError("a claimed path is a glob pattern of at most 500 characters and 8 wildcards, "
                                "not starting with '-'", reason=Reason.INVALID_ARGUMENTS)
            claims = read_claims(repos, repo)
            if patterns:
                claims[call.agent_id] = patterns
            else:
                claims.pop(call.agent_id, None)
            path = claims_file(repos, repo)
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch = path.with_suffix(".tmp")
            scratch.write_text(json.dumps(claims, sort_keys=True, indent=1))
            os.replace(scratch, path)  # whole or not at all
            return {"repository": call.resource, "agent": call.agent_id, "claims": patterns,
                    "overlapping": overlapping(claims, patterns, but=call.agent_id)}

        return await asyncio.to_thread(work)

    @registry.register("merge", MergeArgs, compensation="revert_merge")
    async def merge(call: ToolCall) -> dict[str, Any]:
        """Merge the agent's sandbox branch into target (a merge commit, or a fast-forward by policy)."""
        args = call.arguments
        assert isinstance(args, MergeArgs)

        def work() -> dict[str, Any]:
            repo = repos.path(call.resource)
            branch = branch_of(call.agent_id)
            _valid("target", args.target)
            done = _recorded(repo, call.intent_id)
            if done is not None:  # redelivered after it merged: the same answer, nothing again
                return {"repository": call.resource, "merged": branch, "target": args.target, "head": done,
                        "redelivered": True}
            head = _commit(repo, f"refs/heads/{args.target}", "target branch")
            work_head = _commit(repo, f"refs/heads/{branch}", f"{call.agent_id}'s sandbox branch", Reason.NO_SANDBOX)
            base = args.base or git(repo, "merge-base", head, work_head, check=False).stdout.strip() or None
            if args.expect_head is not None and args.expect_head != head:
                raise ToolError(f"{args.target} moved from {args.expect_head[:12]} to {head[:12]} since it was "
                                "checked", conflict=True, head=head, landed=_landed(repo, args.expect_head, head),
                                advice="Merge again: the check runs again on the new head.")
            main = _check_target(repos, repo, args.target)
            if git(repo, "merge-base", "--is-ancestor", work_head, head, check=False).returncode == 0:
                raise ToolError(f"nothing to merge: {branch} has no commit that {args.target} lacks",
                                reason=Reason.NOTHING_TO_MERGE, advice="Commit your work in the sandbox first.")
            fast = git(repo, "merge-base", "--is-ancestor", head, work_head, check=False).returncode == 0
            if args.strategy == "ff" and fast:
                new = work_head
            else:
                tree, conflicts = _conflicts(repo, head, work_head)
                if tree is None:
                    raise ToolError(f"merging {branch} into {args.target} conflicts in {len(conflicts)} path(s): "
                                    f"{', '.join(conflicts[:20])}", conflict=True, conflicts=conflicts, head=head,
                                    landed=_landed(repo, base, head),
                                    claimed_by=overlapping(read_claims(repos, repo), conflicts, but=call.agent_id),
                                    advice="Rebase your sandbox onto the new head (sandbox_rebase, arbiter sandbox "
                                           "rebase, box.rebase()), resolve these paths, commit, and merge again.")
                message = f"{args.message}\n\nArbiter-Intent: {call.intent_id}\nArbiter-Agent: {call.agent_id}\n"
                new = git(repo, "commit-tree", tree, "-p", head, "-p", work_head, stdin=message).stdout.strip()
            result_tree = git(repo, "rev-parse", f"{new}^{{tree}}").stdout.strip()
            if args.expect_tree is not None and args.expect_tree != result_tree:
                raise ToolError(f"the merge result is tree {result_tree[:12]}, not the checked {args.expect_tree[:12]}",
                                conflict=True, head=head, tree=result_tree,
                                advice="Merge again: the check runs again on this head.")
            _fits_checkout(main, head, new)
            _move(repo, args.target, new, head, call.intent_id, main,
                  {"intent_id": call.intent_id, "agent_id": call.agent_id, "saga_id": call.saga_id,
                   "target": args.target, "previous": head, "head": new})
            return {"repository": call.resource, "merged": branch, "target": args.target, "head": new,
                    "previous": head, "tree": result_tree, "fast_forward": new == work_head,
                    "checked": args.check}

        return await asyncio.to_thread(work)

    @registry.register("revert_merge", RevertArgs)
    async def revert_merge(call: ToolCall) -> dict[str, Any]:
        """Revert what a merge brought into target, as a new commit (a saga's undo of merge)."""
        args = call.arguments
        assert isinstance(args, RevertArgs)

        def work() -> dict[str, Any]:
            repo = repos.path(call.resource)
            _valid("target", args.target)
            done = _recorded(repo, call.intent_id)
            if done is not None:
                return {"repository": call.resource, "reverted": args.merge_intent_id, "head": done,
                        "redelivered": True}
            merged = _recorded(repo, args.merge_intent_id)
            if merged is None:
                return {"repository": call.resource, "reverted": None, "note": "no such merge; nothing to undo"}
            _may_revert(repo, call, args.merge_intent_id, merged)
            head = _commit(repo, f"refs/heads/{args.target}", "target branch")
            main = _check_target(repos, repo, args.target)
            parents = git(repo, "rev-list", "--parents", "-n", "1", merged).stdout.split()[1:]
            before = parents[0] if parents else merged
            scratch = Path(tempfile.mkdtemp(prefix="arbiter-revert-"))
            try:
                git(repo, "worktree", "add", "--detach", str(scratch), head)
                revert = ["revert", "--no-edit"] + (["-m", "1", merged] if len(parents) > 1 else [merged])
                if git(scratch, *revert, check=False).returncode != 0:
                    paths = git(scratch, "diff", "--name-only", "--diff-filter=U").stdout.split()
                    raise ToolError(f"reverting the merge of {args.merge_intent_id} conflicts with what landed "
                                    f"since: {', '.join(paths[:20])}", reason=Reason.REVERT_CONFLICT,
                                    conflicts=paths, head=head, merge=merged,
                                    advice=f"A person reverts it by hand: git revert -m 1 {merged}, resolving "
                                           "these paths.")
                new = _commit(scratch, "HEAD", "revert")
            finally:
                git(repo, "worktree", "remove", "--force", str(scratch), check=False)
                shutil.rmtree(scratch, ignore_errors=True)
            _fits_checkout(main, head, new)
            _move(repo, args.target, new, head, call.intent_id, main)
            return {"repository": call.resource, "reverted": args.merge_intent_id, "merge": merged,
                    "before": before, "head": new, "previous": head}

        return await asyncio.to_thread(work)
