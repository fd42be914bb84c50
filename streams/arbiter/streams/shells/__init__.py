"""Processor shells: each feeds one pure core and owns its state-store interface, with no Kafka.

The one path every input takes, raw record to outcome, is ``arbiter.streams.shells.pipeline.Pipeline``:
the worker's runtimes build it over changelogged tables, audit and replay over dicts, and
it builds the three shells here (``build_shells``, in ``processors``) over the views of one input's scope.
"""

from arbiter.streams.shells.deadlock import DeadlockShell, RowGraphStore
from arbiter.streams.shells.processors import Shell, Shells, build_shells
from arbiter.streams.shells.resource import ResourceShell, ToolRunner
from arbiter.streams.shells.routes import SAGA_PREFIX, Routes, Send
from arbiter.streams.shells.rules import Rules
from arbiter.streams.shells.saga import SagaShell

__all__ = [
    "SAGA_PREFIX",
    "DeadlockShell",
    "ResourceShell",
    "Routes",
    "RowGraphStore",
    "Rules",
    "SagaShell",
    "Send",
    "Shell",
    "Shells",
    "ToolRunner",
    "build_shells",
]
