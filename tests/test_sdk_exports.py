"""The agent SDK's public surface is small and deliberate: changing it fails here first."""

import agents


def test_public_surface() -> None:
    assert sorted(agents.__all__) == ["ArbiterClient", "ArbiterTimeout", "PingResult"]
    for name in agents.__all__:
        assert getattr(agents, name).__doc__, f"{name} needs a docstring"


def test_timeouts_say_a_retry_may_be_safe() -> None:
    assert agents.ArbiterTimeout.retriable is True
