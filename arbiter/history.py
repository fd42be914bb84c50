"""A resource's lease book folded from the log: what ``arbiter lock status`` shows."""

from __future__ import annotations

from contract.partitioning import partition_for
from contract.settings import Settings
from cores.leases import LOCK_EVENTS, LeaseBook, evolve, new_book

from .audit.log import read_log


async def lease_book(settings: Settings, resource: str) -> LeaseBook:
    """A resource's lease book, folded from its decisions on the resource-event topic."""
    book = new_book(resource)
    key = resource.encode()
    events = settings.topics.resource_events
    log = await read_log(settings, only=[(events, partition_for(key, settings.partitions))])
    for entry in log.of(events):
        if entry.key == key and isinstance(entry.record, LOCK_EVENTS):
            evolve(book, entry.record)
    return book
