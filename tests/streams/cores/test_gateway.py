"""The gateway's gate: fencing, OCC and idempotence (pure core, no I/O)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from arbiter.schemas import Cause, ToolApplied, ToolIntent, ToolRejected
from arbiter.streams.cores.gateway import (
    GENESIS_HASH,
    Accepted,
    ContentState,
    GatewayRules,
    ToolOutcome,
    check,
    complete,
    evolve,
)
from tests.streams.cores.test_leases import RES, Harness

RULES = GatewayRules(policies=(("account:", "pessimistic"), ("doc:", "optimistic"), ("ledger:", "both")))
CAUSE = Cause(topic="cmds", partition=0, offset=7)


class Gate:
    """A resource's lease book (through the lease Harness) plus its content state."""

    def __init__(self, rules: GatewayRules = RULES, resource: str = RES) -> None:
        self.leases = Harness()
        self.content = ContentState(resource)
        self.rules = rules
        self.resource = resource
        self.n = 0

    def intent(self, agent: str, *, token: int | None = None, base: int | None = None, base_hash: str | None = None,
               args: Any = None, tool: str = "refund", intent_id: str | None = None) -> ToolIntent:
        self.n += 1
        return ToolIntent(intent_id=intent_id or f"i{self.n}", agent_id=agent, resource=self.resource, token=token,
                          base_version=base, base_hash=base_hash, tool=tool,
                          arguments_json=json.dumps(args if args is not None else {"amount": self.n}), at_ms=0)

    def write(self, intent: ToolIntent, now: int, outcome: ToolOutcome | None = None,
              known_tools: frozenset[str] | None = None) -> ToolApplied | ToolRejected:
        before = self.content.to_dict()
        verdict = check(self.leases.book, self.content, intent, now, CAUSE, self.rules, known_tools)
        assert self.content.to_dict() == before, "check must not change the content"
        if isinstance(verdict, Accepted):
            event = complete(self.leases.book, self.content, intent, outcome or ToolOutcome(True, '{"ok": true}'),
                             now, CAUSE)
        else:
            event = verdict
        evolve(self.content, event, self.rules)
        assert ContentState.from_dict(json.loads(json.dumps(self.content.to_dict()))).to_dict() == \
            self.content.to_dict()
        return event


def reason(event: ToolApplied | ToolRejected) -> str:
    return event.reason if isinstance(event, ToolRejected) else "applied"


def diagnostic(event: ToolApplied | ToolRejected) -> dict[str, Any]:
    assert isinstance(event, ToolRejected)
    result: dict[str, Any] = json.loads(event.diagnostic_json)
    return result


def test_seed_zombie_token_after_a_newer_grant_is_stale() -> None:
    """The token-100-after-101 write is rejected."""
    g = Gate()
    (a,) = g.leases.acquire("alpha", 0, ttl=30_000)
    g.leases.acquire("beta", 35_000)  # alpha expired; beta holds a.token + 1
    event = g.write(g.intent("alpha", token=a.token), 36_000)
    assert reason(event) == "stale_fencing_token"
    d = diagnostic(event)
    assert d["current"]["high_water_token"] == a.token + 1
    assert d["current"]["holder"]["agent_id"] == "beta"
    assert d["you_sent"]["token"] == a.token
    assert "re-read" in d["what_to_do"]
    assert g.content.version == 0


def test_seed_zombie_write_after_the_newer_holder_wrote_is_stale() -> None:
    """A's write with token 101 after B wrote with 102 is rejected."""
    g = Gate()
    (a,) = g.leases.acquire("alpha", 0, ttl=30_000)
    b = g.leases.acquire("beta", 35_000)[-1]
    assert reason(g.write(g.intent("beta", token=b.token), 35_001)) == "applied"
    assert reason(g.write(g.intent("alpha", token=a.token), 35_002)) == "stale_fencing_token"
    assert g.content.version == 1


def test_dead_lease_is_refused_while_nobody_newer_holds_it() -> None:
    g = Gate()
    (a,) = g.leases.acquire("alpha", 0, ttl=1_000)
    # Expired by time, before any tick told the book:
    assert reason(g.write(g.intent("alpha", token=a.token), 1_000)) == "lease_not_live"
    g.leases.tick(1_000)
    assert reason(g.write(g.intent("alpha", token=a.token), 1_001)) == "lease_not_live"
    (b,) = g.leases.acquire("bob", 2_000, ttl=1_000)
    g.leases.release("bob", b.token, 2_001)
    assert reason(g.write(g.intent("bob", token=b.token), 2_002)) == "lease_not_live"


def test_a_live_holder_writes_many_times_with_one_token() -> None:
    g = Gate()
    (a,) = g.leases.acquire("alpha", 0)
    first = g.write(g.intent("alpha", token=a.token), 1)
    second = g.write(g.intent("alpha", token=a.token), 2)
    assert isinstance(first, ToolApplied) and isinstance(second, ToolApplied)
    assert (first.version, second.version) == (1, 2)
    assert first.content_hash != second.content_hash != GENESIS_HASH


def test_anothers_token_and_a_shared_lease_cannot_write() -> None:
    g = Gate()
    (a,) = g.leases.acquire("alpha", 0)
    assert reason(g.write(g.intent("mallory", token=a.token), 1)) == "not_holder"
    g.leases.release("alpha", a.token, 2)
    (s,) = g.leases.acquire("reader", 3, mode="shared")
    assert reason(g.write(g.intent("reader", token=s.token), 4)) == "lease_not_exclusive"


def test_occ_conflict_carries_the_changes_and_the_rebased_retry_succeeds() -> None:
    g = Gate(resource="doc:spec")
    g.write(g.intent("alice", base=0, args={"op": "title", "text": "Arbiter"}), 1)
    g.write(g.intent("bob", base=1, args={"op": "para", "text": "Leases"}), 2)
    stale = g.write(g.intent("carol", base=0, args={"op": "para", "text": "Mine"}), 3)
    d = diagnostic(stale)
    assert d["reason"] == "version_conflict" and d["base_too_old"] is False
    assert [c["version"] for c in d["changes_since_base"]] == [1, 2]
    assert d["changes_since_base"][1]["arguments"] == {"op": "para", "text": "Leases"}
    assert d["current"]["version"] == 2
    rebased = g.write(g.intent("carol", base=d["current"]["version"], args={"op": "para", "text": "Mine"}), 4)
    assert isinstance(rebased, ToolApplied) and rebased.version == 3


def test_base_hash_works_like_a_base_version() -> None:
    g = Gate(resource="doc:spec")
    first = g.write(g.intent("alice", base_hash=GENESIS_HASH), 1)
    assert isinstance(first, ToolApplied)
    assert reason(g.write(g.intent("bob", base_hash=GENESIS_HASH), 2)) == "version_conflict"
    assert reason(g.write(g.intent("bob", base_hash=first.content_hash), 3)) == "applied"
    unknown = g.write(g.intent("bob", base_hash="f" * 32), 4)
    assert diagnostic(unknown)["base_too_old"] is True


def test_a_base_older_than_the_history_says_re_read() -> None:
    g = Gate(GatewayRules(policies=(("doc:", "optimistic"),), history_limit=2), resource="doc:spec")
    for v in range(5):
        g.write(g.intent("alice", base=v), v)
    d = diagnostic(g.write(g.intent("bob", base=1), 10))
    assert d["base_too_old"] is True
    assert [c["version"] for c in d["changes_since_base"]] == [4, 5]
    assert diagnostic(g.write(g.intent("bob", base=3), 11))["base_too_old"] is False


def test_policies_by_prefix() -> None:
    g = Gate(resource="misc:1")
    assert reason(g.write(g.intent("a"), 0)) == "no_policy"
    g = Gate(resource="account:1")
    assert reason(g.write(g.intent("a"), 0)) == "token_required"
    g = Gate(resource="doc:1")
    assert reason(g.write(g.intent("a"), 0)) == "base_version_required"
    g = Gate(resource="ledger:1")
    (lease,) = g.leases.acquire("a", 0, resource="ledger:1")
    assert reason(g.write(g.intent("a", token=lease.token), 1)) == "base_version_required"
    assert reason(g.write(g.intent("a", base=0), 1)) == "token_required"
    assert reason(g.write(g.intent("a", token=lease.token, base=0), 1)) == "applied"
    longest = GatewayRules(policies=(("doc:", "optimistic"), ("doc:locked:", "pessimistic")))
    assert longest.policy_for("doc:locked:1") == "pessimistic" and longest.policy_for("doc:x") == "optimistic"


def test_an_intent_seen_before_returns_its_original_outcome_and_never_runs_again() -> None:
    g = Gate()
    (a,) = g.leases.acquire("alpha", 0)
    first = g.write(g.intent("alpha", token=a.token, intent_id="refund-1"), 1)
    again = check(g.leases.book, g.content, g.intent("alpha", token=a.token, intent_id="refund-1"), 2, CAUSE, RULES)
    assert again == first  # not Accepted: the tool will not run twice
    assert g.content.version == 1
    failed = g.write(g.intent("alpha", token=a.token, intent_id="refund-2"), 3, ToolOutcome(False, error="boom"))
    assert reason(failed) == "tool_failed" and "boom" in failed.diagnostic_json
    assert g.content.version == 1, "a failed tool changes nothing"
    assert check(g.leases.book, g.content, g.intent("alpha", token=a.token, intent_id="refund-2"), 4, CAUSE,
                 RULES) == failed


def test_bad_input_is_refused_and_nothing_is_applied() -> None:
    g = Gate()
    (a,) = g.leases.acquire("alpha", 0)
    big = g.intent("alpha", token=a.token, args={"patch": "x" * (1024 * 1024)})
    assert reason(g.write(big, 1)) == "arguments_too_large"
    not_object = g.intent("alpha", token=a.token).model_copy(update={"arguments_json": "[1, 2]"})
    assert reason(g.write(not_object, 2)) == "invalid_arguments"
    not_json = g.intent("alpha", token=a.token).model_copy(update={"arguments_json": "{nope"})
    assert reason(g.write(not_json, 3)) == "invalid_arguments"
    assert reason(g.write(g.intent("alpha", token=a.token, tool="rm -rf"), 4, known_tools=frozenset({"refund"}))) \
        == "unknown_tool"
    assert reason(g.write(g.intent("", token=a.token), 5)) == "invalid_intent"
    assert g.content.version == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(
    st.sampled_from(["acquire", "release", "write", "tick"]),
    st.sampled_from(["a", "b", "c"]),
    st.integers(0, 6),          # token guess offset
    st.integers(0, 400),        # time step
    st.booleans(),              # use own live token
), max_size=40))
def test_no_accepted_write_ever_comes_from_a_stale_or_dead_lease(steps: list[tuple[str, str, int, int, bool]]) -> None:
    g = Gate(GatewayRules(policies=(("", "pessimistic"),)))
    now = 0
    version = 0
    for op, agent, guess, dt, own in steps:
        now += dt
        book = g.leases.book
        if op == "acquire":
            g.leases.acquire(agent, now, ttl=500)
        elif op == "release":
            mine = [h for h in book.holders.values() if h.agent_id == agent]
            if mine:
                g.leases.release(agent, mine[0].token, now)
        elif op == "tick":
            g.leases.tick(now)
        else:
            mine = [h for h in book.holders.values() if h.agent_id == agent]
            token = mine[0].token if own and mine else max(0, book.last_token - guess)
            event = g.write(g.intent(agent, token=token), now)
            if isinstance(event, ToolApplied):
                lease = book.holders.get(token)
                assert lease is not None and lease.agent_id == agent and lease.mode == "exclusive"
                assert lease.expires_at_ms > now and token == book.last_token
                assert event.version == version + 1
                version = event.version
    assert g.content.version == version


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.integers(0, 60)), min_size=1, max_size=60))
def test_an_intent_id_is_never_decided_twice_however_long_the_history(
        steps: list[tuple[int, bool, int]]) -> None:
    """Redeliver any earlier intent at any later moment: its recorded outcome, or request_expired; never a
    second run. A short window and a small memory make ids be forgotten within a run."""
    rules = GatewayRules(policies=(("", "optimistic"),), id_window_ms=100, clock_skew_ms=5, max_remembered_ids=5)
    g = Gate(rules)
    now, sent = 0, []
    ran: dict[str, ToolApplied] = {}
    for pick, replay, dt in steps:
        now += dt
        if replay and sent:
            intent = sent[pick % len(sent)]
        else:
            intent = g.intent("a", base=g.content.version).model_copy(update={"at_ms": now})
            sent.append(intent)
        event = g.write(intent, now)
        if isinstance(event, ToolApplied):
            assert ran.setdefault(intent.intent_id, event) == event, "an intent ran twice"
        elif intent.intent_id in ran:
            assert event.reason == "request_expired", event


@settings(max_examples=200, deadline=None)
@given(writes=st.integers(1, 12), limit=st.integers(1, 5), back=st.integers(0, 14))
def test_a_base_by_hash_and_by_version_are_decided_alike(writes: int, limit: int, back: int) -> None:
    rules = GatewayRules(policies=(("", "optimistic"),), history_limit=limit)
    g = Gate(rules)
    hashes = [g.content.content_hash]
    for _ in range(writes):
        assert isinstance(g.write(g.intent("a", base=g.content.version), 1), ToolApplied)
        hashes.append(g.content.content_hash)
    base = max(0, writes - back)
    by_version = check(g.leases.book, g.content, g.intent("b", base=base), 2, CAUSE, rules)
    by_hash = check(g.leases.book, g.content, g.intent("b", base_hash=hashes[base]), 2, CAUSE, rules)
    both = check(g.leases.book, g.content, g.intent("b", base=base, base_hash=hashes[base]), 2, CAUSE, rules)
    for verdict in (by_hash, both):
        assert type(verdict) is type(by_version)
        if isinstance(by_version, ToolRejected):
            assert isinstance(verdict, ToolRejected) and verdict.reason == by_version.reason
            mine, theirs = json.loads(verdict.diagnostic_json), json.loads(by_version.diagnostic_json)
            assert mine.get("base_too_old") == theirs.get("base_too_old")
            if not theirs.get("base_too_old"):  # (too old by version lists what it still has; a hash cannot)
                assert mine.get("changes_since_base") == theirs.get("changes_since_base")
    if base != g.content.version:
        mixed = check(g.leases.book, g.content, g.intent("b", base=base, base_hash=g.content.content_hash), 2,
                      CAUSE, rules)
        assert isinstance(mixed, ToolRejected) and mixed.reason == "invalid_intent"


def test_a_refused_write_names_the_holder_without_its_token_when_tokens_are_hidden() -> None:
    from dataclasses import replace

    for hide in (False, True):
        gate = Gate(replace(RULES, hide_tokens=hide), resource="account:a")
        gate.leases.acquire("alice", 1_000, resource="account:a")
        refused = gate.write(gate.intent("mallory", token=1), 1_001)
        assert isinstance(refused, ToolRejected)
        holder = json.loads(refused.diagnostic_json)["current"]["holder"]
        assert holder["agent_id"] == "alice"
        assert ("token" in holder) is not hide, holder
        own = gate.write(gate.intent("alice", token=7), 1_002)  # alice's own refusal shows her token
        assert isinstance(own, ToolRejected)
        assert json.loads(own.diagnostic_json)["current"]["holder"]["token"] == 1


# -- a refusal for the send time alone is an answer, not remembered --


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.booleans()), min_size=10, max_size=40),
       st.integers(1, 4))
def test_a_burst_of_stale_intents_leaves_the_outcomes_and_the_floor_as_they_were(
        steps: list[tuple[int, bool, bool]], copies: int) -> None:
    """A busy resource forgets outcomes early (a memory of 5); then every intent it forgot is sent
    again, ``copies`` times over. Each is refused ``request_expired`` (an invalid one too: the send time
    is judged first) and runs nothing; the content is as it was (a remembered refusal used to push live
    outcomes out and raise the floor), and each intent it remembers still gets its recorded outcome."""
    rules = GatewayRules(policies=(("", "optimistic"),), id_window_ms=60_000, max_remembered_ids=5)
    g = Gate(rules)
    now, sent = 0, []
    for dt, stale_base, invalid in steps:
        now += dt
        intent = g.intent("a", base=g.content.version - stale_base, tool="" if invalid else "refund")
        sent.append(intent.model_copy(update={"at_ms": now}))
        g.write(sent[-1], now)
    before = g.content.to_dict()
    forgotten = [i for i in sent if i.intent_id not in g.content.outcomes]
    assert forgotten and g.content.forgotten_sent_ms is not None
    for intent in forgotten * copies:
        event = g.write(intent, now)
        assert reason(event) == "request_expired", event
        assert g.content.to_dict() == before
    for intent in sent:
        if intent.intent_id in g.content.outcomes:
            assert g.write(intent, now) is g.content.outcomes[intent.intent_id]


def test_an_intent_sent_far_ahead_is_refused_and_never_raises_the_floor() -> None:
    """One intent sent ten years ahead is refused ``clock_skew`` and not remembered (remembered, it was
    forgotten early like any outcome and raised the floor to its send time: every write refused for ten
    years). Sent again in time, it is decided."""
    g = Gate(GatewayRules(policies=(("", "optimistic"),), max_remembered_ids=4, clock_skew_ms=60_000))
    ahead = g.intent("skewed", base=0).model_copy(update={"at_ms": 10 * 365 * 86_400_000})
    assert reason(g.write(ahead, 0)) == "clock_skew"
    for now in range(1, 11):
        assert reason(g.write(g.intent("a", base=g.content.version).model_copy(update={"at_ms": now}),
                              now)) == "applied"
    assert (g.content.forgotten_sent_ms or 0) <= 10
    assert reason(g.write(ahead.model_copy(update={"at_ms": 11, "base_version": 10}), 11)) == "applied"


def test_rules_recorded_before_remember_a_refusal_for_the_send_time_as_they_did() -> None:
    """Logs decided before ``forget_window_refusals`` replay as decided: an invalid intent was refused
    ``invalid_intent`` before its send time was judged, and a stale one's refusal was remembered."""
    for forget in (False, True):
        rules = GatewayRules(policies=(("", "optimistic"),), max_remembered_ids=2, forget_window_refusals=forget)
        g = Gate(rules)
        first = g.intent("a", base=0).model_copy(update={"at_ms": 1})
        g.write(first, 1)
        for now in (2, 3):
            g.write(g.intent("a", base=g.content.version).model_copy(update={"at_ms": now}), now)
        assert reason(g.write(first, 4)) == "request_expired"
        assert (first.intent_id in g.content.outcomes) is not forget
        invalid = first.model_copy(update={"tool": "", "intent_id": "stale-and-invalid"})
        assert reason(g.write(invalid, 5)) == ("request_expired" if forget else "invalid_intent")
