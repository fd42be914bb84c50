"""A repository's merge train through the resource shell, without Kafka or git: tools that answer as a host
would, leases from the lease core, verdicts as a runner sends them. Order, eviction of the culprit only,
entries whose lease died, a target that moved outside Arbiter, ids decided once, and a replay of the same
events giving the same train."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from arbiter.edge.settings import Settings
from arbiter.schemas import (
    Cause,
    CheckVerdict,
    LockReleaseRequested,
    LockRequested,
    MergeChecked,
    MergeQueued,
    MergeReplanned,
    Record,
    ToolApplied,
    ToolIntent,
    ToolRejected,
)
from arbiter.streams.cores import train
from arbiter.streams.cores.gateway import ToolOutcome
from arbiter.streams.cores.train import REPLANNED, Entry, Train, Verdict
from arbiter.streams.shells import Rules
from arbiter.streams.shells.resource import ResourceShell
from arbiter.streams.shells.routes import Routes
from arbiter.streams.tools.repository import MergeArgs

REPO = "repo:app"
DIGEST = "d" * 32
T0 = 1_700_000_000_000


@dataclass
class Host:
    """A repository host that answers as git would: the head moves by one 'commit' per landing."""

    head: str = "h0"
    check: str | None = DIGEST
    moved_outside: str | None = None
    landed: list[str] = field(default_factory=list)

    def names(self) -> frozenset[str]:
        return frozenset({"merge"})

    def parse(self, intent: ToolIntent) -> Any:
        return MergeArgs.model_validate_json(intent.arguments_json)

    async def run(self, intent: ToolIntent, arguments: Any) -> ToolOutcome:
        raise AssertionError("a merge is never run as a tool")

    async def read(self, request: Any) -> str | None:
        return None

    async def join(self, intent: ToolIntent, arguments: Any) -> ToolOutcome:
        return ToolOutcome(True, json.dumps({"commit": f"w-{intent.agent_id}", "head": self.head, "target": "main",
                                             "check_digest": self.check}))

    async def land(self, resource: str, entry: Entry, head: str, verdict: Verdict | None) -> ToolOutcome:
        if self.moved_outside is not None:
            self.head, self.moved_outside = self.moved_outside, None
        if head != self.head:
            return ToolOutcome(False, error="moved", reason=REPLANNED, details=(("head", self.head),))
        self.head = commit_of(entry.intent_id, head)
        self.landed.append(entry.intent_id)
        return ToolOutcome(True, json.dumps({"head": self.head, "previous": head, "tree": f"t-{self.head}"}))


def commit_of(intent_id: str, base: str) -> str:
    return f"{base}+{intent_id}"


@dataclass
class Rig:
    host: Host = field(default_factory=Host)
    sent: list[Record] = field(default_factory=list)
    offset: int = 0

    def __post_init__(self) -> None:
        settings = Settings()

        async def send(topic: str, key: bytes, record: Record) -> None:
            if topic == settings.topics.resource_events:
                self.sent.append(record)

        rules = Rules.from_settings(settings)
        self.shell = ResourceShell({}, {}, 1, rules.leases, rules.gateway, self.host,  # type: ignore[arg-type]
                                   Routes.of(settings.topics, "global"), send)

    def __call__(self, command: Record, at: int = 0) -> list[Record]:
        self.offset += 1
        before = len(self.sent)
        cause = Cause(topic="arbiter.resource.commands", partition=0, offset=self.offset)
        problem = asyncio.run(self.shell.handle(REPO.encode(), command, T0 + at, cause))
        assert problem is None, problem
        return self.sent[before:]

    def lease(self, agent: str, ttl_ms: int = 60_000) -> int:
        granted = self(LockRequested(request_id=f"l-{agent}-{self.offset}", agent_id=agent, resource=REPO,
                                     mode="shared", ttl_ms=ttl_ms, at_ms=T0))
        return next(e.token for e in granted if type(e).__name__ == "LockGranted")  # type: ignore[attr-defined]

    def merge(self, agent: str, token: int, intent_id: str = "") -> list[Record]:
        return self(ToolIntent(intent_id=intent_id or f"m-{agent}", agent_id=agent, resource=REPO, token=token,
                               tool="merge", arguments_json=json.dumps({"message": agent}), at_ms=T0))

    def verdict(self, intent_id: str, base: str, passed: bool = True, conflicts: list[str] | None = None,
                digest: str = DIGEST, stopped: str = "") -> list[Record]:
        return self(CheckVerdict(verdict_id=f"v-{intent_id}-{base}", runner_id="runner", resource=REPO,
                                 intent_id=intent_id, base=base, commit=commit_of(intent_id, base),
                                 tree=f"t-{commit_of(intent_id, base)}", check_digest=digest, passed=passed,
                                 conflicts=conflicts or [], exit_code=0 if passed else 1, stopped=stopped,
                                 output_digest="o", output_bytes=0, output_tail="", seconds_ms=1000, at_ms=T0))

    def train(self) -> Train:
        content = self.shell.contents[REPO.encode()]
        assert content.train is not None
        return content.train


def finals(records: list[Record]) -> list[tuple[str, str, bool]]:
    return [(r.intent_id, r.tool, isinstance(r, ToolApplied)) for r in records
            if isinstance(r, ToolApplied | ToolRejected)]


def test_merges_land_in_join_order_each_on_a_verdict_of_its_own_base_and_only_the_culprit_leaves() -> None:
    rig = Rig()
    tokens = {agent: rig.lease(agent) for agent in ("ann", "bob", "cy")}
    for agent in ("ann", "bob", "cy"):
        queued = rig.merge(agent, tokens[agent])
        assert [type(r).__name__ for r in queued] == ["MergeQueued"], queued
    assert [e.intent_id for e in rig.train().queue("main")] == ["m-ann", "m-bob", "m-cy"]
    # The runner checks all three at once, each on top of the ones ahead (bob's breaks the build).
    a = commit_of("m-ann", "h0")
    assert finals(rig.verdict("m-cy", commit_of("m-bob", a))) == [], "a verdict behind waits"
    assert finals(rig.verdict("m-bob", a, passed=False)) == []
    assert finals(rig.verdict("m-ann", "h0")) == [("m-ann", "merge", True), ("m-bob", "merge", False)]
    evicted = [r for r in rig.sent if isinstance(r, ToolRejected)][-1]
    assert evicted.reason == "check_failed" and json.loads(evicted.diagnostic_json)["check"]["passed"] is False
    assert rig.host.landed == ["m-ann"], "cy's verdict was on top of bob's merge, which left: not landed"
    assert finals(rig.verdict("m-cy", a)) == [("m-cy", "merge", True)]
    assert rig.host.landed == ["m-ann", "m-cy"] and rig.train().entries == []
    assert rig.train().heads["main"] == commit_of("m-cy", a)


def test_a_merge_whose_lease_died_leaves_the_train_wherever_it_is() -> None:
    rig = Rig()
    ann, bob = rig.lease("ann"), rig.lease("bob", ttl_ms=1_000)
    rig.merge("ann", ann)
    rig.merge("bob", bob)
    left = rig(LockReleaseRequested(request_id="rel", agent_id="bob", resource=REPO, token=bob, at_ms=T0), 10)
    gone = [r for r in left if isinstance(r, ToolRejected)]
    assert [(r.intent_id, r.reason) for r in gone] == [("m-bob", "lease_not_live")], left
    assert [e.intent_id for e in rig.train().entries] == ["m-ann"]
    # A verdict on a merge that left decides nothing.
    assert rig.verdict("m-bob", commit_of("m-ann", "h0")) == []


def test_a_merge_asked_again_is_answered_again_and_another_agents_id_is_refused() -> None:
    rig = Rig()
    ann, bob = rig.lease("ann"), rig.lease("bob")
    rig.merge("ann", ann, "shared-id")
    assert rig.merge("ann", ann, "shared-id") == [], "answered in the inbox only: nothing new decided"
    assert rig.merge("bob", bob, "shared-id") == []
    assert [e.agent_id for e in rig.train().entries] == ["ann"]
    assert finals(rig.verdict("shared-id", "h0")) == [("shared-id", "merge", True)]
    assert rig.merge("ann", ann, "shared-id") == [], "decided once: its outcome is answered again"
    assert rig.host.landed == ["shared-id"]


def test_a_target_moved_outside_arbiter_waits_for_a_check_on_the_head_found() -> None:
    rig = Rig()
    rig.merge("ann", rig.lease("ann"))
    rig.host.moved_outside = "pushed"
    replanned = rig.verdict("m-ann", "h0")
    assert [type(r).__name__ for r in replanned] == ["MergeChecked", "MergeReplanned"], replanned
    assert rig.train().heads["main"] == "pushed" and not rig.host.landed
    assert finals(rig.verdict("m-ann", "pushed")) == [("m-ann", "merge", True)]


def test_a_verdict_of_another_check_or_a_conflict() -> None:
    rig = Rig()
    rig.merge("ann", rig.lease("ann"))
    assert finals(rig.verdict("m-ann", "h0", digest="other")) == [], "not the check it joined with"
    conflict = rig.verdict("m-ann", "h0", passed=False, conflicts=["auth.py"])
    refused = [r for r in conflict if isinstance(r, ToolRejected)]
    assert [r.reason for r in refused] == ["version_conflict"]
    assert json.loads(refused[0].diagnostic_json)["conflicts"] == ["auth.py"]


def test_a_runner_with_another_check_evicts_the_merge_rather_than_leave_it_waiting() -> None:
    """Finding: a merge that joined with a check the runner does not have (the operator changed repos.toml,
    or the host and the runner read different ones) waited at the front for ever, its agent renewing its
    lease, every merge behind it stuck. The runner says so, and the merge leaves with check_changed."""
    rig = Rig()
    rig.merge("ann", rig.lease("ann"))
    rig.merge("bob", rig.lease("bob"))
    refused = [r for r in rig.verdict("m-ann", "h0", passed=False, digest="new", stopped=train.CHECK_CHANGED)
               if isinstance(r, ToolRejected)]
    assert [(r.intent_id, r.reason) for r in refused] == [("m-ann", "check_changed")], refused
    assert json.loads(refused[0].diagnostic_json)["runner_check"] == "new"
    assert [e.intent_id for e in rig.train().entries] == ["m-bob"], "the one behind is the front now"
    assert finals(rig.verdict("m-bob", "h0")) == [("m-bob", "merge", True)]


def test_without_a_check_a_merge_lands_when_it_is_the_front() -> None:
    rig = Rig(Host(check=None))
    landed = rig.merge("ann", rig.lease("ann"))
    assert [type(r).__name__ for r in landed] == ["MergeQueued", "ToolApplied"]


def test_folding_the_recorded_events_gives_the_hosts_train() -> None:
    rig = Rig()
    for agent in ("ann", "bob"):
        rig.merge(agent, rig.lease(agent))
    rig.verdict("m-ann", "h0")
    folded = Train()
    for record in rig.sent:
        if isinstance(record, MergeQueued | MergeChecked | MergeReplanned | ToolApplied | ToolRejected):
            train.evolve(folded, record)
    assert folded.to_dict() == rig.train().to_dict()
    assert Train.from_dict(json.loads(json.dumps(folded.to_dict()))).to_dict() == folded.to_dict()
