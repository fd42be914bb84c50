"""The wall clock, for the edges only: when a command was sent, when a dead letter was written.

Decisions never read it (they use the broker's append time); cores cannot import it.
"""

from __future__ import annotations

import time


def now_ms() -> int:
    """Milliseconds since the epoch, from this machine's clock."""
    return time.time_ns() // 1_000_000
