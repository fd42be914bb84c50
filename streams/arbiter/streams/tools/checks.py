"""Running a repository's check on a commit, as the operator configured it, with nothing of Arbiter's.

Theory of operation
-------------------
A check is the repository's configuration (``arbiter.edge.settings.Repository``: a command, a time
limit, an output limit), set by the operator; no call on any surface names a command. What a check
runs is the agents' code (their tests, their build), so it gets nothing an agent could not have:

- **A scratch copy, not a worktree.** The commit's tree is written into a fresh folder with git's
  ``read-tree -u`` through an index of its own: no ``.git`` link back to the repository, so the check
  cannot write the repository's refs, hooks or configuration, and no ``.gitattributes`` the agent
  committed can leave a file out (``git archive`` would honour ``export-ignore``).
- **An environment of its own.** ``PATH``, ``HOME`` and ``TMPDIR`` inside the scratch folder, a locale,
  ``CI=1`` and the repository's ``check_env``: none of the process's variables (no ``ARBITER_*``, no
  key paths, no Kafka credentials).
- **Another user.** As root, the check runs as ``check_user`` (``nobody`` unless the operator names
  another), which cannot read Arbiter's keys (mode 0600) nor write the repository. Not as root, a
  check would run as the process's own user, who can read the runner's key (its file, its
  environment) and so sign its own pass: ``check_account`` refuses that unless ``check_user`` names
  this very user, which says that one user trusts its agents (the demo, the benchmarks, the tests).
- **Its own PID namespace.** As root, the check is the first process of a PID namespace of its own
  (``unshare --pid``, then ``setpriv`` to the check user with no capability left): when it ends, or is
  killed at a limit, the kernel kills every process it started, even one that left its session
  (``setsid``, a double fork), so nothing of one agent's check is left running, as the check user, to
  tamper with the next. Where no namespace can be made (an unprivileged container), checks run
  without one, and a warning says that they may leave processes behind.
- **Limits.** A tree that would take more than ``check_tree_bytes`` is not written out: the check
  fails without running (a small commit can hold a huge tree: one big blob that compresses well, or
  one folder held ten times by a folder held ten times...). The command's whole session (everything it
  started) is killed at its time limit, when its output passes the output limit, and when it ends;
  the scratch folder is removed after.

The result names the tree that was checked, the check's digest (the configuration it ran), the exit
status and a digest of the whole output, with its tail to show.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from arbiter.edge.settings import Repository
from arbiter.streams.tools.git import git

log = logging.getLogger("arbiter.checks")

TAIL_BYTES = 4000
"""How much of a check's output a result keeps to show (its tail)."""
ENTRY_BYTES = 256
"""What each file and folder of a tree counts for against ``check_tree_bytes`` besides its content (its
inode, its index entry): millions of empty files fill a disk too."""


@dataclass(frozen=True)
class CheckResult:
    """What a check printed, and whether it passed."""

    command: str
    """The configured command, as text (what the log and the answers show)."""
    passed: bool
    exit_code: int | None
    """None: it was stopped (time or output limit)."""
    seconds: float
    output: str
    """The output's tail (``TAIL_BYTES``)."""
    tree: str = ""
    """The tree the check ran on: what a merge that cites this check must produce."""
    check_digest: str = ""
    """Which configuration ran (``Repository.check_digest``)."""
    output_digest: str = ""
    """SHA-256 of everything the check printed (what it was stopped at, when it was stopped)."""
    output_bytes: int = 0
    user: str = ""
    """The user the command ran as."""
    stopped: str = ""
    """'' (it ended), 'time' or 'output': the limit it was stopped at."""

    def to_dict(self) -> dict[str, Any]:
        """JSON form, as diagnostics carry it."""
        return dict(self.__dict__)


class CheckUserError(RuntimeError):
    """The configured check user cannot be used by this process."""


@dataclass(frozen=True)
class _Account:
    name: str
    uid: int
    gid: int
    drop: bool
    """True when the check runs as another user than this process."""


def check_account(name: str) -> _Account:
    """Who a check runs as: ``name``, or ``nobody`` when this process is root and names no one.
    ``CheckUserError`` when this process cannot become ``name``, and when it is not root and names no one:
    its checks would run as its own user, who can read its key, and that must be said (see the message)."""
    me = os.geteuid()
    if not name:
        if me != 0:
            own = _own_user()
            raise CheckUserError(
                f"this process runs as {own!r} (uid {me}), not root, and no check user is set: its checks would run "
                f"as {own!r}, who can read this runner's key (its key file, its environment) and so sign a check's "
                "pass. Run the runner as root (checks run as ARBITER_CHECK_USER, nobody by default), or, for one "
                f"user whose agents are trusted, set ARBITER_CHECK_USER={own} to accept that checks can read the "
                "runner's key")
        name = "nobody"  # never run an agent's code as root
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise CheckUserError(f"check user {name!r} does not exist on this machine (ARBITER_CHECK_USER)") from None
    if entry.pw_uid == 0:
        raise CheckUserError("checks run the agents' code: ARBITER_CHECK_USER may not be root")
    if entry.pw_uid == me:
        return _Account(entry.pw_name, entry.pw_uid, entry.pw_gid, False)
    if me != 0:
        raise CheckUserError(f"this process runs as uid {me}, not root: it cannot run checks as {name!r}; run it "
                             f"as root, or as {name!r} itself (one user that trusts its agents: its checks can "
                             "read the runner's key)")
    return _Account(entry.pw_name, entry.pw_uid, entry.pw_gid, True)


def trusted_check_user(configured: str = "") -> str:
    """The check user of a deployment that is one user trusting its own agents (the demo, the benchmarks,
    the tests): ``configured`` when set; as root, '' (``nobody``); else this process's own user, named
    explicitly, as ``check_account`` wants it (its checks can read the runner's key)."""
    if configured or os.geteuid() == 0:
        return configured
    return _own_user()


def _own_user() -> str:
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:  # a uid with no name (a container's): a name check_account cannot look up either
        raise CheckUserError(f"this process's uid {uid} has no user name on this machine: name a check user "
                             "(ARBITER_CHECK_USER)") from None


def tree_bytes(repo: Path, tree: str) -> int:
    """What writing ``tree`` out takes: its files' sizes, and ``ENTRY_BYTES`` for each file and folder, a
    folder counted as often as the tree holds it. Computed over the distinct objects, in four git commands
    whatever the tree holds: listing it out (``ls-tree -r``) would be as big as what is measured. Blocking."""
    ids = git(repo, "rev-list", "--objects", "--no-object-names", tree).stdout.split()
    sizes: dict[str, int] = {}
    trees = []
    described = git(repo, "cat-file", "--batch-check=%(objectname) %(objecttype) %(objectsize)",
                    stdin="".join(f"{oid}\n" for oid in ids)).stdout
    for line in described.splitlines():
        oid, kind, size = line.split()
        sizes[oid] = int(size)
        if kind == "tree":
            trees.append(oid)
    entries = _entries(repo, trees)
    total: dict[str, int] = {}
    stack = [tree]
    while stack:  # depth first, without recursion: a tree may nest deeper than Python's stack
        top = stack[-1]
        if top in total:  # pushed again, by another folder that holds it, before it was counted
            stack.pop()
            continue
        waiting = [oid for mode, oid in entries.get(top, ()) if mode == "040000" and oid not in total]
        if waiting:
            stack.extend(dict.fromkeys(waiting))
            continue
        stack.pop()
        # A submodule (160000) is written as an empty folder; a symbolic link's content is its target.
        total[top] = sum(ENTRY_BYTES + (total[oid] if mode == "040000" else 0 if mode == "160000" else sizes[oid])
                         for mode, oid in entries.get(top, ()))
    return total[tree]


def _entries(repo: Path, trees: list[str]) -> dict[str, list[tuple[str, str]]]:
    """Each tree's own entries, (mode, object id), from one ``diff-tree --stdin`` against the empty tree."""
    empty = git(repo, "hash-object", "-t", "tree", "--stdin", stdin="").stdout.strip()
    found: dict[str, list[tuple[str, str]]] = {oid: [] for oid in trees}
    current: list[tuple[str, str]] = []
    # Quoted paths keep one entry a line, in ASCII, whatever the name (a tab, a newline, bytes not UTF-8).
    listing = git(repo, "-c", "core.quotePath=true", "diff-tree", "--stdin", "--raw",
                  stdin="".join(f"{empty} {oid}\n" for oid in trees)).stdout
    for line in listing.splitlines():
        if line.startswith(":"):  # ":000000 <mode> 0000... <id> A<TAB><path>"
            fields = line.split("\t", 1)[0].split()
            current.append((fields[1], fields[3]))
        elif line.strip():  # "<empty tree> <tree>": the tree whose entries follow
            current = found[line.split()[-1]]
    return found


def _materialize(repo: Path, commit: str, scratch: Path, account: _Account, limit: int) -> tuple[str, int]:
    """Write ``commit``'s tree into ``scratch/work`` (no link to the repository) when it takes at most
    ``limit`` bytes (``tree_bytes``); (its tree id, what it takes). Blocking."""
    tree = git(repo, "rev-parse", "--verify", f"{commit}^{{tree}}").stdout.strip()
    size = tree_bytes(repo, tree)
    if size > limit:
        return tree, size
    work = scratch / "work"
    work.mkdir()
    env = {"GIT_INDEX_FILE": str(scratch / "index")}
    git(repo, f"--work-tree={work}", "read-tree", "-u", "--reset", tree, env=env)
    (scratch / "index").unlink(missing_ok=True)
    for name in ("home", "tmp"):
        (scratch / name).mkdir()
    if account.drop:
        for root, dirs, files in os.walk(scratch):
            for item in (root, *(os.path.join(root, n) for n in dirs + files)):
                os.lchown(item, account.uid, account.gid)
    return tree, size


def _environment(repository: Repository, scratch: Path) -> dict[str, str]:
    env = {"PATH": repository.check_path, "HOME": str(scratch / "home"), "TMPDIR": str(scratch / "tmp"),
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "CI": "1"}
    env.update(repository.check_env)
    return env


def _setpriv(setpriv: str, account: _Account) -> list[str]:
    """``setpriv`` to ``account``, keeping nothing of root's: no groups, no capability (none inheritable, none
    a set-user-ID or file-capability program could get back: empty bounding set, no new privileges)."""
    return [setpriv, f"--reuid={account.uid}", f"--regid={account.gid}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs", "--pdeathsig=KILL", "--"]


_namespace_probe = threading.Lock()


@functools.cache
def _pid_namespace_tools() -> tuple[str, str] | None:
    """(unshare, setpriv) when a check can run in a PID namespace of its own here, else None (warned once).
    Their paths are resolved here, from this process's PATH: root must never look them up in a check's PATH,
    which may name a folder of the agents' tree. Blocking, run once (root only)."""
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    why = "unshare or setpriv (util-linux) is not installed"
    if unshare and setpriv:
        nobody = _Account("nobody", 65534, 65534, True)
        try:
            probe = subprocess.run([unshare, "--pid", "--fork", "--kill-child", *_setpriv(setpriv, nobody),
                                    "/bin/sh", "-c", "exit 0"], capture_output=True, text=True, timeout=10)
            if probe.returncode == 0:
                return unshare, setpriv
            why = (probe.stderr or probe.stdout).strip()[:300] or f"exit status {probe.returncode}"
        except (OSError, subprocess.SubprocessError) as error:
            why = str(error)
    log.warning("checks cannot run in a PID namespace of their own here (%s): a check that detaches (setsid, a "
                "double fork) may leave processes behind, running as the check user after its verdict, where they "
                "can tamper with later checks. Run the runner where it may make namespaces (as root on the host, "
                "or in a container allowed to unshare)", why)
    return None


def pid_namespaces() -> bool:
    """Whether checks run in PID namespaces of their own here: as root, where the kernel lets this process
    make them. Blocking the first time (it tries)."""
    if os.geteuid() != 0:
        return False
    with _namespace_probe:
        return _pid_namespace_tools() is not None


def _command(argv: list[str], account: _Account) -> tuple[list[str], dict[str, Any]]:
    """What starts the check, and how: as root, in a PID namespace of its own as the check user (see the
    module's text), or, where none can be made, as the check user without one; else as this process's user."""
    if not account.drop:
        return argv, {}
    with _namespace_probe:
        tools = _pid_namespace_tools()
    if tools is None:
        return argv, {"user": account.uid, "group": account.gid, "extra_groups": []}
    # Started as root: unshare's child, the namespace's first process, becomes the check user and then the
    # check itself, so the kernel kills the whole namespace when the check ends. (--kill-child's signal does
    # not outlive that change of user: _stop kills the check itself.) Each is killed when its parent dies
    # (--pdeathsig, set again after the change of user, which clears it): a runner killed mid-check leaves
    # no check running on with nobody to stop it at its limits.
    unshare, setpriv = tools
    return [setpriv, "--pdeathsig=KILL", unshare, "--pid", "--fork", "--kill-child", *_setpriv(setpriv, account),
            *argv], {}


class _Output:
    """A check's output as it comes: its digest, its size and its tail; over the limit, the check is killed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.digest = hashlib.sha256()
        self.total = 0
        self.tail = b""
        self.over = False

    async def read(self, stream: asyncio.StreamReader, proc: asyncio.subprocess.Process) -> None:
        while chunk := await stream.read(65536):
            self.digest.update(chunk)
            self.total += len(chunk)
            self.tail = (self.tail + chunk)[-TAIL_BYTES:]
            if self.total > self.limit and not self.over:
                self.over = True
                _stop(proc)


async def _run(argv: list[str], cwd: Path, env: dict[str, str], account: _Account, repository: Repository
               ) -> tuple[int | None, _Output, str]:
    """(exit code or None when stopped, the output, the limit it was stopped at: '', 'time' or 'output')."""
    command, extra = await asyncio.to_thread(_command, argv, account)
    proc = await asyncio.create_subprocess_exec(
        *command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True, **extra)
    assert proc.stdout is not None
    output = _Output(repository.check_output_bytes)
    reader = asyncio.create_task(output.read(proc.stdout, proc))
    stopped = ""
    try:
        async with asyncio.timeout(repository.check_timeout_seconds):
            await proc.wait()
    except TimeoutError:
        stopped = "time"
    finally:
        _stop(proc)  # its namespace and its session: whatever the check left running goes too
        await proc.wait()
        # Every writer of the pipe is dead now, unless one left the session with no namespace to end it: do
        # not wait on it for ever.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5):
                await asyncio.shield(reader)
        reader.cancel()
    if output.over:
        stopped = "output"
    return (None if stopped else proc.returncode), output, stopped


async def run_check(repo: Path, commit: str, repository: Repository, *, check_user: str = "") -> CheckResult:
    """Run ``repository``'s check on ``commit`` of the git repository at ``repo`` (see the module's text)."""
    if repository.check is None:
        raise ValueError(f"repository {repository.name!r} has no check configured")
    account = check_account(check_user)
    started = time.monotonic()
    scratch = Path(tempfile.mkdtemp(prefix="arbiter-check-"))
    try:
        tree, size = await asyncio.to_thread(_materialize, repo, commit, scratch, account,
                                             repository.check_tree_bytes)
        if size > repository.check_tree_bytes:  # a failed check, as any other: the train goes on without it
            shown = (f"(check not run: its tree takes {size} bytes, {ENTRY_BYTES} for each file and folder "
                     f"besides their content, over check_tree_bytes = {repository.check_tree_bytes})")
            return CheckResult(repository.check_text(), False, None, round(time.monotonic() - started, 3), shown,
                               tree, repository.check_digest(), user=account.name)
        code, output, stopped = await _run(list(repository.check), scratch / "work",
                                           _environment(repository, scratch), account, repository)
    finally:
        await asyncio.shield(asyncio.to_thread(shutil.rmtree, scratch, True))
    said = {"time": f"(check stopped after {repository.check_timeout_seconds:g} s)",
            "output": f"(check stopped: it printed over {repository.check_output_bytes} bytes)"}
    shown = output.tail.decode(errors="replace") + (f"\n{said[stopped]}" if stopped else "")
    return CheckResult(repository.check_text(), code == 0, code, round(time.monotonic() - started, 3), shown,
                       tree, repository.check_digest(), output.digest.hexdigest(), output.total, account.name,
                       stopped)


def _stop(proc: asyncio.subprocess.Process) -> None:
    """Kill a check: the first process of its PID namespace (the kernel then kills every other one in it,
    wherever it went), then its session (all there is to kill without a namespace). Killing ``unshare`` alone
    would not do: the parent-death signal it gives its child is dropped when that child changes user."""
    if proc.returncode is None:  # not reaped yet: its pid is still its own, and its children are the check's
        for child in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
    _kill(proc.pid)


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc; a check's process may name itself anything)."""
    try:
        pids = [entry.name for entry in os.scandir("/proc") if entry.name.isdigit()]
    except OSError:  # no /proc (not Linux): its session is all there is to kill
        return []
    found = []
    for each in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = Path("/proc", each, "stat").read_bytes()
            if int(stat.rsplit(b")", 1)[1].split()[1]) == pid:  # after the name: "state ppid ..."
                found.append(int(each))
    return found


def _kill(pid: int) -> None:
    """Kill a check's session: the command and everything it started there."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
