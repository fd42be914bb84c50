"""What one input changes, kept or dropped as a whole: deferred table writes and undo steps.

Every input is decided inside an ``InputScope`` (``arbiter.streams.shells.pipeline``): the shells write
their tables through ``DeferredTable`` views, whose writes reach the table (and so the
worker's changelog) only when the input is done; a shell that changes a value in place
(the lease book, to keep a decision's cost independent of the queue) registers how to
undo it. An input that fails is discarded: its writes are dropped and its in-place
changes undone, newest first, so it leaves nothing behind. Worker and audit both decide
through a scope, over changelogged tables and over dicts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

_GONE = object()


class DeferredTable(MutableMapping[bytes, Any]):
    """``table`` as seen by one input: its own pending writes over the table's values."""

    def __init__(self, table: MutableMapping[bytes, Any]) -> None:
        self.table = table
        self.pending: dict[bytes, Any] = {}

    def __getitem__(self, key: bytes) -> Any:
        if key in self.pending:
            value = self.pending[key]
            if value is _GONE:
                raise KeyError(key)
            return value
        value = self.table.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def get(self, key: bytes, default: Any = None) -> Any:
        """The value under ``key`` (pending writes first), or ``default``."""
        try:
            return self[key]
        except KeyError:
            return default

    def __setitem__(self, key: bytes, value: Any) -> None:
        self.pending[key] = value

    def __delitem__(self, key: bytes) -> None:
        self.pending[key] = _GONE

    def pop(self, key: bytes, default: Any = None) -> Any:
        """Remove ``key`` (when the input is done); its value until then, or ``default``."""
        value = self.get(key, default)
        self.pending[key] = _GONE
        return value

    def __iter__(self) -> Iterator[bytes]:
        seen = set()
        for key in self.pending:
            if self.pending[key] is not _GONE:
                seen.add(key)
                yield key
        for key in list(self.table.keys()):
            if key not in seen and key not in self.pending:
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def commit(self) -> None:
        """Apply the pending writes to the table, in the order they were made."""
        for key, value in self.pending.items():
            if value is _GONE:
                self.table.pop(key, None)
            else:
                self.table[key] = value
        self.pending.clear()

    def discard(self) -> None:
        """Drop the pending writes: the input that made them failed."""
        self.pending.clear()


class InputScope:
    """The views one input decides through, and the undo steps of its in-place changes."""

    def __init__(self, tables: Mapping[str, MutableMapping[bytes, Any]]) -> None:
        self.views = {name: DeferredTable(table) for name, table in tables.items()}
        self._undo: list[Callable[[], None]] = []

    def on_discard(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` if this input is discarded (after the undo steps registered later)."""
        self._undo.append(undo)

    def commit(self) -> None:
        """The input is done: apply its table writes, forget its undo steps."""
        for view in self.views.values():
            view.commit()
        self._undo.clear()

    def discard(self) -> None:
        """The input failed: undo its in-place changes (newest first) and drop its table writes."""
        undo, self._undo = self._undo, []
        for step in reversed(undo):
            step()
        for view in self.views.values():
            view.discard()
