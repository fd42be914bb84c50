"""No value an agent sends becomes code in an Arbiter process: on every surface an agent can reach (the
SDK, the CLI, MCP over stdio, the front door's ``/mcp`` and its HTTP API), a merge that names a command
of its own leaves no marker; the repository's check, as the operator configured it, is what runs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from arbiter.agents import ArbiterClient
from arbiter.agents.identities import Registrar
from arbiter.edge.settings import Settings
from arbiter.processes import DoorProcess, RunnerProcess, WorkerPool, settings_env
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import assert_clean_audit, isolated_settings
from tests.mcp.test_mcp import http_client, stdio
from tests.streams.tools.test_git_tools import commit, make_repo, sh

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]


class Stack:
    def __init__(self, settings: Settings, repo: Path, marker: Path, ran: Path) -> None:
        self.settings, self.repo, self.marker, self.ran = settings, repo, marker, ran

    def attack(self, name: str) -> str:
        """A command that would leave a marker and read Arbiter's environment, were it ever run."""
        return f"env > {self.marker}-{name}; touch {self.marker}-{name}"

    def no_marker(self) -> None:
        planted = sorted(p.name for p in self.marker.parent.glob(f"{self.marker.name}*"))
        assert planted == [], f"an agent's command ran in an Arbiter process: {planted}"


@pytest.fixture
async def stack(bootstrap: str, tmp_path: Path, shared: Path) -> AsyncIterator[Stack]:
    repo = make_repo(shared)
    marker, ran = shared / "open" / "planted", shared / "open" / "repository-check-ran"
    (tmp_path / "repos.toml").write_text(
        f'[repos.app]\npath = "{repo}"\ncheck = "echo $(date +%s%N) >> {ran}"\n')
    settings = isolated_settings(bootstrap, tmp_path)
    await ensure_topics(settings)
    pool = WorkerPool(settings)
    from tests.streams.shells.test_gateway_kafka import start_worker

    await start_worker(settings, pool)
    runner = RunnerProcess(settings, trusted_agents=True).start()
    try:
        yield Stack(settings, repo, marker, ran)
    finally:
        runner.stop()
        pool.stop()


def _checks_run(stack: Stack) -> int:
    return len(stack.ran.read_text().splitlines()) if stack.ran.exists() else 0


async def test_the_sdk_and_the_cli_take_no_check_command(stack: Stack) -> None:
    async with ArbiterClient("ann", stack.settings) as ann, ann.sandbox("app", keep=True) as box:
        commit(box.path, "a.py", "a = 1\n", "ann: a")
        with pytest.raises(TypeError, match="check"):
            await box.merge("ann", check=stack.attack("sdk"))  # type: ignore[call-arg]
        merged = await box.merge("ann")
        assert merged.applied and merged.result["checked"] == f"echo $(date +%s%N) >> {stack.ran}"
    assert _checks_run(stack) == 1, "the repository's own check ran, once"
    env = {**settings_env(stack.settings), "ARBITER_AUTO_ENROLL": "true"}
    cli = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "arbiter", "sandbox", "merge", "--repo", "app", "--agent", "ann", "-m", "m",
        "--check", stack.attack("cli")], env=env, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "No such option: --check" in cli.stderr, cli.stderr
    stack.no_marker()
    await assert_clean_audit(stack.settings)


async def test_mcp_over_stdio_refuses_a_check_argument(stack: Stack) -> None:
    async with stdio(stack.settings, "bob") as bob:
        made = (await bob.call_tool("sandbox_create", {"repository": "app"})).structured_content
        assert made and made["ok"], made
        commit(Path(made["path"]), "b.py", "b = 1\n", "bob: b")
        refused = await bob.call_tool("sandbox_merge", {"repository": "app", "message": "bob",
                                                        "check": stack.attack("stdio")})
        assert refused.is_error and "check" in str(refused.content), refused
        assert _checks_run(stack) == 0 and sh(stack.repo, "rev-list", "--count", "main") == "1", "nothing merged"
        merged = (await bob.call_tool("sandbox_merge", {"repository": "app", "message": "bob"})).structured_content
        assert merged and merged["ok"], merged
    assert _checks_run(stack) == 1
    stack.no_marker()


async def test_the_front_door_runs_no_command_an_agent_sends(stack: Stack) -> None:
    """The finding: through the door's /mcp an agent's check ran as the door's user with the door's whole
    environment. Now /mcp refuses the argument, and the HTTP API's merge intent carries no command anyone
    runs: the merge waits in its train for the runner's verdict of the repository's own check."""
    settings = stack.settings
    registrar = Registrar(settings)
    await registrar.add("cy", allow=["repo:"])
    key = (await registrar.issue_credential("cy", label="attack"))[0].api_key()
    door = DoorProcess(settings)
    await asyncio.to_thread(door.start)
    try:
        async with http_client(f"{door.url}/mcp", key) as cy:
            made = (await cy.call_tool("sandbox_create", {"repository": "app"})).structured_content
            assert made and made["ok"], made
            commit(Path(made["path"]), "c.py", "c = 1\n", "cy: c")
            for arguments in ({"check": stack.attack("door-mcp")},
                              {"check": stack.attack("door-mcp-2"), "check_timeout_seconds": 1}):
                refused = await cy.call_tool("sandbox_merge", {"repository": "app", "message": "cy", **arguments})
                assert refused.is_error, refused
            unknown_tool = await cy.call_tool("execute_tool", {
                "resource": "repo:app", "tool": f"../../bin/sh -c '{stack.attack('tool-name')}'", "arguments": {}})
            assert not (unknown_tool.structured_content or {}).get("ok"), unknown_tool
        headers = {"Authorization": f"Bearer {key}"}

        def post(path: str, body: dict[str, Any]) -> httpx2.Response:
            return httpx2.post(f"{door.url}{path}", json=body, headers=headers, timeout=60)

        lease = (await asyncio.to_thread(post, "/v1/leases/acquire", {"resource": "repo:app", "ttl": 30})).json()
        executed = await asyncio.to_thread(post, "/v1/execute", {
            "resource": "repo:app", "tool": "merge", "token": lease["token"],
            "args": {"message": "cy", "check": stack.attack("door-http")}})
        assert executed.status_code == 200, executed.text  # its "check" is never run: the repository's is
        assert json.loads(executed.text)["result"]["checked"] == f"echo $(date +%s%N) >> {stack.ran}"
        await asyncio.to_thread(post, "/v1/leases/release", {"resource": "repo:app", "token": lease["token"]})
    finally:
        await asyncio.to_thread(door.stop)
    stack.no_marker()
    assert _checks_run(stack) == 1, "the runner ran the repository's check, for the one merge that landed"
