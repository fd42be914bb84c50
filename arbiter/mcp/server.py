"""Arbiter as an MCP server (the official ``mcp`` SDK's ``MCPServer``): one agent's leases, writes
and sandboxes as tools a model calls.

``build_server(resolve)`` registers the tools; ``resolve`` gives the calling agent's ``AgentTools``
from a call's context: ``arbiter mcp --agent NAME`` (stdio) always answers its one agent, and the
front door's ``/mcp`` answers the agent whose API key the request carries (``Authorization: Bearer``),
checked on every request. Each call is a task of its own: a call that waits (an acquire queued
behind another agent) blocks no other call, of this agent or another.

An operator's revoke, a lease that lapsed and a deadlock that chose this agent reach the agent twice:
as a ``notices`` line in its next tool result, and at once as a resource-updated event for
``arbiter://agents/<agent>/notices`` (read it for the text).
"""

# No ``from __future__ import annotations``: the SDK reads these tools' signatures at run time.

import json
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, cast

from mcp.server import MCPServer
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.tools import Tool
from mcp.server.mcpserver.utilities.func_metadata import ArgModelBase
from mcp.server.subscriptions import InMemorySubscriptionBus, ResourceUpdated
from mcp_types import ToolAnnotations
from pydantic import ConfigDict, Field

from .tools import (
    AgentTools,
    ClaimsAnswer,
    DelegateAnswer,
    Explanation,
    LeaseAnswer,
    OutcomeAnswer,
    RebaseAnswer,
    ReleaseAnswer,
    SandboxAnswer,
    SnapshotAnswer,
    StatusAnswer,
)

Resolve = Callable[[Context], Awaitable[AgentTools]]
"""The calling agent's tools, from a call's context (raises to refuse the call)."""

INSTRUCTIONS = """\
Arbiter keeps the agents that share this work from corrupting each other's changes.
- Before you change a shared thing (a file area, a record, a ticket), acquire_lease on its resource
  name; write through execute_tool or commit, which the gateway refuses if your lease is gone.
  This server renews your leases while you keep working; if you go silent they lapse.
- For code: sandbox_create gives you your own git worktree; edit and commit only there; claim_paths
  says what you will touch; sandbox_merge lands it through the merge queue; on a conflict,
  sandbox_rebase and merge again.
- Every refusal has a diagnostic; explain_rejection turns it into the next step.
- Read "notices" in every result: an operator may revoke your lease with a reason; tell your user.
"""

READ = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=True, open_world_hint=False)


def _writes(*, destructive: bool, idempotent: bool, title: str) -> ToolAnnotations:
    return ToolAnnotations(title=title, read_only_hint=False, destructive_hint=destructive,
                           idempotent_hint=idempotent, open_world_hint=False)


Resource = Annotated[str, Field(min_length=1, max_length=512,
                                description="A resource name, as your team names them: 'file:src/auth.py', "
                                            "'ticket:123', 'repo:app'.")]
Repository = Annotated[str, Field(min_length=1, max_length=200,
                                  description="A repository this server knows, by name ('app' or 'repo:app').")]


def notices_uri(agent: str) -> str:
    """The resource whose update event tells an agent's session that it has a new notice."""
    return f"arbiter://agents/{agent}/notices"


class Notifier:
    """Publishes an agent's notice events on the server's subscription bus (``subscriptions/listen``)."""

    def __init__(self) -> None:
        self.bus = InMemorySubscriptionBus()

    async def publish(self, agent: str) -> None:
        """Tell ``agent``'s listening sessions that it has a new notice."""
        await self.bus.publish(ResourceUpdated(uri=notices_uri(agent)))


class ServerTools:
    """Arbiter's MCP tools, one method each, answering the agent ``resolve`` names for each call.

    Methods, not closures in ``build_server``: the SDK reads a bound method's name, signature and
    docstring as it reads a function's (``self`` is not a parameter a caller sees), and the one thing
    the tools share, ``resolve``, is this object's."""

    def __init__(self, resolve: Resolve) -> None:
        self.resolve = resolve

    async def agent(self, ctx: Context) -> AgentTools:
        """The calling agent's tools, marked active (this server renews an active agent's leases)."""
        tools = await self.resolve(ctx)
        tools.touch()
        return tools

    async def acquire_lease(
            self,
            resource: Resource, ctx: Context,
            mode: Annotated[str, Field(pattern="^(exclusive|shared)$",
                                       description="'exclusive' to write; 'shared' to read alongside others.")
                            ] = "exclusive",
            ttl_seconds: Annotated[float, Field(gt=0, le=3600)] = 60.0,
            wait_seconds: Annotated[float, Field(ge=0, le=3600, description="How long to queue if another "
                                                 "agent holds it; 0 answers at once.")] = 30.0,
            priority: int = 0) -> LeaseAnswer:
        """Take the lease on a resource before you change it. You get a fencing token; the gateway refuses
        writes from anyone whose lease is gone or older. While you keep calling tools, this server renews
        the lease for you; release_lease when done. Refused (ok=false) with the holder named if another
        agent keeps it past wait_seconds."""
        return await (await self.agent(ctx)).acquire_lease(resource, mode, ttl_seconds, wait_seconds, priority)

    async def renew_lease(self, resource: Resource, ctx: Context,
                          ttl_seconds: Annotated[float | None, Field(gt=0, le=3600)] = None) -> LeaseAnswer:
        """Extend a lease you hold now. Rarely needed: the server renews your leases while you are active.
        Use it before a long silent step (a long build) so the lease outlives it."""
        return await (await self.agent(ctx)).renew_lease(resource, ttl_seconds)

    async def release_lease(self, resource: Resource, ctx: Context) -> ReleaseAnswer:
        """Give a lease back as soon as you are done, so the next agent in line gets it."""
        return await (await self.agent(ctx)).release_lease(resource)

    async def lease_status(self, ctx: Context) -> StatusAnswer:
        """The leases you hold through this server, their tokens and how long they last, and the idle
        limit after which they stop being renewed."""
        return await (await self.agent(ctx)).lease_status()

    async def snapshot(self, resource: Resource, ctx: Context,
                       content: Annotated[bool, Field(description="Also return the content.")] = False
                       ) -> SnapshotAnswer:
        """A resource's current version, content hash and holders (and its content): read it before you
        plan a change, and use its version as base_version when you commit."""
        return await (await self.agent(ctx)).snapshot(resource, content)

    async def execute_tool(
            self,
            resource: Resource, tool: Annotated[str, Field(min_length=1, max_length=200)],
            arguments: dict[str, Any], ctx: Context,
            base_version: Annotated[int | None, Field(ge=0, description="For a resource you hold no lease on: "
                                                      "the version your change was planned on.")] = None,
            intent_id: Annotated[str | None, Field(max_length=200, description="Reuse one to retry safely: the "
                                                   "tool never runs twice for one intent.")] = None
            ) -> OutcomeAnswer:
        """Run a registered tool on a resource, through the gateway: fenced by your lease's token (or
        checked against base_version). A refusal says why: your lease is gone, your token is stale, or the
        resource moved since your base (with what changed)."""
        return await (await self.agent(ctx)).execute_tool(resource, tool, arguments, base_version, intent_id)

    async def commit(self, resource: Resource, base_version: Annotated[int, Field(ge=0)], patch: dict[str, Any],
                     ctx: Context, intent_id: Annotated[str | None, Field(max_length=200)] = None
                     ) -> OutcomeAnswer:
        """Optimistic write: apply a JSON merge patch to a document, if it is still at base_version. On a
        version_conflict the diagnostic carries the changes since your base: rebase your patch on them and
        commit again with the new version."""
        return await (await self.agent(ctx)).commit(resource, base_version, patch, intent_id)

    async def delegate(self, to: Annotated[str, Field(min_length=1, max_length=200)], ctx: Context,
                       task: Annotated[str, Field(max_length=2000)] = "",
                       finished: Annotated[bool, Field(description="True when the work you handed over is "
                                                       "done, or you stop waiting.")] = False
                       ) -> DelegateAnswer:
        """Say that you hand work to another agent and wait on it, so Arbiter's deadlock detector sees it;
        call again with finished=true when it is done. If a wait cycle forms and you are chosen to break
        it, a notice says so."""
        return await (await self.agent(ctx)).delegate(to, task, finished)

    async def sandbox_create(self, repository: Repository, ctx: Context,
                             base: Annotated[str, Field(min_length=1, max_length=200)] = "main"
                             ) -> SandboxAnswer:
        """Make (or find) your own git worktree of a repository, on your own branch. Edit and commit only
        there: other agents never see your work until sandbox_merge lands it."""
        return await (await self.agent(ctx)).sandbox_create(repository, base)

    async def sandbox_merge(self, repository: Repository,
                            message: Annotated[str, Field(min_length=1, max_length=10_000)],
                            ctx: Context) -> OutcomeAnswer:
        """Merge your sandbox's commits into the target branch through the merge queue, after the
        repository's own check (its tests, as the operator configured them) passes on the result. A conflict
        is version_conflict with the paths and the commits that landed since your base: sandbox_rebase,
        resolve, commit, merge again. A failing check is check_failed with its output."""
        return await (await self.agent(ctx)).sandbox_merge(repository, message)

    async def sandbox_rebase(self, repository: Repository, ctx: Context) -> RebaseAnswer:
        """Rebase your sandbox onto the target's new head. Answers the paths that still conflict (the
        rebase is then undone and your sandbox is as it was), or none when done."""
        return await (await self.agent(ctx)).sandbox_rebase(repository)

    async def claim_paths(self, repository: Repository,
                          paths: Annotated[list[str], Field(max_length=200, description="Paths or globs "
                                                            "('src/auth/**'); [] withdraws your claim.")],
                          ctx: Context) -> ClaimsAnswer:
        """Announce which paths you will work on, before you start, and see other agents' claims that
        overlap them. Claims block nothing (git decides conflicts at merge), but they tell you whom you
        would collide with."""
        return await (await self.agent(ctx)).claim_paths(repository, paths)

    async def claims(self, repository: Repository, ctx: Context) -> ClaimsAnswer:
        """Every agent's path claims on a repository: check before you pick what to change."""
        return await (await self.agent(ctx)).claims(repository)

    async def explain_rejection(self,
                                diagnostic: Annotated[dict[str, Any], Field(description="The 'diagnostic' "
                                                                            "of a refused answer.")],
                                ctx: Context) -> Explanation:
        """Turn a refusal's diagnostic into the next step to take, and whether retrying as is can work."""
        return await (await self.agent(ctx)).explain_rejection(diagnostic)

    async def notices(self, agent: str, ctx: Context) -> str:
        """The notices of your session (revokes, lapses, deadlocks), newest last."""
        tools = await self.resolve(ctx)
        if tools.agent != agent:
            return json.dumps({"error": "forbidden", "detail": "you may read only your own notices"})
        return json.dumps({"agent": agent, "notices": tools.history})


def _tool(fn: Callable[..., Any], annotations: ToolAnnotations) -> Tool:
    """``fn`` as a tool with these hints, refusing arguments it does not take."""
    return strict(Tool.from_function(fn, annotations=annotations))


def lease_tools(tools: ServerTools) -> list[Tool]:
    """Take, renew, give back and list leases."""
    return [
        _tool(tools.acquire_lease, _writes(title="Acquire a lease", destructive=False, idempotent=True)),
        _tool(tools.renew_lease, _writes(title="Renew a lease", destructive=False, idempotent=True)),
        _tool(tools.release_lease, _writes(title="Release a lease", destructive=False, idempotent=True)),
        _tool(tools.lease_status, READ),
    ]


def resource_tools(tools: ServerTools) -> list[Tool]:
    """Read a resource, change it through the gateway, and say whom you wait on."""
    return [
        _tool(tools.snapshot, READ),
        _tool(tools.execute_tool, _writes(title="Run a tool through the gateway", destructive=True, idempotent=True)),
        _tool(tools.commit, _writes(title="Commit a change", destructive=True, idempotent=True)),
        _tool(tools.delegate, _writes(title="Wait on another agent", destructive=False, idempotent=True)),
    ]


def sandbox_tools(tools: ServerTools) -> list[Tool]:
    """Work on a repository: a sandbox of one's own, its merge and rebase, and path claims."""
    return [
        _tool(tools.sandbox_create, _writes(title="Make your sandbox", destructive=False, idempotent=True)),
        _tool(tools.sandbox_merge, _writes(title="Merge your sandbox", destructive=True, idempotent=False)),
        _tool(tools.sandbox_rebase, _writes(title="Rebase your sandbox", destructive=False, idempotent=True)),
        _tool(tools.claim_paths, _writes(title="Claim paths", destructive=False, idempotent=True)),
        _tool(tools.claims, READ),
    ]


def build_server(resolve: Resolve, notifier: Notifier, *, name: str = "arbiter") -> MCPServer:
    """An ``MCPServer`` with Arbiter's tools, answering the agent ``resolve`` names for each call."""
    tools = ServerTools(resolve)
    # The order here is the order tools/list shows them in.
    made = [*lease_tools(tools), *resource_tools(tools), *sandbox_tools(tools), _tool(tools.explain_rejection, READ)]
    server: MCPServer = MCPServer(name, instructions=INSTRUCTIONS, version="1", log_level="WARNING",
                                  subscriptions=notifier.bus, tools=made)
    server.resource("arbiter://agents/{agent}/notices", mime_type="application/json")(tools.notices)
    return server


def strict(tool: Tool) -> Tool:
    """A tool that refuses an argument it does not take (the SDK ignores them): a caller that sends one, a
    ``check`` command, say, learns it was not taken, and the schema says ``additionalProperties: false``."""
    base = tool.fn_metadata.arg_model
    model = cast(type[ArgModelBase], type(base.__name__, (base,), {
        "model_config": ConfigDict(extra="forbid", arbitrary_types_allowed=True)}))
    tool.fn_metadata.arg_model = model
    tool.parameters = model.model_json_schema(by_alias=True)
    return tool
