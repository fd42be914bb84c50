"""A repository's check, run as the operator configured it, on real git: it gets a scratch copy of the tree
(no link back to the repository), an environment of its own, another user when Arbiter is root, and
limits of time and output; nothing it does reaches Arbiter's secrets or the repository."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
from pathlib import Path

import pytest

from arbiter.edge.settings import Repository, Settings
from arbiter.streams.tools import checks
from arbiter.streams.tools.checks import CheckUserError, check_account, run_check, trusted_check_user


def sh(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=dev", "-c", "user.email=dev@example.com",
                           *args], check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(shared: Path) -> Path:
    repo = shared / "app"
    repo.mkdir()
    sh(repo, "init", "-q", "-b", "main")
    (repo / "app.py").write_text("print('app')\n")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_app.py").write_text("assert True\n")
    # What an agent could commit to hide its tests from a check made with `git archive`.
    (repo / ".gitattributes").write_text("tests/ export-ignore\n")
    sh(repo, "add", "-A")
    sh(repo, "commit", "-qm", "init")
    return repo


def check(repo: Path, command: str, **options: object) -> Repository:
    return Repository(name="app", path=repo, check=command, **options)  # type: ignore[arg-type]


def run(repo: Path, command: str, **options: object):  # type: ignore[no-untyped-def]
    # Root (CI): the checks run as nobody. Not root: as this very user, said explicitly, as a runner must.
    return asyncio.run(run_check(repo, "main", check(repo, command, **options), check_user=trusted_check_user()))


def test_the_check_sees_the_whole_tree_and_no_way_back_to_the_repository(repo: Path) -> None:
    result = run(repo, "test -f tests/test_app.py && test -f app.py && test ! -e .git && git status")
    assert not result.passed and "not a git repository" in result.output, result
    assert run(repo, "test -f tests/test_app.py && test ! -e .git").passed
    tree = sh(repo, "rev-parse", "main^{tree}")
    assert result.tree == tree and len(result.output_digest) == 64


def test_the_check_gets_none_of_arbiters_environment(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARBITER_KAFKA_PASSWORD", "s3cret")
    monkeypatch.setenv("ARBITER_HOME", "/srv/arbiter")
    result = run(repo, "env", check_env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert result.passed, result
    names = {line.split("=", 1)[0] for line in result.output.splitlines() if "=" in line}
    assert names <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_ALL", "CI", "PWD", "SHLVL", "_", "PYTHONDONTWRITEBYTECODE",
                     "OLDPWD"}, names
    assert "s3cret" not in result.output and "/srv/arbiter" not in result.output


def test_as_root_the_check_is_another_user_who_cannot_read_a_key_or_write_the_repository(
        repo: Path, shared: Path) -> None:
    secret = shared / "open" / "worker.key"  # in a folder it may enter: only the key's mode stops it
    secret.write_text("PRIVATE")
    secret.chmod(0o600)
    marker = repo / "planted"
    control = shared / "open" / "reached"
    attempt = f"cat {secret}; touch {marker}; touch {repo}/.git/hooks/post-checkout; touch {control}; id -un"
    result = run(repo, attempt)
    who = check_account(trusted_check_user())
    if os.geteuid() == 0:
        assert who.name == "nobody" and who.drop and result.user == "nobody", result
        assert "PRIVATE" not in result.output and "Permission denied" in result.output, result.output
        assert not marker.exists() and not (repo / ".git" / "hooks" / "post-checkout").exists()
        assert control.exists(), "the check did run, and could write where every user may"
        assert result.output.strip().splitlines()[-1] == "nobody"
    else:  # not root: the process's own user, named explicitly (one user that trusts its agents)
        assert not who.drop and result.user == who.name


def test_the_check_user_cannot_be_root_or_unknown() -> None:
    with pytest.raises(CheckUserError, match="does not exist"):
        check_account("no-such-user-here")
    if os.geteuid() == 0:
        with pytest.raises(CheckUserError, match="may not be root"):
            check_account("root")


def test_not_as_root_a_check_runs_as_the_runners_own_user_only_when_that_user_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding: a runner that was not root, with no check user set, ran checks as its own user, who can read
    its key file and /proc/<runner>/environ and so sign its own pass. It is refused, saying how to fix it,
    unless the check user names this very user (one user that trusts its agents)."""
    entry = next(e for e in pwd.getpwall() if e.pw_uid != 0)
    monkeypatch.setattr(os, "geteuid", lambda: entry.pw_uid)
    with pytest.raises(CheckUserError, match=f"ARBITER_CHECK_USER={entry.pw_name}") as refused:
        check_account("")
    assert "read this runner's key" in str(refused.value) and "as root" in str(refused.value)
    with pytest.raises(CheckUserError, match="not root"):
        asyncio.run(run_check(Path("/nonexistent"), "main", Repository(name="app", path=Path("/x"), check="true")))
    who = check_account(entry.pw_name)
    assert (who.name, who.uid, who.drop) == (entry.pw_name, entry.pw_uid, False)
    assert trusted_check_user() == entry.pw_name and trusted_check_user("ci") == "ci"


def test_a_check_past_its_time_is_stopped_with_everything_it_started(repo: Path, shared: Path) -> None:
    alive, started = shared / "open" / "alive", shared / "open" / "started"
    result = run(repo, f"touch {started}; (sleep 2; touch {alive}) & sleep 30", check_timeout_seconds=0.5)
    assert started.exists(), "the check ran, and could write the marker"
    assert not result.passed and result.exit_code is None and "stopped after 0.5 s" in result.output, result
    assert result.seconds < 10
    asyncio.run(asyncio.sleep(2.5))
    assert not alive.exists(), "the background job the check started was killed with it"


def test_a_check_that_ends_leaves_nothing_running(repo: Path, shared: Path) -> None:
    alive, started = shared / "open" / "alive", shared / "open" / "started"
    result = run(repo, f"touch {started}; (sleep 1; touch {alive}) > /dev/null 2>&1 & echo done")
    assert result.passed and "done" in result.output and result.seconds < 5, result
    assert started.exists(), "the check ran, and could write the marker"
    asyncio.run(asyncio.sleep(1.5))
    assert not alive.exists()


needs_namespaces = pytest.mark.skipif(os.geteuid() != 0, reason="checks get a PID namespace of their own as root "
                                     "(CI runs as root: there, a kernel that refuses one fails these tests)")


@needs_namespaces
def test_a_check_that_detaches_leaves_nothing_running_after_its_verdict(repo: Path, shared: Path) -> None:
    """Finding: a check that left its session (setsid, a double fork) outlived the kill of its session and
    kept running as the check user after its verdict, where it could tamper with later checks. Each check is
    the first process of a PID namespace of its own: when it ends, or is stopped at its time limit, the kernel
    kills all it started. (The wait is on the clock: what is asserted is that a timer never fires.)"""
    ended, stopped = shared / "open" / "after-end", shared / "open" / "after-stop"
    result = run(repo, f"setsid -f sh -c 'sleep 2; touch {ended}'; (setsid sh -c 'sleep 2; touch {ended}' &); "
                       "echo detached")
    assert result.passed and "detached" in result.output, result
    result = run(repo, f"setsid -f sh -c 'sleep 2; touch {stopped}'; sleep 30", check_timeout_seconds=0.5)
    assert not result.passed and result.stopped == "time", result
    asyncio.run(asyncio.sleep(3))
    assert not ended.exists(), "a process a check detached outlived the check"
    assert not stopped.exists(), "a process a check detached outlived the check stopped at its time limit"


@needs_namespaces
def test_as_root_the_check_keeps_no_capability_and_is_its_namespaces_first_process(repo: Path) -> None:
    result = run(repo, "grep -E '^(Cap|NoNewPrivs)' /proc/self/status; echo pid $$")
    fields = dict(line.split(":", 1) for line in result.output.splitlines() if ":" in line)
    assert {name: int(value, 16) for name, value in fields.items() if name.startswith("Cap")} == {
        "CapInh": 0, "CapPrm": 0, "CapEff": 0, "CapBnd": 0, "CapAmb": 0}, result.output
    assert int(fields["NoNewPrivs"]) == 1 and "pid 1" in result.output and result.user == "nobody", result.output


def test_where_no_namespace_can_be_made_checks_run_without_one_and_say_so(
        repo: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    if os.geteuid() != 0:
        pytest.skip("checks get a PID namespace of their own only as root")
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: None)  # no unshare, as on a bare machine
    checks._pid_namespace_tools.cache_clear()
    try:
        result = run(repo, "id -un; echo pid $$")
    finally:
        checks._pid_namespace_tools.cache_clear()
    assert result.passed and result.user == "nobody" and "pid 1\n" not in result.output + "\n", result
    assert "may leave processes behind" in caplog.text


def test_a_check_that_prints_too_much_is_stopped_and_fails(repo: Path) -> None:
    result = run(repo, "yes arbiter", check_output_bytes=100_000, check_timeout_seconds=30)
    assert not result.passed and result.exit_code is None and "printed over 100000 bytes" in result.output
    assert 100_000 < result.output_bytes < 1_000_000 and len(result.output) < 5_000


def test_a_tree_over_check_tree_bytes_is_not_written_and_its_check_fails(
        repo: Path, shared: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding: a check's scratch copy was whatever the commit's tree held, so a huge blob that compresses to
    little in git could fill the runner's disk. A tree over check_tree_bytes fails its check, unwritten."""
    (repo / "big.bin").write_bytes(bytes(5_000_000))  # 5 MB of zeros: a few kB in git
    sh(repo, "add", "big.bin")
    sh(repo, "commit", "-qm", "big")
    files = [p for p in repo.rglob("*") if p.is_file() and ".git" not in p.relative_to(repo).parts]
    size = sum(p.stat().st_size for p in files) + checks.ENTRY_BYTES * (len(files) + 1)  # and tests/
    assert checks.tree_bytes(repo, sh(repo, "rev-parse", "main^{tree}")) == size
    ran, commands = shared / "open" / "ran", []
    real = checks.git
    monkeypatch.setattr(checks, "git", lambda at, *args, **kw: commands.append(args) or real(at, *args, **kw))
    result = run(repo, f"touch {ran}", check_tree_bytes=1_000_000)
    assert not result.passed and result.exit_code is None and result.tree == sh(repo, "rev-parse", "main^{tree}")
    assert f"takes {size} bytes" in result.output and "over check_tree_bytes = 1000000" in result.output, result
    assert not ran.exists() and not any("read-tree" in args for args in commands), "nothing was written"
    assert run(repo, f"touch {ran}", check_tree_bytes=size).passed and ran.exists(), "at the limit, it runs"
    assert check(repo, "true", check_tree_bytes=size).check_digest() != check(repo, "true").check_digest()


def test_a_tree_that_holds_one_folder_many_times_is_measured_without_being_listed_out(repo: Path) -> None:
    """Ten folders that each hold the same ten folders, nine deep, over ten 4-byte files: 10^10 files, from
    a dozen objects. Its size is computed from the distinct objects (no `ls-tree -r` of 10^10 lines)."""
    def git_in(*args: str, stdin: str = "") -> str:
        return subprocess.run(["git", "-C", str(repo), *args], input=stdin, check=True, capture_output=True,
                              text=True).stdout.strip()

    blob = git_in("hash-object", "-w", "--stdin", stdin="lol\n")
    level = git_in("mktree", stdin="".join(f"100644 blob {blob}\tf{i}\n" for i in range(10)))
    for _ in range(9):
        level = git_in("mktree", stdin="".join(f"040000 tree {level}\td{i}\n" for i in range(10)))
    sh(repo, "update-ref", "refs/heads/bomb", sh(repo, "commit-tree", level, "-p", "main", "-m", "bomb"))
    folders = sum(10**k for k in range(1, 10))
    assert checks.tree_bytes(repo, level) == 10**10 * (4 + checks.ENTRY_BYTES) + folders * checks.ENTRY_BYTES
    result = asyncio.run(run_check(repo, "bomb", check(repo, "true", check_tree_bytes=1 << 30),
                                   check_user=trusted_check_user()))
    assert not result.passed and "over check_tree_bytes" in result.output and result.seconds < 10, result


def test_the_repository_configuration_is_the_operators_file(tmp_path: Path) -> None:
    (tmp_path / "repos.toml").write_text('[repos.app]\npath = "~/src/app"\ncheck = ["make", "test"]\n'
                                         'check_timeout_seconds = 90\ncheck_tree_bytes = 5_000_000\n')
    repos = Settings(home=tmp_path, repos="docs=/src/docs").repositories()
    assert repos["app"].check == ("make", "test") and repos["app"].check_timeout_seconds == 90
    assert repos["app"].check_tree_bytes == 5_000_000 and repos["docs"].check_tree_bytes == 1 << 30
    assert repos["app"].path == Path("~/src/app").expanduser() and repos["docs"].check is None
    assert Repository(name="a", path=Path("."), check="pytest -q").check == ("/bin/sh", "-c", "pytest -q")
    assert repos["app"].check_digest() != Repository(name="app", path=Path("."), check=["make"]).check_digest()
    (tmp_path / "repos.toml").write_text('[repos.docs]\npath = "/x"\n')
    with pytest.raises(ValueError, match="configured twice"):
        Settings(home=tmp_path, repos="docs=/src/docs").repositories()
    (tmp_path / "repos.toml").write_text('[repos.app]\npath = "/x"\nchek = "typo"\n')
    with pytest.raises(ValueError, match=r"\[repos.app\].*chek"):
        Settings(home=tmp_path).repositories()
    (tmp_path / "repos.toml").write_text("not toml [")
    with pytest.raises(ValueError, match="cannot be read"):
        Settings(home=tmp_path).repositories()
