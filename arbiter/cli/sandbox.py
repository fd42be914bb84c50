"""``arbiter sandbox``: coding agents' sandboxes (a clone each), and merges through the repository's train.

A repository is configured once, for workers and this command alike: ``ARBITER_REPOS=app=/src/app``
makes it resource ``repo:app``. ``--repo`` takes that name, or the repository's path. Each answer is
one JSON object on stdout; the exit status is ``arbiter lock``'s: 0 done, 1 refused, 2 no answer in
time, 3 unreachable, 4 no identity.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import click

from .answers import answer as _answer
from .answers import lock_run
from .terminal import fail, say, settings_of


def _repo(ctx: click.Context, given: str) -> tuple[str, Path]:
    settings = settings_of(ctx)
    try:
        repos = {name: repository.path for name, repository in settings.repositories().items()}
    except ValueError as exc:
        fail(str(exc), "fix the repository configuration (ARBITER_REPOS, repos.toml)")
    if given.removeprefix("repo:") in repos:
        name = given.removeprefix("repo:")
        return name, repos[name]
    wanted = Path(given).expanduser().resolve()
    for name, path in repos.items():
        if path.expanduser().resolve() == wanted:
            return name, path
    known = ", ".join(f"{n}={p}" for n, p in sorted(repos.items())) or "none"
    fail(f"no repository {given!r} is configured (known: {known})",
         "configure it for the workers and for this command alike: ARBITER_REPOS=name=path, or a "
         "[repos.<name>] table in repos.toml")


def _own_box(ctx: click.Context, client: Any, name: str, path: Path, agent: str, target: str = "main") -> Any:
    """AGENT's sandbox of the repository, as this machine has it (None: it has none), with the repository's
    configuration. Nothing runs in the sandbox here (the host finds where its work meets the target)."""
    from arbiter.agents.sandbox import Sandbox
    from arbiter.streams.tools.git import Repos, branch_of

    settings = settings_of(ctx)
    mine = next((b for b in Repos({name: path}, settings.sandbox_root).sandboxes(path) if b["agent"] == agent), None)
    if mine is None:
        return None
    return Sandbox(client, f"repo:{name}", Path(mine["path"]), branch_of(agent), "", target=target)


def _no_sandbox(name: str, agent: str) -> None:
    _answer({"reason": "no_sandbox", "detail": f"{agent} has no sandbox of repo:{name}",
             "what_to_do": f"arbiter sandbox create --repo {name} --agent {agent}"}, "refused")


def _call(ctx: click.Context, agent: str, work: Any) -> Any:
    return lock_run(settings_of(ctx), work)


_repo_option = click.option("--repo", "repo", required=True, help="The repository: its name in ARBITER_REPOS, "
                                                                   "or its path.")
_agent_option = click.option("--agent", required=True, help="The coding agent (its identity signs the intents).")


@click.group()
def sandbox() -> None:
    """Coding agents' sandboxes (a clone and branch each) and merges through the repository's train."""


@sandbox.command("create")
@_repo_option
@_agent_option
@click.option("--base", default="main", show_default=True, help="The branch the sandbox starts from.")
@click.pass_context
def create(ctx: click.Context, repo: str, agent: str, base: str) -> None:
    """Make AGENT's sandbox (a clone of the repository) on branch arbiter/AGENT; print its path and base commit."""
    from arbiter.agents import ArbiterClient
    from arbiter.agents.sandbox import open_sandbox

    name, _path = _repo(ctx, repo)

    async def run() -> Any:
        async with ArbiterClient(agent, settings_of(ctx)) as client:
            return await open_sandbox(client, f"repo:{name}", base, 60.0, 600.0)

    from arbiter.agents import SandboxRefused

    try:
        box = _call(ctx, agent, run())
    except SandboxRefused as exc:
        _answer({"reason": exc.outcome.reason, **exc.outcome.diagnostic}, "refused")
    _answer({"repository": box.repository, "agent": agent, "path": str(box.path), "branch": box.branch,
             "base": box.base})


@sandbox.command("list")
@_repo_option
@click.pass_context
def list_(ctx: click.Context, repo: str) -> None:
    """Every sandbox of the repository: agent, path, branch, head, commits not yet merged."""
    from arbiter.streams.tools.git import Repos, git

    name, path = _repo(ctx, repo)
    settings = settings_of(ctx)
    boxes = Repos({name: path}, settings.sandbox_root).sandboxes(path, heads=True)
    for box in boxes:  # counted where the repository already has the sandbox's head (a merge fetched it)
        known = box["head"] and git(path, "cat-file", "-e", f"{box['head']}^{{commit}}", check=False).returncode == 0
        ahead = git(path, "rev-list", "--count", f"main..{box['head']}", check=False).stdout.strip() if known else ""
        box["unmerged_commits"] = int(ahead) if ahead.isdigit() else None
    click.echo(json.dumps({"repository": f"repo:{name}", "sandboxes": boxes}))


@sandbox.command("merge")
@_repo_option
@_agent_option
@click.option("-m", "--message", required=True, help="The merge commit's message.")
@click.option("--target", default="main", show_default=True)
@click.option("--ff", is_flag=True, help="Fast-forward when the target has not moved (else a merge commit).")
@click.pass_context
def merge(ctx: click.Context, repo: str, agent: str, message: str, target: str, ff: bool) -> None:
    """Merge AGENT's sandbox into the target, in the repository's queue, after the repository's check (its
    configuration, set by the operator) passes on the result: one JSON object; exit 1 on a conflict (its
    paths in "conflicts") or a failing check."""
    from arbiter.agents import ArbiterClient

    name, path = _repo(ctx, repo)

    async def run() -> Any:
        async with ArbiterClient(agent, settings_of(ctx)) as client:
            box = await asyncio.to_thread(_own_box, ctx, client, name, path, agent, target)
            if box is None:
                return None
            return await box.merge(message, strategy="ff" if ff else "merge")

    outcome = _call(ctx, agent, run())
    if outcome is None:
        _no_sandbox(name, agent)
    elif outcome.applied:
        _answer({"merged": True, **outcome.result})
    else:
        _answer({"merged": False, "reason": outcome.reason, **outcome.diagnostic}, "refused")


@sandbox.command("rebase")
@_repo_option
@_agent_option
@click.option("--target", default="main", show_default=True)
@click.pass_context
def rebase(ctx: click.Context, repo: str, agent: str, target: str) -> None:
    """Rebase AGENT's sandbox onto the target's head: {"rebased": true}, or exit 1 with the paths that still
    conflict (the rebase is then undone: the sandbox is as it was)."""
    name, path = _repo(ctx, repo)
    box = _own_box(ctx, None, name, path, agent, target)  # git in the sandbox only: no Kafka needed
    if box is None:
        _no_sandbox(name, agent)
        return
    conflicts = asyncio.run(box.rebase())
    if conflicts:
        _answer({"rebased": False, "reason": "rebase_conflict", "conflicts": conflicts,
                 "what_to_do": "The rebase was undone. Edit those paths to fit the new head (git merge "
                               f"{target} in the sandbox, resolve, commit), then merge again."}, "refused")
    _answer({"rebased": True, "repository": box.repository, "agent": agent, "base": box.base})


@sandbox.command("claims")
@_repo_option
@click.option("--paths", default="", help="Comma-separated paths or globs: show only the claims that overlap them.")
@click.option("--agent", default="", help="Leave this agent's own claim out.")
@click.pass_context
def claims(ctx: click.Context, repo: str, paths: str, agent: str) -> None:
    """Which agents claimed which paths (box.claim), and, with --paths, whose claims overlap those, before
    the work starts. Claims block nothing: git decides conflicts."""
    from arbiter.streams.tools.git import Repos, overlapping, read_claims

    name, path = _repo(ctx, repo)
    kept = read_claims(Repos({name: path}, settings_of(ctx).sandbox_root), path)
    wanted = [p.strip() for p in paths.split(",") if p.strip()]
    body: dict[str, Any] = {"repository": f"repo:{name}", "claims": kept}
    if wanted:
        body["overlapping"] = overlapping(kept, wanted, but=agent)
    click.echo(json.dumps(body))


@sandbox.command("discard")
@_repo_option
@_agent_option
@click.pass_context
def discard(ctx: click.Context, repo: str, agent: str) -> None:
    """Remove AGENT's sandbox (unmerged commits in it are gone)."""
    from arbiter.agents import ArbiterClient

    name, _path = _repo(ctx, repo)

    async def run() -> Any:
        async with ArbiterClient(agent, settings_of(ctx)) as client, client.lease(f"repo:{name}", ttl=30,
                                                                                   wait=600) as lease:
            return await client.execute(lease, "sandbox_discard", {})

    outcome = _call(ctx, agent, run())
    if outcome.applied:
        _answer(outcome.result)
    else:
        _answer({"reason": outcome.reason, **outcome.diagnostic}, "refused")


@sandbox.command("gc")
@_repo_option
@click.option("--yes", is_flag=True, help="Remove them (without it, only list what would go).")
@click.pass_context
def gc(ctx: click.Context, repo: str, yes: bool) -> None:
    """Sandboxes whose agent is gone: revoked, or unknown to the registry. Lists them; --yes removes them
    (an operator's act on the repository, outside the log)."""
    from arbiter.agents.identities import Registrar
    from arbiter.streams.tools.git import Repos
    from arbiter.streams.tools.repository import remove_sandbox

    name, path = _repo(ctx, repo)
    settings = settings_of(ctx)
    entries = asyncio.run(Registrar(settings, create_admin=False).entries())
    active = {e.name for e in entries if e.status == "active"}
    repos = Repos({name: path}, settings.sandbox_root)
    stale = [b for b in repos.sandboxes(path) if b["agent"] not in active]
    for box in stale:
        if yes:
            remove_sandbox(repos, path, box["agent"])
        say(f"{'removed' if yes else 'would remove'} {box['agent']}'s sandbox {box['path']}")
    click.echo(json.dumps({"repository": f"repo:{name}", "gone": stale, "removed": yes}))


@sandbox.command("hook")
@_agent_option
@click.option("--repo", "repo", default=None, help="The repository (default: the one the payload's cwd is in).")
@click.pass_context
def hook(ctx: click.Context, agent: str, repo: str | None) -> None:
    """Claude Code's WorktreeCreate hook: read its JSON payload on stdin, make AGENT's sandbox of the
    repository the payload's ``cwd`` is in (from its ``base_ref``/``base_commit``, else main), and print
    only the sandbox's absolute path, as the hook's contract asks. Errors go to stderr, exit 1."""
    import sys

    from arbiter.agents import ArbiterClient, SandboxRefused
    from arbiter.agents.sandbox import open_sandbox
    from arbiter.streams.tools.git import git

    try:
        payload = json.loads(sys.stdin.read() or "{}")
    except ValueError as exc:
        fail(f"the hook's payload on stdin is not JSON: {exc}")
    if not isinstance(payload, dict):
        fail("the hook's payload on stdin is not a JSON object")
    if repo is None:
        cwd = Path(str(payload.get("cwd") or ".")).expanduser()
        top = git(cwd, "rev-parse", "--path-format=absolute", "--git-common-dir", check=False)
        if top.returncode != 0:
            fail(f"the payload's cwd {str(cwd)!r} is not in a git repository")
        root = Path(top.stdout.strip())
        repo = str(root.parent if root.name == ".git" else root)
    name, _path = _repo(ctx, repo)
    base = str(payload.get("base_ref") or payload.get("base_commit") or "main")

    async def run() -> Any:
        async with ArbiterClient(agent, settings_of(ctx)) as client:
            return await open_sandbox(client, f"repo:{name}", base, 60.0, 600.0)

    import contextlib
    import io

    answer = io.StringIO()  # stdout is the hook's answer: the path and nothing else
    try:
        with contextlib.redirect_stdout(answer):
            box = lock_run(settings_of(ctx), run())
    except SandboxRefused as exc:
        fail(f"no sandbox for {agent}: {exc.outcome.diagnostic.get('error', exc.outcome.reason)}")
    except SystemExit as exc:  # lock_run answered a failure (unreachable, no identity...): say it on stderr
        why = json.loads(answer.getvalue() or "{}")
        fail(f"no sandbox for {agent}: {why.get('reason', 'failed')}: {why.get('detail', '')}".rstrip(": "),
             str(why.get("what_to_do", "")), code=int(exc.code) if isinstance(exc.code, int) else 1)
    say(f"sandbox of repo:{name} for {agent} on {box.branch} from {box.base[:12]}")
    click.echo(str(box.path))
