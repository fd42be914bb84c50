"""The wall clock, for the edges only: when a command was sent, when a dead letter was written.

Decisions never read it (they use the broker's append time); cores cannot import it. A
simulation (``arbiter.sim``) puts its virtual clock in its place for as long as it runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator


def _wall() -> int:
    return time.time_ns() // 1_000_000


_source: Callable[[], int] = _wall


def now_ms() -> int:
    """Milliseconds since the epoch, from this machine's clock (or a simulation's)."""
    return _source()


@contextlib.contextmanager
def clock_of(source: Callable[[], int]) -> Iterator[None]:
    """Every ``now_ms`` reads ``source`` inside the block (a simulation's virtual clock)."""
    global _source
    before, _source = _source, source
    try:
        yield
    finally:
        _source = before
