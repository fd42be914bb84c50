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
    from arbiter.streams.tools.git import Repos
    from arbiter.streams.tools.ledger import Ledger, worker_tool_registry

    configured = settings.repositories()
    repos = Repos({name: r.path for name, r in configured.items()}, settings.sandbox_root,
                  {name: r.check_digest() if r.check is not None else None for name, r in configured.items()},
                  sandbox_group=settings.sandbox_group)
    return worker_tool_registry(Ledger(settings.ledger_url()), repos, merge_failpoint())


def merge_failpoint() -> Callable[[str, str], None]:
    """Fault injection, for tests only. ``ARBITER_FAILPOINT=merge_<step>:<intent id prefix>`` kills this worker
    and its git (its process group) at that step of a landing (``arbiter.streams.tools.merges.STEPS``)."""
    kind, _, target = os.environ.get("ARBITER_FAILPOINT", "").partition(":")
    step = kind.removeprefix("merge_")
    if not kind.startswith("merge_") or not target:
        return lambda _step, _intent: None

    def inject(at: str, intent_id: str) -> None:
        if at == step and intent_id.startswith(target):
            os.killpg(os.getpgrp(), signal.SIGKILL)

    return inject


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


def lost_outputs_failpoint() -> str | None:
    """Fault injection, for tests only. ``ARBITER_FAILPOINT=lose_outputs_once:<key prefix>``: the first batch
    with an output keyed by the prefix sends its other records, not those, and fails as a batch whose
    outputs the broker did not take. The prefix, or None."""
    kind, _, target = os.environ.get("ARBITER_FAILPOINT", "").partition(":")
    return target if kind == "lose_outputs_once" and target else None


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
    grew with the resource's history).

    Rows live in the value's own changelog partition under keys no value has (``ROW_MARK`` first: a
    table key is a resource name, UTF-8, which never holds that byte). A batch writes a value's new
    rows, then its record, then the tombstones of the rows it no longer needs, all in that partition's
    batch: a record never lands without the rows it counts on, and a row is never gone while a record
    that counts on it is the last one written."""

    head: Callable[[Any], bytes]
    """The value's changelog form without its rows (``TableSpec.loads`` reads it back)."""
    take: Callable[[Any], list[tuple[bytes, bytes | None]]]
    """The rows to write since the value was last written (row key, value or None: gone)."""
    keys: Callable[[Any], list[bytes]]
    """Every row key the value may have written (tombstoned when the value goes)."""
    attach: Callable[[Any, list[tuple[bytes, bytes]]], None]
    """Put restored rows back into a restored value (read from ``head``)."""

    ROW_MARK = b"\xff"

    @classmethod
    def row_key(cls, key: bytes, item: bytes) -> bytes:
        """The changelog key of row ``item`` of the value under ``key``."""
        return cls.ROW_MARK + len(key).to_bytes(2, "big") + key + item

    @classmethod
    def is_row(cls, changelog_key: bytes) -> bool:
        """Whether a changelog key is a row's (not a value's)."""
        return changelog_key[:1] == cls.ROW_MARK

    @staticmethod
    def split(row_key: bytes) -> tuple[bytes, bytes]:
        """Inverse of ``row_key``: (the value's key, the row's)."""
        size = int.from_bytes(row_key[1:3], "big")
        return row_key[3:3 + size], row_key[3 + size:]


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
        """Its changelog topic: the name faust gives it (the benchmarks' faust baseline writes whole values,
        and reads the worker's records but not its rows)."""
        return f"{app_id}-{self.name}-changelog"


TABLES: dict[str, TableSpec] = {
    "books": TableSpec("leases", "resource", book_to_bytes, book_from_bytes,
                       RowSpec(book_head_to_bytes, book_take_id_rows, book_id_row_keys, book_attach_id_rows)),
    "contents": TableSpec("contents", "resource", content_to_bytes, content_from_bytes),
    # One small changelog entry per edge (not the whole graph per write): the graph is
    # rebuilt in memory from the table after a rebalance.
    "graphs": TableSpec("waitedges", "deadlock", _same, _same),
    "sagas": TableSpec("sagas", "saga", _saga_to_bytes, _saga_from_bytes),
}
"""The processors' state, by the name ``arbiter.streams.shells.pipeline.Pipeline`` gives each store."""
