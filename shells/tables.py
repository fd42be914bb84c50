"""A table whose writes wait until the input that made them is done.

The worker wraps each changelogged table in one, per processor: an input's shell writes
into it, then the worker sends the input's outputs, and only then applies the writes to
the table (and so to its changelog). The decisions go to the producer before the state
that follows from them, in one batch, and an input that fails leaves nothing behind:
``discard`` drops its writes.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
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
