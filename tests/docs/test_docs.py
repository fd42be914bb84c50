"""The docs' examples run as written, against a real worker, check runner and front door; the site builds.

The pages are the README, then the pages of ``docs/`` in the order of ``mkdocs.yml``'s nav: the order a
reader goes down them. Every fenced block in a language a person runs (``bash``, ``python``) carries a
note on the line above it:

- ``<!-- example: run -->``: this test runs it, in the pages' order, in one home (what one block
  creates, the next can use, as for a reader going down the pages). A shell block runs under
  ``bash -euo pipefail``; a Python block runs with top-level ``await`` allowed, as in ``python -m
  asyncio`` or a notebook. Each must exit 0.
- ``<!-- example: covered by tests/FILE.py::TEST -->``: a block that starts what this test cannot
  start beside its own (a three-node cluster, the whole demo, the test suite itself); the named test
  runs those commands, and this test checks that it exists. Two name this module's own tests: the
  block of Getting started that starts the broker's topics, a worker, a check runner and a front door
  (``test_the_docs_run_as_written`` starts them at that point of the pages, so a set-up step written
  after it is missing when the worker starts), and the README's tour, whose blocks are copies of blocks
  the pages run (``test_the_readmes_tour_is_run_on_the_pages``).

A block without a note fails this test, so a new example cannot slip in unrun. Two things are put in
for the reader's own: the broker (``kafka-1:9092`` in the pages) is the test's, and the front door's
port (8080) is a free one. Blocks see ``ARBITER_API_KEY`` (a front-door credential of ``triage-1``,
which an earlier block issues the same way) and ``SAGA_ID`` (a saga of ``triage-7`` left open for the
operator's abort), as the pages say where they use them.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from arbiter.agents import ArbiterClient
from arbiter.edge.settings import Repository, Settings, Topics
from arbiter.processes import DoorProcess, RunnerProcess, WorkerPool, settings_env, wait_until_served
from tests.conftest import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
CLI_PAGE = DOCS / "cli.md"
CONFIGURATION_PAGE = DOCS / "configuration.md"
RUNNABLE = {"bash", "sh", "python"}
NOTE = re.compile(r"^<!-- example: (run|covered by (tests/[\w/]+\.py)::(\w+)) -->$")
RUN = "<!-- example: run -->"
STARTS_ARBITER = "<!-- example: covered by tests/docs/test_docs.py::test_the_docs_run_as_written -->"
TOUR = "<!-- example: covered by tests/docs/test_docs.py::test_the_readmes_tour_is_run_on_the_pages -->"
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
    page: Path
    line: int
    language: str
    text: str
    note: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def pages() -> list[Path]:
    """The README, then every page of mkdocs.yml's nav in its order (``index.md`` is the README)."""

    def files(entries: list[object]) -> Iterator[str]:
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            if isinstance(value, list):
                yield from files(value)
            else:
                yield str(value)

    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]
    return [README, *(DOCS / name for name in files(nav) if name != "index.md")]


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, with its language and the note on the line above it."""
    found, lines, i = [], page.read_text().splitlines(), 0
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
        found.append(Block(page, start + 1, language, "\n".join(body) + "\n",
                           above if above.startswith("<!--") else None))
        i += 1
    return found


def examples() -> list[Block]:
    """Every runnable block of every page, in reading order."""
    return [b for page in pages() for b in blocks(page) if b.language in RUNNABLE]


def test_every_example_says_whether_it_runs_here_or_which_test_runs_it() -> None:
    problems = []
    for block in examples():
        note = NOTE.match(block.note or "")
        if note is None:
            problems.append(f"{block.where}: a {block.language} block without '{RUN}' "
                            "or '<!-- example: covered by tests/FILE.py::TEST -->' on the line above")
        elif note.group(2):
            path = REPO / note.group(2)
            if not path.is_file() or not re.search(rf"^(async )?def {note.group(3)}\(", path.read_text(), re.M):
                problems.append(f"{block.where}: {note.group(2)}::{note.group(3)} does not exist")
    assert not problems, "\n".join(problems)
    assert sum(1 for b in examples() if b.note == RUN) >= 8
    starts = [b.where for b in examples() if b.note == STARTS_ARBITER]
    assert len(starts) == 1, f"one block starts the examples' Arbiter, not {starts}"


def test_the_readmes_tour_is_run_on_the_pages() -> None:
    """A block of the README's tour is a copy of a block that a page runs, so it runs as written too."""
    run = {b.text for b in examples() if b.note == RUN and b.page != README}
    tour = [b for b in blocks(README) if b.note == TOUR]
    assert tour, "the README's tour shows no example"
    stale = [b.where for b in tour if b.text not in run]
    assert not stale, f"README blocks that no page runs as they are (copy them from the page): {stale}"



def test_the_readme_reads_in_ten_minutes_and_links_every_page() -> None:
    """At most 250 lines, and a link to each page of the nav by its path, which GitHub follows too."""
    text = README.read_text()
    assert len(text.splitlines()) <= 250, f"README.md has {len(text.splitlines())} lines: move some to a page"
    unlinked = [page.name for page in pages()[1:] if f"](docs/{page.name})" not in text]
    assert not unlinked, f"README.md links no page of: {unlinked}"

@pytest.fixture
def kafka_settings(bootstrap: str, tmp_path: Path) -> Settings:
    """The module's settings: topics and a consumer group of its own, nothing else configured (the pages
    write the repository's configuration themselves, before the worker starts)."""
    from arbiter.streams.runtime.topics import ensure_topics
    from tests.conftest import isolated_settings

    settings = isolated_settings(bootstrap, tmp_path)
    asyncio.run(ensure_topics(settings))
    return settings


@asynccontextmanager
async def arbiter_started(settings: Settings) -> AsyncIterator[DoorProcess]:
    """What Getting started's block starts, in its order: a worker, a check runner, a front door."""
    from arbiter.schemas.partitioning import key_for_partition

    workers, runner, door = WorkerPool(settings), RunnerProcess(settings, trusted_agents=True), DoorProcess(settings)
    try:
        workers.start(1)
        keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
        async with ArbiterClient("warmup", settings) as client:
            await wait_until_served(client, workers, keys)
        runner.start()
        await asyncio.to_thread(door.start)
        yield door
    finally:
        await asyncio.to_thread(door.stop)
        runner.stop()
        workers.stop()


@pytest.mark.e2e
@pytest.mark.kafka
async def test_the_docs_run_as_written(kafka_settings: Settings, tmp_path: Path) -> None:
    settings = kafka_settings
    env = {**settings_env(settings), "ARBITER_AUTO_ENROLL": "false",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    work = tmp_path / "reader"
    work.mkdir(exist_ok=True)
    ran, door = 0, None
    async with AsyncExitStack() as stack:
        for block in examples():
            if block.note == STARTS_ARBITER:
                door = await stack.enter_async_context(arbiter_started(settings))
                continue
            if block.note != RUN:
                continue
            text = block.text.replace("kafka-1:9092", settings.bootstrap)
            if "8080" in text:
                assert door is not None, f"{block.where} uses the front door before the block that starts it"
                text = text.replace("8080", str(door.port))
            if "SAGA_ID" in text:
                env["SAGA_ID"] = await _open_saga(settings, env)
            if "ARBITER_API_KEY" in text and not env.get("ARBITER_API_KEY"):
                env["ARBITER_API_KEY"] = _run(["arbiter", "agents", "api-key", "triage-1", "--label", "docs-python"],
                                              env, work, block).strip()
            if block.language == "python":
                script = work / f"block-{block.page.stem}-{block.line}.py"
                script.write_text(text)
                command = [sys.executable, "-c", RUNNER, str(script), block.where]
            else:
                command = ["bash", "-euo", "pipefail", "-c", text]
            await asyncio.to_thread(_run, command, env, work, block)
            ran += 1
    assert door is not None, "no block started the examples' Arbiter"
    assert ran >= 8


def _run(command: list[str], env: dict[str, str], cwd: Path, block: Block) -> str:
    done = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (f"{block.where} ({block.language}) exited {done.returncode}\n"
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


def test_the_command_table_names_every_command_and_the_cli_page_every_option() -> None:
    import click

    from arbiter.cli import main

    text = CLI_PAGE.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `arbiter ")]

    def walk(command: click.Command, path: list[str]) -> list[tuple[list[str], click.Command]]:
        if isinstance(command, click.Group):
            ctx = click.Context(command, info_name=path[-1] if path else "arbiter")
            subs = {name: command.get_command(ctx, name) for name in command.list_commands(ctx)}
            return [leaf for name, sub in sorted(subs.items()) if sub for leaf in walk(sub, [*path, name])]
        return [(path, command)]

    problems = []
    for path, command in [([], main), *walk(main, [])]:
        group, leaf = (path[0], path[-1]) if path else ("", "")
        if path and not any(f"arbiter {group}" in row and re.search(rf"\b{re.escape(leaf)}\b", row) for row in rows):
            problems.append(f"'arbiter {' '.join(path)}' is not in the command table")
        for param in command.params:
            names = [o for o in getattr(param, "opts", []) if o.startswith("--")]
            if names and not any(re.search(re.escape(o) + r"\b", text) for o in names):
                problems.append(f"'arbiter {' '.join(path)} {names[0]}' is not in {CLI_PAGE.relative_to(REPO)}")
    assert not problems, "\n".join(sorted(set(problems)))


def _default(value: object) -> str:
    """A setting's default as the configuration page writes it."""
    if value is None:
        return "(unset)"
    if value == "":
        return "(empty)"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if value == {}:
        return "(none)"
    return f"`{value}`"


def test_the_configuration_page_names_every_setting_with_its_default() -> None:
    """Every ``ARBITER_*`` setting, topic name and repos.toml key has its row, with the code's default."""
    text = CONFIGURATION_PAGE.read_text()
    cells = {m.group(1): m.group(2).strip()
             for m in re.finditer(r"^\| `([A-Za-z0-9_]+)` \|([^|]*)\|", text, re.M)}
    wanted = {f"ARBITER_{name.upper()}": field.get_default(call_default_factory=True)
              for name, field in Settings.model_fields.items() if name != "topics"}
    wanted |= {f"ARBITER_TOPICS__{name.upper()}": field.get_default() for name, field in Topics.model_fields.items()}
    problems = [f"| `{name}` | {_default(default)} | ... | (missing)" for name, default in wanted.items()
                if name not in cells]
    problems += [f"| `{name}` | {_default(default)} | ... | (the page says {cells[name]})"
                 for name, default in wanted.items() if name in cells and cells[name] != _default(default)]
    problems += [f"| `{name}` | ... | (missing: a key of repos.toml)" for name in Repository.model_fields
                 if name != "name" and name not in cells]
    assert not problems, f"rows {CONFIGURATION_PAGE.relative_to(REPO)} should have:\n" + "\n".join(problems)


def test_the_site_builds_in_strict_mode_with_nothing_fetched(tmp_path: Path) -> None:
    """``mkdocs build --strict``: any warning (a link or an anchor that leads nowhere, a page left out of
    the nav) fails; and no page loads anything from another site when it opens."""
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    output = done.stdout + done.stderr
    warnings = [line for line in output.splitlines() if "WARNING" in line]
    assert done.returncode == 0 and not warnings, output[-5000:]
    home = (site / "index.html").read_text()
    assert "Two commands" in home and 'href="getting-started/"' in home, "the home page is not the README"
    fetched = [f"{page.relative_to(site)}: {m.group(0)}" for page in site.rglob("*.html")
               for m in re.finditer(r"<(?:script|link|img)\b[^>]*(?:src|href)=\"(?:https?:)?//[^\"]+\"",
                                    page.read_text())]
    assert not fetched, "\n".join(fetched)


def test_the_architecture_page_draws_the_tree_as_it_is() -> None:
    """Every folder the Layout block names exists, and every folder of the checkout's top level (but caches and
    environments) is named there."""
    text = (DOCS / "architecture.md").read_text()
    block = text[text.index("## Layout"):].split("```")[1]
    named = {line.split()[0].rstrip("/") for line in block.splitlines() if line.strip() and not line.startswith(" ")}
    for path in named:
        assert (REPO / path).exists(), f"the Layout names {path}, which is not there"
    tops = {p.name for p in REPO.iterdir() if not p.name.startswith(".") and p.name not in ("site", "dist", "build")}
    missing = sorted(t for t in tops if t not in {n.split("/")[0] for n in named}
                     and t not in ("dev", "mkdocs.yml", "Dockerfile"))
    assert not missing, f"top-level entries the Layout does not draw: {missing}"
