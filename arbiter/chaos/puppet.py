"""An agent in a child process that a campaign can freeze (SIGSTOP) and wake (SIGCONT).

``python -m arbiter.chaos.puppet NAME``: the agent's settings (its key among them) come from
the environment. It reads one JSON command a line on stdin and answers each with one JSON
line on stdout:

- ``{"op": "acquire", "resource": R, "ttl": S}``: enter ``client.lease(R, ttl=S)`` (renewed in
  the background at a third of the TTL, as any agent's lease) -> ``{"token", "version"}``;
- ``{"op": "write", "intent_id": I, "order_id": O}``: refund one cent of ``O`` on the held
  resource with the lease's token, whatever the SDK thinks of the lease (a zombie does not
  check ``lease.lost``) -> ``{"applied", "reason", "lost"}``;
- ``{"op": "release"}``: leave the lease's block -> ``{"released": true}``;
- ``{"op": "quit"}``.

Anything unexpected is answered ``{"error": ...}``. Logs go to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import Any

from arbiter.agents import ArbiterClient, ArbiterError, Lease
from arbiter.edge.settings import load_settings


def _answer(payload: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


async def main(name: str) -> None:
    """Serve commands until ``quit`` or the end of stdin."""
    settings = load_settings()
    async with ArbiterClient(name, settings) as client, contextlib.AsyncExitStack() as held:
        lease: Lease | None = None
        writes = 0
        _answer({"ready": True})
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return
            command = json.loads(line)
            op = command.get("op")
            try:
                if op == "acquire":
                    lease = await held.enter_async_context(
                        client.lease(command["resource"], ttl=command["ttl"], wait=command.get("wait", 30)))
                    writes = 0
                    _answer({"token": lease.token, "version": lease.resource_version})
                elif op == "write" and lease is not None:
                    outcome = await client.execute(lease, "refund", {"order_id": command["order_id"], "amount": 1},
                                                   base_version=lease.resource_version + writes,
                                                   intent_id=command["intent_id"], timeout=30)
                    writes += outcome.applied
                    _answer({"applied": outcome.applied, "reason": outcome.reason, "lost": lease.lost_reason})
                elif op == "release":
                    await held.aclose()
                    lease = None
                    _answer({"released": True})
                elif op == "quit":
                    return
                else:
                    _answer({"error": f"unknown or untimely command {command!r}"})
            except ArbiterError as exc:
                _answer({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
