"""``arbiter hook pre-tool-use`` fed recorded PreToolUse payloads (Claude Code's and Codex's shapes) against
a real worker: what another agent holds, or what lies outside the agent's sandbox, is denied in the format
the agents read; bad input and an unreachable Arbiter block the call (exit 2), never let it through."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from arbiter.agents import ArbiterClient
from arbiter.edge.settings import Settings
from arbiter.mcp.hook import Payload, lease_names, parse, written_paths
from arbiter.processes import WorkerPool, settings_env
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import assert_clean_audit, isolated_settings
from tests.streams.shells.test_gateway_kafka import start_worker
from tests.streams.tools.test_git_tools import make_repo


def hook(settings: Settings, agent: str, stdin: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "arbiter", "hook", "pre-tool-use", "--agent", agent, "--timeout", "8"],
                          input=stdin, capture_output=True, text=True, timeout=60,
                          env={**settings_env(settings), **env})


def claude(tool: str, cwd: Path, **tool_input: Any) -> str:
    return json.dumps({"session_id": "abc123", "transcript_path": "/tmp/t.jsonl", "cwd": str(cwd),
                       "permission_mode": "default", "hook_event_name": "PreToolUse", "tool_name": tool,
                       "tool_input": tool_input})


def denied(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)["hookSpecificOutput"]
    assert answer["hookEventName"] == "PreToolUse" and answer["permissionDecision"] == "deny", answer
    return str(answer["permissionDecisionReason"])


def allowed(done: subprocess.CompletedProcess[str]) -> None:
    assert done.returncode == 0 and done.stdout == "", (done.returncode, done.stdout, done.stderr)


def test_the_paths_a_call_writes() -> None:
    cwd = Path("/w/app")
    assert written_paths(parse(claude("Read", cwd, file_path="/w/app/a.py"))) is None
    assert written_paths(parse(claude("Edit", cwd, file_path="a.py", old_string="x", new_string="y"))) == [
        Path("/w/app/a.py")]
    assert written_paths(parse(claude("Bash", cwd, command="echo hi > notes.md && cat src/x.py | wc -l"))) == [
        Path("/w/app/notes.md"), Path("/w/app/src/x.py")]
    patch = "*** Begin Patch\n*** Update File: src/a.py\n@@\n-x\n+y\n*** Add File: b.txt\n+b\n*** End Patch\n"
    codex = Payload("apply_patch", {"input": patch}, cwd)
    assert written_paths(codex) == [Path("/w/app/src/a.py"), Path("/w/app/b.txt")]
    shell = Payload("shell", {"command": ["bash", "-lc", "sed -i 's|a|b|' src/a.py"], "workdir": "/w/app"}, cwd)
    assert written_paths(shell) == [Path("/w/app/src/a.py")]
    assert lease_names("app", Path("src/auth/login.py")) == [
        "file:app/src/auth/login.py", "file:app/src/auth", "file:app/src"]


@pytest.fixture
async def stack(bootstrap: str, tmp_path: Path) -> AsyncIterator[tuple[Settings, Path]]:
    repo = make_repo(tmp_path, {"auth.py": "def login():\n    return 1\n", "src/x.py": "x = 1\n"})
    settings = isolated_settings(bootstrap, tmp_path, repos=f"app={repo}")
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    await start_worker(settings, pool)
    try:
        yield settings, repo
    finally:
        pool.stop()


@pytest.mark.kafka
async def test_a_write_to_what_another_agent_holds_or_outside_the_sandbox_is_denied(
        stack: tuple[Settings, Path], tmp_path: Path) -> None:
    settings, _ = stack
    await denies_what_it_must(stack, tmp_path, lambda payload: hook(settings, "ann", payload))
    assert (settings.home / "mcp" / "ann.heartbeat").exists(), "each run is a heartbeat for arbiter mcp"
    await assert_clean_audit(settings)


Hook = Callable[[str], subprocess.CompletedProcess[str]]
"""One run of a hook (as ann) on one payload."""


async def denies_what_it_must(stack: tuple[Settings, Path], tmp_path: Path, run: Hook) -> None:
    """What another agent holds, or what lies outside ann's sandbox, is denied with its reason; the rest is
    allowed."""
    settings, repo = stack
    async with ArbiterClient("ann", settings) as ann, ArbiterClient("bob", settings) as bob, \
            ann.sandbox("app", keep=False) as mine, bob.sandbox("app", keep=False) as theirs:
        box = mine.path

        held = await bob.acquire("file:app/auth.py", ttl=120)
        folder = await bob.acquire("file:app/src", ttl=120)
        checks = await asyncio.to_thread(lambda: {
            "edit held": run(claude("Edit", box, file_path=str(box / "auth.py"), old_string="1", new_string="2")),
            "shell held": run(claude("Bash", box, command="echo 'x' >> auth.py")),
            "folder held": run(claude("Write", box, file_path=str(box / "src/y.py"), content="y\n")),
            "codex patch": run(json.dumps({"session_id": "c1", "cwd": str(box), "hook_event_name": "PreToolUse",
                                           "tool_name": "apply_patch", "tool_input": {
                                               "input": "*** Begin Patch\n*** Update File: auth.py\n*** End Patch"}})),
            "main checkout": run(claude("Edit", repo, file_path=str(repo / "README"), old_string="a", new_string="b")),
            "their sandbox": run(claude("Write", theirs.path, file_path=str(theirs.path / "n.txt"), content="n")),
            "free file": run(claude("Write", box, file_path=str(box / "notes.md"), content="# n\n")),
            "a read": run(claude("Read", box, file_path=str(box / "auth.py"))),
            "a plain command": run(claude("Bash", box, command="ls")),
            "outside every repo": run(claude("Write", tmp_path, file_path=str(tmp_path / "scratch.txt"), content="")),
        })
        reason = denied(checks["edit held"])
        assert "leased by bob (exclusive)" in reason and "file:app/auth.py" in reason, reason
        assert "bob" in denied(checks["shell held"]) and "bob" in denied(checks["codex patch"])
        assert "file:app/src" in denied(checks["folder held"])
        assert "outside your sandbox" in denied(checks["main checkout"]) and str(box) in denied(checks["main checkout"])
        assert "bob's sandbox" in denied(checks["their sandbox"])
        for name in ("free file", "a read", "a plain command", "outside every repo"):
            allowed(checks[name])

        await bob.release(held)
        await bob.release(folder)
        allowed(await asyncio.to_thread(run, claude("Edit", box, file_path=str(box / "auth.py"), old_string="1",
                                                    new_string="2")))
        own = await ann.acquire("file:app/auth.py", ttl=60)  # ann's own lease never denies ann
        allowed(await asyncio.to_thread(run, claude("Edit", box, file_path=str(box / "auth.py"), old_string="1",
                                                    new_string="2")))
        await ann.release(own)


def test_bad_input_and_an_unreachable_arbiter_block_the_call_with_the_reason(tmp_path: Path) -> None:
    repo = make_repo(tmp_path)
    settings = Settings(home=tmp_path / "home", repos=f"app={repo}", bootstrap="127.0.0.1:1", auto_enroll=True)
    for payload, said in [("not json", "not JSON"), ("[1]", "not a JSON object"),
                          (json.dumps({"tool_name": "Edit", "tool_input": {}}), "no absolute cwd"),
                          (json.dumps({"cwd": "/w", "tool_input": {}}), "no tool_name")]:
        done = hook(settings, "ann", payload)
        assert done.returncode == 2 and said in done.stderr and done.stdout == "", (payload, done.stderr)
        assert "Traceback" not in done.stderr
    started = time.monotonic()
    done = hook(settings, "ann", claude("Edit", repo, file_path=str(repo / "auth.py"), old_string="1", new_string="2"))
    assert done.returncode == 2 and "cannot reach Arbiter" in done.stderr and done.stdout == "", done.stderr
    assert "Traceback" not in done.stderr and time.monotonic() - started < 30
    allowed(hook(settings, "ann", claude("Read", repo, file_path=str(repo / "auth.py"))))  # reads need no Arbiter
