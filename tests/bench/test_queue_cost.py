"""A hand-off's cost does not grow with the queue: 100 waiters within 2x of 1, through the whole
per-input path (``bench.leases.queue_cost`` prints the figures with 1 to 1,000 waiters); nor with
the resource's history (``bench.leases.history_cost``: after 10 and after 4,000 hand-offs)."""

from __future__ import annotations

import pytest

from bench.leases import after_history, through_pipeline, through_step


def _best_of_interleaved(make: object, rounds: int) -> tuple[float, float]:
    one, hundred = make(1, rounds), make(100, rounds)  # type: ignore[operator]
    best_one = best_hundred = 0.0
    for _ in range(5):  # interleaved, best of each: both see the same machine
        best_one, best_hundred = max(best_one, one()), max(best_hundred, hundred())
    return best_one, best_hundred


def test_a_hand_off_through_the_pipeline_costs_the_same_with_100_waiters_as_with_1() -> None:
    one, hundred = _best_of_interleaved(through_pipeline, 300)
    assert hundred >= one / 2, f"1 waiter: {one:,.0f} decisions/s, 100 waiters: {hundred:,.0f}"


def test_a_hand_off_in_the_core_costs_the_same_with_100_waiters_as_with_1() -> None:
    one, hundred = _best_of_interleaved(through_step, 1000)
    assert hundred >= one / 2, f"1 waiter: {one:,.0f} decisions/s, 100 waiters: {hundred:,.0f}"


@pytest.mark.parametrize("fused", [False, True], ids=["decide-evolve", "step"])
def test_a_decision_after_4000_hand_offs_costs_what_it_costs_after_10(fused: bool) -> None:
    early = late = float("inf")
    for _ in range(3):  # interleaved, best of each
        early, late = min(early, after_history(10, fused)), min(late, after_history(4_000, fused))
    assert late <= 2 * early, f"after 10 hand-offs: {early:.1f} µs a decision, after 4,000: {late:.1f} µs"
