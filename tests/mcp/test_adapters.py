"""The framework adapters, each in its own framework's agent loop: an OpenAI Agents SDK ``Runner`` and a
LangGraph ReAct agent, each driven by a scripted model plugged into the framework's model interface (no
network), calling Arbiter's tools against a real worker; the audit passes on the log.

The loops run in a child process started outside the source tree: a checkout's ``agents/`` folder would
shadow the OpenAI Agents SDK's top-level package ``agents`` (an installed Arbiter has only ``arbiter``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from arbiter.agents import ArbiterClient
from arbiter.edge.settings import Settings
from arbiter.processes import WorkerPool, settings_env
from tests.conftest import assert_clean_audit

pytestmark = pytest.mark.kafka

SCRIPT = r'''
import asyncio, json, sys

from arbiter.agents import ArbiterClient
from arbiter.mcp.adapters import langchain_tools, openai_agents_tools
from arbiter.mcp.tools import AgentTools


def plan(resource, text):
    """What each scripted model does: lease, read, commit on the version it read, release; then a refusal
    (a commit on a stale base) that it asks explain_rejection about."""
    return [
        ("acquire_lease", lambda last: {"resource": resource, "ttl_seconds": 30}),
        ("snapshot", lambda last: {"resource": resource}),
        ("commit", lambda last: {"resource": resource, "base_version": last["version"], "patch": {"text": text}}),
        ("commit", lambda last: {"resource": resource, "base_version": 0, "patch": {"text": "stale"}}),
        ("explain_rejection", lambda last: {"diagnostic": last["diagnostic"]}),
        ("release_lease", lambda last: {"resource": resource}),
    ]


async def openai_agents(tools):
    from agents import Agent, Runner, set_tracing_disabled
    from agents.items import ModelResponse
    from agents.models.interface import Model
    from agents.usage import Usage
    from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

    set_tracing_disabled(True)
    steps, seen = plan("doc:adapters-oa", "from the OpenAI Agents SDK"), []

    class Scripted(Model):
        async def get_response(self, system_instructions, input, model_settings, tools, output_schema, handoffs,
                               tracing, *, previous_response_id=None, conversation_id=None, prompt=None):
            outputs = [i for i in input if isinstance(i, dict) and i.get("type") == "function_call_output"]
            last = json.loads(outputs[-1]["output"]) if outputs else None
            if last is not None:
                seen.append(last)
            if len(seen) < len(steps) and len(outputs) == len(seen):
                name, args = steps[len(seen)]
                n = len(seen)
                return ModelResponse(output=[ResponseFunctionToolCall(
                    arguments=json.dumps(args(last)), call_id=f"call{n}", name=name, type="function_call",
                    id=f"fc{n}", status="completed")], usage=Usage(), response_id=None)
            return ModelResponse(output=[ResponseOutputMessage(
                id="done", content=[ResponseOutputText(text="done", type="output_text", annotations=[])],
                role="assistant", status="completed", type="message")], usage=Usage(), response_id=None)

        async def stream_response(self, *args, **kwargs):
            raise NotImplementedError

    agent = Agent(name="oa-agent", instructions="Use Arbiter.", tools=await openai_agents_tools(tools),
                  model=Scripted())
    result = await Runner.run(agent, "Write to the document.", max_turns=20)
    return {"final": str(result.final_output), "seen": seen}


async def langgraph(tools):
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.outputs import ChatGeneration, ChatResult
    from langgraph.prebuilt import create_react_agent

    steps, seen = plan("doc:adapters-lc", "from LangGraph"), []

    class Scripted(BaseChatModel):
        @property
        def _llm_type(self):
            return "scripted"

        def bind_tools(self, tools, **kwargs):
            return self

        def _generate(self, messages, stop=None, run_manager=None, **kwargs):
            raise NotImplementedError("async only")

        async def _agenerate(self, messages, stop=None, run_manager=None, **kwargs):
            answers = [m for m in messages if isinstance(m, ToolMessage)]
            last = json.loads(answers[-1].content) if answers else None
            if last is not None:
                seen.append(last)
            if len(seen) < len(steps):
                name, args = steps[len(seen)]
                message = AIMessage(content="", tool_calls=[{"name": name, "args": args(last), "id": f"c{len(seen)}",
                                                             "type": "tool_call"}])
            else:
                message = AIMessage(content="done")
            return ChatResult(generations=[ChatGeneration(message=message)])

    graph = create_react_agent(Scripted(), await langchain_tools(tools))
    state = await graph.ainvoke({"messages": [("user", "Write to the document.")]})
    return {"final": state["messages"][-1].content, "seen": seen}


async def main():
    out = {}
    for name, loop in (("openai-agents", openai_agents), ("langgraph", langgraph)):
        async with ArbiterClient(f"{name}-agent") as client:
            tools = AgentTools(client)
            try:
                out[name] = await loop(tools)
            finally:
                await tools.close()
    print(json.dumps(out))


asyncio.run(main())
'''


async def test_each_frameworks_agent_loop_drives_arbiters_tools_and_the_audit_passes(
        kafka_settings: Settings, worker: WorkerPool, tmp_path: Path) -> None:
    script = tmp_path / "loops.py"
    script.write_text(SCRIPT)
    done = await asyncio.to_thread(subprocess.run, [sys.executable, str(script)], capture_output=True, text=True,
                                   timeout=240, cwd=tmp_path, env=settings_env(kafka_settings))
    assert done.returncode == 0, done.stderr[-4000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    for name, resource, text in (("openai-agents", "doc:adapters-oa", "from the OpenAI Agents SDK"),
                                 ("langgraph", "doc:adapters-lc", "from LangGraph")):
        seen = runs[name]["seen"]
        assert runs[name]["final"] == "done" and len(seen) == 6, (name, seen)
        leased, read, wrote, stale, explained, released = seen
        assert leased["ok"] and leased["lease"]["resource"] == resource, (name, leased)
        assert read["ok"] and wrote["ok"] and wrote["applied"], (name, read, wrote)
        assert not stale["ok"] and stale["reason"] == "version_conflict", (name, stale)
        assert explained["reason"] == "version_conflict" and "snapshot" in explained["next_step"], (name, explained)
        assert released["ok"] and released["released"], (name, released)
        async with ArbiterClient("checker", kafka_settings) as checker:
            snap = await checker.snapshot(resource, content=True)
        assert text in json.dumps(snap.content) and snap.holders == [], (name, snap)
    await assert_clean_audit(kafka_settings)
