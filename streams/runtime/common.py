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
from arbiter.streams.shells.resource import book_from_bytes, book_to_bytes, content_from_bytes, content_to_bytes


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
class TableSpec:
    """One changelogged table: its name, the processor it belongs to (``shells.pipeline.processor_of``),
    its value codec."""

    name: str
    processor: str
    dumps: Callable[[Any], bytes]
    loads: Callable[[bytes], Any]

    def changelog(self, app_id: str) -> str:
        """Its changelog topic: the name faust gives it, so either runtime reads the other's state."""
        return f"{app_id}-{self.name}-changelog"


TABLES: dict[str, TableSpec] = {
    "books": TableSpec("leases", "resource", book_to_bytes, book_from_bytes),
    "contents": TableSpec("contents", "resource", content_to_bytes, content_from_bytes),
    # One small changelog entry per edge (not the whole graph per write): the graph is
    # rebuilt in memory from the table after a rebalance.
    "graphs": TableSpec("waitedges", "deadlock", _same, _same),
    "sagas": TableSpec("sagas", "saga", _saga_to_bytes, _saga_from_bytes),
}
"""The processors' state, by the name ``arbiter.streams.shells.pipeline.Pipeline`` gives each store."""
