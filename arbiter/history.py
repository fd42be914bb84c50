"""A resource's lease book folded from the log: what ``arbiter lock status`` shows.

Only the workers' decisions count. With signature verification on (the default), each
event must carry a worker's signature that verifies against the registry the admin
signed (``arbiter.schemas.identity``), rooted in the admin public keys this machine trusts; a
message that is unsigned, forged or signed by anyone else (an agent, say) is skipped,
so a forged ``LockGranted`` on the event topic never shows as a holder. The skipped
positions are returned to a caller that asks for them, and logged.
"""

from __future__ import annotations

import logging

from arbiter.edge.registryfeed import RegistryFeed
from arbiter.edge.settings import Settings
from arbiter.schemas import default_codec
from arbiter.schemas.codec import Codec
from arbiter.schemas.identity import ROLE_WORKER, Refused, Registry
from arbiter.schemas.partitioning import partition_for
from arbiter.streams.cores.leases import LOCK_EVENTS, LeaseBook, evolve, new_book

from .audit.log import Entry, read_log
from .audit.replay import SET_ANCHORS, TrustAnchorsMissing, trust_anchors

log = logging.getLogger(__name__)


async def lease_book(settings: Settings, resource: str, skipped: list[str] | None = None) -> LeaseBook:
    """A resource's lease book, folded from its decisions on the resource-event topic.

    ``skipped`` (if given) receives ``topic[partition]@offset: why`` for every event left out
    because it is not a worker's signed decision.
    """
    book = new_book(resource)
    key = resource.encode()
    events = settings.topics.resource_events
    registry = await worker_registry(settings) if settings.verify_signatures else None
    codec = default_codec(settings.max_message_bytes)
    found = await read_log(settings, only=[(events, partition_for(key, settings.partitions))])
    left_out: list[str] = []
    for entry in found.of(events):
        if entry.key == key and isinstance(entry.record, LOCK_EVENTS):
            problem = None if registry is None else not_a_workers(registry, entry, codec)
            if problem is not None:
                left_out.append(f"{entry.where}: {problem}")
                continue
            evolve(book, entry.record)
    if left_out:
        log.warning("lock status of %s: %d event(s) left out, not signed by a worker: %s", resource, len(left_out),
                    "; ".join(left_out[:5]))
    if skipped is not None:
        skipped.extend(left_out)
    return book


async def worker_registry(settings: Settings) -> Registry:
    """The registry as the admin signed it, read whole from the registry topic."""
    anchors = trust_anchors(settings)
    if not anchors:
        raise TrustAnchorsMissing("signature verification is on, and no admin public key is known to check the "
                                  f"workers' signatures against: {SET_ANCHORS}")
    registry = Registry(anchors)
    feed = RegistryFeed(registry, settings)
    await feed.start()
    await feed.stop()
    return registry


def not_a_workers(registry: Registry, entry: Entry, codec: Codec) -> str | None:
    """Why ``entry`` is not a decision a worker signed (None: it is)."""
    signer = registry.verify(entry.topic, entry.key, entry.value_bytes(codec), entry.headers, entry.timestamp_ms)
    if isinstance(signer, Refused):
        return signer.detail
    if signer.role != ROLE_WORKER:
        return f"signed by {signer.name!r} (role {signer.role}), not by a worker"
    return None
