"""Git repositories behind the gateway: what the repository host's tools share.

Resource ``repo:<name>`` is the repository the operator configured as ``name`` (``ARBITER_REPOS``,
``repos.toml``). This module runs git (``git``, with ``SAFE_GIT``), validates the names an agent sends
before git sees them, lists a repository's sandboxes (``Repos``) and keeps the path claims. The tools
themselves are in ``arbiter.streams.tools.repository`` (sandboxes, claims) and
``arbiter.streams.tools.merges`` (a train's join and landing, reverts, crash recovery).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbiter.schemas.identity import valid_name
from arbiter.schemas.reasons import Reason
from arbiter.streams.tools.registry import ToolError

BRANCH_PREFIX = "arbiter/"
INTENT_REFS = "refs/arbiter/intents/"
_REF_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$")
GIT_TIMEOUT = 60.0
"""Seconds any one git command may take before the tool fails (nothing half-done: refs move last)."""


class GitFailed(ToolError):
    """A git command failed."""


SAFE_GIT = ("-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", "-c", "protocol.allow=never",
            "-c", "protocol.file.allow=always", "-c", "commit.gpgSign=false", "-c", "tag.gpgSign=false",
            "-c", "gc.auto=0", "-c", "maintenance.auto=false")
"""Options every git command of Arbiter's runs with: no hook and no fsmonitor command, no transport but local
paths, no signing program, no background maintenance. The repository host's git folder is its own (agents
edit clones of it: ``arbiter.streams.tools.repository``), so its configuration is the operator's; these
pin what an operator's repository might still say."""

_KEPT_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "TZ")
"""The only variables of the process's environment git sees: none of Arbiter's (keys, credentials)."""


def git_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment Arbiter's git runs in: a few of the process's variables, no system or global git
    configuration (nothing installed for a person, such as a git-lfs filter, acts on agents' trees), and
    fixed names for the commits git makes."""
    env = {name: os.environ[name] for name in _KEPT_ENV if name in os.environ}
    env.update({"GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C", "GIT_CONFIG_NOSYSTEM": "1",
                "GIT_CONFIG_GLOBAL": os.devnull, "GIT_ATTR_NOSYSTEM": "1",
                "GIT_AUTHOR_NAME": os.environ.get("GIT_AUTHOR_NAME", "arbiter"),
                "GIT_AUTHOR_EMAIL": os.environ.get("GIT_AUTHOR_EMAIL", "arbiter@localhost"),
                "GIT_COMMITTER_NAME": os.environ.get("GIT_COMMITTER_NAME", "arbiter"),
                "GIT_COMMITTER_EMAIL": os.environ.get("GIT_COMMITTER_EMAIL", "arbiter@localhost")})
    env.update(extra or {})
    return env


def git(repo: Path, *args: str, check: bool = True, stdin: str | None = None,
        timeout: float = GIT_TIMEOUT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``git -C repo args`` (with ``SAFE_GIT``, in ``git_environment``); with ``check``, a failure raises
    ``GitFailed`` with git's message. ``env``: variables added to git's environment."""
    try:
        done = subprocess.run(["git", *SAFE_GIT, "-C", str(repo), *args], input=stdin, capture_output=True,
                              text=True, env=git_environment(env), timeout=timeout)
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

    def __init__(self, repos: dict[str, Path], sandbox_root: str = "", checks: dict[str, str | None] | None = None,
                 *, sandbox_group: str = "") -> None:
        self.repos = repos
        self.sandbox_root = sandbox_root
        self.checks = checks or {}
        self.sandbox_group = sandbox_group

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

    def sandbox_folder(self, repo: Path) -> Path:
        """Where ``repo``'s sandboxes live: one folder each, named by its agent."""
        if self.sandbox_root:
            return Path(self.sandbox_root).expanduser() / repo.name
        return self.git_dir(repo) / "arbiter" / "sandboxes"

    def sandbox_path(self, repo: Path, agent: str) -> Path:
        """Where ``agent``'s sandbox of ``repo`` lives."""
        return self.sandbox_folder(repo) / agent

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

    def sandboxes(self, repo: Path, *, heads: bool = False) -> list[dict[str, Any]]:
        """Every sandbox of ``repo``: agent, path, branch (and, with ``heads``, the branch's head as the
        sandbox has it, asked through ``git ls-remote``: "" when it cannot be read). Read from the folder
        alone: no git runs in a sandbox for the list."""
        folder = self.sandbox_folder(repo)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            return []
        found = []
        for entry in entries:
            if valid_name(entry.name) is not None or not entry.is_dir(follow_symlinks=False):
                continue
            box: dict[str, Any] = {"agent": entry.name, "path": entry.path, "branch": branch_of(entry.name)}
            if heads:
                box["head"] = sandbox_head(repo, Path(entry.path), branch_of(entry.name)) or ""
            found.append(box)
        return found


# -- sandboxes: clones the host reads only through git's upload-pack ----------------------------

SANDBOX_REFS = "refs/arbiter/sandboxes/"
"""Where the host keeps what it fetched of each agent's sandbox branch (``SANDBOX_REFS<agent>``)."""
WORK_REFS = "refs/arbiter/work/"
"""A merge's work, kept by the host for as long as the repository lives (the train and the runner read it)."""


def _sandbox_git_dir(path: Path) -> Path:
    """The git folder of the sandbox at ``path``, refused unless it is a plain folder of the sandbox's own that
    borrows objects from nowhere but its repository (``ToolError``): the host never reads another repository
    on an agent's word."""
    git_dir = path / ".git"
    try:
        mode = os.lstat(git_dir).st_mode
    except OSError:
        raise ToolError(f"{path} is not a sandbox (no git folder)", reason=Reason.NO_SANDBOX) from None
    if not stat.S_ISDIR(mode) or os.path.lexists(git_dir / "commondir"):
        raise ToolError(f"{path}'s git folder is not its own (a link or a worktree's): the host reads only a "
                        "sandbox it made", reason=Reason.NO_SANDBOX,
                        advice="Discard this sandbox (sandbox_discard) and make a new one (sandbox_create).")
    return git_dir


@contextlib.contextmanager
def _reading(git_dir: Path) -> Iterator[dict[str, str]]:
    """Git's environment to read a sandbox: its folder trusted by name alone (``safe.directory``, for a
    sandbox its agent's user owns). Git reads that setting only from a global file, never from ``-c``."""
    handle, name = tempfile.mkstemp(prefix="arbiter-git-", suffix=".config")
    try:
        with os.fdopen(handle, "w") as out:
            out.write(f"[safe]\n\tdirectory = {_quoted(git_dir)}\n\tdirectory = {_quoted(git_dir.parent)}\n")
        yield {"GIT_CONFIG_GLOBAL": name}
    finally:
        os.unlink(name)


def _quoted(path: Path) -> str:
    """``path`` as a value in a git configuration file."""
    text = str(path)
    if "\n" in text:
        raise ToolError(f"a sandbox path may not hold a line break: {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def sandbox_head(repo: Path, path: Path, branch: str) -> str | None:
    """The commit ``branch`` names in ``repo``'s sandbox at ``path`` (None: it has no such branch, or it cannot
    be read), through ``git ls-remote`` run in ``repo``: git's upload-pack, which runs nothing a repository's
    configuration names, is the only git the host runs in a folder an agent writes."""
    try:
        git_dir = _sandbox_git_dir(path)
    except ToolError:
        return None
    try:
        with _reading(git_dir) as env:
            done = git(repo, "ls-remote", "--", str(git_dir), f"refs/heads/{branch}", check=False, timeout=10.0,
                       env=env)
    except (GitFailed, ToolError):
        return None
    head = done.stdout.split("\t", 1)[0].strip() if done.returncode == 0 else ""
    return head if re.fullmatch(r"[0-9a-f]{40}([0-9a-f]{24})?", head) else None


def fetch_sandbox(repos: Repos, repo: Path, agent: str, into: str) -> str:
    """Fetch ``agent``'s sandbox branch into ``repo``'s ref ``into``; the commit. Git's upload-pack reads the
    sandbox (nothing its configuration names runs), every object is checked as it arrives
    (``fetch.fsckObjects``: no tree that would write into a git folder), and ``ToolError`` says what is
    missing."""
    path = repos.sandbox_path(repo, agent)
    git_dir = _sandbox_git_dir(path)
    branch = branch_of(agent)
    with _reading(git_dir) as env:
        done = git(repo, "-c", "fetch.fsckObjects=true", "fetch", "--quiet", "--no-tags", "--no-write-fetch-head",
                   "--no-recurse-submodules", "--", str(git_dir), f"+refs/heads/{branch}:{into}", check=False,
                   env=env)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip()[:500]
        if "couldn't find remote ref" in said:
            raise ToolError(f"{agent}'s sandbox has no branch {branch!r}", reason=Reason.BRANCH_MISSING,
                            advice=f"Commit your work on branch {branch} in your sandbox {path}, then merge.")
        raise GitFailed(f"reading {agent}'s sandbox: {said}")
    return _commit(repo, into, f"{agent}'s sandbox branch", Reason.NO_SANDBOX)


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
    paths = sorted({*(_overwritten(line) for line in text.splitlines() if "' would be overwritten" in line),
                    *(line.strip() for line in text.splitlines() if line.startswith("\t"))} - {""})
    raise ToolError(f"the main checkout {main} cannot follow the merge: {text.strip()[:500]}",
                    reason=Reason.UNTRACKED_IN_THE_WAY, paths=paths,
                    advice=f"The operator moves those files out of {main}; then merge again.")


def _overwritten(line: str) -> str:
    """The path in git's "... file 'x' would be overwritten ..." line (read by position: no regex backtracks
    over a long line)."""
    start, end = line.find("file '"), line.rfind("' would be overwritten")
    return line[start + 6:end] if 0 <= start < end else ""


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


def _glob_text(pattern: str) -> str:
    """A claim as the matcher reads it: stripped, its leading '.' and '/' characters dropped (``./src``, ``/src``
    and ``.src`` all read ``src``), empty as ``**``, a trailing ``/`` as the folder and everything below,
    ``**/**`` as ``**``. Theory: that rewrite has one normal form whatever the
    order (it only shortens, and its overlaps ``**/**/**`` and ``**/***/**`` each end the same either way), so
    one pass with a stack reaches it in linear time, where repeating ``str.replace`` may not."""
    pattern = pattern.strip().lstrip("./") or "**"
    if pattern.endswith("/"):
        pattern += "**"
    out: list[str] = []
    for char in pattern:
        out.append(char)
        while out[-5:] == ["*", "*", "/", "*", "*"]:  # only the last push can have made one
            del out[-3:]
    return "".join(out)


_WILD = ("**/", "**", "*")  # none or any folders; anything; anything within one segment


def _fold(run: list[str]) -> list[str]:
    """A run of adjacent wildcards as an equal one of at most two. Theory: ``**`` absorbs its neighbours,
    ``**/`` then ``*`` is anything (split at the last '/'), and a wildcard twice is itself once."""
    if "**" in run or ("**/" in run and "*" in run[run.index("**/"):]):
        return ["**"]
    return [wild for wild in ("*", "**/") if wild in run]


def _glob_tokens(pattern: str) -> list[str]:
    """The pattern's tokens: a wildcard of ``_WILD``, ``?`` (one character of a segment), or one literal
    character. Theory: read left to right as the regex it replaces was, ``**/`` before ``**`` before ``*``."""
    tokens: list[str] = []
    run: list[str] = []
    i = 0
    while i < len(pattern):
        wild = next((w for w in _WILD if pattern.startswith(w, i)), None)
        if wild is not None:
            run.append(wild)
            i += len(wild)
            continue
        tokens += [*_fold(run), pattern[i]]
        run = []
        i += 1
    return tokens + _fold(run)


@dataclass(frozen=True)
class _Glob:
    """A glob as a bit-parallel NFA: a set bit is a state, "this token is next"; bit ``accept`` is "matched".
    ``**/`` takes three bits: an entry with ε-moves to the next bit and past all three, a loop on any
    character, a literal '/'."""

    literal: dict[str, int]  # bits that consume exactly this character
    one: int  # bits that consume one character but '/'
    segment_loop: int  # bits that stay on any character but '/' (``*``)
    any_loop: int  # bits that stay on any character (``**``, the loop of ``**/``)
    skip1: int  # ε-moves to the next bit
    skip3: int  # ε-moves past the next two (``**/`` matching nothing)
    accept: int

    def close(self, states: int) -> int:
        """``states`` with every state reachable by ε-moves. Theory: wildcard runs are folded to at most two
        tokens, so this settles within five rounds."""
        while True:
            more = states | ((states & self.skip1) << 1) | ((states & self.skip3) << 3)
            if more == states:
                return states
            states = more

    def step(self, states: int, char: str) -> int:
        """The states after reading ``char`` from ``states``. Theory: shift-and, every state at once."""
        after = ((states & self.literal.get(char, 0)) << 1) | (states & self.any_loop)
        if char != "/":
            after |= ((states & self.one) << 1) | (states & self.segment_loop)
        return self.close(after)


@functools.lru_cache(maxsize=1024)
def _compile_glob(pattern: str) -> _Glob:
    """The NFA of a claim pattern. Theory: one bit per token (three for ``**/``), a mask per kind of move."""
    literal: dict[str, int] = {}
    one = segment_loop = any_loop = skip1 = skip3 = 0
    k = 0
    for token in _glob_tokens(_glob_text(pattern)):
        bit = 1 << k
        if token == "?":
            one |= bit
        elif token == "*":
            segment_loop, skip1 = segment_loop | bit, skip1 | bit
        elif token == "**":
            any_loop, skip1 = any_loop | bit, skip1 | bit
        elif token == "**/":  # entry, loop, '/'
            skip1, skip3 = skip1 | bit | bit << 1, skip3 | bit
            any_loop |= bit << 1
            literal["/"] = literal.get("/", 0) | bit << 2
            k += 2
        else:
            literal[token] = literal.get(token, 0) | bit
        k += 1
    return _Glob(literal, one, segment_loop, any_loop, skip1, skip3, k)


def glob_match(pattern: str, path: str) -> bool:
    """``path`` matches ``pattern``: ``*`` within one segment, ``?`` one character of one, ``**`` across any
    number (``a/**/b`` is also ``a/b``), a trailing ``/`` a folder and everything below, ``""`` everything;
    the rest is itself (``[`` too).
    Theory: every position of the pattern is tried at once, one path character at a time (no backtracking),
    so the time is O(len(pattern) * len(path)) whatever either is."""
    glob = _compile_glob(pattern)
    states = glob.close(1)
    for char in path:
        if not states:
            return False
        states = glob.step(states, char)
    return bool(states >> glob.accept & 1)


def write_whole(path: Path, text: str, *, durable: bool = False) -> None:
    """Replace ``path`` with ``text``, whole or not at all: written to a fresh file of its own beside it
    (``mkstemp``: never through a link someone left there), then renamed; ``durable``: on disk before the
    rename, and the rename on disk after it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w") as out:
            out.write(text)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        raise
    if durable:
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


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
