"""The agent SDK's public surface is small and deliberate: changing it fails here first."""

from arbiter import agents


def test_public_surface() -> None:
    assert sorted(agents.__all__) == [
        "ArbiterClient", "ArbiterError", "ArbiterTimeout", "ArbiterUnavailable", "DoorRefused",
        "Lease", "LeaseDenied", "LeaseLost", "Outcome", "PingResult", "Saga", "SagaAborted",
        "SagaStepRejected", "Sandbox", "SandboxRefused", "Snapshot",
    ]
    for name in agents.__all__:
        assert getattr(agents, name).__doc__, f"{name} needs a docstring"


def test_errors_say_whether_a_retry_may_succeed() -> None:
    assert agents.ArbiterTimeout.retriable is True
    assert issubclass(agents.ArbiterTimeout, agents.ArbiterError)
    assert agents.LeaseDenied("busy", {}).retriable is True
    assert agents.LeaseDenied("invalid_ttl", {}).retriable is False
    assert agents.LeaseLost.retriable is False
    assert agents.ArbiterUnavailable.retriable is True
    assert issubclass(agents.ArbiterUnavailable, agents.ArbiterError)
    assert agents.DoorRefused(429, "rate_limited", "").retriable is True
    assert agents.DoorRefused(403, "forbidden", "").retriable is False
