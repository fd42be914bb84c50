"""One fencing rule: renew, release and write agree on every token, at every moment."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from arbiter.schemas import LockDenied, LockReleased, LockRenewed, ToolApplied, ToolRejected
from arbiter.schemas.reasons import Reason
from arbiter.streams.cores.gateway import GatewayRules
from arbiter.streams.cores.leases import LockTick
from tests.streams.cores.test_gateway import Gate
from tests.streams.cores.test_leases import Harness

AGENTS = ["a", "b", "c"]

# Shared and exclusive leases both may act: the gateway's own exclusivity check is off here,
# so that only the fencing rule speaks.
NON_EXCLUSIVE = GatewayRules(policies=(("account:", "pessimistic"),), require_exclusive=False)

steps = st.lists(st.tuples(st.sampled_from(AGENTS), st.sampled_from(["exclusive", "shared"]),
                           st.integers(1, 40), st.integers(0, 15), st.booleans()), min_size=1, max_size=12)


def _book_after(history: list[tuple[str, str, int, int, bool]]) -> tuple[Harness, int]:
    h = Harness()
    now = 0
    for agent, mode, ttl, dt, release in history:
        now += dt
        h.acquire(agent, now, mode=mode, ttl=ttl, wait=0)
        if release and h.book.holders:
            lease = next(iter(sorted(h.book.holders.values(), key=lambda x: x.token)))
            h.release(lease.agent_id, lease.token, now)
    return h, now


@settings(max_examples=300, deadline=None)
@given(history=steps, agent=st.sampled_from(AGENTS), token=st.integers(0, 14), later=st.integers(0, 50))
def test_renew_release_and_write_decide_a_token_alike(history: list[tuple[str, str, int, int, bool]], agent: str,
                                                      token: int, later: int) -> None:
    h, now = _book_after(history)
    now += later
    h.send(LockTick(request_id="t", partition=0, at_ms=0), now)  # time first, for all three alike
    renew = copy.deepcopy(h).renew(agent, token, now, ttl=10)[-1]
    release = copy.deepcopy(h).release(agent, token, now)[-1]
    gate = Gate(NON_EXCLUSIVE)
    gate.leases = copy.deepcopy(h)
    write = gate.write(gate.intent(agent, token=token), now)
    allowed = {isinstance(renew, LockRenewed), isinstance(release, LockReleased), isinstance(write, ToolApplied)}
    assert len(allowed) == 1, (renew, release, write)
    if not allowed.pop():
        assert isinstance(renew, LockDenied) and isinstance(release, LockDenied) and isinstance(write, ToolRejected)
        assert renew.reason == release.reason == write.reason
        assert renew.reason in {Reason.STALE_FENCING_TOKEN, Reason.LEASE_NOT_LIVE, Reason.NOT_HOLDER}


def test_a_live_shared_holder_below_the_high_water_mark_may_write() -> None:
    h = Harness()
    h.acquire("a", 0, mode="shared")
    h.acquire("b", 0, mode="shared")
    assert h.book.last_token == 2
    gate = Gate(NON_EXCLUSIVE)
    gate.leases = h
    assert isinstance(gate.write(gate.intent("a", token=1), 1), ToolApplied)
