"""One agent's Arbiter tools, as a model calls them: leases the server keeps alive while the agent is
active, writes through the gateway, sandboxes, and what to do about a refusal.

``AgentTools`` wraps the agent's ``ArbiterClient``; ``arbiter mcp`` (stdio, one agent per process)
and the front door's ``/mcp`` (one per API key) expose the same methods as MCP tools, and the
framework adapters as function tools. Every method answers a pydantic model whose ``ok``, ``reason``
and ``diagnostic`` are the SDK's own JSON diagnostics; none raises for a refusal. ``notices`` carries
what happened to the agent's leases since its last call (an operator's revoke with its reason, a
lease that lapsed), so a model learns it on its next step even if its client shows no notification.

Leases survive long model turns: the server renews each lease it holds for the agent while the agent
shows activity (any tool call, or a hook's heartbeat: the file ``heartbeat`` names), for at most
``mcp_max_hold_seconds``; after ``mcp_idle_seconds`` of silence it stops, and the lease lapses at its
TTL like any silent holder's, so a crashed or wedged agent never blocks others for long.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field

from arbiter.agents import ArbiterClient, ArbiterError, Lease, LeaseDenied, Outcome, Sandbox, SandboxRefused
from arbiter.agents.sandbox import open_sandbox
from arbiter.schemas import DeadlockDetected, LockExpired, LockRevoked, Record
from arbiter.schemas.reasons import is_retriable, what_to_do
from arbiter.streams.tools.git import branch_of

# -- answers -----------------------------------------------------------------------------------


class Answer(BaseModel):
    """What every tool answers."""

    ok: bool
    """True when the request was done."""
    reason: str = "ok"
    """A stable code: ``ok``, or why it was refused (``busy``, ``version_conflict``, ``lease_not_live``...)."""
    diagnostic: dict[str, Any] = Field(default_factory=dict)
    """When refused: the holder, your token or base, the current version, the changes since your base, and
    ``what_to_do``. Pass it to ``explain_rejection`` for the next step."""
    notices: list[str] = Field(default_factory=list)
    """What happened to your leases since your last call (an operator's revoke and its reason, a lapse)."""


class LeaseInfo(BaseModel):
    """A lease this server holds for you."""

    resource: str
    token: int
    """The fencing token: the gateway refuses writes with an older one."""
    mode: str
    expires_in_seconds: float
    held_for_seconds: float
    renewed_while_active: bool
    """True while the server renews it for you (you are active and under the hold limit)."""


class LeaseAnswer(Answer):
    """``acquire_lease``, ``renew_lease``."""

    lease: LeaseInfo | None = None


class StatusAnswer(Answer):
    """``lease_status``."""

    agent: str
    leases: list[LeaseInfo]
    idle_limit_seconds: float
    """Silent this long, your leases stop being renewed and lapse at their TTL."""
    max_hold_seconds: float


class ReleaseAnswer(Answer):
    """``release_lease``."""

    released: bool = False


class SnapshotAnswer(Answer):
    """``snapshot``."""

    resource: str
    version: int | None = None
    content_hash: str | None = None
    holders: list[dict[str, Any]] = Field(default_factory=list)
    content: Any = None


class OutcomeAnswer(Answer):
    """``execute_tool``, ``commit``, ``sandbox_merge``: the gateway's outcome."""

    intent_id: str = ""
    applied: bool = False
    version: int | None = None
    result: Any = None


class DelegateAnswer(Answer):
    """``delegate``."""

    to: str
    waiting: bool
    """True while Arbiter's deadlock detector sees you waiting on ``to``."""


class SandboxAnswer(Answer):
    """``sandbox_create``."""

    repository: str
    path: str = ""
    """Your git worktree: edit and commit there, nowhere else."""
    branch: str = ""
    base: str = ""


class RebaseAnswer(Answer):
    """``sandbox_rebase``."""

    conflicts: list[str] = Field(default_factory=list)
    """Paths that still conflict; empty when the rebase is done."""


class ClaimsAnswer(Answer):
    """``claim_paths``, ``claims``."""

    repository: str
    claims: dict[str, list[str]] = Field(default_factory=dict)
    overlapping: list[dict[str, Any]] = Field(default_factory=list)
    """Other agents' claims that overlap the paths you named."""


class Explanation(BaseModel):
    """``explain_rejection``: a refusal turned into the next step."""

    reason: str
    retriable: bool
    """True when the same request may succeed later, as it is."""
    next_step: str
    facts: dict[str, Any] = Field(default_factory=dict)
    """The diagnostic's facts that the next step refers to (holder, versions, paths)."""


A = TypeVar("A", bound=Answer)


def _info(lease: Lease, since: float, active: bool) -> LeaseInfo:
    return LeaseInfo(resource=lease.resource, token=lease.token, mode=lease.mode,
                     expires_in_seconds=round(max(0.0, lease.remaining()), 3),
                     held_for_seconds=round(time.monotonic() - since, 3), renewed_while_active=active)


def _refused(error: ArbiterError) -> dict[str, Any]:
    diagnostic = getattr(error, "diagnostic", None)
    if isinstance(diagnostic, dict):
        return diagnostic
    return {"reason": getattr(error, "reason", "error"), "detail": str(error),
            "what_to_do": what_to_do(getattr(error, "reason", "error"))}


def _holder_names(diagnostic: dict[str, Any]) -> str:
    """Who holds the resource, as a diagnostic says (``holder``, ``holders`` or ``current.holders``)."""
    current = diagnostic.get("current")
    found = diagnostic.get("holders") or (current.get("holders") if isinstance(current, dict) else None) or []
    names = [str(h.get("agent_id")) for h in found if isinstance(h, dict) and h.get("agent_id")]
    if isinstance(diagnostic.get("holder"), str):
        names.insert(0, diagnostic["holder"])
    return ", ".join(dict.fromkeys(names))


def explain(diagnostic: dict[str, Any]) -> Explanation:
    """The next step for a refusal's diagnostic (the ``diagnostic`` of any answer, or the SDK's)."""
    reason = str(diagnostic.get("reason") or "unknown")
    facts = {key: diagnostic[key] for key in ("holder", "holders", "resource", "current", "your_token",
                                              "high_water_token", "conflicts", "landed", "claimed_by",
                                              "changes_since_base", "check") if key in diagnostic}
    given = diagnostic.get("what_to_do") or diagnostic.get("advice")
    if reason == "version_conflict" and "conflicts" in diagnostic:
        step = (f"Your merge conflicts in {', '.join(diagnostic['conflicts'][:10])}. Call sandbox_rebase, "
                "resolve those paths in your sandbox, commit, and call sandbox_merge again.")
    elif reason == "version_conflict":
        step = ("Someone changed the resource since your base. Read it again (snapshot with content), "
                "re-apply your change to the new version, and commit with that version as base_version.")
    elif reason == "check_failed":
        step = "The check failed on your merge result (its output is in facts.check). Fix it, commit, merge again."
    elif reason in ("busy", "wait_timed_out"):
        names = _holder_names(diagnostic)
        step = (f"Another agent holds it{f' ({names})' if names else ''}. Work on something else and "
                "acquire again later, or acquire with a longer wait_seconds to queue for it.")
    elif reason in ("lease_not_live", "stale_fencing_token", "not_holder"):
        step = ("Your lease is gone (it lapsed, was revoked or was taken over): anything you planned under it "
                "may be stale. Acquire it again, re-read the resource, and redo the change.")
    elif reason == "deadlock_victim":
        step = "You were chosen to break a deadlock: release what you hold, wait a moment, and start the task over."
    elif reason == "forbidden":
        step = "Your identity may not touch this resource. Ask the operator, or use a resource you are allowed."
    else:
        step = str(given or what_to_do(reason))
    return Explanation(reason=reason, retriable=is_retriable(reason), next_step=step, facts=facts)


# -- the tools ---------------------------------------------------------------------------------


class AgentTools:
    """One agent's tools on one ``ArbiterClient`` (started by the caller)."""

    def __init__(self, client: ArbiterClient, *, idle_seconds: float | None = None,
                 max_hold_seconds: float | None = None, heartbeat: Path | None = None,
                 on_notice: Callable[[str], None] | None = None, runs_git: bool = True) -> None:
        settings = client.settings
        self.runs_git = runs_git
        """Whether this process may run git in the agent's sandbox: the agent's own process (``arbiter mcp``)
        may; a front door, which serves many agents with its own authority, never does."""
        self.client = client
        self.agent = client.agent_id
        self.idle_seconds = settings.mcp_idle_seconds if idle_seconds is None else idle_seconds
        self.max_hold_seconds = settings.mcp_max_hold_seconds if max_hold_seconds is None else max_hold_seconds
        self.heartbeat = heartbeat
        self.on_notice = on_notice
        self.leases: dict[str, tuple[Lease, float]] = {}
        self.sandboxes: dict[str, Sandbox] = {}
        self.delegations: dict[str, asyncio.Task[None]] = {}
        self._notices: list[str] = []
        self.history: list[str] = []
        """Every notice of this session (the last 100), for the notices resource."""
        self._active = time.monotonic()
        self._keeper: asyncio.Task[None] | None = None
        self._unsubscribe = client.subscribe(self._on_record)

    # -- activity and notices

    def touch(self) -> None:
        """The agent did something: keep renewing its leases."""
        self._active = time.monotonic()
        if self._keeper is None or self._keeper.done():
            self._keeper = asyncio.create_task(self._keep())

    def last_active(self) -> float:
        """Monotonic time of the agent's last sign of life (its last call, or its hook's heartbeat)."""
        active = self._active
        if self.heartbeat is not None:
            with contextlib.suppress(OSError):
                age = time.time() - self.heartbeat.stat().st_mtime
                active = max(active, time.monotonic() - max(0.0, age))
        return active

    def active(self) -> bool:
        return time.monotonic() - self.last_active() < self.idle_seconds

    def holding(self) -> bool:
        """Whether this agent holds a lease here (a door keeps its state while it does)."""
        return bool(self.leases) or bool(self.delegations)

    def notice(self, text: str) -> None:
        self._notices.append(text)
        del self._notices[:-50]
        self.history.append(text)
        del self.history[:-100]
        if self.on_notice is not None:
            self.on_notice(text)

    def drain(self) -> list[str]:
        """The notices since the last call (each is given once)."""
        notices, self._notices = self._notices, []
        return notices

    def _on_record(self, record: Record) -> None:
        if isinstance(record, LockRevoked | LockExpired) and record.agent_id == self.agent:
            held = self.leases.get(record.resource)
            if held is None or held[0].token != record.token:
                return
            self.leases.pop(record.resource, None)
            if isinstance(record, LockRevoked):
                held[0].mark_lost(f"revoked: {record.reason}")
                by = f" by {record.by_agent_id}" if record.by_agent_id else ""
                self.notice(f"Your lease on {record.resource} (token {record.token}) was revoked{by}: "
                            f"{record.reason}. Stop writing to it; tell your user why.")
            else:
                held[0].mark_lost("expired")
                self.notice(f"Your lease on {record.resource} (token {record.token}) lapsed: you were silent "
                            f"for more than {self.idle_seconds:g} s, or held it past {self.max_hold_seconds:g} s. "
                            "Acquire it again before writing.")
        elif isinstance(record, DeadlockDetected) and record.victim == self.agent:
            self.notice(f"You were chosen to break a deadlock ({' -> '.join(record.cycle)}): {record.message}")

    async def _keep(self) -> None:
        """Renew held leases while the agent is active; stop when there is nothing to keep."""
        while self.leases:
            await asyncio.sleep(0.25)
            for resource, (lease, since) in list(self.leases.items()):
                if lease.lost:
                    self.leases.pop(resource, None)
                    if lease.lost_reason == "ttl_elapsed_locally":
                        self.notice(f"Your lease on {resource} (token {lease.token}) lapsed: you were silent for "
                                    f"more than {self.idle_seconds:g} s, or held it past {self.max_hold_seconds:g} "
                                    "s. Acquire it again before writing.")
                    continue
                if not self.active() or time.monotonic() - since > self.max_hold_seconds:
                    continue  # silent, or held too long: let it lapse at its TTL
                if lease.remaining() > lease.ttl_ms / 1000 / 2:
                    continue
                try:
                    await self.client.renew(lease)
                except LeaseDenied as denied:
                    self.leases.pop(resource, None)
                    self.notice(f"Your lease on {resource} could not be renewed ({denied.reason}). Acquire it "
                                "again before writing.")
                except ArbiterError:
                    pass  # Kafka did not answer: try again on the next round, while the lease lasts

    async def close(self) -> None:
        """Give back every lease and delegation (a server's shutdown)."""
        self._unsubscribe()
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        for task in self.delegations.values():
            task.cancel()
        for lease, _ in list(self.leases.values()):
            with contextlib.suppress(ArbiterError, OSError):
                await self.client.release(lease)
        self.leases.clear()

    # -- leases

    def _answer(self, cls: type[A], **fields: Any) -> A:
        return cls(notices=self.drain(), **fields)

    async def acquire_lease(self, resource: str, mode: str = "exclusive", ttl_seconds: float = 60.0,
                            wait_seconds: float = 30.0, priority: int = 0) -> LeaseAnswer:
        held = self.leases.get(resource)
        if held is not None and not held[0].lost:
            return self._answer(LeaseAnswer, ok=True, reason="already_held",
                                lease=_info(held[0], held[1], self.active()))
        try:
            lease = await self.client.acquire(resource, ttl=ttl_seconds, mode=mode, wait=wait_seconds,
                                              priority=priority)
        except ArbiterError as error:
            return self._answer(LeaseAnswer, ok=False, reason=getattr(error, "reason", "error"),
                                diagnostic=_refused(error))
        self.leases[resource] = (lease, time.monotonic())
        self.touch()
        return self._answer(LeaseAnswer, ok=True, lease=_info(lease, self.leases[resource][1], True))

    async def renew_lease(self, resource: str, ttl_seconds: float | None = None) -> LeaseAnswer:
        held = self.leases.get(resource)
        if held is None:
            return self._answer(LeaseAnswer, ok=False, reason="not_holder", diagnostic={
                "reason": "not_holder", "resource": resource,
                "what_to_do": "You hold no lease on it here (it lapsed, was revoked or released): acquire it."})
        try:
            await self.client.renew(held[0], ttl_seconds)
        except ArbiterError as error:
            self.leases.pop(resource, None)
            return self._answer(LeaseAnswer, ok=False, reason=getattr(error, "reason", "error"),
                                diagnostic=_refused(error))
        # renewing by hand starts a new hold period
        self.leases[resource] = (held[0], time.monotonic())
        return self._answer(LeaseAnswer, ok=True, lease=_info(held[0], self.leases[resource][1], self.active()))

    async def release_lease(self, resource: str) -> ReleaseAnswer:
        held = self.leases.pop(resource, None)
        if held is None:
            return self._answer(ReleaseAnswer, ok=True, released=False, reason="not_held")
        try:
            await self.client.release(held[0])
        except ArbiterError as error:
            return self._answer(ReleaseAnswer, ok=False, reason=getattr(error, "reason", "error"),
                                diagnostic=_refused(error))
        return self._answer(ReleaseAnswer, ok=True, released=True)

    async def lease_status(self) -> StatusAnswer:
        active = self.active()
        leases = [_info(lease, since, active and time.monotonic() - since <= self.max_hold_seconds)
                  for lease, since in self.leases.values() if not lease.lost]
        return self._answer(StatusAnswer, ok=True, agent=self.agent, leases=leases,
                            idle_limit_seconds=self.idle_seconds, max_hold_seconds=self.max_hold_seconds)

    # -- reads and writes

    async def snapshot(self, resource: str, content: bool = False) -> SnapshotAnswer:
        try:
            snap = await self.client.snapshot(resource, content=content)
        except ArbiterError as error:
            return self._answer(SnapshotAnswer, ok=False, resource=resource, reason=getattr(error, "reason", "error"),
                                diagnostic=_refused(error))
        return self._answer(SnapshotAnswer, ok=True, resource=resource, version=snap.version,
                            content_hash=snap.content_hash, holders=snap.holders, content=snap.content)

    def _outcome(self, outcome: Outcome) -> OutcomeAnswer:
        return self._answer(OutcomeAnswer, ok=outcome.applied, reason="ok" if outcome.applied else outcome.reason,
                            diagnostic=outcome.diagnostic, intent_id=outcome.intent_id, applied=outcome.applied,
                            version=outcome.version, result=outcome.result)

    async def execute_tool(self, resource: str, tool: str, arguments: dict[str, Any],
                           base_version: int | None = None, intent_id: str | None = None) -> OutcomeAnswer:
        held = self.leases.get(resource)
        try:
            if held is not None and base_version is None:
                outcome = await self.client.execute(held[0], tool, arguments, intent_id=intent_id)
            else:
                outcome = await self.client.execute(resource, tool, arguments, base_version=base_version,
                                                    intent_id=intent_id)
        except ArbiterError as error:
            return self._answer(OutcomeAnswer, ok=False, reason=getattr(error, "reason", "error"),
                                diagnostic=_refused(error))
        return self._outcome(outcome)

    async def commit(self, resource: str, base_version: int, patch: dict[str, Any],
                     intent_id: str | None = None) -> OutcomeAnswer:
        held = self.leases.get(resource)
        try:
            outcome = await self.client.commit(resource, base_version, patch,
                                               lease=held[0] if held else None, intent_id=intent_id)
        except ArbiterError as error:
            return self._answer(OutcomeAnswer, ok=False, reason=getattr(error, "reason", "error"),
                                diagnostic=_refused(error))
        return self._outcome(outcome)

    async def delegate(self, to: str, task: str = "", finished: bool = False) -> DelegateAnswer:
        if finished:
            running = self.delegations.pop(to, None)
            if running is not None:
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
            return self._answer(DelegateAnswer, ok=True, to=to, waiting=False)
        if to in self.delegations:
            return self._answer(DelegateAnswer, ok=True, reason="already_waiting", to=to, waiting=True)
        opened = asyncio.get_running_loop().create_future()

        async def wait_on() -> None:
            async with self.client.delegate(to, task=task):
                opened.set_result(None)
                await asyncio.Event().wait()  # until finished=True (or the server stops)

        self.delegations[to] = asyncio.create_task(wait_on())
        await asyncio.wait({opened, self.delegations[to]}, return_when=asyncio.FIRST_COMPLETED)
        if not opened.done():
            failed = self.delegations.pop(to)
            return self._answer(DelegateAnswer, ok=False, reason="unavailable", to=to, waiting=False,
                                diagnostic={"reason": "unavailable", "detail": str(failed.exception())})
        self.touch()
        return self._answer(DelegateAnswer, ok=True, to=to, waiting=True)

    # -- sandboxes

    def _repo_path(self, repository: str) -> tuple[str, Path] | None:
        name = repository.removeprefix("repo:")
        found = self.client.settings.repositories().get(name)
        return (name, found.path) if found is not None else None

    def _unknown_repo(self, repository: str) -> dict[str, Any]:
        known = ", ".join(sorted(self.client.settings.repositories())) or "none"
        return {"reason": "unknown_repository", "detail": f"no repository {repository!r} here (known: {known})",
                "what_to_do": "Use one of the known repositories; the operator configures them (ARBITER_REPOS, "
                              "repos.toml)."}

    async def _repository_view(self, name: str) -> dict[str, Any]:
        """The host's view of ``repo:<name>`` (its sandboxes and claims), read through the log; or a
        diagnostic."""
        try:
            snap = await self.client.snapshot(f"repo:{name}", content=True)
        except ArbiterError as error:
            return _refused(error)
        if not isinstance(snap.content, dict) or "sandboxes" not in snap.content:
            return {"reason": "unavailable", "detail": f"no repository host answered for repo:{name}",
                    "what_to_do": "The operator starts a worker with this repository configured; try again."}
        return snap.content

    async def _box(self, repository: str) -> Sandbox | dict[str, Any]:
        """This agent's sandbox of ``repository``: the one it made here, or the one the host has for it."""
        found = self._repo_path(repository)
        if found is None:
            return self._unknown_repo(repository)
        name, _path = found
        box = self.sandboxes.get(name)
        if box is not None:
            return box
        view = await self._repository_view(name)
        if "sandboxes" not in view:
            return view
        mine = next((b for b in view["sandboxes"] if b.get("agent") == self.agent), None)
        if mine is None:
            return {"reason": "no_sandbox", "detail": f"{self.agent} has no sandbox of repo:{name}",
                    "what_to_do": "Call sandbox_create first."}
        box = self.sandboxes[name] = Sandbox(self.client, f"repo:{name}", Path(mine["path"]), branch_of(self.agent),
                                             "")
        return box

    async def sandbox_create(self, repository: str, base: str = "main") -> SandboxAnswer:
        found = self._repo_path(repository)
        if found is None:
            return self._answer(SandboxAnswer, ok=False, repository=repository, reason="unknown_repository",
                                diagnostic=self._unknown_repo(repository))
        name, _ = found
        try:
            box = await open_sandbox(self.client, name, base, 60.0, 600.0)
        except SandboxRefused as refused:
            existing = await self._box(name) if "already" in str(refused) else None
            if isinstance(existing, Sandbox):  # made earlier (by this server or another): the same answer
                return self._answer(SandboxAnswer, ok=True, reason="already_exists", repository=existing.repository,
                                    path=str(existing.path), branch=existing.branch, base=existing.base)
            return self._answer(SandboxAnswer, ok=False, repository=f"repo:{name}",
                                reason=refused.outcome.reason, diagnostic=refused.outcome.diagnostic)
        except ArbiterError as error:
            return self._answer(SandboxAnswer, ok=False, repository=f"repo:{name}",
                                reason=getattr(error, "reason", "error"), diagnostic=_refused(error))
        self.sandboxes[name] = box
        return self._answer(SandboxAnswer, ok=True, repository=box.repository, path=str(box.path), branch=box.branch,
                            base=box.base)

    async def sandbox_merge(self, repository: str, message: str) -> OutcomeAnswer:
        box = await self._box(repository)
        if not isinstance(box, Sandbox):
            return self._answer(OutcomeAnswer, ok=False, reason=box["reason"], diagnostic=box)
        try:
            outcome = await box.merge(message)
        except ArbiterError as error:
            return self._answer(OutcomeAnswer, ok=False, reason=getattr(error, "reason", "error"),
                                diagnostic=_refused(error))
        return self._outcome(outcome)

    async def sandbox_rebase(self, repository: str) -> RebaseAnswer:
        box = await self._box(repository)
        if not isinstance(box, Sandbox):
            return self._answer(RebaseAnswer, ok=False, reason=box["reason"], diagnostic=box)
        if not self.runs_git or not box.here:
            return self._answer(RebaseAnswer, ok=False, reason="rebase_in_your_sandbox", diagnostic={
                "reason": "rebase_in_your_sandbox", "sandbox": str(box.path),
                "what_to_do": f"This server runs no git in sandboxes. In your sandbox ({box.path}): git fetch origin "
                              f"{box.target} && git rebase origin/{box.target}; resolve, commit, then sandbox_merge."})
        conflicts = await box.rebase()
        if conflicts:
            return self._answer(RebaseAnswer, ok=False, reason="rebase_conflict", conflicts=conflicts, diagnostic={
                "reason": "rebase_conflict", "conflicts": conflicts,
                "what_to_do": "The rebase was aborted, your sandbox is as it was. Edit those paths to fit the new "
                              "head (git merge origin/main in your sandbox, resolve, commit), then sandbox_merge."})
        return self._answer(RebaseAnswer, ok=True)

    async def claim_paths(self, repository: str, paths: list[str]) -> ClaimsAnswer:
        box = await self._box(repository)
        if not isinstance(box, Sandbox):
            return self._answer(ClaimsAnswer, ok=False, repository=repository, reason=box["reason"], diagnostic=box)
        try:
            overlapping = await box.claim(paths)
        except SandboxRefused as refused:
            return self._answer(ClaimsAnswer, ok=False, repository=box.repository, reason=refused.outcome.reason,
                                diagnostic=refused.outcome.diagnostic)
        return self._answer(ClaimsAnswer, ok=True, repository=box.repository, overlapping=overlapping,
                            claims={self.agent: list(paths)} if paths else {})

    async def claims(self, repository: str) -> ClaimsAnswer:
        found = self._repo_path(repository)
        if found is None:
            return self._answer(ClaimsAnswer, ok=False, repository=repository, reason="unknown_repository",
                                diagnostic=self._unknown_repo(repository))
        name, _path = found
        view = await self._repository_view(name)
        if "claims" not in view:
            return self._answer(ClaimsAnswer, ok=False, repository=f"repo:{name}", reason=str(view["reason"]),
                                diagnostic=view)
        return self._answer(ClaimsAnswer, ok=True, repository=f"repo:{name}", claims=view["claims"])

    async def explain_rejection(self, diagnostic: dict[str, Any]) -> Explanation:
        return explain(diagnostic)


@contextlib.asynccontextmanager
async def agent_tools(agent: str, settings: Any = None, **options: Any) -> AsyncIterator[AgentTools]:
    """``async with agent_tools("claude-1") as tools``: the agent's client and tools, closed after."""
    async with ArbiterClient(agent, settings) as client:
        tools = AgentTools(client, **options)
        try:
            yield tools
        finally:
            await tools.close()

