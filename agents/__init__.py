"""The agent-side SDK: what an AI agent uses to talk to Arbiter.

The public surface is re-exported here and pinned by ``tests/test_sdk_exports.py``.
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
from arbiter.agents.train import MergeTrain, TrainStats
from arbiter.streams.tools.checks import CheckResult

__all__ = [
    "ArbiterClient",
    "ArbiterError",
    "ArbiterTimeout",
    "ArbiterUnavailable",
    "CheckResult",
    "DoorRefused",
    "Lease",
    "LeaseDenied",
    "LeaseLost",
    "MergeTrain",
    "Outcome",
    "PingResult",
    "Saga",
    "SagaAborted",
    "SagaStepRejected",
    "Sandbox",
    "SandboxRefused",
    "Snapshot",
    "TrainStats",
]
