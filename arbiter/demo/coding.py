"""The demo's coding story: three coding agents change one small real repository.

``ada`` documents ``add``, ``bo`` rewrites ``add``'s body (the next line: the two changes conflict),
and ``cy`` breaks ``sub``. With Arbiter each works in its own sandbox and merges through the
repository's queue with the tests as the check: ada merges, bo gets the conflict with its path,
rebases (which names the path), redoes its change on the new head and merges, and cy's merge fails
its check and is refused. Without Arbiter (``--unsafe``) the same three edit one working tree on
``main``, each writing the file as it read it: changes are lost and a broken ``calc.py`` lands.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from arbiter.edge.settings import Settings

FILE = "calc.py"
ORIGINAL = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
CHECK = "python3 -c 'import calc; assert calc.add(2, 3) == 5 and calc.sub(5, 3) == 2'"
"""The repository's tests: what a merge must pass (its check, in the run's repos.toml)."""


def _ada(text: str) -> str:
    return text.replace("def add(a, b):\n", 'def add(a, b):\n    """The sum of a and b."""\n', 1)


def _bo(text: str) -> str:
    return text.replace("    return a + b\n", "    return sum((a, b))\n", 1)


def _cy(text: str) -> str:
    return text.replace("    return a - b\n", "    return a + b  # oops\n", 1)


AGENTS: dict[str, tuple[Callable[[str], str], str, float]] = {
    "ada": (_ada, "document add()", 0.0),
    "bo": (_bo, "rewrite add()'s body", 0.3),
    "cy": (_cy, "change sub()", 0.6),
}
"""Each coding agent: its change, what it says, and when it starts (s)."""

MARKS = {"ada": '"""The sum of a and b."""', "bo": "return sum((a, b))"}
"""What each kept change leaves in calc.py (cy's is refused by design)."""


@dataclass
class CodingResult:
    """How the coding story ended."""

    lost: list[str] = field(default_factory=list)
    broken: bool = False
    steps: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        """No change lost, main passes its check."""
        return not self.lost and not self.broken


def _git(repo: Path, *args: str, who: str = "dev") -> str:
    done = subprocess.run(["git", "-C", str(repo), "-c", f"user.name={who}", "-c", f"user.email={who}@example.com",
                           *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def make_repo(path: Path) -> Path:
    """The story's repository: calc.py on main."""
    path.mkdir(parents=True, exist_ok=True)
    _git(path, "init", "-q", "-b", "main")
    (path / FILE).write_text(ORIGINAL)
    _git(path, "add", FILE)
    _git(path, "commit", "-qm", "calc: add and sub")
    return path


def _judge(repo: Path, result: CodingResult) -> CodingResult:
    text = (repo / FILE).read_text() if (repo / FILE).exists() else ""
    result.lost = [agent for agent, mark in MARKS.items() if mark not in text]
    result.broken = subprocess.run(CHECK, shell=True, cwd=repo, capture_output=True).returncode != 0
    return result


def unsafe_story(folder: Path) -> CodingResult:
    """The three agents on one working tree of main, no queue: each writes the file as it read it."""
    repo = make_repo(folder / "coding-unsafe")
    seen = {agent: (repo / FILE).read_text() for agent in AGENTS}  # all read before any writes
    result = CodingResult()
    for agent, (change, what, _start) in AGENTS.items():
        (repo / FILE).write_text(change(seen[agent]))
        _git(repo, "commit", "-qam", f"{agent}: {what}", who=agent)
        result.steps.append(f"{agent} committed to main")
    return _judge(repo, result)


async def safe_story(settings: Settings, enroll: Callable[[str], Awaitable[Settings]]) -> CodingResult:
    """The three agents in sandboxes, merging through the queue with the check. ``enroll(name)``
    awaits the settings a coding agent signs with."""
    from arbiter.agents import ArbiterClient

    repo = settings.repositories()["demo"].path
    result = CodingResult()

    async def agent(name: str) -> None:
        change, what, start = AGENTS[name]
        await asyncio.sleep(start)
        mine = await enroll(name)
        async with ArbiterClient(name, mine) as client, client.sandbox("demo", keep=False) as box:
            path = box.path / FILE
            await asyncio.to_thread(path.write_text, change(path.read_text()))
            await asyncio.to_thread(_git, box.path, "commit", "-qam", f"{name}: {what}", who=name)
            await asyncio.sleep(0.8 - start)  # they all think for a while: their merges meet in the queue
            outcome = await box.merge(f"{name}: {what}")
            if outcome.reason == "version_conflict":
                paths = outcome.diagnostic.get("conflicts", [])
                still = await box.rebase()
                result.steps.append(f"{name}: version_conflict in {', '.join(paths)}; rebase names "
                                    f"{', '.join(still) or 'nothing'}")
                # It re-plans on the new head: the same change, made on what is there now.
                await asyncio.to_thread(_git, box.path, "reset", "-q", "--hard", await box.head(), who=name)
                await asyncio.to_thread(path.write_text, change(path.read_text()))
                await asyncio.to_thread(_git, box.path, "commit", "-qam", f"{name}: {what}, on the new head",
                                        who=name)
                outcome = await box.merge(f"{name}: {what}")
            if outcome.applied:
                result.steps.append(f"{name}: merged ({str(outcome.result['head'])[:10]})")
            else:
                result.steps.append(f"{name}: {outcome.reason} - refused, main unchanged")

    await asyncio.gather(*(agent(name) for name in AGENTS))
    return await asyncio.to_thread(_judge, repo, result)


def describe(unsafe: CodingResult | None, safe: CodingResult) -> list[str]:
    """The story's lines for the demo's summary."""
    lines = ["coding agents (ada, bo, cy on one repository's calc.py; the check: its tests):"]
    if unsafe is not None:
        lines.append(f"  without Arbiter (one working tree on main): {len(unsafe.lost)} of 2 kept changes lost "
                     f"({', '.join(unsafe.lost) or 'none'}), main {'broken' if unsafe.broken else 'passes'}")
    lines.append(f"  with Arbiter (a sandbox each, one merge queue): {len(safe.lost)} lost, main "
                 f"{'broken' if safe.broken else 'passes its check'}")
    lines += [f"    {step}" for step in safe.steps]
    return lines
