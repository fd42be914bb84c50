"""Shared fixtures, and each test's tier. Tests marked ``kafka`` need a real broker and FAIL when none answers.

The broker is the one ``ARBITER_BOOTSTRAP`` names (``./dev test`` and ``.ci/run``
start the local one). Each test module gets topics and a consumer group of its own,
so tests never see each other's messages.

Every test is in one tier (``./dev test --tier NAME`` runs one): ``e2e`` is marked by hand;
a test that needs a service (marked ``kafka`` or ``postgres``) is ``broker``; the rest are
``pure``. The tiers say how big a test is; ``kafka`` and ``postgres`` say what it needs, and
a test that asks for the broker or a PostgreSQL ledger is marked so here even if its module
forgot, so it can never land in ``pure``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from arbiter.edge.settings import Settings, Topics, load_settings
from arbiter.kafka import broker_answers
from arbiter.processes import DoorProcess, WorkerPool
from arbiter.streams.runtime.topics import ensure_topics

if TYPE_CHECKING:
    from arbiter.audit.log import Log

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
"""The checkout's root: test modules take it from here, whatever their depth under tests/."""


TIERS = ("pure", "broker", "e2e")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by the tiers given here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark what each test needs, then its tier (the module's docstring says how)."""
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if "bootstrap" in item.fixturenames and "bootstrap" not in params:  # the fixture, not a parameter so named
            item.add_marker(pytest.mark.kafka)
        if params.get("ledger_dsn") == "postgres":
            item.add_marker(pytest.mark.postgres)
        marked = [tier for tier in TIERS if item.get_closest_marker(tier) is not None]
        if marked not in ([], ["e2e"]):
            raise pytest.UsageError(f"{item.nodeid} is marked {marked}: only e2e is marked by hand, "
                                    "tests/conftest.py gives pure and broker")
        needs_a_service = any(item.get_closest_marker(name) is not None for name in ("kafka", "postgres"))
        item.add_marker("e2e" if marked else "broker" if needs_a_service else "pure")
    _biggest_first(items)


def _biggest_first(items: list[pytest.Item]) -> None:
    """Files with e2e tests first, then those with broker tests, then pure ones, each file's tests in their
    order: ``./dev test`` hands a whole file to each of its processes (``--dist loadfile``), in this order, and
    the long files started last would leave the others idle at the end while they finish."""
    rank: dict[str, int] = {}
    for item in items:
        tier = next(t for t in TIERS if item.get_closest_marker(t) is not None)
        module = item.nodeid.split("::")[0]
        rank[module] = min(rank.get(module, 2), {"e2e": 0, "broker": 1, "pure": 2}[tier])
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # (stable: a file's tests keep their order)


@pytest.fixture(scope="session")
def bootstrap() -> str:
    """The broker under test. Missing is a failure, never a skip."""
    settings = load_settings()
    if not broker_answers(settings.bootstrap, timeout=10):
        pytest.fail(
            f"no Kafka broker answers at {settings.bootstrap}. Integration tests never skip: "
            "run them with ./dev test (which starts the local broker) or set ARBITER_BOOTSTRAP.",
            pytrace=False,
        )
    return settings.bootstrap


def isolated_settings(bootstrap: str, tmp_home: Path, **overrides: object) -> Settings:
    """Settings whose topics and consumer group belong to one test only."""
    run = uuid.uuid4().hex[:10]
    topics = Topics(**{name: f"t{run}.{name}" for name in Topics.model_fields})
    values: dict[str, object] = {
        "bootstrap": bootstrap,
        "topics": topics,
        "app_id": f"test-{run}",
        "home": tmp_home,
        "partitions": 2,
        # Each test's home gets its own admin key; its agents are issued keys on first use.
        "auto_enroll": True,
    }
    values.update(overrides)
    settings = Settings(**values)  # type: ignore[arg-type]
    _THROWAWAY.append(settings)
    return settings


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every user can reach (pytest's own are root's alone), with ``open/`` that every user may
    write: what a check could touch if nothing stopped it."""
    folder = Path(tempfile.mkdtemp(prefix="arbiter-test-checks-"))
    folder.chmod(0o755)
    (folder / "open").mkdir()
    (folder / "open").chmod(0o777)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def share_broker_jars(home: Path) -> Path:
    """Give a test's own broker home the jars the main broker fetched, when they are current (no second
    download from Maven Central); ``home``."""
    from arbiter.kafka import LocalKafka

    main = LocalKafka(load_settings())
    if main.jars_current():
        own = LocalKafka(Settings(home=home, kafka_version=main.version)).libs
        own.parent.mkdir(parents=True, exist_ok=True)
        if not own.exists():
            own.symlink_to(main.libs)
    return home


_THROWAWAY: list[Settings] = []
"""Every test's settings: their topics are deleted when the session ends."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Delete the topics the tests created, so a local broker does not pile up thousands of them
    (it slows down, then runs out of heap). Nothing to do when no broker answers."""
    from arbiter.streams.runtime.topics import delete_topics_named

    by_bootstrap: dict[str, list[Settings]] = {}
    for settings in _THROWAWAY:
        by_bootstrap.setdefault(settings.bootstrap, []).append(settings)
    for bootstrap, runs in by_bootstrap.items():
        if not broker_answers(bootstrap):
            continue
        prefixes = tuple(p for s in runs for p in (f"{s.topics.resource_commands.split('.')[0]}.", f"{s.app_id}-"))
        try:
            asyncio.run(delete_topics_named(runs[0], prefixes))
        except Exception as exc:  # cleanup only: never fail a run over it
            print(f"\ncould not delete the tests' topics on {bootstrap}: {exc}")


def postgres_dsn() -> str:
    """The PostgreSQL the ledger tests use. Missing is a failure, never a skip."""
    dsn = os.environ.get("ARBITER_TEST_POSTGRES_DSN", "")
    if not dsn:
        pytest.fail("ARBITER_TEST_POSTGRES_DSN is not set. Ledger tests run against a real PostgreSQL: "
                    "run them with ./dev test (which starts Debian's postgresql) or set the DSN.", pytrace=False)
    return dsn


@pytest.fixture(params=["sqlite", "postgres"])
def ledger_dsn(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh ledger database of each kind: an SQLite file, and a PostgreSQL schema of its own."""
    if request.param == "sqlite":
        return str(tmp_path / "ledger.sqlite3")
    return fresh_postgres_schema()


def fresh_postgres_schema() -> str:
    """A DSN whose search path is a new, empty schema of the test PostgreSQL."""
    dsn = postgres_dsn()
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in dsn else "?"
    return f"{dsn}{sep}options=-csearch_path%3D{schema}"


@pytest.fixture
def kafka_settings(bootstrap: str, tmp_path: Path) -> Settings:
    """Isolated settings with their topics created."""
    settings = isolated_settings(bootstrap, tmp_path)
    asyncio.run(ensure_topics(settings))
    return settings


@pytest.fixture
def workers(kafka_settings: Settings) -> Iterator[WorkerPool]:
    """A pool of real ``arbiter worker`` processes; stopped after the test."""
    pool = WorkerPool(kafka_settings)
    yield pool
    pool.stop()


async def settled_log(settings: Settings, within: float = 20) -> Log:
    """The test's whole log, once the decisions of what it holds are on it too.

    An agent's answer and the event it reports are separate records, and the answer can be read
    first: while the audit finds work still open, and nothing wrong, read the log again (for at
    most ``within`` seconds; what is still open then is the audit's to report)."""
    from arbiter.audit import audit
    from arbiter.audit.log import read_log

    deadline = time.monotonic() + within
    while True:
        log = await read_log(settings)
        partial = await audit(log, settings, complete=False)
        severities = {f["severity"] for f in partial["findings"]}
        if "open" not in severities or severities - {"open"} or time.monotonic() > deadline:
            return log
        await asyncio.sleep(0.2)


async def assert_clean_audit(settings: Settings, archive: Path | None = None) -> dict[str, object]:
    """Audit the test's whole log: zero violations, nothing left open. Optionally keep an archive."""
    from arbiter.audit import audit
    from arbiter.audit.log import write_archive

    log = await settled_log(settings)
    if archive is not None:
        write_archive(archive, log)
    report = await audit(log, settings)
    problems = [f"{f['check']}: {f['message']} at {f['where']}" for f in report["findings"]]
    assert report["verdict"] == "pass" and not problems, "\n".join(problems)
    return report


@pytest.fixture
async def worker(kafka_settings: Settings, workers: WorkerPool) -> AsyncIterator[WorkerPool]:
    """One real worker, serving every partition before the test starts."""
    from arbiter.agents import ArbiterClient
    from arbiter.processes import wait_until_served
    from arbiter.schemas.partitioning import key_for_partition

    workers.start(1)
    keys = [key_for_partition(p, kafka_settings.partitions) for p in range(kafka_settings.partitions)]
    async with ArbiterClient("warmup", kafka_settings) as client:
        await wait_until_served(client, workers, keys)
    yield workers


@pytest.fixture
async def door(kafka_settings: Settings, worker: WorkerPool) -> AsyncIterator[DoorProcess]:
    """A real front door (``arbiter serve``) in front of one real worker; stopped after the test."""
    process = DoorProcess(kafka_settings)
    await asyncio.to_thread(process.start)
    try:
        yield process
    finally:
        await asyncio.to_thread(process.stop)
