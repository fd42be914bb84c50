"""The example agents (``agents/arbiter/agents/examples/``) run as written, against a real worker and a real front door:
two Python drafters and a JavaScript one add their sections to one document at once, and none is lost."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from arbiter.agents import ArbiterClient
from arbiter.agents.identities import Registrar
from arbiter.edge.settings import Settings
from arbiter.processes import DoorProcess, settings_env
from tests.conftest import REPO
from tests.door.test_door_http import node_command

pytestmark = [pytest.mark.kafka, pytest.mark.e2e]

EXAMPLES = REPO / "agents" / "arbiter" / "agents" / "examples"


async def test_the_drafters_in_python_and_javascript_add_every_section(kafka_settings: Settings,
                                                                        door: DoorProcess) -> None:
    settings = kafka_settings
    registrar = Registrar(settings)
    for name in ("drafter-1", "drafter-2", "drafter-js"):
        await registrar.add(name, allow=["doc:"])
    credential, _ = await registrar.issue_credential("drafter-js", label="example")
    env = {**settings_env(settings), "ARBITER_AUTO_ENROLL": "false"}
    document = "doc:launch-plan-test"
    python = [await asyncio.create_subprocess_exec(
        sys.executable, "-m", "arbiter.agents.examples.drafter", name, document, section, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name, section in (("drafter-1", "Pricing"),
                                                                              ("drafter-2", "Risks"))]
    javascript = await asyncio.create_subprocess_exec(
        *node_command(), str(EXAMPLES / "drafter.mjs"), door.url, credential.api_key(), document, "Timeline",
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for proc in [*python, javascript]:
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert json.loads(out.decode().strip().splitlines()[-1])["applied"] is True
    async with ArbiterClient("drafter-1", settings) as reader:
        assert (await reader.snapshot(document)).version == 3, "a section was lost"
