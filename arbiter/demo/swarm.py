"""A swarm of simulated LLM agents working on shared state: the stories of ``arbiter demo``.

Each agent "thinks" for a random 3-30 s (the profile of a model call), divided by a
speed factor, between reading the world and acting on it: exactly the gap in which
agents corrupt each other's work. Four stories run at once:

- **Refund triage**: each customer's ticket reaches several triage agents at once;
  each checks whether the order was refunded, thinks, and refunds it.
- **Slow agents**: an agent takes a VIP refund, then stalls past its lease's TTL (a
  frozen process: no heartbeats); a backup agent takes over; the stalled one wakes up
  and acts on what it saw before.
- **Delegation ring**: Routing, Refactoring, Testing and Documentation each start a
  change, then hand work to the next in a ring and wait for it.
- **Shared document**: drafting agents each add a section to one launch plan.

The agents are written once against ``Workspace``. ``SafeWorkspace`` is Arbiter's
public SDK (leases, fencing tokens, versions, sagas, delegation edges).
``UnsafeWorkspace`` is what the same agents do without Arbiter: they call the tools
straight on the shared store, with nothing checked, and a delegation is only a
wait with a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from arbiter.agents import ArbiterClient, LeaseDenied, LeaseLost, Outcome, SagaAborted, SagaStepRejected
from arbiter.streams.tools.ledger import Ledger
from arbiter.streams.tools.registry import ToolRegistry

STORIES = ("refunds", "slow", "ring", "document")
RING = ("routing", "refactoring", "testing", "documentation")
"""The delegation ring. Its victim is the youngest: whose delegation the broker appends last."""


@dataclass
class Plan:
    """What the swarm works on; everything drawn from one seed."""

    seed: int
    speed: float
    run: str
    customers: int = 6
    triage_agents: int = 4
    racers_per_ticket: int = 3
    slow_agents: int = 2
    drafters: int = 4
    amount: int = 2_500
    stories: tuple[str, ...] = STORIES
    """Which stories run (all by default; golden histories record one each)."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def think_s(self) -> float:
        """One model call: 3-30 s, scaled down by the speed factor."""
        return self.rng.uniform(3.0, 30.0) / self.speed

    @property
    def ttl_s(self) -> float:
        """Lease TTL of the slow agents: 30 s of agent time, at least 1 s of wall time."""
        return max(1.0, 30.0 / self.speed)

    @property
    def ring_timeout_s(self) -> float:
        """How long a delegating agent waits for its delegate before it gives up."""
        return max(2.0, 60.0 / self.speed)

    def accounts(self) -> dict[str, int]:
        """The ledger's opening balances for this run."""
        names = [f"cust_{self.run}_{i}" for i in range(self.customers)]
        names += [f"vip_{self.run}_{i}" for i in range(self.slow_agents)]
        return {name: 100_000 for name in names}

    @property
    def document(self) -> str:
        """The shared document's resource name."""
        return f"doc:launch-plan-{self.run}"

    def agents(self) -> dict[str, list[str]]:
        """Every agent of the plan's stories, with the resource prefixes it may act on (what the
        demo registers for it: each agent's key is good only for its own story's resources)."""
        found: dict[str, list[str]] = {}
        if "refunds" in self.stories:
            found |= {f"triage-{i + 1}": [f"account:cust_{self.run}_"] for i in range(self.triage_agents)}
        if "slow" in self.stories:
            for i in range(self.slow_agents):
                found |= {f"slow-{i + 1}": [f"account:vip_{self.run}_{i}"],
                          f"backup-{i + 1}": [f"account:vip_{self.run}_{i}"]}
        if "ring" in self.stories:
            found |= {name: [f"repo:services/{name}-{self.run}"] for name in RING}
        if "document" in self.stories:
            found |= {f"drafter-{i + 1}": [self.document] for i in range(self.drafters)}
        return found

    def steps(self) -> int:
        """How many units of work the progress bar counts."""
        sizes = {"refunds": self.customers * self.racers_per_ticket, "slow": 2 * self.slow_agents,
                 "ring": len(RING), "document": self.drafters}
        return sum(sizes[story] for story in self.stories)


@dataclass
class Tally:
    """What the agents saw, by story and outcome (the demo's progress and summary)."""

    counts: Counter[str] = field(default_factory=Counter)
    done: int = 0
    ring_stalled_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def count(self, what: str, n: int = 1) -> None:
        """Count one outcome."""
        self.counts[what] += n

    def step_done(self) -> None:
        """One unit of work finished (for the progress bar)."""
        self.done += 1


@dataclass
class _NoLease:
    """A lease as agents without Arbiter have it: a name and nothing else."""

    resource: str
    token: int | None = None


class SagaLike(Protocol):
    """The part of ``agents.Saga`` the ring agents use."""

    async def step(self, lease: Any, tool: str, args: dict[str, Any], *, compensate: Any = None,
                   base_version: int | None = None) -> Outcome:
        """Run one step."""

    def delegate(self, to: str, task: str = "", priority: int = 0) -> contextlib.AbstractAsyncContextManager[None]:
        """Wait on another agent."""


class Workspace(Protocol):
    """What an agent can do to the shared world."""

    agent_id: str
    ledger: Ledger

    def hold(self, resource: str, ttl: float, wait: float) -> contextlib.AbstractAsyncContextManager[Any]:
        """Hold a resource for a while (renewed in the background)."""

    async def grab(self, resource: str, ttl: float, wait: float) -> Any:
        """Take a resource without renewing it (an agent whose heartbeats can stop)."""

    async def let_go(self, handle: Any) -> None:
        """Give a grabbed resource back (nothing if it is already gone)."""

    async def version(self, resource: str) -> int | None:
        """The resource's version as Arbiter orders it (None without Arbiter)."""

    async def write(self, handle: Any, tool: str, args: dict[str, Any], base_version: int | None) -> Outcome:
        """Run a tool on the resource."""

    def saga(self, name: str) -> contextlib.AbstractAsyncContextManager[SagaLike]:
        """A multi-step task that is undone if it cannot finish."""

    async def wait_for_delegate(self, timeout: float, released: asyncio.Event) -> str:
        """Wait for the agent we delegated to: 'done', 'deadlock: ...' or 'timeout'."""


# -- with Arbiter --------------------------------------------------------------------------


class SafeWorkspace:
    """The agents' world through Arbiter's SDK."""

    def __init__(self, client: ArbiterClient, ledger: Ledger) -> None:
        self.client, self.ledger, self.agent_id = client, ledger, client.agent_id

    def hold(self, resource: str, ttl: float, wait: float) -> contextlib.AbstractAsyncContextManager[Any]:
        return self.client.lease(resource, ttl=ttl, wait=wait)

    async def grab(self, resource: str, ttl: float, wait: float) -> Any:
        return await self.client.acquire(resource, ttl=ttl, wait=wait)

    async def let_go(self, handle: Any) -> None:
        with contextlib.suppress(LeaseDenied, LeaseLost):
            await self.client.release(handle)

    async def version(self, resource: str) -> int | None:
        return (await self.client.snapshot(resource)).version

    async def write(self, handle: Any, tool: str, args: dict[str, Any], base_version: int | None) -> Outcome:
        return await self.client.execute(handle, tool, args, base_version=base_version)

    def saga(self, name: str) -> contextlib.AbstractAsyncContextManager[SagaLike]:
        return self.client.saga(name)

    async def wait_for_delegate(self, timeout: float, released: asyncio.Event) -> str:
        notice = asyncio.ensure_future(self.client.wait_for_deadlock())
        freed = asyncio.ensure_future(released.wait())
        done, pending = await asyncio.wait({notice, freed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if notice in done:
            return f"deadlock: {notice.result().message}"
        return "done" if freed in done else "timeout"


# -- without Arbiter -----------------------------------------------------------------------


class UnsafeWorkspace:
    """The same agents with nothing in between: tools run straight on the shared store."""

    def __init__(self, agent_id: str, ledger: Ledger, registry: ToolRegistry) -> None:
        self.agent_id, self.ledger, self.registry = agent_id, ledger, registry

    @contextlib.asynccontextmanager
    async def hold(self, resource: str, ttl: float, wait: float) -> AsyncIterator[Any]:
        yield _NoLease(resource)

    async def grab(self, resource: str, ttl: float, wait: float) -> Any:
        return _NoLease(resource)

    async def let_go(self, handle: Any) -> None:
        return None

    async def version(self, resource: str) -> int | None:
        return None

    async def write(self, handle: Any, tool: str, args: dict[str, Any], base_version: int | None) -> Outcome:
        from arbiter.schemas import ToolIntent

        resource = handle if isinstance(handle, str) else handle.resource
        intent = ToolIntent(intent_id=uuid.uuid4().hex, agent_id=self.agent_id, resource=resource, token=None,
                            tool=tool, arguments_json=json.dumps(args, sort_keys=True), at_ms=0)
        parsed = self.registry.parse(intent)
        if isinstance(parsed, str):
            return Outcome(intent.intent_id, resource, tool, False, reason="invalid_arguments")
        result = await self.registry.run(intent, parsed)
        if not result.ok:
            return Outcome(intent.intent_id, resource, tool, False, reason="tool_failed",
                           diagnostic={"error": result.error})
        return Outcome(intent.intent_id, resource, tool, True, result=json.loads(result.result_json))

    @contextlib.asynccontextmanager
    async def saga(self, name: str) -> AsyncIterator[SagaLike]:
        yield _NoSaga(self)

    async def wait_for_delegate(self, timeout: float, released: asyncio.Event) -> str:
        try:
            await asyncio.wait_for(released.wait(), timeout)
            return "done"
        except TimeoutError:
            return "timeout"


@dataclass
class _NoSaga:
    """A "saga" without Arbiter: steps run, nothing is ever undone."""

    workspace: UnsafeWorkspace

    async def step(self, lease: Any, tool: str, args: dict[str, Any], *, compensate: Any = None,
                   base_version: int | None = None) -> Outcome:
        outcome = await self.workspace.write(lease, tool, args, base_version)
        if not outcome.applied:
            raise SagaStepRejected(outcome)
        return outcome

    @contextlib.asynccontextmanager
    async def delegate(self, to: str, task: str = "", priority: int = 0) -> AsyncIterator[None]:
        yield


# -- the stories --------------------------------------------------------------------------


def _refunded(ledger: Ledger, account: str, order: str) -> bool:
    return any(r["account"] == account and r["order_id"] == order and not r["reversed_by"]
               for r in ledger.refunds())


async def triage(ws: Workspace, plan: Plan, tally: Tally, ticket: str, think: float) -> None:
    """Refund triage: read, think, refund (if it still looks unrefunded)."""
    account, order = ticket, f"order-{ticket}"
    resource = f"account:{account}"
    seen = await ws.version(resource)
    if _refunded(ws.ledger, account, order):
        tally.count("triage: saw it refunded already")
        return
    await asyncio.sleep(think)  # the model decides the refund is due
    async with ws.hold(resource, ttl=30, wait=60) as lease:
        outcome = await ws.write(lease, "refund", {"order_id": order, "amount": plan.amount}, seen)
    if outcome.applied:
        tally.count("triage: refund applied")
    elif outcome.conflict:
        changed = [c["tool"] for c in outcome.diagnostic.get("changes_since_base", [])]
        tally.count("triage: double refund prevented (version_conflict)")
        tally.notes.append(f"{ws.agent_id}: refund of {order} refused, version_conflict; changes since its read: "
                           f"{', '.join(changed) or 'none listed'}")
    else:
        tally.count(f"triage: refused ({outcome.reason})")


async def slow_agent(ws: Workspace, plan: Plan, tally: Tally, account: str, stalled: asyncio.Event) -> None:
    """Takes a VIP refund, then freezes past its TTL; wakes up and acts on what it saw."""
    resource, order = f"account:{account}", f"order-{account}"
    lease = await ws.grab(resource, ttl=plan.ttl_s, wait=60)
    seen = await ws.version(resource)
    already = _refunded(ws.ledger, account, order)
    stalled.set()
    await asyncio.sleep(2.5 * plan.ttl_s)  # a frozen process: no thinking, no heartbeats
    if already:
        return
    outcome = await ws.write(lease, "refund", {"order_id": order, "amount": plan.amount}, seen)
    if outcome.applied:
        tally.count("slow agent: zombie refund applied")
    else:
        tally.count(f"slow agent: zombie write fenced off ({outcome.reason})")
        tally.notes.append(f"{ws.agent_id}: woke up after {2.5 * plan.ttl_s:.1f} s and refunded {order} with token "
                           f"{getattr(lease, 'token', None)}: refused, {outcome.reason}")
    await ws.let_go(lease)


async def backup_agent(ws: Workspace, plan: Plan, tally: Tally, account: str, stalled: asyncio.Event) -> None:
    """The supervisor sees no progress on a VIP refund and gives it to a backup agent."""
    resource, order = f"account:{account}", f"order-{account}"
    await stalled.wait()
    await asyncio.sleep(0.5 * plan.ttl_s)  # no progress reported: reassign (it queues behind the frozen lease)
    async with ws.hold(resource, ttl=30, wait=60) as lease:
        seen = await ws.version(resource)
        if _refunded(ws.ledger, account, order):
            return
        outcome = await ws.write(lease, "refund", {"order_id": order, "amount": plan.amount}, seen)
    tally.count("backup: refund applied" if outcome.applied else f"backup: refused ({outcome.reason})")


async def ring_agent(ws: Workspace, plan: Plan, tally: Tally, name: str, nxt: str, think: float,
                     released: asyncio.Event) -> None:
    """Start a change, hand the next part to ``nxt``, wait for it; undo the change on a deadlock."""
    resource = f"repo:services/{name}-{plan.run}"
    started = asyncio.get_running_loop().time()
    try:
        async with ws.saga(f"{name}-change") as saga:
            async with ws.hold(resource, ttl=60, wait=60) as lease:
                await saga.step(lease, "commit", {"patch": {"status": "in progress", "owner": name}},
                                compensate=("commit", {"patch": {"status": "reverted", "owner": name}}))
            await asyncio.sleep(think)
            async with saga.delegate(to=nxt, task=f"{name} hands off to {nxt}"):
                outcome = await ws.wait_for_delegate(plan.ring_timeout_s, released)
            if outcome.startswith("deadlock"):
                released.set()  # the ring is broken: the others go on while this one is undone
                raise SagaAbortRequested(outcome)
            if outcome == "timeout":
                tally.ring_stalled_s = max(tally.ring_stalled_s, asyncio.get_running_loop().time() - started)
                tally.count("ring: gave up after a timeout, change left half-done")
                released.set()
                return
            async with ws.hold(resource, ttl=60, wait=60) as lease:
                await saga.step(lease, "commit", {"patch": {"status": "done", "owner": name}})
        tally.count("ring: change completed")
    except (SagaAbortRequested, SagaAborted) as exc:
        tally.count("ring: deadlock victim, change compensated")
        tally.notes.append(f"{name}: {exc}")
        released.set()  # the ring is broken: the others can go on
    finally:
        tally.step_done()


class SagaAbortRequested(Exception):
    """Raised inside a saga to abort it (the SDK compensates on the way out)."""


async def drafter(ws: Workspace, plan: Plan, tally: Tally, section: str, think: float) -> None:
    """Add a section to the shared document: read, think, write (rebase on a conflict)."""
    doc = plan.document

    def read() -> list[str]:
        found = ws.ledger.document(doc)
        return list(found[1].get("sections", [])) if found else []

    base = await ws.version(doc)
    sections = read()
    await asyncio.sleep(think)  # drafting
    outcome = await ws.write(doc, "commit", {"patch": {"sections": [*sections, section]}}, base)
    attempts = 1
    while outcome.conflict and attempts < 8:
        tally.count("document: conflict rebased (version_conflict)")
        base, sections = await ws.version(doc), read()
        outcome = await ws.write(doc, "commit", {"patch": {"sections": [*sections, section]}}, base)
        attempts += 1
    tally.count("document: section written" if outcome.applied else f"document: gave up ({outcome.reason})")
    tally.step_done()


async def run_swarm(plan: Plan, workspace: Callable[[str], Awaitable[Workspace]], tally: Tally) -> None:
    """Every story of the plan at once. ``workspace(agent_id)`` opens an agent's workspace."""
    rng = plan.rng
    work: list[Awaitable[None]] = []
    if "refunds" in plan.stories:
        triagers = [await workspace(f"triage-{i + 1}") for i in range(plan.triage_agents)]
        queues: dict[str, list[tuple[str, float]]] = {ws.agent_id: [] for ws in triagers}
        for ticket in (f"cust_{plan.run}_{i}" for i in range(plan.customers)):
            for ws in rng.sample(triagers, plan.racers_per_ticket):  # each ticket reaches several agents at once
                queues[ws.agent_id].append((ticket, plan.think_s()))

        async def triage_worker(ws: Workspace) -> None:
            for ticket, think in queues[ws.agent_id]:
                await triage(ws, plan, tally, ticket, think)
                tally.step_done()

        work += [triage_worker(ws) for ws in triagers]
    if "slow" in plan.stories:
        work += [_vip(plan, workspace, tally, i) for i in range(plan.slow_agents)]
    if "ring" in plan.stories:
        ring = [await workspace(name) for name in RING]
        released = asyncio.Event()
        work += [ring_agent(ws, plan, tally, ws.agent_id, RING[(i + 1) % len(RING)], plan.think_s() / 4, released)
                 for i, ws in enumerate(ring)]
    if "document" in plan.stories:
        drafters = [await workspace(f"drafter-{i + 1}") for i in range(plan.drafters)]
        work += [drafter(ws, plan, tally, f"section by {ws.agent_id}", plan.think_s()) for ws in drafters]
    await asyncio.gather(*work)


async def _vip(plan: Plan, workspace: Callable[[str], Awaitable[Workspace]], tally: Tally, i: int) -> None:
    account = f"vip_{plan.run}_{i}"
    stalled = asyncio.Event()
    slow, backup = await workspace(f"slow-{i + 1}"), await workspace(f"backup-{i + 1}")

    async def counted(work: Awaitable[None]) -> None:
        await work
        tally.step_done()

    await asyncio.gather(counted(slow_agent(slow, plan, tally, account, stalled)),
                         counted(backup_agent(backup, plan, tally, account, stalled)))
