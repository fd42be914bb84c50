"""The front door's interactive docs (``/docs``) work offline: Swagger UI's assets come from the door
itself, never a CDN. Checked in Debian's headless Chromium with every name but loopback unresolvable;
the screenshot is kept under ``$ARBITER_TEST_ARTIFACTS``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import urllib.request
from pathlib import Path

import pytest

from arbiter.processes import DoorProcess
from tests.audit.test_audit_html import REPO, chromium

pytestmark = pytest.mark.kafka

OFFLINE = "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1"


def _browse(url: str, profile: Path, *args: str) -> str:
    proc = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--no-first-run",
         f"--user-data-dir={profile}", OFFLINE, "--virtual-time-budget=8000", *args, url],
        capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.stdout


async def test_the_docs_render_without_a_network(door: DoorProcess, tmp_path: Path) -> None:
    await asyncio.to_thread(_check_docs, door.url, tmp_path)


def _check_docs(url: str, tmp_path: Path) -> None:
    page = urllib.request.urlopen(f"{url}/docs", timeout=10).read().decode()
    assert "/docs/assets/swagger-ui-bundle.js" in page and "cdn" not in page.lower(), page[:500]
    dom = _browse(f"{url}/docs", tmp_path / "profile", "--dump-dom")
    assert 'class="swagger-ui"' in dom, dom[:1000]
    for path in ("/v1/leases/acquire", "/v1/commit", "/v1/sagas/{saga_id}/abort"):
        assert path in dom, f"{path} is not on the rendered page"
    artifacts = Path(os.environ.get("ARBITER_TEST_ARTIFACTS") or REPO / ".arbiter" / "test-artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "door-docs.png"
    shot.unlink(missing_ok=True)
    _browse(f"{url}/docs", tmp_path / "profile2", f"--screenshot={shot}", "--window-size=1280,1400")
    assert shot.is_file() and shot.stat().st_size > 10_000, "no screenshot"
