"""An agent that adds a section to a shared document, safely, however many drafters run at once.

    arbiter agents add drafter-1 --allow doc:
    python -m arbiter.agents.examples.drafter drafter-1 doc:launch-plan "Pricing"

It leases the document (waiting its turn), reads the version it holds, "thinks", and commits
its section as a JSON merge patch on that version. A drafter whose base is stale (one that
commits without a lease, say) gets ``version_conflict`` with the changes since its base and
rebases; here the lease makes that rare, and ``commit_rebasing`` handles it when it happens.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from arbiter.agents import ArbiterClient, Outcome


async def draft(agent: str, document: str, section: str, think_seconds: float = 0.1) -> Outcome:
    """Add ``section`` to ``document`` as ``agent``; the gateway's outcome."""
    async with ArbiterClient(agent) as client, client.lease(document, ttl=30, wait=60) as lease:
        base = (await client.snapshot(document)).version
        await asyncio.sleep(think_seconds)  # the model's turn
        patch: dict[str, Any] = {"sections": {section: f"{section}, drafted by {agent}"}}

        async def replan(conflict: Outcome) -> tuple[int, dict[str, Any]]:
            # The others' changes are in conflict.diagnostic["changes_since_base"]: ours does not touch
            # them (a merge patch of one key), so rebase by sending it again on the current version.
            return (await client.snapshot(document)).version, patch

        return await client.commit_rebasing(document, base, patch, replan, lease=lease)


def main() -> None:
    defaults = ["drafter-1", "doc:launch-plan", "Pricing"]
    given = sys.argv[1:4]
    agent, document, section = given + defaults[len(given):]
    outcome = asyncio.run(draft(agent, document, section))
    print(json.dumps({"applied": outcome.applied, "version": outcome.version, "reason": outcome.reason}))
    raise SystemExit(0 if outcome.applied else 1)


if __name__ == "__main__":
    main()
