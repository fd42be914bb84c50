"""The agent-side SDK: what an AI agent uses to talk to Arbiter.

The public surface is re-exported here and pinned by ``tests/test_sdk_exports.py``.
"""

from .client import ArbiterClient, ArbiterTimeout, PingResult
from .httptransport import DoorRefused
from .leases import ArbiterError, ArbiterUnavailable, Lease, LeaseDenied, LeaseLost
from .outcomes import Outcome, Snapshot
from .sagas import Saga, SagaAborted, SagaStepRejected

__all__ = [
    "ArbiterClient",
    "ArbiterError",
    "ArbiterTimeout",
    "ArbiterUnavailable",
    "DoorRefused",
    "Lease",
    "LeaseDenied",
    "LeaseLost",
    "Outcome",
    "PingResult",
    "Saga",
    "SagaAborted",
    "SagaStepRejected",
    "Snapshot",
]
