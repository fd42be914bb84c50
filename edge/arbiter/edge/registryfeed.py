"""Following the registry topic: who holds which key, kept up to date.

Workers, SDK clients, the front door, the CLI and the audit all need the same view of who
holds which key (``arbiter.schemas.identity.Registry``). ``RegistryFeed`` reads every
partition of the compacted registry topic from the start (``arbiter.edge.tail.Tail``),
applies each admin-signed record, and keeps following. ``catch_up`` returns once everything
written before it was called has been applied: a process that meets an unknown key asks for
it before refusing, so a key registered a moment ago is never refused.
"""

from __future__ import annotations

import logging

from arbiter.edge.kafkaio import Received
from arbiter.edge.settings import Settings
from arbiter.edge.tail import Tail
from arbiter.schemas.codec import ContractError
from arbiter.schemas.identity import Registry
from arbiter.schemas.models import IdentityRegistered, Record

log = logging.getLogger(__name__)


class RegistryFeed:
    """Keeps ``registry`` up to date from the registry topic. ``start`` before use, ``stop`` after."""

    def __init__(self, registry: Registry, settings: Settings) -> None:
        self.registry = registry
        self.topic = settings.topics.registry
        self._tail = Tail(settings, [self.topic], start="beginning", decode=False, on_message=self._apply)

    async def start(self, timeout: float = 30.0) -> None:
        """Connect, read the whole registry, then keep following it in the background."""
        await self._tail.start()
        if not await self.catch_up(timeout):
            log.warning("the registry was not read to its end within %.0f s; going on with what was read", timeout)

    async def stop(self) -> None:
        """Stop following."""
        await self._tail.stop()

    async def catch_up(self, timeout: float = 10.0) -> bool:
        """Wait until every registry record written before this call is applied (False: timed out)."""
        return await self._tail.caught_up(timeout)

    def _apply(self, message: Received, _record: Record | None) -> None:
        self.apply(message.topic, message.key, message.value, message.headers)

    def apply(self, topic: str, key: bytes | None, value: bytes | None, headers: object) -> None:
        """Apply one registry message (what does not decode or verify is logged and skipped)."""
        if value is None:
            return
        try:
            record = self._tail.codec.decode(value, IdentityRegistered)
        except ContractError as error:
            log.warning("registry record at %s does not decode: %s", topic, error)
            return
        problem = self.registry.apply(topic, key, value, headers, record)  # type: ignore[arg-type]  # the seam's headers and Kafka's are alike
        if problem is not None:
            log.warning("registry record for %r refused: %s", record.name, problem.detail)
