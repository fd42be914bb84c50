"""``python -m bench merges``: the merge queue's throughput, and preflight time against repository size.

- Throughput: ``--agents`` coding agents (4) each make a sandbox of one real repository, commit a
  small change to a file of their own, and merge it through a real worker, ``--rounds`` times (3),
  all at once: merges per second without a check, and with a 1 s check (``sleep 1`` on the merge
  result, the repository's check in a ``repos.toml``) two ways: serial (``box.merge``: the repository's
  lease is the queue, so each
  merge waits for the checks of all those ahead) and speculative (one ``MergeTrain`` of depth
  ``--agents``: each merge checked on top of those ahead of it, at once, landed in order).
- Preflight: ``git merge-tree --write-tree`` of a one-file change against a head that moved, in
  repositories of 100 to 10,000 files (median of 5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from arbiter.agents import ArbiterClient, MergeTrain

from .env import bench_arbiter

IDENTITY = ["-c", "user.name=bench", "-c", "user.email=bench@example.com"]


def _git(repo: Path, *args: str, stdin: str | None = None) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          input=stdin).stdout.strip()


def make_repo(root: Path, files: int) -> Path:
    """A repository with ``files`` small files in folders of 100, in one commit (by fast-import)."""
    repo = root / f"repo-{files}"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    lines = ["commit refs/heads/main", "committer bench <bench@example.com> 0 +0000", "data 4", "init"]
    for i in range(files):
        body = f"value_{i} = {i}\n"
        lines += [f"M 100644 inline src/d{i // 100:03d}/f{i:05d}.py", f"data {len(body)}", body.rstrip("\n")]
    _git(repo, "fast-import", "--quiet", stdin="\n".join(lines) + "\n")
    _git(repo, "reset", "-q", "--hard", "main")
    return repo


def preflight(sizes: list[int]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        for files in sizes:
            repo = make_repo(Path(folder), files)
            base = _git(repo, "rev-parse", "main")
            _git(repo, "branch", "work")
            (repo / "src/d000/f00000.py").write_text("value_0 = 'main moved'\n")
            _git(repo, *IDENTITY, "commit", "-qam", "main moves")
            _git(repo, "checkout", "-q", "work")
            last = f"src/d{(files - 1) // 100:03d}/f{files - 1:05d}.py"
            (repo / last).write_text("changed = True\n")
            _git(repo, *IDENTITY, "commit", "-qam", "work")
            _git(repo, "checkout", "-q", base)
            times = []
            for _ in range(5):
                started = time.perf_counter()
                _git(repo, "merge-tree", "--write-tree", "main", "work")
                times.append((time.perf_counter() - started) * 1000)
            print(f"merges: preflight (git merge-tree --write-tree) in a repository of {files:>6,} files: "
                  f"{statistics.median(times):6.1f} ms (median of 5)")


async def throughput(agents: int, rounds: int, check: str | None, speculative: bool = False) -> float:
    with tempfile.TemporaryDirectory() as folder:
        repo = make_repo(Path(folder), 100)
        config = Path(folder) / "repos.toml"
        config.write_text(f"[repos.app]\npath = {json.dumps(str(repo))}\n"
                          + (f"check = {json.dumps(check)}\ncheck_timeout_seconds = 60\n" if check else ""))
        async with bench_arbiter(repos_file=config) as settings:
            merged: list[float] = []
            train = MergeTrain(depth=agents) if speculative and check else None

            async def agent(i: int) -> None:
                async with ArbiterClient(f"coder-{i}", settings) as client, client.sandbox("app") as box:
                    for r in range(rounds):
                        if r:
                            await asyncio.to_thread(_git, box.path, "rebase", "-q", "main")
                        path = box.path / f"agent-{i}.txt"
                        await asyncio.to_thread(path.write_text, f"round {r}\n")
                        await asyncio.to_thread(_git, box.path, "add", path.name)
                        await asyncio.to_thread(_git, box.path, *IDENTITY, "commit", "-qm", f"coder-{i} {r}")
                        if train is not None:
                            outcome = await box.merge(f"coder-{i}: round {r}", train=train)
                        else:
                            outcome = await box.merge(f"coder-{i}: round {r}")
                        if not outcome.applied:
                            raise SystemExit(f"a merge was refused: {outcome.diagnostic}")
                        merged.append(time.perf_counter())

            started = time.perf_counter()
            await asyncio.gather(*(agent(i) for i in range(agents)))
            took = time.perf_counter() - started
            if train is not None:
                await train.close()
            count = len(merged)
            heads = _git(repo, "rev-list", "--first-parent", "--count", "main")
        label = f"with a check ({check})" if check else "without a check"
        mode = "speculative" if train is not None else "serial"
        extra = (f"; {train.stats.checks_started} checks, at most {train.stats.most_at_once} at once"
                 if train is not None else "")
        print(f"merges: {count} merges by {agents} agents at once, {mode}, {label}: {count / took:5.2f} merges/s "
              f"({took:.1f} s; main has {heads} first-parent commits{extra})")
        return count / took


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench merges", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="100,1000,10000", help="repository sizes (files) for the preflight")
    args = parser.parse_args(argv)
    preflight([int(s) for s in args.sizes.split(",")])
    asyncio.run(throughput(args.agents, args.rounds, None))
    serial = asyncio.run(throughput(args.agents, args.rounds, "sleep 1"))
    speculative = asyncio.run(throughput(args.agents, args.rounds, "sleep 1", speculative=True))
    print(f"merges: with a 1 s check, speculative is {speculative / serial:.1f}x serial")
