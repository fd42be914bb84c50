"""The git tools on real repositories, without a broker: sandboxes, merges, conflicts by path,
refusals that change nothing, a redelivered merge that does not merge twice, and a revert."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from arbiter.schemas import ToolIntent
from arbiter.streams.cores.train import Entry
from arbiter.streams.tools.git import Repos, git, intent_ref
from arbiter.streams.tools.registry import ToolRegistry
from arbiter.streams.tools.repository import register_git_tools


def sh(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def make_repo(root: Path, files: dict[str, str] | None = None) -> Path:
    """A real repository with one commit on main."""
    repo = root / "app"
    repo.mkdir()
    sh(repo, "init", "-q", "-b", "main")
    sh(repo, "config", "user.email", "dev@example.com")
    sh(repo, "config", "user.name", "dev")
    for name, text in (files or {"auth.py": "def login():\n    return 1\n", "README": "app\n"}).items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    sh(repo, "add", "-A")
    sh(repo, "commit", "-qm", "init")
    return repo


def commit(path: Path, name: str, text: str, message: str) -> str:
    (path / name).write_text(text)
    sh(path, "add", name)
    sh(path, "-c", "user.email=a@example.com", "-c", "user.name=agent", "commit", "-qm", message)
    return sh(path, "rev-parse", "HEAD")


class Tools:
    """The repository tools as the worker runs them; ``merge`` is a train's join and, at once, its landing
    (unchecked: the train's order and checks are the core's, tested apart)."""

    def __init__(self, repo: Path) -> None:
        self.registry = ToolRegistry()
        register_git_tools(self.registry, Repos({"app": repo}))
        self.count = 0
        self.entries: dict[str, tuple[Entry, str]] = {}

    def __call__(self, agent: str, tool: str, args: dict[str, Any], intent_id: str | None = None,
                 **fields: Any) -> tuple[bool, dict[str, Any]]:
        self.count += 1
        intent = ToolIntent(intent_id=intent_id or f"i{self.count}", agent_id=agent, resource="repo:app", tool=tool,
                            arguments_json=json.dumps(args), token=1, at_ms=0, **fields)
        parsed = self.registry.parse(intent)
        assert not isinstance(parsed, str), parsed
        if tool != "merge":
            return _answer(asyncio.run(self.registry.run(intent, parsed)))
        joined = asyncio.run(self.registry.join(intent, parsed))
        if not joined.ok:
            return _answer(joined)
        pin = json.loads(joined.result_json)
        entry = Entry(intent.intent_id, agent, 1, pin["commit"], pin["target"], None, 1_700_000_000_000,
                      intent.arguments_json, 0)
        self.entries[intent.intent_id] = (entry, pin["head"])
        return self.land(intent.intent_id)

    def land(self, intent_id: str) -> tuple[bool, dict[str, Any]]:
        """Land a joined merge (again: a worker killed after it landed, before its offset was committed)."""
        entry, head = self.entries[intent_id]
        return _answer(asyncio.run(self.registry.land("repo:app", entry, head, None)))


def _answer(outcome: Any) -> tuple[bool, dict[str, Any]]:
    if outcome.ok:
        return True, json.loads(outcome.result_json)
    return False, {"error": outcome.error, "reason": outcome.reason, **dict(outcome.details)}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path)


def test_a_sandbox_per_agent_and_a_clean_merge_moves_main_once(repo: Path) -> None:
    tools = Tools(repo)
    ok, box = tools("ann", "sandbox_create", {"base": "main"})
    assert ok and box["branch"] == "arbiter/ann" and Path(box["path"]).is_dir(), box
    assert box["base"] == sh(repo, "rev-parse", "main")
    again, refused = tools("ann", "sandbox_create", {})
    assert not again and "already" in refused["error"], refused
    commit(Path(box["path"]), "notes.md", "hello\n", "notes")
    before = sh(repo, "rev-parse", "main")
    ok, merged = tools("ann", "merge", {"message": "ann: notes"}, intent_id="merge-1")
    assert ok and merged["previous"] == before, merged
    assert sh(repo, "rev-parse", "main") == merged["head"] != before
    assert sh(repo, "rev-parse", intent_ref("merge-1")) == merged["head"]
    assert (repo / "notes.md").read_text() == "hello\n", "the main worktree follows its branch"
    assert sh(repo, "status", "--porcelain") == ""
    # Redelivered (a worker killed after the merge, before its offset was committed): no second merge.
    ok, replayed = tools.land("merge-1")
    assert ok and replayed["head"] == merged["head"] and replayed["redelivered"]
    assert sh(repo, "rev-list", "--count", "main") == "3"  # init, the work, one merge commit
    ok, gone = tools("ann", "sandbox_discard", {})
    assert ok and gone["discarded"] and not Path(box["path"]).exists()
    assert "arbiter/ann" not in sh(repo, "branch", "--list")


def test_two_agents_on_one_function_the_second_gets_the_paths_and_rebases(repo: Path) -> None:
    tools = Tools(repo)
    _, ann = tools("ann", "sandbox_create", {})
    _, bob = tools("bob", "sandbox_create", {})
    commit(Path(ann["path"]), "auth.py", "def login():\n    return 2\n", "ann: login returns 2")
    commit(Path(bob["path"]), "auth.py", "def login():\n    return 3\n", "bob: login returns 3")
    ok, merged = tools("ann", "merge", {"message": "ann", "base": ann["base"]})
    assert ok, merged
    ok, conflict = tools("bob", "merge", {"message": "bob", "base": bob["base"]})
    assert not ok and conflict["reason"] == "version_conflict", conflict
    assert conflict["conflicts"] == ["auth.py"] and conflict["head"] == merged["head"]
    assert [c["subject"] for c in conflict["landed"]] == ["ann", "ann: login returns 2"], conflict["landed"]
    assert sh(repo, "rev-parse", "main") == merged["head"], "a conflict changes nothing"
    # Bob fetches the new head from the repository his sandbox was cloned from, rebases, resolves the path
    # git named, and merges.
    bob_path = Path(bob["path"])
    sh(bob_path, "fetch", "-q", "origin", "main")
    rebase = subprocess.run(["git", "-C", str(bob_path), "rebase", "origin/main"], capture_output=True, text=True)
    assert rebase.returncode != 0
    (bob_path / "auth.py").write_text("def login():\n    return 2 + 3\n")
    sh(bob_path, "add", "auth.py")
    subprocess.run(["git", "-C", str(bob_path), "-c", "core.editor=true", "rebase", "--continue"], check=True,
                   capture_output=True)
    ok, second = tools("bob", "merge", {"message": "bob, rebased"})
    assert ok, second
    assert (repo / "auth.py").read_text() == "def login():\n    return 2 + 3\n"


def test_refusals_say_what_to_do_and_change_nothing(repo: Path, tmp_path: Path) -> None:
    tools = Tools(repo)
    _, ann = tools("ann", "sandbox_create", {})
    head = sh(repo, "rev-parse", "main")
    ok, nothing = tools("ann", "merge", {"message": "empty"})
    assert not ok and "nothing to merge" in nothing["error"]
    commit(Path(ann["path"]), "x.txt", "x\n", "x")
    ok, missing = tools("ann", "merge", {"message": "m", "target": "release"})
    assert not ok and "'refs/heads/release' does not exist" in missing["error"], missing
    ok, bad = tools("ann", "sandbox_create", {"base": "--upload-pack=x"})
    assert not ok and "not a branch name" in bad["error"], bad
    (repo / "README").write_text("edited, not committed\n")
    ok, dirty = tools("ann", "merge", {"message": "m"})
    assert not ok and "uncommitted changes: README" in dirty["error"] and "advice" in dirty, dirty
    sh(repo, "checkout", "--", "README")
    sh(repo, "branch", "release")
    sh(repo, "worktree", "add", "-q", str(tmp_path / "rel"), "release")
    ok, elsewhere = tools("ann", "merge", {"message": "m", "target": "release"})
    assert not ok and "checked out in the worktree" in elsewhere["error"], elsewhere
    assert sh(repo, "rev-parse", "main") == head and sh(repo, "rev-parse", "release") == head
    registry = ToolRegistry()
    register_git_tools(registry, Repos({}))
    intent = ToolIntent(intent_id="u", agent_id="ann", resource="repo:nope", tool="merge",
                        arguments_json='{"message": "m"}', token=1, at_ms=0)
    parsed = registry.parse(intent)
    assert not isinstance(parsed, str)
    outcome = asyncio.run(registry.join(intent, parsed))
    assert not outcome.ok and "no repository 'nope'" in outcome.error and outcome.reason == "unknown_repository"


def _undo(saga: str) -> dict[str, Any]:
    """What a saga's compensation intent carries (only a worker's saga processor may send one)."""
    return {"saga_id": saga, "is_compensation": True}


def test_a_revert_undoes_a_merge_as_a_new_commit_once(repo: Path) -> None:
    tools = Tools(repo)
    _, ann = tools("ann", "sandbox_create", {})
    commit(Path(ann["path"]), "feature.py", "on = True\n", "feature")
    ok, merged = tools("ann", "merge", {"message": "feature"}, intent_id="m-1", saga_id="saga:ann/x")
    assert ok and (repo / "feature.py").exists()
    undo = "saga:ann/x:1f|undo|0|1"  # a saga's ids hold characters no ref name may
    ok, reverted = tools("saga:ann/x", "revert_merge", {"merge_intent_id": "m-1"}, intent_id=undo,
                         **_undo("saga:ann/x"))
    assert ok and reverted["previous"] == merged["head"], reverted
    assert not (repo / "feature.py").exists() and sh(repo, "rev-parse", "main") == reverted["head"]
    ok, again = tools("saga:ann/x", "revert_merge", {"merge_intent_id": "m-1"}, intent_id=undo,
                      **_undo("saga:ann/x"))
    assert ok and again["redelivered"] and sh(repo, "rev-list", "--count", "main") == "4"  # init, work, merge, revert
    ok, none = tools("saga:ann/x", "revert_merge", {"merge_intent_id": "never"}, intent_id="r-2",
                     **_undo("saga:ann/x"))
    assert ok and none["reverted"] is None


def test_only_the_merging_agents_saga_reverts_its_merge(repo: Path) -> None:
    """Bob may not undo Ann's merge: not directly, not through a compensation of his own saga that names it;
    nor may Ann outside her saga's compensation. Each is refused not_your_merge and changes nothing."""
    tools = Tools(repo)
    _, ann = tools("ann", "sandbox_create", {})
    commit(Path(ann["path"]), "feature.py", "on = True\n", "feature")
    ok, merged = tools("ann", "merge", {"message": "feature"}, intent_id="m-ann")
    assert ok
    for agent, fields in [("bob", {}), ("saga:bob/steal", _undo("saga:bob/steal")), ("ann", {}),
                          ("saga:ann", _undo("saga:ann"))]:
        ok, refused = tools(agent, "revert_merge", {"merge_intent_id": "m-ann"}, **fields)
        assert not ok and refused["reason"] == "not_your_merge" and refused["merged_by"] == "ann", (agent, refused)
        assert sh(repo, "rev-parse", "main") == merged["head"] and (repo / "feature.py").exists()
    ok, reverted = tools("saga:ann/fix", "revert_merge", {"merge_intent_id": "m-ann"}, **_undo("saga:ann/fix"))
    assert ok and not (repo / "feature.py").exists(), reverted


def test_git_is_the_one_this_machine_has() -> None:
    version = git(Path("."), "--version").stdout
    assert version.startswith("git version 2."), version


def test_claims_are_announced_seen_and_named_in_a_conflict_and_never_block(repo: Path) -> None:
    tools = Tools(repo)
    _, ann = tools("ann", "sandbox_create", {})
    _, bob = tools("bob", "sandbox_create", {})
    ok, mine = tools("ann", "claim", {"paths": ["auth.py", "src/auth/**"]})
    assert ok and mine["claims"] == ["auth.py", "src/auth/**"] and mine["overlapping"] == []
    ok, seen = tools("bob", "claim", {"paths": ["src/**", "docs/"]})
    assert ok and seen["overlapping"] == [{"agent": "ann", "claims": ["auth.py", "src/auth/**"],
                                           "paths": ["src/**"]}], seen
    commit(Path(ann["path"]), "auth.py", "def login():\n    return 2\n", "ann")
    commit(Path(bob["path"]), "auth.py", "def login():\n    return 3\n", "bob")
    ok, _ = tools("bob", "merge", {"message": "bob first"})  # a claim blocks nothing
    assert ok
    ok, conflict = tools("ann", "merge", {"message": "ann"})
    assert not ok and conflict["conflicts"] == ["auth.py"]
    assert conflict["claimed_by"] == [], "ann's own claim is not named to ann"
    tools("bob", "claim", {"paths": ["auth.py"]})
    ok, again = tools("ann", "merge", {"message": "ann"})
    assert [c["agent"] for c in again["claimed_by"]] == ["bob"], again
    ok, bad = tools("ann", "claim", {"paths": ["--output=x"]})
    assert not ok and "glob pattern" in bad["error"]
    ok, bad = tools("ann", "claim", {"paths": ["*a" * 9]})
    assert not ok and "8 wildcards" in bad["error"]
    tools("bob", "sandbox_discard", {})
    ok, left = tools("ann", "claim", {"paths": ["auth.py"]})
    assert ok and left["overlapping"] == [], "a discarded sandbox's claim is gone"
    ok, none = tools("ann", "claim", {"paths": []})
    assert ok and none["claims"] == []


def test_arguments_that_would_reach_git_as_options_or_commands_are_refused(repo: Path) -> None:
    """An agent's arguments become git arguments and ref-transaction lines: none may read as an option
    (``--output=FILE`` would write a file on the worker) or as another command."""
    tools = Tools(repo)
    _, ann = tools("ann", "sandbox_create", {})
    commit(Path(ann["path"]), "x.txt", "x\n", "x")
    registry = tools.registry
    for tool, args in [("merge", {"message": "m", "base": "--output=planted"}),
                       ("merge", {"message": "m", "expect_head": "--output=planted"}),  # reached git log before
                       ("merge", {"message": "m", "expect_head": "HEAD"}),
                       ("merge", {"message": "m", "target": "main\ndelete refs/heads/main"}),
                       ("revert_merge", {"merge_intent_id": "x", "target": "main\ndelete refs/heads/main"}),
                       ("sandbox_create", {"base": "--orphan"})]:
        intent = ToolIntent(intent_id=f"bad-{tool}", agent_id="ann", resource="repo:app", tool=tool,
                            arguments_json=json.dumps(args), token=1, at_ms=0)
        parsed = registry.parse(intent)
        if isinstance(parsed, str):
            continue  # refused by the argument schema: invalid_arguments
        outcome = asyncio.run(registry.run(intent, parsed))
        assert not outcome.ok, (tool, args)
    assert not list(repo.glob("planted*")) and not list(Path(ann["path"]).glob("planted*"))
    assert sh(repo, "rev-parse", "--verify", "main")


def test_each_refusal_has_its_own_code_and_changes_nothing(repo: Path, tmp_path: Path) -> None:
    """Every git refusal names its cause (never the catch-all tool_failed, whose advice of a new intent id
    cannot help) and leaves the repository as it was."""
    tools = Tools(repo)
    main = sh(repo, "rev-parse", "main")
    assert tools("ann", "sandbox_create", {"base": "nope"})[1]["reason"] == "branch_missing"
    assert tools("ann", "sandbox_create", {"base": "-x"})[1]["reason"] == "invalid_ref"
    _, ann = tools("ann", "sandbox_create", {})
    assert tools("ann", "sandbox_create", {})[1]["reason"] == "sandbox_exists"
    assert tools("ann", "merge", {"message": "m"})[1]["reason"] == "nothing_to_merge"
    commit(Path(ann["path"]), "new.py", "x = 1\n", "new")
    assert tools("ann", "merge", {"message": "m", "target": "nope"})[1]["reason"] == "branch_missing"
    assert tools("ann", "merge", {"message": "m", "target": "a..b"})[1]["reason"] == "invalid_ref"
    assert tools("bob", "merge", {"message": "m"})[1]["reason"] == "no_sandbox"
    (repo / "new.py").write_text("untracked, where the merge adds new.py\n")
    refused = tools("ann", "merge", {"message": "m"})[1]
    assert refused["reason"] == "untracked_in_the_way" and refused["paths"] == ["new.py"], refused
    (repo / "new.py").unlink()
    (repo / "README").write_text("edited by hand\n")
    refused = tools("ann", "merge", {"message": "m"})[1]
    assert refused["reason"] == "target_dirty" and refused["paths"] == ["README"], refused
    sh(repo, "checkout", "-q", "README")
    sh(repo, "switch", "-q", "--detach")
    sh(repo, "worktree", "add", "-q", str(tmp_path / "elsewhere"), "main")
    refused = tools("ann", "merge", {"message": "m"})[1]
    assert refused["reason"] == "target_checked_out_elsewhere" and "switch --detach" in refused["advice"], refused
    assert sh(repo, "rev-parse", "main") == main, "nothing moved"
    sh(repo, "worktree", "remove", str(tmp_path / "elsewhere"))
    ok, merged = tools("ann", "merge", {"message": "m"})
    assert ok and merged["previous"] == main
    tools("ann", "sandbox_discard", {})
    assert tools("ann", "merge", {"message": "again"})[1]["reason"] == "no_sandbox"
    from arbiter.schemas.reasons import WHAT_TO_DO, Reason

    for code in ("branch_missing", "invalid_ref", "sandbox_exists", "nothing_to_merge", "no_sandbox",
                 "untracked_in_the_way", "target_dirty", "target_checked_out_elsewhere"):
        assert "new intent id" not in WHAT_TO_DO[Reason(code)], code


def _plant(sandbox: Path, marker: Path) -> None:
    """Everything an agent can write in its own sandbox that would make a git of the host's run a program:
    attributes naming drivers (committed), then its configuration (filters, a merge driver, diff commands, a
    signing program, fsmonitor, an ssh command, upload-pack's hook, another hooks folder) and hooks."""
    (sandbox / ".gitattributes").write_text("* filter=evil merge=evil diff=evil\n")
    sh(sandbox, "add", ".gitattributes")
    sh(sandbox, "-c", "user.email=a@example.com", "-c", "user.name=agent", "commit", "-qm", "attributes")
    run = f"sh -c 'echo $0 >> {marker}'"
    for key, value in {"filter.evil.smudge": f"{run} smudge", "filter.evil.clean": f"{run} clean",
                       "merge.evil.driver": f"{run} merge", "diff.evil.textconv": f"{run} textconv",
                       "diff.evil.command": f"{run} diff", "commit.gpgSign": "true", "gpg.program": f"{run}",
                       "core.fsmonitor": f"{run} fsmonitor", "core.sshCommand": f"{run} ssh",
                       "uploadpack.packObjectsHook": f"{run} pack", "core.alternateRefsCommand": f"{run} refs",
                       "core.hooksPath": str(sandbox / "hooks")}.items():
        sh(sandbox, "config", key, value)
    hooks = sandbox / "hooks"
    hooks.mkdir()
    (sandbox / sh(sandbox, "rev-parse", "--git-path", "hooks")).mkdir(exist_ok=True)
    for name in ("post-checkout", "reference-transaction", "pre-commit", "post-merge", "pre-auto-gc"):
        for folder in (hooks, sandbox / sh(sandbox, "rev-parse", "--git-path", "hooks")):
            (folder / name).write_text(f"#!/bin/sh\necho hook {name} >> {marker}\n")
            (folder / name).chmod(0o755)


def test_nothing_an_agent_writes_in_its_sandbox_runs_in_the_host(repo: Path, tmp_path: Path) -> None:
    """Finding: a sandbox was a worktree of the repository, so `git config` in it wrote the repository's own
    configuration; the host's merge preflight, checkout sync, new sandboxes and reverts then ran the filters,
    merge drivers and signing program an agent named there. A sandbox is a clone now, read by the host only
    through git's upload-pack: nothing an agent configures, hooks or commits runs in the host."""
    marker = tmp_path / "ran"
    tools = Tools(repo)
    _, ann = tools("ann", "sandbox_create", {})
    _, bob = tools("bob", "sandbox_create", {})
    ann_path = Path(ann["path"])
    commit(ann_path, "auth.py", "def login():\n    return 2\n", "ann: login")
    _plant(ann_path, marker)
    ok, merged = tools("ann", "merge", {"message": "ann"}, intent_id="m-evil", saga_id="saga:ann/x")
    assert ok, merged
    assert (repo / ".gitattributes").exists() and (repo / "auth.py").read_text() == "def login():\n    return 2\n"
    commit(Path(bob["path"]), "auth.py", "def login():\n    return 3\n", "bob: login")
    ok, conflict = tools("bob", "merge", {"message": "bob"})  # a merge of auth.py, whose attributes name a driver
    assert not ok and conflict["conflicts"] == ["auth.py"], conflict
    _, carol = tools("carol", "sandbox_create", {})  # a checkout of a tree whose attributes name the filters
    commit(Path(carol["path"]), "other.py", "x = 1\n", "carol: other")
    ok, landed = tools("carol", "merge", {"message": "carol"})
    assert ok, landed
    ok, reverted = tools("saga:ann/x", "revert_merge", {"merge_intent_id": "m-evil"}, intent_id="undo-evil",
                         **_undo("saga:ann/x"))
    assert ok, reverted
    assert Repos({"app": repo}).sandboxes(repo, heads=True)[0]["head"] == sh(ann_path, "rev-parse", "HEAD")
    ok, _ = tools("ann", "sandbox_discard", {})
    assert ok and not ann_path.exists()
    assert not marker.exists(), marker.read_text()
    assert "evil" not in sh(repo, "config", "--list"), "the repository's configuration is the operator's"


def test_a_sandbox_whose_git_folder_points_elsewhere_is_not_read(repo: Path, tmp_path: Path) -> None:
    """A sandbox is read as the folder the host made: an agent that turns its `.git` into a link, or a file
    naming another repository (bob's sandbox), gets no_sandbox and nothing of the other repository moves."""
    tools = Tools(repo)
    _, ann = tools("ann", "sandbox_create", {})
    _, bob = tools("bob", "sandbox_create", {})
    sh(Path(bob["path"]), "checkout", "-q", "-b", "arbiter/ann")
    commit(Path(bob["path"]), "bobs.py", "secret = 1\n", "bob's unmerged work")
    ann_git = Path(ann["path"]) / ".git"
    subprocess.run(["rm", "-rf", str(ann_git)], check=True)
    for redirect in ("link", "file"):
        if redirect == "link":
            ann_git.symlink_to(Path(bob["path"]) / ".git")
        else:
            ann_git.unlink()
            ann_git.write_text(f"gitdir: {Path(bob['path']) / '.git'}\n")
        before = sh(repo, "rev-parse", "main")
        ok, refused = tools("ann", "merge", {"message": "ann"})
        assert not ok and refused["reason"] == "no_sandbox", (redirect, refused)
        assert sh(repo, "rev-parse", "main") == before
        assert "bob's unmerged work" not in sh(repo, "log", "--all", "--format=%s"), redirect


def test_agents_of_the_sandbox_group_write_their_sandbox_and_never_the_repository() -> None:
    """The deployment the docs give for a boundary: the host owns the repository; each sandbox is made
    read-write for the agents' group (``ARBITER_SANDBOX_GROUP``). An agent's user (here ``nobody``, of
    ``nogroup``) commits in its sandbox, its merge lands, and it cannot write the repository's own git
    folder (its configuration, its refs)."""
    import shutil
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="arbiter-group-"))
    try:
        top.chmod(0o755)  # the agents read the repository's objects (their clone borrows them)
        repo = make_repo(top)
        tools = Tools(repo)
        tools.registry = ToolRegistry()
        register_git_tools(tools.registry, Repos({"app": repo}, str(top / "sandboxes"), sandbox_group="nogroup"))
        ok, box = tools("nobody-agent", "sandbox_create", {})
        assert ok, box
        path = Path(box["path"])

        def as_agent(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(["runuser", "-u", "nobody", "--", "git", "-c", "safe.directory=*", "-C", str(path),
                                   "-c", "user.name=agent", "-c", "user.email=a@example.com", *args],
                                  capture_output=True, text=True, cwd="/")

        subprocess.run(["runuser", "-u", "nobody", "--", "sh", "-c", f"echo hi > {path}/hi.txt"], check=True)
        assert as_agent("add", "hi.txt").returncode == 0
        done = as_agent("commit", "-qm", "hi")
        assert done.returncode == 0, done.stderr
        ok, merged = tools("nobody-agent", "merge", {"message": "hi"})
        assert ok and (repo / "hi.txt").read_text() == "hi\n", merged
        config = subprocess.run(["runuser", "-u", "nobody", "--", "git", "-c", "safe.directory=*", "-C", str(repo),
                                 "config", "core.fsmonitor", "touch /tmp/x"], capture_output=True, text=True, cwd="/")
        assert config.returncode != 0 and "core.fsmonitor" not in sh(repo, "config", "--list")
    finally:
        shutil.rmtree(top)
