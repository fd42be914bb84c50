"""Arbiter's MCP tools as the function tools of agent frameworks: the OpenAI Agents SDK and LangChain
(and so LangGraph, whose agents take LangChain tools).

The tools are the MCP server's own, called in this process: the same names, descriptions, argument
schemas (validated by the MCP SDK) and JSON answers, so an agent sees one Arbiter whichever way it
is wired. Each framework is an optional extra (``pip install openai-agents`` or ``langchain-core``);
nothing here imports one until it is asked for::

    async with ArbiterClient("planner") as client:
        tools = AgentTools(client)
        agent = Agent(name="planner", tools=await openai_agents_tools(tools), ...)   # OpenAI Agents SDK
        graph = create_react_agent(model, await langchain_tools(tools))              # LangGraph
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from .tools import AgentTools


class InProcessTools:
    """The MCP server's tools for one agent, called without a transport."""

    def __init__(self, tools: AgentTools) -> None:
        from .server import Notifier, build_server

        async def resolve(_ctx: Any) -> AgentTools:
            return tools

        self.tools = tools
        self.server = build_server(resolve, Notifier())

    async def specs(self) -> list[Any]:
        """The tools as MCP describes them (name, description, input and output schemas, hints)."""
        return list(await self.server.list_tools())

    async def call(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Call one tool; arguments it refuses are an answer too (``invalid_arguments``), never an exception
        that would end the agent's run."""
        from mcp.server.mcpserver.exceptions import ToolError

        try:
            result = await self.server.call_tool(name, arguments)
        except ToolError as error:
            return {"ok": False, "reason": "invalid_arguments", "diagnostic": {
                "reason": "invalid_arguments", "detail": str(error)[:2000],
                "what_to_do": "Call the tool again with arguments that match its schema."}}
        data = getattr(result, "structured_content", None)
        if isinstance(data, dict):
            return data
        text = " ".join(getattr(block, "text", "") for block in getattr(result, "content", []))
        return {"ok": False, "reason": "tool_error", "diagnostic": {"reason": "tool_error", "detail": text[:2000]}}


async def openai_agents_tools(tools: AgentTools) -> list[Any]:
    """Arbiter's tools as OpenAI Agents SDK ``FunctionTool``s (their results are the JSON answers)."""
    # The OpenAI Agents SDK's package: its top-level name is ``agents`` (imported by name, so that a checkout's
    # own agents/ folder never stands in for it in a type checker either).
    FunctionTool = importlib.import_module("agents").FunctionTool

    here = InProcessTools(tools)
    made = []
    for spec in await here.specs():
        async def invoke(_ctx: Any, args_json: str, name: str = spec.name) -> str:
            try:
                arguments = json.loads(args_json or "{}")
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                return json.dumps({"ok": False, "reason": "invalid_arguments",
                                   "diagnostic": {"detail": "the arguments are not a JSON object"}})
            return json.dumps(await here.call(name, arguments))

        made.append(FunctionTool(name=spec.name, description=spec.description or spec.name,
                                 params_json_schema=spec.input_schema, on_invoke_tool=invoke,
                                 strict_json_schema=False))
    return made


async def langchain_tools(tools: AgentTools) -> list[Any]:
    """Arbiter's tools as LangChain ``StructuredTool``s (async; LangGraph's agents take them as they are)."""
    from langchain_core.tools import StructuredTool

    here = InProcessTools(tools)
    return [StructuredTool(name=spec.name, description=spec.description or spec.name, args_schema=spec.input_schema,
                           coroutine=_caller(here, spec.name)) for spec in await here.specs()]


def _caller(here: InProcessTools, name: str) -> Any:
    async def run(**arguments: Any) -> str:
        return json.dumps(await here.call(name, arguments))

    return run
