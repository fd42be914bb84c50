"""The demo's rogue agent: mallory joins the swarm mid-run, every attack of hers is refused,
and the summary says how; one that is not refused fails the demo loudly."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from arbiter.demo.rogue import DROPPED, FORBIDDEN, UNAUTHENTICATED, Attempt, RogueReport
from arbiter.demo.swarm import Plan
from arbiter.edge.settings import Settings, Topics
from arbiter.processes import settings_env
from tests.cli.test_cli import arbiter

# Each attempt of the demo's rogue agent (its row's start) and the reason it must be refused with.
EXPECTED = [
    (r"release \S+'s lease as \S+, unsigned", UNAUTHENTICATED, "dead letter + LockDenied to "),
    (r"renew \S+'s lease to 1 ms as \S+, with her own key", FORBIDDEN, "dead letter + LockDenied to "),
    (r"write as \S+ through the gateway, with an unregistered key", UNAUTHENTICATED, "dead letter + ToolRejected to "),
    (r"forged LockGranted into \S+'s inbox, with her own key", DROPPED, "'s SDK, forged count "),
    (r"forged DeadlockDetected into routing's inbox, posing as worker", DROPPED, "routing's SDK, forged count "),
    (r"forged wait-for edge of the lease book \(source lock\)", FORBIDDEN, "dead letter"),
    (r"forged LockRevokeRequested of \S+'s lease, as the operator", FORBIDDEN, "dead letter"),
    (r"forged LockTick \(the workers' clock\), an hour ahead", FORBIDDEN, "dead letter"),
    (r"forged CompensationRequested for routing's saga", FORBIDDEN, "dead letter"),
    (r"saga step on account:cust_\S+, outside her prefixes", FORBIDDEN, "dead letter"),
    (r"an intent id in the saga: namespace, on her own account", FORBIDDEN, "dead letter + ToolRejected to mallory"),
]


@pytest.mark.e2e
@pytest.mark.kafka
@pytest.mark.parametrize("via_http", [False, True], ids=["kafka", "front-door"])
def test_the_demo_refuses_every_attack_of_its_rogue_agent(bootstrap: str, tmp_path: Path, via_http: bool) -> None:
    from tests.conftest import isolated_settings

    # As the README runs it: no agent is enrolled on first use; the demo issues every key itself.
    env = settings_env(isolated_settings(bootstrap, tmp_path, auto_enroll=False))
    proc = arbiter("demo", "--workers", "1", "--speed", "100", "--seed", "5", "--keep",
                   *(["--via-http"] if via_http else []), env=env, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert ("the swarm's agents go through it" in out) == via_http, out
    verdict = next(line for line in out.splitlines() if line.startswith("audit of the run's log"))
    assert "PASS: no safety rule was broken; 2 intrusion(s) detected" in verdict, out
    # One verdict: the re-audit the demo suggests, and the HTML report, say the same.
    archive = next(line.split(": ", 1)[1].split(" (", 1)[0] for line in out.splitlines()
                   if line.startswith("log archive: "))
    again = arbiter("audit", "--log", archive, env=env, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert verdict.split("): ", 1)[1] in again.stdout, again.stdout
    page = Path(archive).with_name("audit.html").read_text()
    assert '<div class="verdict">PASS</div>' in page and "2 intrusion(s) detected" in page
    assert "rogue agent mallory (allowed account:mallory), joined mid-run: 11 attempts, 11 refused" in out, \
        out + proc.stderr
    assert "SECURITY" not in out and "NOT REFUSED" not in out and "UNEXPECTED" not in out, out
    rows = [line[2:] for line in out.splitlines() if line.startswith("  ") and " -> " in line]
    assert len(rows) == len(EXPECTED), out
    for row, (attempt, reason, how) in zip(rows, EXPECTED, strict=True):
        what, refusal = (part.strip() for part in row.split(" -> ", 1))
        assert re.fullmatch(attempt, what), (what, attempt)
        assert refusal.startswith(f"{reason} ("), row
        assert how in refusal.split("): ", 1)[0], row

    # Every agent the demo ran has a key of its own in the run's registry, good only for its
    # story's resources; none is left in a key file (they were handed over in memory).
    run = next(line.split("run ", 1)[1].split(":")[0] for line in out.splitlines() if "; run " in line)
    topics = Topics(**{name: f"arbiter.demo.{run}.{name}" for name in Topics.model_fields})
    from arbiter.agents.identities import Registrar

    entries = asyncio.run(Registrar(Settings(bootstrap=bootstrap, topics=topics, home=tmp_path)).entries())
    allowed = {e.name: e.allow for e in entries if e.role == "agent"}
    plan = Plan(seed=5, speed=100, run=run.replace("-", "_"))
    from arbiter.demo.coding import AGENTS as CODERS

    assert allowed == {**plan.agents(), **{name: ["repo:"] for name in CODERS}, "demo-warmup": ["probe:"],
                       "mallory": ["account:mallory"]}
    assert [e.name for e in entries if e.role == "worker"] == ["worker"]
    assert sorted(p.name for p in (tmp_path / "keys").glob("*.key")) == ["admin.key", "worker.key"]


def test_every_resource_of_the_swarm_lies_under_its_agents_prefixes() -> None:
    plan = Plan(seed=1, speed=4, run="r")
    agents = plan.agents()
    assert len(agents) == plan.triage_agents + 2 * plan.slow_agents + 4 + plan.drafters
    assert all(agents.values()), "an agent without prefixes may act on every resource"
    uses = {"triage-1": [f"account:{name}" for name in plan.accounts() if name.startswith("cust_")],
            "slow-2": ["account:vip_r_1"], "backup-1": ["account:vip_r_0"],
            "routing": ["repo:services/routing-r"], "drafter-3": [plan.document]}
    for agent, resources in uses.items():
        assert all(any(r.startswith(p) for p in agents[agent]) for r in resources), (agent, agents[agent])
    assert not any(p.startswith("account:vip_r_1") for p in agents["slow-1"])


def test_an_attempt_that_is_not_refused_fails_the_demo_loudly(capsys: pytest.CaptureFixture[str]) -> None:
    from arbiter.demo.runs import print_rogue as _print_rogue

    report = RogueReport(allow=["account:mallory"], attempts=[
        Attempt("release triage-1's lease as triage-1, unsigned", UNAUTHENTICATED, UNAUTHENTICATED, "dead letter",
                "the message is not signed"),
        Attempt("forged LockTick (the workers' clock), an hour ahead", FORBIDDEN,
                detail="no dead letter for t[0]@7 within 30 s"),
    ])
    assert not report.ok and report.refused == 1 and report.failed == 1
    _print_rogue(report)
    out = capsys.readouterr().out
    assert "2 attempts, 1 refused" in out
    assert "an hour ahead -> NOT REFUSED: no dead letter for t[0]@7 within 30 s" in out
    assert "SECURITY: the rogue agent mallory was not refused" in out
    # Refused, but for another reason than the rule says: that fails too.
    odd = RogueReport(attempts=[Attempt("x", FORBIDDEN, UNAUTHENTICATED, "dead letter", "unknown signing key")])
    assert not odd.ok and "UNEXPECTED: should be forbidden" in odd.lines()[1]
    assert not RogueReport().ok, "no attempt made is no proof"
