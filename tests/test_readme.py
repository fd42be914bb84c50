"""The README's examples run as written, against a real worker and a real front door.

Every fenced block in a language a person runs (``bash``, ``python``) carries a note on the line
above it:

- ``<!-- example: run -->``: this test runs it, in the README's order, in one home (what one
  block creates, the next can use, as for a reader going down the page). A shell block runs
  under ``bash -euo pipefail``; a Python block runs with top-level ``await`` allowed, as in
  ``python -m asyncio`` or a notebook. Each must exit 0.
- ``<!-- example: covered by tests/FILE.py::TEST -->``: a block that starts what this test cannot
  start beside its own (a three-node cluster, the whole demo, the test suite itself); the named
  test runs those commands, and this test checks that it exists.

A block without a note fails this test, so a new example cannot slip in unrun. Two things are
put in for the reader's own: the broker (``kafka-1:9092`` in the README) is the test's, and the
front door's port (8080) is a free one. Blocks see ``ARBITER_API_KEY`` (a front-door credential
of ``triage-1``, which an earlier block issues the same way) and ``SAGA_ID`` (a saga of
``triage-7`` left open for the operator's abort), as the README says where it uses them.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from arbiter.agents import ArbiterClient
from arbiter.edge.settings import Settings
from arbiter.processes import DoorProcess, RunnerProcess, settings_env

pytestmark = pytest.mark.kafka

README = Path(__file__).resolve().parents[1] / "README.md"
RUNNABLE = {"bash", "sh", "python"}
NOTE = re.compile(r"^<!-- example: (run|covered by (tests/[\w/]+\.py)::(\w+)) -->$")
RUNNER = """
import ast, asyncio, sys
source = open(sys.argv[1]).read()
code = compile(source, sys.argv[2], "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)

async def main():
    result = eval(code, {"__name__": "__main__"})
    if asyncio.iscoroutine(result):
        await result

asyncio.run(main())
"""


@dataclass(frozen=True)
class Block:
    line: int
    language: str
    text: str
    note: str | None


@pytest.fixture
def kafka_settings(bootstrap: str, tmp_path: Path) -> Settings:
    """The module's settings: the README's repository (``app``, which its example creates in the reader's
    folder) is configured for the worker, as the README says to configure it."""
    from arbiter.streams.runtime.topics import ensure_topics

    from .conftest import isolated_settings

    # As the operator's repos.toml says it before the worker and the check runner start; the README's block
    # writes it again.
    (tmp_path / "repos.toml").write_text(f'[repos.app]\npath = "{tmp_path / "reader" / "app"}"\n'
                                         'check = "python3 -m compileall -q ."\n')
    settings = isolated_settings(bootstrap, tmp_path)
    asyncio.run(ensure_topics(settings))
    return settings


def blocks(text: str) -> list[Block]:
    """Every fenced block, with its language and the note on the line above it."""
    found, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = re.match(r"^```(\w*)\s*$", lines[i])
        if opening is None:
            i += 1
            continue
        start, language = i, opening.group(1)
        i += 1
        body = []
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        above = lines[start - 1].strip() if start else ""
        found.append(Block(start + 1, language, "\n".join(body) + "\n", above if above.startswith("<!--") else None))
        i += 1
    return found


def examples() -> list[Block]:
    return [b for b in blocks(README.read_text()) if b.language in RUNNABLE]


def test_every_example_says_whether_it_runs_here_or_which_test_runs_it() -> None:
    problems = []
    for block in examples():
        note = NOTE.match(block.note or "")
        if note is None:
            problems.append(f"README.md:{block.line}: a {block.language} block without '<!-- example: run -->' "
                            "or '<!-- example: covered by tests/FILE.py::TEST -->' on the line above")
        elif note.group(2):
            path = README.parent / note.group(2)
            if not path.is_file() or not re.search(rf"^(async )?def {note.group(3)}\(", path.read_text(), re.M):
                problems.append(f"README.md:{block.line}: {note.group(2)}::{note.group(3)} does not exist")
    assert not problems, "\n".join(problems)
    assert sum(1 for b in examples() if b.note == "<!-- example: run -->") >= 8


@pytest.fixture
def runner(kafka_settings: Settings) -> Iterator[RunnerProcess]:
    """The check runner the README's merges wait for, as an operator runs one beside the worker."""
    process = RunnerProcess(kafka_settings, trusted_agents=True).start()
    try:
        yield process
    finally:
        process.stop()


async def test_the_readme_runs_as_written(kafka_settings: Settings, door: DoorProcess, runner: RunnerProcess,
                                          tmp_path: Path) -> None:
    settings = kafka_settings
    env = {**settings_env(settings), "ARBITER_AUTO_ENROLL": "false",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    work = tmp_path / "reader"
    work.mkdir(exist_ok=True)
    ran = 0
    for block in examples():
        if block.note != "<!-- example: run -->":
            continue
        text = block.text.replace("kafka-1:9092", settings.bootstrap).replace("8080", str(door.port))
        if "SAGA_ID" in text:
            env["SAGA_ID"] = await _open_saga(settings, env)
        if "ARBITER_API_KEY" in text and not env.get("ARBITER_API_KEY"):
            env["ARBITER_API_KEY"] = _run(["arbiter", "agents", "api-key", "triage-1", "--label", "readme-python"],
                                          env, work, block).strip()
        if block.language == "python":
            script = work / f"block-{block.line}.py"
            script.write_text(text)
            command = [sys.executable, "-c", RUNNER, str(script), f"README.md:{block.line}"]
        else:
            command = ["bash", "-euo", "pipefail", "-c", text]
        await asyncio.to_thread(_run, command, env, work, block)
        ran += 1
    assert ran >= 8


def _run(command: list[str], env: dict[str, str], cwd: Path, block: Block) -> str:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (f"README.md:{block.line} ({block.language}) exited {done.returncode}\n"
                                  f"--- block\n{block.text}--- stdout\n{done.stdout[-3000:]}\n"
                                  f"--- stderr\n{done.stderr[-3000:]}")
    return done.stdout


async def _open_saga(settings: Settings, env: dict[str, str]) -> str:
    """A saga of triage-7 with one completed step, left open: what an operator would abort."""
    async with ArbiterClient("triage-7", settings) as client:
        saga = client.open_saga("refund")
        async with client.lease("account:cust_8492", ttl=30) as lease:
            seen = await client.snapshot("account:cust_8492")
            await saga.step(lease, "refund", {"order_id": "o-saga", "amount": 100}, base_version=seen.version,
                            compensate=lambda done: ("reverse_refund", {"refund_intent_id": done.intent_id}))
        return saga.saga_id


def test_the_command_table_names_every_command_and_the_readme_every_option() -> None:
    import click

    from arbiter.cli import main

    text = README.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `arbiter ")]

    def walk(command: click.Command, path: list[str]) -> list[tuple[list[str], click.Command]]:
        if isinstance(command, click.Group):
            ctx = click.Context(command, info_name=path[-1] if path else "arbiter")
            subs = {name: command.get_command(ctx, name) for name in command.list_commands(ctx)}
            return [leaf for name, sub in sorted(subs.items()) if sub for leaf in walk(sub, [*path, name])]
        return [(path, command)]

    problems = []
    for path, command in walk(main, []):
        group, leaf = (path[0], path[-1])
        if not any(f"arbiter {group}" in row and re.search(rf"\b{re.escape(leaf)}\b", row) for row in rows):
            problems.append(f"'arbiter {' '.join(path)}' is not in the command table")
        for param in command.params:
            names = [o for o in getattr(param, "opts", []) if o.startswith("--")]
            if names and not any(re.search(re.escape(o) + r"\b", text) for o in names):
                problems.append(f"'arbiter {' '.join(path)} {names[0]}' is not in the README")
    assert not problems, "\n".join(problems)
