"""The audit HTML page: offline, faithful to the report, and drawn by a real browser.

The browser tests run Debian's headless Chromium and FAIL, never skip, when it is
missing (``.ci/run`` installs it with apt). The screenshot of the sample report is kept
as a test artifact under ``$ARBITER_TEST_ARTIFACTS`` (default ``.arbiter/test-artifacts``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from arbiter.audit.html import MAX_LANES, render
from tests.conftest import REPO

T0 = 1_700_000_000_000
NASTY = "doc:</script><!--<script>"  # a resource name that tries to end the JSON block early


def sample_report() -> dict[str, Any]:
    """3 resources, 5 leases, 2 waits, 2 rejections, 2 writes, 3 violations (2 placed), 1 deadlock, 2 sagas."""
    return {
        "verdict": "fail",
        "source": "kafka://127.0.0.1:9092",
        "messages": 1234,
        "span_ms": [T0, T0 + 8000],
        "checks": {
            "determinism": {"description": "re-derived decisions equal the recorded ones", "violations": 1, "open": 0},
            "mutual_exclusion": {"description": "no overlapping exclusive grants", "violations": 1, "open": 0},
            "fenced_writes": {"description": "no accepted write with a stale token", "violations": 1, "open": 0},
            "sagas_finished": {"description": "every saga ended", "violations": 0, "open": 1},
        },
        "stats": {"grants": 5, "writes": 2, "rejections": 2},
        "findings": [
            {"check": "sagas_finished", "severity": "open", "message": "saga:two is still running",
             "where": ["arbiter.saga.commands[0]@40"], "resource": None, "at_ms": None},
            {"check": "mutual_exclusion", "severity": "violation",
             "message": "a1 and b held account:acme <exclusively> at once",
             "where": ["arbiter.resource.events[0]@17", "arbiter.resource.events[0]@19"],
             "resource": "account:acme", "at_ms": T0 + 1500},
            {"check": "fenced_writes", "severity": "violation", "message": "write accepted with stale token 1",
             "where": ["arbiter.resource.events[1]@23"], "resource": NASTY, "at_ms": T0 + 4500},
            {"check": "determinism", "severity": "violation", "message": "replay granted token 3, log says 4",
             "where": ["arbiter.resource.events[2]@5"], "resource": None, "at_ms": None},
        ],
        "timeline": {
            "start_ms": T0,
            "end_ms": T0 + 8000,
            "resources": [
                {"resource": "account:acme",
                 "leases": [
                     {"agent": "a1", "token": 1, "mode": "exclusive", "start_ms": T0, "end_ms": T0 + 2000,
                      "end": "released", "where": "arbiter.resource.events[0]@17"},
                     {"agent": "b", "token": 2, "mode": "exclusive", "start_ms": T0 + 1000, "end_ms": T0 + 5000,
                      "end": "expired", "where": "arbiter.resource.events[0]@19"},
                 ],
                 "waits": [{"agent": "c", "start_ms": T0 + 500, "end_ms": T0 + 5000, "end": "timed_out"}],
                 "rejections": [{"agent": "a1", "at_ms": T0 + 2500, "reason": "stale_fencing_token", "token": 1,
                                 "where": "arbiter.resource.events[0]@21"}],
                 "writes": [{"agent": "a1", "at_ms": T0 + 1200, "version": 4, "tool": "refund",
                             "where": "arbiter.resource.events[0]@18"}]},
                {"resource": NASTY,
                 "leases": [
                     {"agent": "r1", "token": 1, "mode": "shared", "start_ms": T0 + 1000, "end_ms": T0 + 4000,
                      "end": "released", "where": "arbiter.resource.events[1]@20"},
                     {"agent": "r2", "token": 2, "mode": "shared", "start_ms": T0 + 1500, "end_ms": T0 + 6000,
                      "end": "revoked", "where": "arbiter.resource.events[1]@21"},
                 ],
                 "waits": [{"agent": "w", "start_ms": T0 + 2000, "end_ms": T0 + 6000, "end": "granted"}],
                 "rejections": [{"agent": "w", "at_ms": T0 + 3000, "reason": "stale_base_version", "token": None,
                                 "where": "arbiter.resource.events[1]@22"}],
                 "writes": [{"agent": "r1", "at_ms": T0 + 4500, "version": 7, "tool": "edit",
                             "where": "arbiter.resource.events[1]@23"}]},
                {"resource": "queue:jobs",
                 "leases": [{"agent": "w", "token": 1, "mode": "exclusive", "start_ms": T0 + 6000,
                             "end_ms": T0 + 8000, "end": "open", "where": "arbiter.resource.events[2]@30"}],
                 "waits": [], "rejections": [], "writes": []},
            ],
            "deadlocks": [{"at_ms": T0 + 3500, "victim": "b", "cycle": ["a", "b", "c"],
                           "where": "arbiter.wait.edges[0]@9"}],
            "sagas": [
                {"saga_id": "saga:one", "agent": "a1", "start_ms": T0 + 200, "end_ms": T0 + 5000,
                 "outcome": "COMPENSATED", "steps": 3, "compensations": [{"step": 2, "at_ms": T0 + 4200}]},
                {"saga_id": "saga:two", "agent": "b", "start_ms": T0 + 3000, "end_ms": T0 + 8000,
                 "outcome": "open", "steps": 1, "compensations": []},
            ],
        },
    }


def empty_report() -> dict[str, Any]:
    return {"verdict": "pass", "source": "/tmp/empty.jsonl", "messages": 0, "span_ms": [T0, T0],
            "checks": {}, "stats": {}, "findings": [],
            "timeline": {"start_ms": T0, "end_ms": T0, "resources": [], "deadlocks": [], "sagas": []}}


def crowded_report(lanes: int) -> dict[str, Any]:
    """``lanes`` resources of one lease each; the last one has a violation, so it must be drawn."""
    report = empty_report()
    report["verdict"] = "fail"
    report["span_ms"] = [T0, T0 + lanes]
    report["timeline"]["end_ms"] = T0 + lanes
    report["timeline"]["resources"] = [
        {"resource": f"r:{i:04}", "waits": [], "rejections": [], "writes": [],
         "leases": [{"agent": "a", "token": 1, "mode": "exclusive", "start_ms": T0 + i, "end_ms": T0 + i + 1,
                     "end": "released", "where": f"t[0]@{i}"}]}
        for i in range(lanes)]
    report["findings"] = [{"check": "monotonic_tokens", "severity": "violation", "message": "token went back",
                           "where": ["t[0]@9999"], "resource": f"r:{lanes - 1:04}", "at_ms": T0 + lanes - 1}]
    return report


def placed_violations(report: dict[str, Any]) -> int:
    return sum(1 for f in report["findings"]
               if f["severity"] == "violation" and f["resource"] is not None and f["at_ms"] is not None)


def data_block(page: str) -> str:
    (block,) = re.findall(r'<script type="application/json" id="audit-data">(.*?)</script>', page, re.DOTALL)
    return block


# -- the page itself ---------------------------------------------------------------------


def test_page_is_offline_and_carries_every_proof() -> None:
    report = sample_report()
    page = render(report)
    assert "http://" not in page and "https://" not in page
    for finding in report["findings"]:
        for where in finding["where"]:
            assert f"<code>{where}</code>" in page
    assert "VIOLATIONS" in page and "kafka://127.0.0.1:9092" in page
    static = page.replace(data_block(page), "")  # the JSON block holds the text raw, as script data
    assert "&lt;exclusively&gt;" in static and "<exclusively>" not in static


def test_violations_are_listed_before_open_items() -> None:
    page = render(sample_report())
    assert page.index("replay granted token 3") < page.index("saga:two is still running")
    assert page.index("write accepted with stale token") < page.index("saga:two is still running")


def test_json_block_round_trips_even_with_script_tags_in_names() -> None:
    report = sample_report()
    page = render(report)
    assert json.loads(data_block(page)) == report
    assert page.count("</script>") == 2  # the data block's and the renderer's own end tags, nothing else


def test_passing_report_says_pass() -> None:
    page = render(empty_report())
    assert ">PASS<" in page and "No findings." in page
    assert json.loads(data_block(page)) == empty_report()


def figures(page: str) -> dict[str, str]:
    """The page's headline figures, name -> value as shown."""
    return dict(re.findall(r"<dt>([^<]+)</dt><dd>([^<]+)", page))


def test_the_figures_count_each_severity_as_the_json_does() -> None:
    """Finding: a run whose only findings were two intrusions showed 'open items 2' while the JSON said
    0 open items (every finding that was not a violation was counted as open)."""
    report = empty_report()
    report["checks"] = {"authenticated": {"description": "every message is signed", "violations": 0,
                                          "intrusions": 2, "open": 0},
                        "sagas_finished": {"description": "every saga ended", "violations": 0, "intrusions": 0,
                                           "open": 1}}
    report["findings"] = [
        {"check": "authenticated", "severity": "intrusion", "message": f"a forged grant {i}",
         "where": [f"arbiter.agent.inbox[0]@{i}"], "resource": None, "at_ms": None} for i in range(2)]
    report["findings"].append({"check": "sagas_finished", "severity": "open", "message": "saga:x is running",
                               "where": ["arbiter.saga.commands[0]@1"], "resource": None, "at_ms": None})
    page = render(report)
    shown = figures(page)
    assert (shown["violations"], shown["intrusions"], shown["open items"]) == ("0", "2", "1"), shown
    row = re.search(r"<code>authenticated</code></td><td>[^<]*</td>((?:<td class=\"num\">\d+</td>)+)", page)
    assert row is not None and re.findall(r"\d+", row.group(1)) == ["0", "2", "0"], row
    assert "2 intrusions detected" in page


# -- in a real browser -------------------------------------------------------------------


def chromium() -> str:
    """Debian's Chromium. Missing is a failure, never a skip."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: the audit page is checked in Debian's headless Chromium, "
                    "which .ci/run installs with apt (apt-get install chromium).", pytrace=False)
    return found


def run_chromium(page: Path, profile: Path, *args: str) -> str:
    proc = subprocess.run(
        [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args, page.as_uri()],
        capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.stdout  # stderr carries harmless noise (dbus, GPU) and is ignored


class Elements(HTMLParser):
    """Every start tag of a dumped DOM, with its attributes."""

    def __init__(self, dom: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.feed(dom)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))

    def count(self, css_class: str) -> int:
        return sum(1 for _, attrs in self.tags if css_class in (attrs.get("class") or "").split())

    def by_id(self, element_id: str) -> dict[str, str | None]:
        (found,) = [attrs for _, attrs in self.tags if attrs.get("id") == element_id]
        return found


def browse(report: dict[str, Any], tmp_path: Path) -> tuple[Path, str]:
    page = tmp_path / "audit.html"
    page.write_text(render(report), encoding="utf-8")
    return page, run_chromium(page, tmp_path / "profile", "--dump-dom")


def test_browser_draws_the_timeline(tmp_path: Path) -> None:
    report = sample_report()
    page, dom = browse(report, tmp_path)
    elements = Elements(dom)
    assert elements.by_id("timeline").get("data-rendered") == "true"
    resources = report["timeline"]["resources"]
    assert elements.count("lease") == sum(len(r["leases"]) for r in resources) == 5
    assert elements.count("violation") == placed_violations(report) == 2
    assert elements.count("wait") == 2
    assert elements.count("rejection") == 2
    assert elements.count("write") == 2
    assert elements.count("deadlock") == 1
    assert elements.count("saga") == 2
    assert elements.count("compensation") == 1
    assert "victim b; cycle a \u2192 b \u2192 c \u2192 a" in dom
    assert {attrs.get("data-agent") for _, attrs in elements.tags if attrs.get("class") == "lease"} == {
        "a1", "b", "r1", "r2", "w"}

    artifacts = Path(os.environ.get("ARBITER_TEST_ARTIFACTS") or REPO / ".arbiter" / "test-artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "audit-report.png"
    shot.unlink(missing_ok=True)
    # Without this flag a busy machine sometimes captures before every tile is painted.
    run_chromium(page, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1400,900",
                 "--run-all-compositor-stages-before-draw")
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 5 * 1024


def test_browser_says_when_there_are_no_leases(tmp_path: Path) -> None:
    _, dom = browse(empty_report(), tmp_path)
    elements = Elements(dom)
    assert elements.by_id("timeline").get("data-rendered") == "true"
    assert "no leases in this log" in dom
    assert elements.count("lease") == 0


def test_browser_caps_the_lanes_and_keeps_violations(tmp_path: Path) -> None:
    report = crowded_report(MAX_LANES + 50)
    _, dom = browse(report, tmp_path)
    elements = Elements(dom)
    assert elements.by_id("timeline").get("data-rendered") == "true"
    assert elements.count("lease") == MAX_LANES
    assert elements.count("violation") == 1
    assert "50 more resources (50 leases) not drawn" in dom
