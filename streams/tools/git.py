"""Git repositories behind the gateway: what the repository host's tools share.

Resource ``repo:<name>`` is the repository the operator configured as ``name`` (``ARBITER_REPOS``,
``repos.toml``). This module runs git (``git``, with ``SAFE_GIT``), validates the names an agent sends
before git sees them, lists a repository's sandboxes (``Repos``) and keeps the path claims. The tools
themselves are in ``arbiter.streams.tools.repository`` (sandboxes, claims) and
``arbiter.streams.tools.merges`` (a train's join and landing, reverts, crash recovery).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

from arbiter.schemas.reasons import Reason
from arbiter.streams.tools.registry import ToolError

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


class Repos:
    """The repositories a worker serves, by name, and each one's check (its digest, ``Repository``)."""

    def __init__(self, repos: dict[str, Path], sandbox_root: str = "", checks: dict[str, str | None] | None = None
                 ) -> None:
        self.repos = repos
        self.sandbox_root = sandbox_root
        self.checks = checks or {}

    def check_digest(self, resource: str) -> str | None:
        """The check a merge into ``resource`` must pass (None: it lands unchecked)."""
        return self.checks.get(resource.partition(":")[2])

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


def _conflicts(repo: Path, head: str, branch: str, options: tuple[str, ...] = ()) -> tuple[str | None, list[str]]:
    """(merged tree, []) or (None, conflicting paths), by ``git merge-tree --write-tree`` (``options``: git's
    ``-c`` settings for it)."""
    done = git(repo, *options, "merge-tree", "--write-tree", "--name-only", "-z", head, branch, check=False)
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
