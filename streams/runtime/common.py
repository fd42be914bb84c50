"""What the runtime and the benchmarks' faust baseline share: names, the tables' changelog forms,
the tools, fault injection. Nothing here starts a Kafka client."""

from __future__ import annotations

import json
import os
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from arbiter.edge.settings import Settings
from arbiter.schemas import ToolIntent
from arbiter.streams.cores.saga import Saga
from arbiter.streams.shells import ToolRunner
from arbiter.streams.shells.resource import (
    book_attach_id_rows,
    book_from_bytes,
    book_head_to_bytes,
    book_id_row_keys,
    book_take_id_rows,
    book_to_bytes,
    content_from_bytes,
    content_to_bytes,
)


def worker_id(settings: Settings) -> str:
    """This worker's name in answers and diagnostics."""
    return settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"


def default_tools(settings: Settings) -> ToolRunner:
    """The ledger's tools against the configured database, and the configured git repositories'."""
    from arbiter.streams.tools.ledger import Ledger, worker_tool_registry

    return worker_tool_registry(Ledger(settings.ledger_url()), settings.parse_repos(settings.repos),
                                settings.sandbox_root)


def failpoint(settings: Settings) -> Callable[[ToolIntent], None]:
    """Fault injection, for tests only. ``ARBITER_FAILPOINT=crash_after_tool:<intent id prefix>``:
    SIGKILL this worker right after the tool of an intent whose id starts with the prefix ran,
    before its outcome is recorded; ``raise_after_tool:<prefix>``: raise there instead (a
    processor bug, which the worker quarantines)."""
    spec = os.environ.get("ARBITER_FAILPOINT", "")
    kind, _, target = spec.partition(":")
    if kind not in ("crash_after_tool", "raise_after_tool") or not target:
        return lambda _intent: None

    def inject(intent: ToolIntent) -> None:
        if intent.intent_id.startswith(target):
            if kind == "crash_after_tool":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"failpoint raise_after_tool:{target} hit by intent {intent.intent_id}")

    return inject


def _saga_to_bytes(saga: Saga) -> bytes:
    return json.dumps(saga.to_dict(), separators=(",", ":")).encode()


def _saga_from_bytes(data: bytes) -> Saga:
    return Saga.from_dict(json.loads(data))


def _same(data: bytes) -> bytes:
    return data


@dataclass(frozen=True)
class RowSpec:
    """A part of a table's values that its changelog keeps in rows of their own, so a change writes
    what it changed instead of re-encoding the whole value (a lease book's id memory, in chunks: its cost
    grew with the resource's history). A row's changelog key is the value's key, length-prefixed, then
    the row's own key."""

    name: str
    head: Callable[[Any], bytes]
    """The value's changelog form without its rows (``TableSpec.loads`` reads it back)."""
    take: Callable[[Any], list[tuple[bytes, bytes | None]]]
    """The rows to write since the value was last written (row key, value or None: gone)."""
    keys: Callable[[Any], list[bytes]]
    """Every row key the value may have written (tombstoned when the value goes)."""
    attach: Callable[[Any, list[tuple[bytes, bytes]]], None]
    """Put restored rows back into a restored value (read from ``head``)."""

    def changelog(self, app_id: str) -> str:
        """Its changelog topic."""
        return f"{app_id}-{self.name}-changelog"

    @staticmethod
    def row_key(key: bytes, item: bytes) -> bytes:
        """The changelog key of ``item`` of the value under ``key``."""
        return len(key).to_bytes(2, "big") + key + item

    @staticmethod
    def split(row_key: bytes) -> tuple[bytes, bytes]:
        """Inverse of ``row_key``."""
        size = int.from_bytes(row_key[:2], "big")
        return row_key[2:2 + size], row_key[2 + size:]


@dataclass(frozen=True)
class TableSpec:
    """One changelogged table: its name, the processor it belongs to (``shells.pipeline.processor_of``),
    its value codec."""

    name: str
    processor: str
    dumps: Callable[[Any], bytes]
    """The whole value (checkpoints; the changelog too, unless ``rows``)."""
    loads: Callable[[bytes], Any]
    rows: RowSpec | None = None

    def changelog(self, app_id: str) -> str:
        """Its changelog topic: the name faust gives it (the benchmarks' faust baseline writes whole values
        there, rows included, and so reads the heads the worker writes but not its rows)."""
        return f"{app_id}-{self.name}-changelog"

    def changelogs(self, app_id: str) -> list[str]:
        """Every changelog topic it writes: its own, and its rows'."""
        return [self.changelog(app_id), *([self.rows.changelog(app_id)] if self.rows else [])]


TABLES: dict[str, TableSpec] = {
    "books": TableSpec("leases", "resource", book_to_bytes, book_from_bytes,
                       RowSpec("leaseids", book_head_to_bytes, book_take_id_rows, book_id_row_keys,
                               book_attach_id_rows)),
    "contents": TableSpec("contents", "resource", content_to_bytes, content_from_bytes),
    # One small changelog entry per edge (not the whole graph per write): the graph is
    # rebuilt in memory from the table after a rebalance.
    "graphs": TableSpec("waitedges", "deadlock", _same, _same),
    "sagas": TableSpec("sagas", "saga", _saga_to_bytes, _saga_from_bytes),
}
"""The processors' state, by the name ``arbiter.streams.shells.pipeline.Pipeline`` gives each store."""
