"""``arbiter hook pre-tool-use``: a coding agent's PreToolUse hook that makes leases binding.

Claude Code and Codex run the hook before each tool call with a JSON payload on stdin
(``tool_name``, ``tool_input``, ``cwd``, ``session_id``). The hook finds the paths the call would
write, and denies it when one of them

- lies in a resource another agent holds: a lease on ``file:<repo>/<path>`` or on any folder above
  it (``file:<repo>/src`` covers ``src/auth.py``), named in the reason with its holder; or
- lies in a configured repository outside the agent's own sandbox, when the agent has one there
  (the main checkout, another agent's sandbox).

A deny is the JSON the agents expect on stdout (``hookSpecificOutput.permissionDecision: "deny"``
with the reason), exit 0. Both agents read a hook's exit 1 as "go ahead", so a hook that cannot
parse its input, or cannot reach Arbiter in time, exits 2 with the reason on stderr: the call is
blocked and the model is told why. Reads (``Read``, ``Grep``, ``Glob``...) are let through.
Shell commands are checked by the paths they name (every word that resolves into a configured
repository, and redirection targets): a command that writes a path it does not name is not
caught, which is why the sandbox, not the hook, is the isolation (docs/mcp.md: what is enforced).

Every run also touches the agent's heartbeat file, which ``arbiter mcp`` reads as activity: an
agent busy in its own tools keeps its leases renewed.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WRITE_TOOLS = {"Edit": ("file_path",), "Write": ("file_path",), "MultiEdit": ("file_path",),
               "NotebookEdit": ("notebook_path",), "str_replace_based_edit_tool": ("path",),
               "write_file": ("path", "file_path"), "edit_file": ("path", "file_path")}
"""Tools that write the file their input names (Claude Code's, and common MCP file servers')."""
SHELL_TOOLS = {"Bash", "shell", "exec_command", "local_shell", "container.exec", "unified_exec"}
"""Tools that run a command (Claude Code's ``Bash``; Codex's shell tools)."""
PATCH_TOOLS = {"apply_patch"}
"""Codex's patch tool: its input names the files it adds, updates, deletes or moves."""
PATCH_LINE = re.compile(r"^\*\*\* (?:Add|Update|Delete) File: (.+)$|^\*\*\* Move to: (.+)$", re.MULTILINE)


class HookInputError(ValueError):
    """The payload is not a PreToolUse JSON object."""


@dataclass
class Payload:
    """The part of a PreToolUse payload the hook reads."""

    tool_name: str
    tool_input: dict[str, Any]
    cwd: Path
    session_id: str = ""
    raw: dict[str, Any] = field(default_factory=dict)


def parse(text: str) -> Payload:
    """The payload, or ``HookInputError`` saying what is wrong with it."""
    try:
        data = json.loads(text)
    except ValueError as error:
        raise HookInputError(f"the input is not JSON ({error})") from None
    if not isinstance(data, dict):
        raise HookInputError("the input is not a JSON object")
    name = data.get("tool_name")
    if not isinstance(name, str) or not name:
        raise HookInputError("the input has no tool_name")
    tool_input = data.get("tool_input", {})
    if not isinstance(tool_input, dict):
        raise HookInputError("tool_input is not an object")
    cwd = data.get("cwd")
    if not isinstance(cwd, str) or not cwd.startswith("/"):
        raise HookInputError("the input has no absolute cwd")
    session = data.get("session_id", "")
    return Payload(name, tool_input, Path(cwd), session if isinstance(session, str) else "", data)


def _command_words(command: Any) -> list[str]:
    if isinstance(command, list):
        words = [str(w) for w in command]
        if len(words) >= 3 and words[0] in ("bash", "sh", "zsh", "/bin/sh", "/bin/bash") and words[1] in ("-c", "-lc"):
            return _command_words(words[2])
        return words
    if not isinstance(command, str):
        return []
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|<>()")
        lexer.whitespace_split = True
        return list(lexer)
    except ValueError:  # unbalanced quotes: the plain words
        return command.split()


def written_paths(payload: Payload) -> list[Path] | None:
    """The absolute paths the call may write; None for a call that writes nothing (a read)."""
    tool, data = payload.tool_name, payload.tool_input
    found: list[str] = []
    if tool in WRITE_TOOLS:
        found = [str(data[key]) for key in WRITE_TOOLS[tool] if isinstance(data.get(key), str)]
        if not found:
            return []
    elif tool in PATCH_TOOLS or (tool in SHELL_TOOLS and "apply_patch" in json.dumps(data)):
        text = data.get("input") or data.get("patch") or json.dumps(data)
        found = [m.group(1) or m.group(2) for m in PATCH_LINE.finditer(str(text).replace("\\n", "\n"))]
    elif tool in SHELL_TOOLS:
        words = _command_words(data.get("command", data.get("cmd")))
        found = [w for w in words if w and w[0] not in ";&|<>()-" and ("/" in w or "." in w)]
    else:
        return None
    base = Path(str(data.get("workdir") or payload.cwd))
    return [(base / p).resolve() if not Path(p).is_absolute() else Path(p).resolve() for p in found]


def deny_json(reason: str) -> str:
    """The deny answer Claude Code and Codex read from a PreToolUse hook's stdout (exit 0)."""
    return json.dumps({"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "deny",
                                              "permissionDecisionReason": reason}})


def lease_names(repo: str, relative: Path) -> list[str]:
    """The resources whose lease covers ``relative`` in repository ``repo``: the file, then each folder."""
    parts = relative.parts
    return [f"file:{repo}/{'/'.join(parts[:i])}" for i in range(len(parts), 0, -1)]


@dataclass
class Place:
    """Where a path lies: a configured repository, the path inside it, and whose checkout it is in."""

    repo: str
    relative: Path
    owner: str
    """The agent whose sandbox holds the path; "" for the repository's own checkout."""
    own_sandbox: Path | None
    """The calling agent's sandbox of this repository, if it has one."""


Sandboxes = Callable[[str, Path], list[dict[str, Any]]]
"""A repository's sandboxes (``Repos.sandboxes``), given its name and root."""


def sandboxes_of(sandbox_root: str) -> Sandboxes:
    """``Repos.sandboxes`` as a ``Sandboxes``: the folder listed each time."""
    from arbiter.streams.tools.git import Repos

    return lambda name, root: Repos({name: root}, sandbox_root).sandboxes(root)


def locate(path: Path, agent: str, repos: dict[str, Path], sandboxes: Sandboxes) -> Place | None:
    """The repository ``path`` lies in (its sandboxes first: they may sit inside its git dir)."""
    for name, root in sorted(repos.items()):
        root = root.expanduser().resolve()
        try:
            boxes = sandboxes(name, root)
        except Exception:  # not a repository (yet): nothing of it to protect
            continue
        mine = next((Path(b["path"]).resolve() for b in boxes if b["agent"] == agent), None)
        for box in boxes:
            top = Path(box["path"]).resolve()
            if path == top or top in path.parents:
                return Place(name, path.relative_to(top), box["agent"], mine)
        if path == root or root in path.parents:
            return Place(name, path.relative_to(root), "", mine)
    return None


async def decide(payload: Payload, client: Any, repos: dict[str, Path], sandboxes: Sandboxes) -> str | None:
    """None to let the call go ahead, or the reason to deny it (the holder named)."""
    import asyncio

    from arbiter.agents import LeaseDenied

    agent = client.agent_id
    paths = written_paths(payload)
    if not paths:
        return None
    for path in paths:
        place = await asyncio.to_thread(locate, path, agent, repos, sandboxes)
        if place is None:
            continue
        shown = f"{place.repo}/{place.relative}" if str(place.relative) != "." else place.repo
        if place.owner and place.owner != agent:
            return (f"{path} is in {place.owner}'s sandbox of repo:{place.repo}: only {place.owner} works there. "
                    + (f"Work in your own sandbox, {place.own_sandbox}." if place.own_sandbox else
                       "Make your own with the sandbox_create tool (or 'arbiter sandbox create')."))
        if not place.owner and place.own_sandbox is not None:
            return (f"{path} is in the main checkout of repo:{place.repo}, outside your sandbox: edit "
                    f"{place.own_sandbox / place.relative} instead, commit there, and merge with sandbox_merge.")
        if str(place.relative) == ".":
            continue
        names = lease_names(place.repo, place.relative)
        try:
            snapshots = await asyncio.gather(*(client.snapshot(name, timeout=5.0) for name in names))
        except LeaseDenied as denied:
            return (f"{shown}: Arbiter refused to say who holds it ({denied.reason}); this agent may not touch "
                    "it. Ask the operator.")
        for name, snap in zip(names, snapshots, strict=True):
            others = [h for h in snap.holders if h["agent_id"] != agent]
            if others:
                who = ", ".join(f"{h['agent_id']} ({h['mode']})" for h in others)  # (their tokens are not ours)
                return (f"{shown} is leased by {who} on {name}: another agent is changing it. Do something else "
                        f"first, or wait with acquire_lease('{name}') and work once you hold it.")
    return None
