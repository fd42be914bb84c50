"""The fencing rule: may this token act on this resource now? One rule for renew, release and write.

Theory of operation
-------------------
Every grant takes the resource's next token, so tokens order the leases of a resource.
A token may act (renew its lease, release it, write through the gateway) exactly when
its lease is live at the decision's time and belongs to the agent that sends it. A live
holder may act any number of times, whatever was granted after it (shared holders
coexist, each below the newest token). Every other token is refused, with the reason
that tells its agent what happened:

- ``not_holder``: the lease is live but another agent's;
- ``stale_fencing_token``: the lease is gone and a newer token was granted since;
- ``lease_not_live``: the lease is gone (expired, released, revoked) and nobody newer
  was granted: the token is the newest, but dead.

A lease whose expiry time has passed is dead even before a tick has recorded it: time,
not the tick, ends a lease. The lease book and the gateway both ask ``token_problem``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from arbiter.schemas.reasons import Reason


class LiveLease(Protocol):
    """What the rule reads of a lease."""

    @property
    def agent_id(self) -> str: ...

    @property
    def expires_at_ms(self) -> int: ...


def token_problem(holders: Mapping[int, LiveLease], last_token: int, agent_id: str, token: int,
                  now_ms: int) -> Reason | None:
    """Why ``agent_id`` may not act with ``token`` at ``now_ms`` (None: it may)."""
    lease = holders.get(token)
    if lease is not None and lease.expires_at_ms > now_ms:
        return None if lease.agent_id == agent_id else Reason.NOT_HOLDER
    return Reason.STALE_FENCING_TOKEN if token < last_token else Reason.LEASE_NOT_LIVE
