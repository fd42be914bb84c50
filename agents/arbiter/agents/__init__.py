"""The agent-side SDK: what an AI agent uses to talk to Arbiter.

The public surface is re-exported here and pinned by ``tests/agents/test_sdk_exports.py``.
"""

from arbiter.agents.client import ArbiterClient, PingResult
from arbiter.agents.errors import (
    ArbiterError,
    ArbiterTimeout,
    ArbiterUnavailable,
    DoorRefused,
    LeaseDenied,
    LeaseLost,
    SagaAborted,
    SagaStepRejected,
    SandboxRefused,
)
from arbiter.agents.leases import Lease
from arbiter.agents.outcomes import Outcome, Snapshot
from arbiter.agents.sagas import Saga
from arbiter.agents.sandbox import Sandbox

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
    "Sandbox",
    "SandboxRefused",
    "Snapshot",
]
