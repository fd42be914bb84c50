"""Arbiter as an MCP server, driven by the MCP SDK's own client against real workers: over stdio
(``arbiter mcp``, one process per agent) and over streamable HTTP (the front door's ``/mcp``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from arbiter.agents import ArbiterClient
from arbiter.agents.identities import Registrar
from arbiter.edge.settings import Settings
from arbiter.mcp.server import notices_uri
from arbiter.processes import WorkerPool, settings_env
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import assert_clean_audit, isolated_settings
from tests.streams.shells.test_gateway_kafka import start_worker
from tests.streams.tools.test_git_tools import commit, make_repo

pytestmark = pytest.mark.kafka

TOOLS = {"acquire_lease", "renew_lease", "release_lease", "lease_status", "snapshot", "execute_tool", "commit",
         "delegate", "sandbox_create", "sandbox_merge", "sandbox_rebase", "claim_paths", "claims",
         "explain_rejection"}
READ_ONLY = {"lease_status", "snapshot", "claims", "explain_rejection"}


async def call(client: Client, tool: str, **arguments: Any) -> dict[str, Any]:
    result = await client.call_tool(tool, arguments)
    assert not result.is_error, (tool, result.content)
    data = result.structured_content
    assert isinstance(data, dict), (tool, result)
    return data


@contextlib.asynccontextmanager
async def stdio(settings: Settings, agent: str, *extra: str) -> AsyncIterator[Client]:
    params = StdioServerParameters(command=sys.executable, args=["-m", "arbiter", "mcp", "--agent", agent, *extra],
                                   env=settings_env(settings))
    async with Client(params, read_timeout_seconds=120) as client:
        yield client


async def holders(settings: Settings, resource: str) -> list[str]:
    async with ArbiterClient("auditor", settings) as auditor:
        return [h["agent_id"] for h in (await auditor.snapshot(resource)).holders]


@pytest.fixture
async def stack(bootstrap: str, tmp_path: Path) -> AsyncIterator[tuple[Settings, Path]]:
    repo = make_repo(tmp_path)
    settings = isolated_settings(bootstrap, tmp_path, repos=f"app={repo}")
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    await start_worker(settings, pool)
    try:
        yield settings, repo
    finally:
        pool.stop()


def check_tool_list(tools: list[Any]) -> None:
    assert {t.name for t in tools} == TOOLS
    for tool in tools:
        notes = tool.annotations
        assert notes is not None and None not in (notes.read_only_hint, notes.destructive_hint, notes.idempotent_hint)
        assert notes.read_only_hint == (tool.name in READ_ONLY), tool.name
        assert tool.description and len(tool.description) > 60, tool.name
        assert tool.output_schema, tool.name
        assert tool.name == "explain_rejection" or "ok" in tool.output_schema["properties"], tool.name
    acquire = next(t for t in tools if t.name == "acquire_lease")
    assert acquire.input_schema["required"] == ["resource"]
    assert set(acquire.input_schema["properties"]) == {"resource", "mode", "ttl_seconds", "wait_seconds", "priority"}


async def test_over_stdio_two_agents_race_a_silent_holder_lapses_a_revoke_reaches_its_holder(
        stack: tuple[Settings, Path]) -> None:
    settings, _ = stack
    async with stdio(settings, "ann", "--idle", "2") as ann, stdio(settings, "bob", "--idle", "2") as bob:
        check_tool_list((await ann.list_tools()).tools)

        # Two agents race for one lease: one gets it, the other is told who holds it.
        first, second = await asyncio.gather(
            call(ann, "acquire_lease", resource="doc:race", wait_seconds=0, ttl_seconds=30),
            call(bob, "acquire_lease", resource="doc:race", wait_seconds=0, ttl_seconds=30))
        assert sorted([first["ok"], second["ok"]]) == [False, True], (first, second)
        loser, winner = (first, "bob") if not first["ok"] else (second, "ann")
        assert loser["reason"] == "busy" and winner in json.dumps(loser["diagnostic"]), loser
        explained = await call(ann, "explain_rejection", diagnostic=loser["diagnostic"])
        assert explained["reason"] == "busy" and winner in explained["next_step"], explained
        assert await holders(settings, "doc:race") == [winner]
        await call(ann if winner == "ann" else bob, "release_lease", resource="doc:race")

        # The TTL is 2 s and both stop renewing after 2 s of silence: bob stays active, ann goes silent.
        assert (await call(ann, "acquire_lease", resource="doc:ann", ttl_seconds=2))["ok"]
        assert (await call(bob, "acquire_lease", resource="doc:bob", ttl_seconds=2))["ok"]
        deadline = time.monotonic() + 30
        while await holders(settings, "doc:ann") == ["ann"]:  # until the worker expired ann's lease
            assert time.monotonic() < deadline, "ann's lease never lapsed"
            status = await call(bob, "lease_status")  # bob's activity
            assert [lease["resource"] for lease in status["leases"]] == ["doc:bob"], status
        for _ in range(8):  # bob keeps it through four TTLs
            await call(bob, "lease_status")
            await asyncio.sleep(1)
        assert await holders(settings, "doc:bob") == ["bob"], "an active agent keeps its lease"
        # (Released now: bob is idle while the revoke below runs, and a 2 s lease of an idle agent lapses.)
        assert (await call(bob, "release_lease", resource="doc:bob"))["ok"]
        lapsed = await call(ann, "lease_status")
        assert lapsed["leases"] == [] and any("lapsed" in n for n in lapsed["notices"]), lapsed

        # An operator's revoke reaches the holder's session at once, and its next result.
        assert (await call(bob, "acquire_lease", resource="doc:hot", ttl_seconds=60))["ok"]
        async with bob.listen(resource_subscriptions=[notices_uri("bob")]) as events:
            revoke = await asyncio.to_thread(subprocess.run, [
                sys.executable, "-m", "arbiter", "lock", "revoke", "doc:hot", "--agent", "bob",
                "--reason", "needed for the hotfix"], env=settings_env(settings), capture_output=True, text=True,
                timeout=60)
            assert revoke.returncode == 0, revoke.stdout + revoke.stderr
            event = await asyncio.wait_for(anext(aiter(events)), 30)
        assert notices_uri("bob") in str(event)
        text = (await bob.read_resource(notices_uri("bob"))).contents[0]
        assert "needed for the hotfix" in getattr(text, "text", ""), text
        after = await call(bob, "lease_status")
        assert any("needed for the hotfix" in n for n in after["notices"]), after
        assert after["leases"] == [], after  # the revoked lease is gone from the holder's session
    await assert_clean_audit(settings)


async def test_over_stdio_a_sandbox_merge_conflict_names_its_paths_and_the_rebase_says_so(
        stack: tuple[Settings, Path]) -> None:
    settings, repo = stack
    async with stdio(settings, "ann") as ann, stdio(settings, "bob") as bob:
        a = await call(ann, "sandbox_create", repository="app")
        b = await call(bob, "sandbox_create", repository="app")
        assert a["ok"] and b["ok"] and a["path"] != b["path"], (a, b)
        again = await call(ann, "sandbox_create", repository="app")
        assert again["ok"] and again["reason"] == "already_exists" and again["path"] == a["path"]
        claimed = await call(ann, "claim_paths", repository="app", paths=["auth.py"])
        seen = await call(bob, "claim_paths", repository="app", paths=["*.py"])
        assert claimed["ok"] and [c["agent"] for c in seen["overlapping"]] == ["ann"], seen
        assert (await call(bob, "claims", repository="app"))["claims"]["ann"] == ["auth.py"]
        commit(Path(a["path"]), "auth.py", "def login():\n    return 2\n", "ann: 2")
        commit(Path(b["path"]), "auth.py", "def login():\n    return 3\n", "bob: 3")
        merged = await call(ann, "sandbox_merge", repository="app", message="ann: login returns 2")
        assert merged["ok"] and merged["applied"], merged
        conflict = await call(bob, "sandbox_merge", repository="app", message="bob: login returns 3")
        assert not conflict["ok"] and conflict["reason"] == "version_conflict", conflict
        assert conflict["diagnostic"]["conflicts"] == ["auth.py"]
        explained = await call(bob, "explain_rejection", diagnostic=conflict["diagnostic"])
        assert "sandbox_rebase" in explained["next_step"], explained
        rebased = await call(bob, "sandbox_rebase", repository="app")
        assert not rebased["ok"] and rebased["conflicts"] == ["auth.py"], rebased
        unknown = await call(bob, "sandbox_merge", repository="nope", message="m")
        assert not unknown["ok"] and unknown["reason"] == "unknown_repository"
    assert (repo / "auth.py").read_text() == "def login():\n    return 2\n"
    await assert_clean_audit(settings)


def http_client(url: str, key: str) -> Client:
    transport = streamable_http_client(url, http_client=httpx2.AsyncClient(
        headers={"Authorization": f"Bearer {key}"}, timeout=httpx2.Timeout(120)))
    return Client(transport, read_timeout_seconds=120)


async def test_over_http_the_door_names_the_agent_by_its_key_and_a_waiting_call_blocks_no_other(
        kafka_settings: Settings, door: Any) -> None:
    registrar = Registrar(kafka_settings)
    keys = {}
    for name in ("ann", "bob", "cy"):
        await registrar.add(name)
        keys[name] = (await registrar.issue_credential(name, label="mcp"))[0].api_key()
    url = f"{door.url}/mcp"
    denied = await asyncio.to_thread(httpx2.post, url, json={}, headers={"Authorization": "Bearer nope"})
    assert denied.status_code == 401 and denied.json()["reason"] == "unauthenticated", denied.text
    async with http_client(url, keys["ann"]) as ann, http_client(url, keys["bob"]) as bob, \
            http_client(url, keys["cy"]) as cy:
        check_tool_list((await ann.list_tools()).tools)
        assert (await call(ann, "acquire_lease", resource="doc:http", ttl_seconds=30))["ok"]
        waiting = asyncio.create_task(call(bob, "acquire_lease", resource="doc:http", wait_seconds=60))
        for client, name in ((cy, "cy"), (bob, "bob"), (ann, "ann")):  # answered while bob's call waits
            started = time.monotonic()
            status = await call(client, "lease_status")
            assert status["agent"] == name and time.monotonic() - started < 5, status
        assert not waiting.done()
        assert await holders(kafka_settings, "doc:http") == ["ann"]
        await call(ann, "release_lease", resource="doc:http")
        granted = await asyncio.wait_for(waiting, 60)
        assert granted["ok"] and granted["lease"]["resource"] == "doc:http", granted
        await call(bob, "release_lease", resource="doc:http")
    await assert_clean_audit(kafka_settings)
