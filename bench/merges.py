"""``python -m bench merges``: merges/s of coding agents in separate processes sharing one train, and the hook.

- Throughput: ``--agents`` coding agents (4), each its own process (``python -c``: the SDK, as a coding
  agent's session is), make a sandbox of one real repository, commit a small change to a file of their
  own and merge it, ``--rounds`` times (3), all at once (the clock starts once every agent is enrolled and in
  its sandbox), through a real worker and a real check runner (``arbiter runner``), with the repository's
  check a 1 s ``sleep``: merges per second with the runner at depth 1 (serial: each merge is checked
  after the one ahead landed) and at ``--depth`` (4: each is checked on top of the ones ahead, at once);
  and, for the floor, without a check.
- Preflight: ``git merge-tree --write-tree`` of a one-file change against a head that moved, in
  repositories of 100 to 10,000 files (median of 5).
- The hook: ``arbiter-hook`` answered by ``arbiter hook serve`` (the agent's long-lived process), over
  ``--hook-calls`` (1,000) PreToolUse edits: p50 and p99 in ms, and the one-shot CLI hook for comparison;
  and how soon ``arbiter mcp`` answers ``initialize`` after its launch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from arbiter.mcp import hookclient
from arbiter.processes import RunnerProcess, settings_env

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


AGENT = """
import asyncio, subprocess, sys, time
from arbiter.agents import ArbiterClient
name, rounds = sys.argv[1], int(sys.argv[2])
IDENTITY = ["-c", f"user.name={name}", "-c", f"user.email={name}@example.com"]

def git(path, *args):
    subprocess.run(["git", "-C", str(path), *IDENTITY, *args], check=True, capture_output=True)

async def main():
    async with ArbiterClient(name) as client, client.sandbox("app") as box:
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the bench starts every agent's merges at once
        for r in range(rounds):
            if r:
                git(box.path, "fetch", "-q", "origin", "main")
                git(box.path, "rebase", "-q", "origin/main")
            (box.path / f"{name}.txt").write_text(f"round {r}\\n")
            git(box.path, "add", f"{name}.txt")
            git(box.path, "commit", "-qm", f"{name} {r}")
            outcome = await box.merge(f"{name}: round {r}")
            if not outcome.applied:
                raise SystemExit(f"a merge was refused: {outcome.reason} {outcome.diagnostic}")
            print(time.time(), flush=True)

asyncio.run(main())
"""


async def throughput(agents: int, rounds: int, check: str | None, depth: int) -> float:
    """Merges/s of ``agents`` processes merging ``rounds`` times each through one train."""
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)  # the check's user (nobody, under root) reads the scratch copies, not this
        repo = make_repo(Path(folder), 100)
        config = Path(folder) / "repos.toml"
        config.write_text(f"[repos.app]\npath = {json.dumps(str(repo))}\n"
                          + (f"check = {json.dumps(check)}\ncheck_timeout_seconds = 60\n" if check else ""))
        async with bench_arbiter(repos_file=config) as settings:
            # The bench is one user that trusts its agents: not root, its checks run as this very user.
            runner = RunnerProcess(settings, depth=depth, trusted_agents=True).start()
            procs: list[asyncio.subprocess.Process] = []
            try:
                env = settings_env(settings)
                for i in range(agents):
                    procs.append(await asyncio.create_subprocess_exec(
                        sys.executable, "-c", AGENT, f"coder-{i}", str(rounds), env=env, stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE))
                # Each agent process starts, enrolls and makes its sandbox first: the clock measures the merges.
                for proc in procs:
                    assert proc.stdout is not None
                    if await proc.stdout.readline() != b"ready\n":
                        _, err = await proc.communicate()
                        raise SystemExit(f"an agent failed before its merges: {err.decode()[-500:]}")
                started = time.perf_counter()
                outs = await asyncio.gather(*(p.communicate(b"go\n") for p in procs))
                took = time.perf_counter() - started
            finally:
                runner.stop()
                for proc in procs:  # after a failure, no agent is left waiting for its go
                    if proc.returncode is None:
                        proc.kill()
                        await proc.wait()
            failed = [err.decode()[-500:] for (_, err), p in zip(outs, procs, strict=True) if p.returncode]
            if failed:
                raise SystemExit(f"an agent failed: {failed[0]}")
            count = sum(len(out.split()) for out, _ in outs)
            heads = _git(repo, "rev-list", "--first-parent", "--count", "main")
    label = f"with a check ({check}), runner depth {depth}" if check else "without a check"
    print(f"merges: {count} merges by {agents} agent processes at once, {label}: {count / took:5.2f} merges/s "
          f"({took:.1f} s; main has {heads} first-parent commits)")
    return count / took


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench merges", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--sizes", default="100,1000,10000", help="repository sizes (files) for the preflight")
    parser.add_argument("--hook-calls", type=int, default=1000)
    args = parser.parse_args(argv)
    preflight([int(s) for s in args.sizes.split(",")])
    asyncio.run(throughput(args.agents, args.rounds, None, 1))
    serial = asyncio.run(throughput(args.agents, args.rounds, "sleep 1", 1))
    shared = asyncio.run(throughput(args.agents, args.rounds, "sleep 1", args.depth))
    print(f"merges: with a 1 s check, the shared train at depth {args.depth} is {shared / serial:.1f}x serial "
          "(target >= 2.5x)")
    if args.hook_calls:
        asyncio.run(hook_latency(args.hook_calls))


async def hook_latency(calls: int) -> None:
    """The hook's latency, as a coding agent sees it (a process per call)."""
    with tempfile.TemporaryDirectory() as folder:
        repo = make_repo(Path(folder), 100)
        async with bench_arbiter(repos=f"app={repo}") as settings:
            env = settings_env(settings)
            server = await asyncio.create_subprocess_exec(sys.executable, "-m", "arbiter", "hook", "serve", "--agent",
                                                          "coder-0", env=env, stderr=asyncio.subprocess.DEVNULL)
            try:
                await asyncio.to_thread(_wait_for_socket, Path(hookclient.socket_path(settings.home, "coder-0")))
                edit = json.dumps({"session_id": "s", "cwd": str(repo), "hook_event_name": "PreToolUse",
                                   "tool_name": "Edit", "tool_input": {"file_path": str(repo / "src/d000/f00001.py"),
                                                                       "old_string": "1", "new_string": "2"}})
                hook = [str(Path(sys.executable).parent / "arbiter-hook"), "--agent", "coder-0"]
                fast = await _timed(hook, edit, env, calls)
                ready = statistics.median([await _mcp_ready(env) for _ in range(5)])
                slow = await _timed([sys.executable, "-m", "arbiter", "hook", "pre-tool-use", "--agent", "coder-0"],
                                    edit, env, 20)
            finally:
                server.terminate()
                await server.wait()
            gone, mute = await _unanswered(hook, edit, env, Path(hookclient.socket_path(settings.home, "coder-0")))
    print(f"hook: arbiter-hook answered by arbiter hook serve, {calls} edits: p50 {fast[0]:.0f} ms, p99 {fast[1]:.0f} "
          f"ms (targets 50 / 150); the one-shot CLI hook connecting to Kafka itself, 20 edits: p50 {slow[0]:.0f} ms")
    print(f"hook: blocked with its reason when nothing answers, 20 edits each: no process {gone[0]:.0f} / "
          f"{gone[1]:.0f} ms, a process that never answers {mute[0]:.0f} / {mute[1]:.0f} ms (p50 / max; target 500)")
    print(f"mcp: arbiter mcp answers initialize over stdio {ready:.2f} s after launch (median of 5; target 1.5)")


INITIALIZE = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}})


async def _mcp_ready(env: dict[str, str]) -> float:
    """Seconds from launching ``arbiter mcp`` to its answer to ``initialize``, as a coding agent starts it."""
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "arbiter", "mcp", "--agent", "coder-1", env=env,
                                                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(INITIALIZE.encode() + b"\n")
        await proc.stdin.drain()
        answer = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
        took = time.perf_counter() - started
        if "result" not in answer:
            raise SystemExit(f"arbiter mcp did not initialize: {answer}")
        return took
    finally:
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _unanswered(hook: list[str], edit: str, env: dict[str, str], path: Path) -> tuple[tuple[float, float], ...]:
    """(p50, max) ms of the hook blocking a call: with no process to ask, and with one that never answers."""
    import socket

    async def blocked() -> tuple[float, float]:
        times = []
        for _ in range(20):
            started = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(*hook, env=env, stdin=asyncio.subprocess.PIPE,
                                                        stdout=asyncio.subprocess.DEVNULL,
                                                        stderr=asyncio.subprocess.DEVNULL)
            await proc.communicate(edit.encode())
            if proc.returncode != hookclient.EXIT_BLOCK:
                raise SystemExit(f"the hook answered exit {proc.returncode} with nothing to ask: it must block")
            times.append((time.perf_counter() - started) * 1000)
        return statistics.median(times), max(times)

    await asyncio.to_thread(path.unlink, True)
    gone = await blocked()
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(64)
        mute = await blocked()
    return gone, mute


def _wait_for_socket(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"arbiter hook serve never listened at {path}")
        time.sleep(0.05)


async def _timed(command: list[str], stdin: str, env: dict[str, str], calls: int) -> tuple[float, float]:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(*command, env=env, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        await proc.communicate(stdin.encode())
        if proc.returncode:
            raise SystemExit(f"{command[0]} answered exit {proc.returncode}: the edit was to be allowed")
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.99))]
