"""Virtual time for a simulation: an asyncio loop whose clock moves only when nothing is ready to run.

Theory of operation
-------------------
asyncio's loop runs every ready callback, then asks its selector for I/O, waiting at most until its
next timer. ``VirtualLoop`` gives it a selector with no I/O that, asked to wait, moves the virtual
clock forward by the wait instead: the next timer is due at once, so a 30 s lease expires in no
time, and the order of everything that happens is the order of the timers and callbacks alone.
Nothing here reads the machine's clock or starts a thread; ``arbiter.edge.clock.now_ms`` and
``time.monotonic`` read the virtual clock while ``run`` runs. One seed, one schedule: run twice, the
same things happen in the same order (with ``PYTHONHASHSEED`` fixed, as ``./dev sim`` does, since a
set's order of strings depends on it).

A loop with nothing ready, no timer and nothing to wake it can never go on: the simulation is
stuck (every task waits for something no one will do), which ``run`` reports as ``SimStuck``
instead of hanging. An exception in a task no one awaits is not lost: ``run`` raises it (as the
cause of ``SimStuck``, when it is why the rest waits).
"""

from __future__ import annotations

import asyncio
import math
import selectors
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar
from unittest import mock

from arbiter.edge.clock import clock_of

T = TypeVar("T")

EPOCH_MS = 1_800_000_000_000
"""Where a simulation's clock starts (2027-01-15): far from 0, as a real clock is."""


class SimStuck(RuntimeError):
    """Every task waits, no timer is set: nothing can ever happen again."""


class _NoIO(selectors.BaseSelector):
    """A selector that has no I/O to report: asked to wait, it moves the clock instead."""

    def __init__(self, loop: VirtualLoop) -> None:
        self._loop = loop
        self._keys: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        return self._keys.pop(fd)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise SimStuck("every task waits and no timer is set: the simulation can never go on")
        if timeout > 0:
            self._loop.advance(timeout)
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return dict(self._keys)

    def close(self) -> None:
        self._keys.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time: ``time()`` is the seconds since the simulation started (small, so a
    float keeps microseconds), ``now_ms()`` the wall clock it stands for."""

    def __init__(self, start_ms: int = EPOCH_MS) -> None:
        self._start_ms = start_ms
        self._now = 0.0
        super().__init__(_NoIO(self))
        self.failures: list[BaseException] = []
        """What failed where no one awaited it (a background task's exception): ``run`` raises the first."""
        self.set_exception_handler(lambda _loop, context: self.failures.append(
            context.get("exception") or RuntimeError(str(context.get("message")))))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward (the selector does, when the loop would wait): always by something, or a
        wait shorter than the float's step would leave the loop asking to wait forever."""
        later = self._now + seconds
        self._now = later if later > self._now else math.nextafter(self._now, math.inf)

    def now_ms(self) -> int:
        """The virtual wall clock, in milliseconds since the epoch."""
        return self._start_ms + int(self._now * 1000)


def run(main: Coroutine[Any, Any, T], start_ms: int = EPOCH_MS) -> T:
    """Run ``main`` to its end on a new ``VirtualLoop``, with ``now_ms`` on its clock; ``SimStuck`` if
    it can never end."""
    loop = VirtualLoop(start_ms)
    try:
        # Every clock the code reads is the virtual one: a deadline on time.monotonic would otherwise pass
        # by the machine's clock, at a virtual moment that depends on how fast the machine is.
        # A thread would finish at a moment of the machine's: what the code hands to one (the ledger's
        # SQLite) runs inline instead, at a moment of the schedule's.
        with clock_of(loop.now_ms), mock.patch("time.monotonic", loop.time), \
                mock.patch("asyncio.to_thread", _inline):
            try:
                result = loop.run_until_complete(main)
            except SimStuck as stuck:
                if loop.failures:  # a task that failed in the background is most often why the rest waits
                    raise stuck from loop.failures[0]
                raise
            if loop.failures:
                raise loop.failures[0]
            return result
    finally:
        try:
            _cancel_all(loop)
        finally:
            loop.close()


async def _inline(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``asyncio.to_thread`` in a simulation: the call, here and now."""
    return fn(*args, **kwargs)


def _cancel_all(loop: VirtualLoop) -> None:
    """Cancel what ``main`` left running and let it finish (as ``asyncio.run`` does)."""
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
