"""The saga processor's shell: one saga per key, its steps and aborts and the answers to its own agent."""

from __future__ import annotations

import copy
from collections.abc import MutableMapping
from dataclasses import dataclass

from arbiter.schemas import (
    Cause,
    ContractError,
    LockExpired,
    LockQueued,
    LockReleaseRequested,
    LockRenewed,
    LockRequested,
    LockRevoked,
    MergeChecked,
    MergeQueued,
    MergeReplanned,
    Record,
    SagaFinished,
    ToolIntent,
)
from arbiter.schemas.identity import Verified
from arbiter.schemas.reasons import Reason
from arbiter.streams.cores import saga as saga_core
from arbiter.streams.cores.saga import COMPENSATION_FAILED, Saga, SagaInput
from arbiter.streams.cores.trust import saga_owner
from arbiter.streams.shells.routes import SAGA_PREFIX, Routes, Send

NOTHING_TO_DO = (LockQueued, LockRenewed, LockExpired, LockRevoked, MergeQueued, MergeChecked, MergeReplanned)
"""Answers the resource processor sends a saga's agent (``Routes.reply_to``) that move no saga on: a
compensation's lease queued behind a holder, or its merge's progress, say. Taken and let be, not dead-lettered (they are
the processors' own answers, not a command on the wrong topic)."""


def saga_key_problem(key: bytes | None, record: Record) -> ContractError | None:
    """Why a saga message cannot be decided under its key (None: it can)."""
    try:
        saga_id = (key or b"").decode()
    except UnicodeDecodeError:
        saga_id = ""
    if not saga_id.startswith(SAGA_PREFIX) or getattr(record, "saga_id", saga_id) != saga_id:
        return ContractError(Reason.KEY_MISMATCH, f"saga messages are keyed by a saga id starting with "
                                                  f"{SAGA_PREFIX!r}; got {key!r} for {type(record).__name__}")
    return None


@dataclass
class SagaShell:
    """The saga processor: decides each saga message against the saga's state in ``sagas``."""

    sagas: MutableMapping[bytes, Saga]
    routes: Routes
    send: Send

    async def handle(self, key: bytes | None, record: Record, now_ms: int, cause: Cause,
                     sender: Verified | None = None) -> ContractError | None:
        """Decide one saga message: an agent's step or abort, or an answer to the saga's own agent."""
        if isinstance(record, NOTHING_TO_DO):
            return saga_key_problem(key, record)
        if not isinstance(record, SagaInput):
            # Well-typed, wrong topic: a lease request here would be taken for the saga's own.
            return ContractError(Reason.UNSUPPORTED_COMMAND,
                                 f"{type(record).__name__} does not belong on the saga-command topic")
        problem = saga_key_problem(key, record)
        if problem is not None:
            return problem
        assert key is not None
        stored = self.sagas.get(key)
        saga = Saga(key.decode()) if stored is None else copy.deepcopy(stored)  # copy on write
        outputs = saga_core.decide(saga, record, now_ms, cause)
        saga_core.evolve(saga, record)
        for output in outputs:
            saga_core.evolve(saga, output)
            if isinstance(output, LockRequested | LockReleaseRequested | ToolIntent):
                await self.send(self.routes.resource_commands, output.resource.encode(), output)
            else:
                await self.send(self.routes.saga_events, key, output)
                # A saga that ended before any step (completed empty, or aborted by an operator) has
                # no agent on record: its owner is in its id, and only it or an operator could end it.
                owner = saga.agent_id or saga_owner(saga.saga_id)
                if isinstance(output, SagaFinished) and owner:
                    await self.send(self.routes.agent_inbox, owner.encode(), output)
                if isinstance(output, SagaFinished) and output.outcome == COMPENSATION_FAILED:
                    await self.send(self.routes.operator, key, output)  # a human must act
        self.sagas[key] = saga
        return None
