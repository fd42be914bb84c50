"""Arbiter for the coding agents people run: its tools as a model calls them (``tools``), an MCP server
of them (``server``: ``arbiter mcp`` and the front door's ``/mcp``), and the PreToolUse hook's rules
(``hook``). Above the SDK, below the front door."""
