"""Merges on the repository host: a train's join and landing, and a merge's revert, each safe to kill.

Theory of operation
-------------------
A merge joins its repository's train (``arbiter.streams.cores.train``) with a preflight (``join``): the
refs are validated, the agent's branch commit is taken, and a merge that brings nothing or conflicts with
the target's head is answered at once. It lands later (``land``), when the train's front has what it
needs, as a commit both the check runner and the host make alike (``land_commit``: fixed names, dates
and merge options), so the host lands exactly the commit that was checked, or nothing.

A landing (and a revert) moves a branch in steps, and a crash may stop it between any two:

1. **journal**: ``<git dir>/arbiter/landing.json`` says what is about to move (written whole, or not);
2. **ref transaction**: the branch and the intent's records, in one ``update-ref --stdin`` transaction
   (``prepare``, then ``commit``: a kill between them leaves git's lock files, and nothing moved);
3. **checkout**: the main worktree, when it has the branch checked out, follows it;
4. the journal goes; the decision that asked for the landing is then recorded by the worker.

Before any git tool runs on a repository, ``recover`` finishes or undoes what a journal left: a branch
that moved gets its checkout brought along; one that did not gets the lock files of its transaction
removed once they are stale. The input that asked is then decided again (its offset was not committed):
its intent's record (``refs/arbiter/intents/<digest>``) makes a landing that happened answer as landed,
and one that did not lands now. So a crash anywhere ends merged once or not at all, the checkout in step,
and the next merge needs nobody.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from arbiter.schemas.reasons import Reason
from arbiter.streams.cores.train import Entry, Verdict
from arbiter.streams.cores.trust import owned_saga_prefix
from arbiter.streams.tools.git import (
    GIT_TIMEOUT,
    SAFE_GIT,
    WORK_REFS,
    Repos,
    _check_target,
    _commit,
    _conflicts,
    _fits_checkout,
    _landed,
    _recorded,
    _valid,
    branch_of,
    fetch_sandbox,
    git,
    git_environment,
    intent_ref,
    overlapping,
    read_claims,
    write_whole,
)
from arbiter.streams.tools.registry import Replan, ToolCall, ToolError

MERGE_RECORDS = "refs/arbiter/merges/"
STEPS = ("journaled", "prepared", "moved", "synced")
"""Where a landing may be stopped (``Failpoint``, for the crash tests)."""
MERGE_OPTIONS = ("-c", "merge.renames=true", "-c", "merge.directoryRenames=conflict", "-c", "commit.gpgSign=false")
"""The host's and the runner's merges are the same whatever each repository's configuration says."""

Failpoint = Callable[[str, str], None]
"""Called at each of ``STEPS`` with the intent id (a test's failpoint kills the worker there)."""


def no_failpoint(_step: str, _intent_id: str) -> None:
    """A landing that nothing stops."""


def work_ref(intent_id: str) -> str:
    """The ref that keeps the work the merge of intent ``intent_id`` took from its sandbox (the train, the
    runner and the landing read it; the sandbox may change or go meanwhile)."""
    return WORK_REFS + hashlib.sha256(intent_id.encode()).hexdigest()[:40]


def merge_record_ref(intent_id: str) -> str:
    """The ref that keeps who made the merge of intent ``intent_id`` (a blob: JSON)."""
    return MERGE_RECORDS + hashlib.sha256(intent_id.encode()).hexdigest()[:40]


# -- the same commit on both sides -------------------------------------------------------------


def land_commit(repo: Path, head: str, work: str, strategy: str, message: str, intent_id: str, agent_id: str,
                at_ms: int) -> tuple[str, str]:
    """(commit, tree) of merging ``work`` into ``head``, made alike wherever it is made; ``ToolError`` when it
    brings nothing or conflicts (``conflicts`` names the paths)."""
    if git(repo, "merge-base", "--is-ancestor", work, head, check=False).returncode == 0:
        raise ToolError("nothing to merge: the sandbox has no commit the target lacks", reason=Reason.NOTHING_TO_MERGE,
                        advice="Commit your work in the sandbox first.")
    if strategy == "ff" and git(repo, "merge-base", "--is-ancestor", head, work, check=False).returncode == 0:
        return work, git(repo, "rev-parse", f"{work}^{{tree}}").stdout.strip()
    tree, conflicts = _conflicts(repo, head, work, MERGE_OPTIONS)
    if tree is None:
        raise ToolError(f"the merge conflicts in {len(conflicts)} path(s): {', '.join(conflicts[:20])}",
                        conflict=True, conflicts=conflicts, head=head)
    when = f"@{at_ms // 1000} +0000"
    env = {"GIT_AUTHOR_NAME": agent_id, "GIT_AUTHOR_EMAIL": "arbiter@localhost", "GIT_AUTHOR_DATE": when,
           "GIT_COMMITTER_NAME": "arbiter", "GIT_COMMITTER_EMAIL": "arbiter@localhost", "GIT_COMMITTER_DATE": when}
    text = f"{message}\n\nArbiter-Intent: {intent_id}\nArbiter-Agent: {agent_id}\n"
    commit = git(repo, *MERGE_OPTIONS, "commit-tree", tree, "-p", head, "-p", work, stdin=text, env=env)
    return commit.stdout.strip(), tree


def entry_commit(repo: Path, head: str, entry: Entry) -> tuple[str, str]:
    """``land_commit`` of a train's entry on ``head``."""
    args = entry.arguments()
    return land_commit(repo, head, entry.commit, str(args.get("strategy", "merge")), str(args.get("message", "")),
                       entry.intent_id, entry.agent_id, entry.joined_at_ms)


# -- the journal, and moving a branch in steps -------------------------------------------------


@dataclass(frozen=True)
class Landing:
    """What a journal says is about to move (``refs``: what its transaction locks; HEAD too, when it names the
    branch)."""

    intent_id: str
    target: str
    old: str
    new: str
    main: str | None
    at: float
    refs: tuple[str, ...]


def journal_path(repos: Repos, repo: Path) -> Path:
    return repos.git_dir(repo) / "arbiter" / "landing.json"


def _write_journal(path: Path, landing: Landing) -> None:
    write_whole(path, json.dumps(asdict(landing)), durable=True)


def move(repos: Repos, repo: Path, landing: Landing, blob: str | None, failpoint: Failpoint) -> None:
    """Move ``landing.target`` from ``old`` to ``new`` with the intent's records, in the steps of the module's
    text; ``blob``: the merge record (who merged), for a merge."""
    journal = journal_path(repos, repo)
    _write_journal(journal, landing)
    failpoint("journaled", landing.intent_id)
    lines = [f"update refs/heads/{landing.target} {landing.new} {landing.old}",
             f"create {intent_ref(landing.intent_id)} {landing.new}"]
    if blob is not None:
        lines.append(f"create {merge_record_ref(landing.intent_id)} {blob}")
    _transaction(repo, lines, lambda: failpoint("prepared", landing.intent_id))
    failpoint("moved", landing.intent_id)
    if landing.main is not None:
        sync_checkout(Path(landing.main), landing.old, landing.new)
    failpoint("synced", landing.intent_id)
    journal.unlink()


def _transaction(repo: Path, lines: list[str], prepared: Callable[[], None]) -> None:
    """One ``update-ref --stdin`` transaction: ``prepare`` (locks taken, nothing moved), then ``commit``."""
    proc = subprocess.Popen(["git", *SAFE_GIT, "-C", str(repo), "update-ref", "--stdin"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=git_environment())
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write("start\n" + "\n".join(lines) + "\nprepare\n")
        proc.stdin.flush()
        answers = [proc.stdout.readline().strip() for _ in range(2)]
        if answers != ["start: ok", "prepare: ok"]:
            raise ToolError(f"git update-ref: {proc.communicate(timeout=GIT_TIMEOUT)[1].strip()[:500]}")
        prepared()
        _, err = proc.communicate("commit\n", timeout=GIT_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise ToolError(f"git update-ref: {err.strip()[:500]}")


def sync_checkout(main: Path, old: str, new: str) -> None:
    """Bring the main worktree's files from ``old`` to ``new`` (from wherever a crash left them)."""
    tree = git(main, "rev-parse", f"{new}^{{tree}}").stdout.strip()
    if git(main, "write-tree", check=False).stdout.strip() == tree:
        return
    if git(main, "read-tree", "-m", "-u", old, new, check=False).returncode != 0:
        git(main, "read-tree", "--reset", "-u", new)  # a checkout stopped midway: tracked files as new has them
    git(main, "update-index", "-q", "--refresh", check=False)


STALE_LOCK_S = 2.0
"""A ref lock this old, taken after a landing's journal, is that landing's: no live git holds one so long."""


def recover(repos: Repos, repo: Path) -> str | None:
    """Finish or undo what a landing's journal left (see the module's text); what was done, or None."""
    journal = journal_path(repos, repo)
    try:
        landing = _read_journal(journal, repo)
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError):
        journal.unlink(missing_ok=True)  # torn: it was written before anything moved
        return "removed a journal that was never whole"
    git_dir = repos.git_dir(repo)
    current = _commit(repo, f"refs/heads/{landing.target}", "target branch")
    done = "nothing had moved"
    if current == landing.new:
        if landing.main is not None:
            _clear_locks(git_dir, ("index",), landing.at)  # a checkout killed midway leaves the index locked
            sync_checkout(Path(landing.main), landing.old, landing.new)
        done = "the branch had moved: the checkout follows it"
    elif current == landing.old:
        done = _clear_locks(git_dir, landing.refs, landing.at)
    journal.unlink(missing_ok=True)
    return f"recovered the landing of {landing.intent_id}: {done}"


def _read_journal(journal: Path, repo: Path) -> Landing:
    """The journal's landing, or ``ValueError`` when it is not one this host wrote: the refs it names are
    those its landing locks, and its checkout is the repository's own (a journal is never a way to name
    another folder or file)."""
    data = json.loads(journal.read_text())
    landing = Landing(**{**data, "refs": tuple(data["refs"])})
    _valid("target", landing.target)
    allowed = {"HEAD", f"refs/heads/{landing.target}", intent_ref(landing.intent_id),
               merge_record_ref(landing.intent_id)}
    if not set(landing.refs) <= allowed:
        raise ValueError(f"a journal names refs its landing does not lock: {landing.refs}")
    if landing.main is not None and Path(landing.main).resolve() != repo.resolve():
        raise ValueError(f"a journal names a checkout that is not the repository's: {landing.main}")
    return landing


def _clear_locks(git_dir: Path, refs: tuple[str, ...], since: float) -> str:
    removed = []
    for ref in refs:
        lock = git_dir / f"{ref}.lock"
        with contextlib.suppress(FileNotFoundError):
            if lock.stat().st_mtime < since - 1:
                continue  # older than the landing: someone else's
            while time.time() - lock.stat().st_mtime < STALE_LOCK_S:
                time.sleep(0.1)
            lock.unlink()
            removed.append(ref)
    return f"removed the stale lock(s) of {', '.join(removed)}" if removed else "nothing had moved"


# -- the tools ---------------------------------------------------------------------------------


def join(repos: Repos, call: ToolCall) -> dict[str, Any]:
    """A merge's preflight: the branch commit it takes and the head it joins on; refusals at once."""
    args = call.arguments
    target = str(getattr(args, "target", "main"))
    repo = repos.path(call.resource)
    recover(repos, repo)
    _valid("target", target)
    done = landed_record(repo, call.intent_id)
    if done is not None:  # it landed before a crash (unchecked, in this very decision): it joins as it did
        return {"commit": str(done.get("work", done["head"])), "head": str(done.get("previous", done["head"])),
                "target": target, "check_digest": repos.check_digest(call.resource)}
    head = _commit(repo, f"refs/heads/{target}", "target branch")
    work = fetch_sandbox(repos, repo, call.agent_id, work_ref(call.intent_id))
    if git(repo, "merge-base", "--is-ancestor", work, head, check=False).returncode == 0:
        raise ToolError(f"nothing to merge: {branch_of(call.agent_id)} has no commit that {target} lacks",
                        reason=Reason.NOTHING_TO_MERGE, advice="Commit your work in the sandbox first.")
    tree, conflicts = _conflicts(repo, head, work, MERGE_OPTIONS)
    if tree is None:
        base = git(repo, "merge-base", head, work, check=False).stdout.strip() or None
        raise ToolError(f"merging {branch_of(call.agent_id)} into {target} conflicts in {len(conflicts)} path(s): "
                        f"{', '.join(conflicts[:20])}", conflict=True, conflicts=conflicts, head=head,
                        landed=_landed(repo, base, head),
                        claimed_by=overlapping(read_claims(repos, repo), conflicts, but=call.agent_id),
                        advice="Rebase your sandbox onto the new head (sandbox_rebase, arbiter sandbox rebase, "
                               "box.rebase()), resolve these paths, commit, and merge again.")
    return {"commit": work, "head": head, "target": target, "check_digest": repos.check_digest(call.resource)}


def land(repos: Repos, resource: str, entry: Entry, head: str, verdict: Verdict | None,
         failpoint: Failpoint = no_failpoint) -> dict[str, Any]:
    """Land a train's front entry on ``head``: the commit its verdict checked (unchecked: the one made here)."""
    repo = repos.path(resource)
    recover(repos, repo)
    done = landed_record(repo, entry.intent_id)
    if done is not None:  # landed before a crash: the same answer, nothing again
        return {**done, "redelivered": True}
    actual = _commit(repo, f"refs/heads/{entry.target}", "target branch")
    if actual != head:
        raise Replan(f"{entry.target} is at {actual[:12]}, not at {head[:12]} where the train had it", actual)
    main = _check_target(repos, repo, entry.target)
    commit, tree = entry_commit(repo, head, entry)
    if verdict is not None and (commit, tree) != (verdict.commit, verdict.tree):
        raise ToolError(f"the merge made here ({commit[:12]}) is not the one the runner checked "
                        f"({verdict.commit[:12]}): the host's git and the runner's disagree", checked=verdict.commit,
                        made=commit,
                        advice="The operator runs the same git for the host and the runner; then merge again.")
    _fits_checkout(main, head, commit)
    answer = {"repository": resource, "merged": branch_of(entry.agent_id), "target": entry.target, "head": commit,
              "previous": head, "tree": tree, "work": entry.commit, "fast_forward": commit == entry.commit,
              "checked": None if verdict is None else verdict.command,
              "verdict": None if verdict is None else verdict.verdict_id,
              "check_digest": None if verdict is None else verdict.check_digest}
    record = {**answer, "intent_id": entry.intent_id, "agent_id": entry.agent_id}
    blob = git(repo, "hash-object", "-w", "--stdin", stdin=json.dumps(record, sort_keys=True)).stdout.strip()
    refs = ("HEAD", f"refs/heads/{entry.target}", intent_ref(entry.intent_id), merge_record_ref(entry.intent_id))
    move(repos, repo, Landing(entry.intent_id, entry.target, head, commit, None if main is None else str(main),
                              time.time(), refs), blob, failpoint)
    return answer


_ANSWER = ("repository", "merged", "target", "head", "previous", "tree", "work", "fast_forward", "checked",
           "verdict", "check_digest")


def landed_record(repo: Path, intent_id: str) -> dict[str, Any] | None:
    """What the landing of ``intent_id`` answered, from its record (None: it has not landed)."""
    head = _recorded(repo, intent_id)
    if head is None:
        return None
    done = git(repo, "cat-file", "blob", merge_record_ref(intent_id), check=False)
    record: dict[str, Any] = {}
    with contextlib.suppress(ValueError):
        record = json.loads(done.stdout) if done.returncode == 0 else {}
    return {**{k: record[k] for k in _ANSWER if k in record}, "head": head}


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


def _revert_commit(repo: Path, head: str, merged: str, merge_intent_id: str) -> str:
    """A commit on ``head`` that undoes what ``merged`` brought (in a scratch worktree)."""
    parents = git(repo, "rev-list", "--parents", "-n", "1", merged).stdout.split()[1:]
    scratch = Path(tempfile.mkdtemp(prefix="arbiter-revert-"))
    try:
        git(repo, "worktree", "add", "--detach", str(scratch), head)
        revert = ["revert", "--no-edit"] + (["-m", "1", merged] if len(parents) > 1 else [merged])
        if git(scratch, *revert, check=False).returncode != 0:
            paths = git(scratch, "diff", "--name-only", "--diff-filter=U").stdout.split()
            raise ToolError(f"reverting the merge of {merge_intent_id} conflicts with what landed since: "
                            f"{', '.join(paths[:20])}", reason=Reason.REVERT_CONFLICT, conflicts=paths, head=head,
                            merge=merged, advice=f"A person reverts it by hand: git revert -m 1 {merged}, resolving "
                                                 "these paths.")
        return _commit(scratch, "HEAD", "revert")
    finally:
        git(repo, "worktree", "remove", "--force", str(scratch), check=False)
        shutil.rmtree(scratch, ignore_errors=True)


def revert(repos: Repos, call: ToolCall, failpoint: Failpoint = no_failpoint) -> dict[str, Any]:
    """Revert, as a new commit on the target, what the merge of ``merge_intent_id`` brought (a saga's undo)."""
    args = call.arguments
    target, merge_intent_id = str(getattr(args, "target", "main")), str(getattr(args, "merge_intent_id", ""))
    repo = repos.path(call.resource)
    recover(repos, repo)
    _valid("target", target)
    done = _recorded(repo, call.intent_id)
    if done is not None:
        return {"repository": call.resource, "reverted": merge_intent_id, "head": done, "redelivered": True}
    merged = _recorded(repo, merge_intent_id)
    if merged is None:
        return {"repository": call.resource, "reverted": None, "note": "no such merge; nothing to undo"}
    _may_revert(repo, call, merge_intent_id, merged)
    head = _commit(repo, f"refs/heads/{target}", "target branch")
    main = _check_target(repos, repo, target)
    new = _revert_commit(repo, head, merged, merge_intent_id)
    _fits_checkout(main, head, new)
    refs = ("HEAD", f"refs/heads/{target}", intent_ref(call.intent_id))
    move(repos, repo, Landing(call.intent_id, target, head, new, None if main is None else str(main), time.time(),
                              refs), None, failpoint)
    parents = git(repo, "rev-list", "--parents", "-n", "1", merged).stdout.split()[1:]
    return {"repository": call.resource, "reverted": merge_intent_id, "merge": merged,
            "before": parents[0] if parents else merged, "head": new, "previous": head}
