"""Every error the SDK raises, in one place. ``retriable`` says whether the same call may succeed later.

- ``ArbiterError``: the base of them all.
- ``ArbiterUnavailable``, ``ArbiterTimeout``: Arbiter could not be reached, or no decision came in time;
  retriable, and safe to retry with the same ids (a decided id is answered, never decided again).
- ``LeaseDenied``: a lock command or a read was refused; ``str(error)`` is the JSON diagnostic.
- ``LeaseLost``: the lease expired or was revoked.
- ``SagaStepRejected``, ``SagaAborted``: a saga's write was refused, or the saga was compensated.
- ``DoorRefused``: a front door refused the call (HTTP status, reason, detail).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from arbiter.schemas import LockCancelled, LockDenied, LockWaitTimedOut
from arbiter.schemas.reasons import Reason, is_retriable, what_to_do

if TYPE_CHECKING:
    from arbiter.agents.outcomes import Outcome


class ArbiterError(Exception):
    """Base of the SDK's errors. ``retriable`` says whether the same call may succeed later."""

    retriable = False


class ArbiterUnavailable(ArbiterError):
    """Arbiter could not be reached, or the connection broke mid-call. Retriable: the command may or
    may not have been decided, so retry with the same ids (a decided id is answered, never decided again)."""

    retriable = True


class LeaseDenied(ArbiterError):
    """The lease was not granted. ``reason`` is a stable code; ``diagnostic`` says what to do.

    ``str(error)`` is the JSON diagnostic, ready to paste into an LLM's context.
    """

    def __init__(self, reason: str, diagnostic: dict[str, Any]) -> None:
        super().__init__(json.dumps(diagnostic, sort_keys=True))
        self.reason = reason
        self.diagnostic = diagnostic

    @classmethod
    def from_event(cls, record: LockDenied | LockWaitTimedOut | LockCancelled) -> LeaseDenied:
        """The error an agent sees for a refusal, a wait time-out or a withdrawn request."""
        if isinstance(record, LockDenied):
            try:
                diagnostic = json.loads(record.detail)
            except ValueError:
                diagnostic = {"reason": record.reason, "detail": record.detail}
            return cls(record.reason, diagnostic)
        if isinstance(record, LockWaitTimedOut):
            return cls("wait_timed_out", {
                "reason": "wait_timed_out", "resource": record.resource, "waited_ms": record.waited_ms,
                "what_to_do": what_to_do(Reason.WAIT_TIMED_OUT)})
        return cls(record.reason, {
            "reason": record.reason, "resource": record.resource,
            "what_to_do": "Your request was withdrawn before it was granted."})

    @property
    def retriable(self) -> bool:  # type: ignore[override]  # the base's class attribute, a property here: both read alike
        """Busy, timed out, cancelled and deadlock victims may succeed later; bad input will not.

        The one table of which reasons are retriable is ``arbiter.schemas.reasons``.
        """
        return is_retriable(self.reason)


class LeaseLost(ArbiterError):
    """The lease expired or was revoked: stop acting on this resource."""


class ArbiterTimeout(ArbiterError, TimeoutError):
    """No outcome arrived in time. Retriable: the command may or may not have been decided."""

    retriable = True


class DoorRefused(ArbiterError):
    """The front door refused a call: ``status`` (HTTP code), ``reason`` (a stable code) and ``detail``."""

    def __init__(self, status: int, reason: str, detail: str) -> None:
        super().__init__(json.dumps({"status": status, "reason": reason, "detail": detail}, sort_keys=True))
        self.status = status
        self.reason = reason
        self.detail = detail

    @property
    def retriable(self) -> bool:  # type: ignore[override]  # the base's class attribute, a property here: both read alike
        """Rate limits and overload pass; bad credentials, forbidden commands and bad input do not."""
        return self.status in (429, 503)


class SagaStepRejected(ArbiterError):
    """A step's write was refused or failed; ``outcome`` says why. Raise it on to abort."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.diagnostic_json)
        self.outcome = outcome


class SagaAborted(ArbiterError):
    """The saga was aborted (by the agent or as a deadlock victim) and is compensated."""

    def __init__(self, saga_id: str, reason: str) -> None:
        super().__init__(f"saga {saga_id} was aborted ({reason}) and compensated")
        self.saga_id = saga_id
        self.reason = reason


class SandboxRefused(ArbiterError):
    """The worker refused to make (or discard) a sandbox; ``outcome`` says why (a second sandbox of one
    repository, an unknown repository or base branch)."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome.diagnostic_json)
        self.outcome = outcome
