"""The live console in Debian's headless Chromium, against a real door and worker during a real run: it
loads without console errors, a lease granted after it opened appears within a second, a deadlock shows
its cycle and victim, names are rendered as text (a ``<script>`` resource runs nothing), and an agent's
search opens its timeline. A screenshot is kept as the test's artifact."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from arbiter.agents import ArbiterClient
from arbiter.edge.settings import Settings
from arbiter.processes import DoorProcess, WorkerPool, settings_env, wait_until_served
from arbiter.schemas import DeadlockDetected
from arbiter.schemas.partitioning import key_for_partition
from bench.cdp import Browser
from tests.audit.test_audit_html import chromium

LIVE = "document.getElementById('status').textContent === 'live'"
"""The page's stream is open (the door's live feed has caught up with the log first: on a busy broker, seconds)."""

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]

HOSTILE = 'doc:<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'


def artifacts(tmp_path: Path) -> Path:
    """Where a test's artifacts go: ``ARBITER_TEST_ARTIFACTS`` when set (CI keeps it), else the test's folder."""
    folder = Path(os.environ.get("ARBITER_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


async def test_the_console_shows_a_live_run(kafka_settings: Settings, door: DoorProcess, tmp_path: Path) -> None:
    settings = kafka_settings
    async with ArbiterClient("ann", settings) as ann, ArbiterClient("bob", settings) as bob, \
            Browser(chromium(), tmp_path / "profile") as page:
        early = await ann.acquire("doc:before", ttl=60)  # in the snapshot the page gets first
        await page.open(door.url + "/")
        await page.until(LIVE, timeout=30)
        await page.until("document.querySelector('#leases tr[data-resource=\"doc:before\"]') !== null")

        # A grant after the page opened is on it within a second.
        sent = time.time() * 1000
        lease = await bob.acquire("doc:live", ttl=60)
        appeared = await page.until("window.arbiterConsole.appeared['doc:live\\u0000bob']", timeout=5)
        assert appeared - sent < 1000, f"the grant took {appeared - sent:.0f} ms to appear"
        queued = asyncio.create_task(ann.acquire("doc:live", ttl=60, wait=30))
        await page.until("[...document.querySelectorAll('#leases tr')].some(r => r.dataset.resource === 'doc:live' "
                         "&& r.textContent.includes('ann'))")

        # A name is text: nothing in it runs, nothing becomes an element.
        hostile = await ann.acquire(HOSTILE, ttl=60)
        await page.until(f"[...document.querySelectorAll('#leases tr')].some(r => r.dataset.resource === "
                         f"{json.dumps(HOSTILE)})")
        assert await page.eval("window.pwned === undefined && document.querySelectorAll('#leases img, "
                               "#leases script').length === 0")

        # A deadlock shows its cycle and its victim.
        async with ann.delegate(to="bob", task="review"), bob.delegate(to="ann", task="merge"):
            found = await asyncio.wait_for(_first_deadlock(ann, bob), 60)
            victim = await page.until("document.querySelector('#deadlocks .cycle')?.dataset.victim", timeout=5)
            assert victim == found.victim
            text = await page.eval("document.getElementById('deadlocks').textContent")
            assert "ann" in text and "bob" in text and "victim" in text, text

        # A search opens the agent's timeline.
        await page.eval("document.getElementById('search').value = 'bob'; document.getElementById('search')"
                        ".dispatchEvent(new KeyboardEvent('keydown', {key: 'Enter'}))")
        await page.until("document.querySelectorAll('#history tr').length > 0")
        assert "doc:live" in await page.eval("document.getElementById('history').textContent")

        await bob.release(lease)
        granted = await queued  # the queued grant follows the release
        await page.until("[...document.querySelectorAll('#leases tr')].some(r => r.dataset.resource === 'doc:live' "
                         "&& r.querySelector('.held').textContent === 'ann')")
        shot = await page.screenshot(artifacts(tmp_path) / "console.png")
        assert shot.stat().st_size > 10_000
        assert page.errors == [], page.errors
        for held in (granted, hostile, early):
            await ann.release(held)
    body = json.loads(await asyncio.to_thread(
        lambda: urllib.request.urlopen(door.url + "/console/history?name=doc:live", timeout=10).read()))
    assert [e["kind"] for e in body["events"]][:2] == ["granted", "queued"] and "token" not in json.dumps(body)


async def test_the_console_shows_running_workers_their_lag_and_whole_saga_rows(
        kafka_settings: Settings, workers: WorkerPool, tmp_path: Path) -> None:
    """A worker that stopped is not listed as one that runs; the lag is one figure; a saga's row, with its
    long id, fits its panel (its status and counts are not cut off)."""
    settings = kafka_settings
    workers.start(2)
    keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
    async with ArbiterClient("warmup", settings) as client:
        await wait_until_served(client, workers, keys)
    door = DoorProcess(settings, log_dir=tmp_path)
    await asyncio.to_thread(door.start)
    try:
        async with ArbiterClient("ann-of-the-long-name", settings) as ann, \
                Browser(chromium(), tmp_path / "profile") as page:
            saga = ann.open_saga("refund-order-8492-for-a-customer-who-waited")
            await saga.step("doc:console-saga", "commit", {"patch": {"x": 1}}, base_version=0,
                            compensate=("commit", {"patch": {"x": None}}))
            await ann.finish_saga(saga, "test")
            stopped = workers.workers[1]
            stopped.proc.send_signal(signal.SIGTERM)  # leaves the group as it stops
            await asyncio.to_thread(stopped.proc.wait, 30)

            await page.open(door.url + "/")
            await page.until(LIVE, timeout=30)
            running = await page.until("(() => { const w = [...document.querySelectorAll('#workers .worker')]"
                                       ".map(e => e.dataset.worker); return w.length === 1 && w; })()", timeout=15)
            assert running == ["worker-1"], running
            assert "1 stopped" in await page.eval("document.getElementById('workers').textContent")
            lag = await page.until("(t => !t.includes('measuring') && t)(document.getElementById('lag-total')"
                                   ".textContent)", timeout=15)
            assert lag.startswith("lag: "), lag
            cells = await page.until(f"""(() => {{
                const row = [...document.querySelectorAll('#sagas tr')].find(r => r.textContent.includes(
                    {json.dumps(saga.saga_id)}));
                if (!row) return null;
                const panel = row.closest('section').getBoundingClientRect();
                return [...row.cells].map(c => [c.textContent, c.getBoundingClientRect().right <= panel.right]);
            }})()""", timeout=15)
            assert [c[0] for c in cells] == [saga.saga_id, "COMPENSATED", "1 step, 1 compensated"], cells
            assert all(inside for _, inside in cells), f"a saga's cell reaches past its panel: {cells}"
            await page.screenshot(artifacts(tmp_path) / "console-workers.png")
            assert page.errors == [], page.errors
    finally:
        await asyncio.to_thread(door.stop)


async def _first_deadlock(*clients: ArbiterClient) -> DeadlockDetected:
    done, pending = await asyncio.wait({asyncio.ensure_future(c.wait_for_deadlock()) for c in clients},
                                       return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return done.pop().result()


async def test_arbiter_top_shows_holders_queues_and_refusals(kafka_settings: Settings, worker: object) -> None:
    async with ArbiterClient("ann", kafka_settings) as ann, ArbiterClient("bob", kafka_settings) as bob:
        held = await ann.acquire("doc:top", ttl=60)
        in_queue = asyncio.Event()
        queued = asyncio.create_task(bob.acquire("doc:top", ttl=60, wait=60, on_queued=lambda _q: in_queue.set()))
        await asyncio.wait_for(in_queue.wait(), 30)  # the worker queued bob (decided: on the log)
        done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "arbiter", "top", "--once"],
                                       capture_output=True, text=True, timeout=60,
                                       env={**settings_env(kafka_settings), "COLUMNS": "140"})
        assert done.returncode == 0, done.stderr
        line = next(li for li in done.stdout.splitlines() if "doc:top" in li)
        assert "ann" in line and "bob" in line, done.stdout
        await ann.release(held)
        await bob.release(await queued)



async def test_beyond_loopback_only_an_operators_key_opens_the_console(kafka_settings: Settings, worker: object,
                                                                       tmp_path: Path) -> None:
    from arbiter.agents.identities import Registrar

    registrar = Registrar(kafka_settings)
    keys = {}
    for name in ("ops", "ann"):
        await registrar.add(name)
        keys[name] = (await registrar.issue_credential(name, label="console"))[0].api_key()
    door = DoorProcess(kafka_settings.model_copy(update={"door_host": "0.0.0.0", "console_operators": "ops"}),
                       log_dir=tmp_path)
    await asyncio.to_thread(door.start)
    try:
        def status(key: str | None) -> int:
            request = urllib.request.Request(door.url + "/console/history?name=doc:x",
                                             headers={"Authorization": f"Bearer {key}"} if key else {})
            try:
                with urllib.request.urlopen(request, timeout=30) as answer:
                    return int(answer.status)
            except urllib.error.HTTPError as error:
                return int(error.code)

        assert await asyncio.to_thread(status, None) == 401
        assert await asyncio.to_thread(status, keys["ann"]) == 403
        assert await asyncio.to_thread(status, keys["ops"]) == 200
        page = await asyncio.to_thread(lambda: urllib.request.urlopen(door.url + "/", timeout=10).read().decode())
        assert "operator's API key" in page  # the page itself asks for it
    finally:
        door.stop()
