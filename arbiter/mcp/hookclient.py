"""``arbiter-hook --agent A``: the PreToolUse hook's client, standard library only, answered in milliseconds.

A coding agent runs its PreToolUse hook before every Edit, Write and Bash. Starting Arbiter's CLI for each
call (Python, click, the SDK, a Kafka connection) cost 0.8-2.1 s; this client imports nothing but the
standard library and asks the agent's long-lived process (``arbiter mcp``, which serves the hook beside its
MCP tools, or ``arbiter hook serve``) over a Unix socket only its user can open. That process holds a live
Arbiter client and decides (``arbiter.mcp.hook``); the client prints what the agents expect:

- allowed: nothing, exit 0 (the agent's own permission rules still apply);
- denied: the ``hookSpecificOutput`` JSON with ``permissionDecision: "deny"`` and the reason (as the
  process wrote it), exit 0;
- undecidable (no process answers within ``--timeout``, input it cannot read, Arbiter unreachable): the
  reason on stderr, exit 2, which both agents read as "block" (exit 1 would let the call go ahead).

This module must import only the standard library: ``tests/mcp/test_hook_socket.py`` checks it.
"""

from __future__ import annotations

# The C module, not ``socket``: ``socket`` imports enum and selectors, a third of this client's start-up.
import _socket
import os
import sys

EXIT_BLOCK = 2
"""The exit code Claude Code and Codex read as "block this call"."""
TIMEOUT = 0.45
"""Seconds the client waits for an answer before it blocks the call (a denial within half a second)."""
_MAX_SOCKET_PATH = 100
"""A Unix socket's path is at most 107 bytes (Linux): longer homes get a short path under /tmp."""

# The protocol, one request and one answer a connection, no JSON to import here: the request is the agent's
# name on a line, then the payload as the agent sent it; the answer is "allow", "deny" or "block" on a line,
# then what to print (for deny, the whole JSON the agents read on stdout; for block, the reason).
DECISIONS = ("allow", "deny", "block")


def socket_path(home: str | os.PathLike[str], agent: str) -> str:
    """Where the agent's hook process listens: ``<home>/mcp/<agent>.sock``, or a short path of the home's and
    the agent's digest in a folder of this user's own when that would be too long."""
    home_path = os.path.abspath(os.path.expanduser(os.fspath(home)))
    path = os.path.join(home_path, "mcp", f"{agent}.sock")
    if len(os.fsencode(path)) <= _MAX_SOCKET_PATH:
        return path
    import hashlib

    digest = hashlib.sha256(f"{home_path}\0{agent}".encode()).hexdigest()[:24]
    return f"/tmp/arbiter-{os.getuid()}/{digest}.sock"


def _own_folder(path: str) -> None:
    """Refuse (``ValueError``) a socket whose folder is not this user's own, mode 0700 and not a link: in a
    folder others can write (``/tmp``'s short paths), another user could answer "allow" to every call."""
    folder = os.path.dirname(path)
    info = os.lstat(folder)
    if info.st_uid != os.getuid() or (info.st_mode & 0o170000) != 0o040000 or info.st_mode & 0o077:
        raise ValueError(f"the folder {folder} of the hook's socket is not this user's alone")


def ask(path: str, agent: str, payload: bytes, timeout: float = TIMEOUT) -> tuple[str, str]:
    """The hook process's answer to ``payload``: (allow, deny or block; what to print)."""
    _own_folder(path)
    conn = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        conn.connect(path)
        conn.sendall(agent.encode() + b"\n" + payload)
        conn.shutdown(_socket.SHUT_WR)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    finally:
        conn.close()
    decision, _, text = data.decode(errors="replace").partition("\n")
    if decision not in DECISIONS:
        raise ValueError(f"an answer this client cannot read: {data[:200]!r}")
    return decision, text


def _arguments(argv: list[str]) -> tuple[str, str, float]:
    agent, home, timeout = "", os.environ.get("ARBITER_HOME", ".arbiter"), TIMEOUT
    it = iter(argv)
    for arg in it:
        name, _, value = arg.partition("=")
        if name not in ("--agent", "--home", "--timeout"):
            raise ValueError(f"unknown argument {arg!r} (usage: arbiter-hook --agent NAME [--home DIR] "
                             "[--timeout SECONDS])")
        value = value or next(it, "")
        if name == "--agent":
            agent = value
        elif name == "--home":
            home = value
        else:
            timeout = float(value)
    if not agent:
        raise ValueError("--agent NAME is required (the coding session's identity)")
    return agent, home, timeout


def main(argv: list[str] | None = None) -> int:
    """Read a PreToolUse payload on stdin; answer as the module's text says. Returns the exit code."""
    try:
        agent, home, timeout = _arguments(sys.argv[1:] if argv is None else argv)
    except ValueError as error:
        print(f"arbiter hook: {error}", file=sys.stderr)
        return EXIT_BLOCK
    payload = sys.stdin.buffer.read()
    path = socket_path(home, agent)
    try:
        decision, text = ask(path, agent, payload, timeout)
    except (OSError, ValueError) as error:
        why = ("nothing answers" if isinstance(error, FileNotFoundError | ConnectionRefusedError)
               else f"no answer within {timeout:g} s" if isinstance(error, TimeoutError) else str(error))
        print(f"arbiter hook: {agent}'s Arbiter process ({path}) cannot decide: {why}. Start it "
              f"('arbiter mcp --agent {agent}', or 'arbiter hook serve --agent {agent}'). The call is blocked "
              "until this is fixed.", file=sys.stderr)
        return EXIT_BLOCK
    if decision == "deny":
        print(text)
    elif decision == "block":
        print(f"arbiter hook: {text} The call is blocked until this is fixed.", file=sys.stderr)
        return EXIT_BLOCK
    return 0


if __name__ == "__main__":
    sys.exit(main())
