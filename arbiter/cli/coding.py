"""``arbiter mcp`` (an MCP server over stdio, one agent per process) and ``arbiter hook pre-tool-use``
(a coding agent's PreToolUse hook that denies edits to what another agent holds)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from arbiter.edge.settings import Settings

if TYPE_CHECKING:
    from arbiter.agents import ArbiterClient

from .terminal import fail, settings_of

HOOK_EXIT_BLOCK = 2
"""The exit code Claude Code and Codex read as "block this call" (1 would let it go ahead)."""


def heartbeat_path(settings: Settings, agent: str) -> Path:
    """The file the hook touches and ``arbiter mcp`` reads as the agent's activity."""
    return settings.home / "mcp" / f"{agent}.heartbeat"


class Connection:
    """A client's connection, begun at once in the background; a call waits for it, and after a failure
    (Kafka unreachable) the next call tries again instead of failing for the rest of the session."""

    def __init__(self, client: ArbiterClient) -> None:
        self.client = client
        self.task: asyncio.Task[None] = asyncio.create_task(client.start())

    async def ready(self) -> None:
        """Return once connected; raise what the connecting raised (``ArbiterUnavailable``, say)."""
        if self.task.done() and (self.task.cancelled() or self.task.exception() is not None):
            self.task = asyncio.create_task(self.client.start())
        await asyncio.shield(self.task)

    async def stop(self) -> bool:
        """Stop connecting; whether it had connected."""
        if not self.task.done():
            self.task.cancel()
        try:
            await self.task
        except (asyncio.CancelledError, Exception):  # cancelled, or it never connected
            return False
        return True


@click.command("mcp")
@click.option("--agent", required=True, help="The agent this server acts as (its identity signs every command).")
@click.option("--idle", "idle", type=float, default=None,
              help="Seconds of silence after which its leases stop being renewed (default ARBITER_MCP_IDLE_SECONDS, "
                   "300).")
@click.option("--max-hold", "max_hold", type=float, default=None,
              help="Longest it renews one lease, in seconds (default ARBITER_MCP_MAX_HOLD_SECONDS, 3600).")
@click.pass_context
def mcp(ctx: click.Context, agent: str, idle: float | None, max_hold: float | None) -> None:
    """An MCP server over stdio for one coding agent: leases the server renews while the agent works,
    writes through the gateway, sandboxes and merges, and explain_rejection. Coding agents launch it
    (.mcp.json, Codex's config.toml); stdout carries only the protocol."""
    from arbiter.agents import ArbiterClient, ArbiterUnavailable
    from arbiter.mcp.tools import AgentTools
    from arbiter.schemas.identity import IdentityError

    try:
        from mcp.server.mcpserver.exceptions import ToolError

        from arbiter.mcp.server import Notifier, build_server
    except ImportError as exc:
        fail(f"arbiter mcp needs the MCP SDK ({exc})", "pip install 'arbiter[mcp]'")

    settings = settings_of(ctx)

    async def serve() -> None:
        from arbiter.mcp.hookserver import HookServer

        # The protocol answers at once; the client connects meanwhile (a call waits for it, and an
        # outage's refusal is answered as such and tried again on the next call), so an agent's launch
        # does not wait on Kafka.
        client = ArbiterClient(agent, settings)
        connection = Connection(client)
        notifier = Notifier()
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task[None]] = set()

        def on_notice(_: str) -> None:
            task = loop.create_task(notifier.publish(agent))
            pending.add(task)
            task.add_done_callback(pending.discard)

        tools = AgentTools(client, idle_seconds=idle, max_hold_seconds=max_hold,
                           heartbeat=heartbeat_path(settings, agent), on_notice=on_notice)

        async def resolve(_ctx: Any) -> AgentTools:
            try:
                await connection.ready()
            except ArbiterUnavailable as exc:
                raise ToolError(f"unavailable: {exc}. Nothing was done; call again once Kafka answers.") from exc
            except IdentityError as exc:
                raise ToolError(f"{exc}. Nothing was done; the operator issues it: arbiter agents add {agent}") from exc
            return tools

        hooks = HookServer(client, settings, on_activity=tools.touch, ready=connection.ready)
        try:
            await hooks.start()
            await build_server(resolve, notifier).run_stdio_async()
        finally:
            await hooks.close()
            if await connection.stop():
                await tools.close()
            await client.close()

    try:
        asyncio.run(serve())
    except IdentityError as exc:
        fail(str(exc), f"issue the agent's identity first: arbiter agents add {agent}")
    except KeyboardInterrupt:
        pass


@click.group("hook")
def hook() -> None:
    """Hooks for coding agents (Claude Code, Codex) that make Arbiter's leases binding."""


@hook.command("serve")
@click.option("--agent", required=True, help="The agent whose hook this process answers.")
@click.pass_context
def serve_hook(ctx: click.Context, agent: str) -> None:
    """Answer AGENT's PreToolUse hook (arbiter-hook --agent AGENT) over a Unix socket only this user can
    open, until stopped: for an agent that runs no 'arbiter mcp' (which answers it itself)."""
    from arbiter.agents import ArbiterClient
    from arbiter.mcp.hookserver import HookServer
    from arbiter.schemas.identity import IdentityError

    settings = settings_of(ctx)

    async def run() -> None:
        async with ArbiterClient(agent, settings) as client:
            server = HookServer(client, settings, heartbeat=heartbeat_path(settings, agent))
            if not await server.start():
                fail(f"another process already answers {agent}'s hook at {server.path}")
            click.echo(f"answering {agent}'s hook at {server.path} (arbiter-hook --agent {agent})", err=True)
            try:
                await asyncio.Event().wait()
            finally:
                await server.close()

    try:
        asyncio.run(run())
    except IdentityError as exc:
        fail(str(exc), f"issue the agent's identity first: arbiter agents add {agent}")
    except KeyboardInterrupt:
        pass


@hook.command("pre-tool-use")
@click.option("--agent", required=True, help="The agent the coding session is (its identity reads the leases).")
@click.option("--timeout", type=float, default=10.0, show_default=True,
              help="Seconds to reach Arbiter when no process of the agent's answers the hook; past them the call "
                   "is denied (exit 2), never let through.")
@click.pass_context
def pre_tool_use(ctx: click.Context, agent: str, timeout: float) -> None:
    """Read a PreToolUse payload on stdin; deny (JSON on stdout) a write to a path another agent holds or
    outside this agent's sandbox; exit 2 (blocked, reason on stderr) when the input cannot be parsed or
    Arbiter cannot be reached. Allowed calls print nothing. The agent's own process answers when one runs
    (arbiter mcp, arbiter hook serve); the hook's fast client is arbiter-hook."""
    from arbiter.mcp import hookclient

    settings = settings_of(ctx)
    if os.path.exists(hookclient.socket_path(settings.home, agent)):
        sys.exit(hookclient.main(["--agent", agent, "--home", str(settings.home)]))
    _decide_here(settings, agent, timeout)


def _decide_here(settings: Settings, agent: str, timeout: float) -> None:
    """The hook without a long-lived process: this one connects to Kafka for the one call (slower)."""
    from arbiter.mcp.hook import HookInputError, decide, deny_json, parse, sandboxes_of, written_paths
    from arbiter.schemas.identity import IdentityError

    def block(why: str) -> None:
        click.echo(f"arbiter hook: {why} The call is blocked until this is fixed.", err=True)
        sys.exit(HOOK_EXIT_BLOCK)

    try:
        payload = parse(sys.stdin.read())
    except HookInputError as error:
        block(f"cannot read the PreToolUse input: {error}.")
        return
    try:
        beat = heartbeat_path(settings, agent)
        beat.parent.mkdir(parents=True, exist_ok=True)
        beat.touch()
        if not written_paths(payload):
            return  # a read, or nothing to check: no answer lets the agent's own permissions decide
        repos = {name: repository.path for name, repository in settings.repositories().items()}
    except Exception as error:  # a broken setting or home: block, say so, no traceback
        block(f"cannot load Arbiter's settings: {error}.")
        return
    started = time.monotonic()

    async def check() -> str | None:
        from arbiter.agents import ArbiterClient

        async with ArbiterClient(agent, settings) as client:
            return await decide(payload, client, repos, sandboxes_of(settings.sandbox_root))

    try:
        reason = asyncio.run(asyncio.wait_for(check(), timeout))
    except IdentityError as error:
        block(f"{agent} has no identity here ({error}); issue it with 'arbiter agents add {agent}'.")
        return
    except TimeoutError:
        block(f"cannot reach Arbiter at {settings.bootstrap} within {timeout:g} s, so it cannot tell whether "
              "another agent holds these paths.")
        return
    except Exception as error:
        block(f"cannot reach Arbiter at {settings.bootstrap} ({type(error).__name__}: {error}) after "
              f"{time.monotonic() - started:.1f} s, so it cannot tell whether another agent holds these paths.")
        return
    if reason is not None:
        click.echo(deny_json(reason))
