"""The SDK's Kafka transport: one agent's commands out, that agent's inbox records in.

Theory of operation
-------------------
``send(topic, key, record)`` encodes a record, signs it with this agent's own key
(``arbiter.schemas.identity``) and waits until every in-sync replica has it (``acks="all"``,
no lingering). The processors decide per key, in order, so the caller names the key:
the resource, the saga, the wait graph.

Outcomes come back on the agent-inbox topic, keyed by agent id. The Kafka clients are
not this agent's own: every transport in the process with the same connection settings
shares one producer, one registry feed and one inbox reader (``arbiter.agents.hub``). ``start``
joins that hub, which pins this agent's start in its inbox partition before returning,
so no outcome of a command sent afterwards is missed. The reader hands this transport
only records keyed by this agent; each one the codec understands goes to ``on_record``;
what it means is the facade's business (``arbiter.agents.client``).

Trust: an inbox record reaches ``on_record`` only when a worker identity signed it;
anything else is counted in this agent's ``forged``, logged, and never acted on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from arbiter.agents import hub as hubs
from arbiter.agents.errors import ArbiterError, ArbiterUnavailable
from arbiter.agents.identities import ensure_identity
from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaconn import describe
from arbiter.edge.kafkaio import KafkaIOError, Received
from arbiter.edge.keys import key_file, signer_for
from arbiter.edge.registryfeed import RegistryFeed
from arbiter.edge.settings import Settings
from arbiter.schemas import Codec, ContractError, Record
from arbiter.schemas.identity import ROLE_WORKER, Refused, Signer

log = logging.getLogger(__name__)

OnRecord = Callable[[Record], None]
"""Called, in inbox order, with each record for this agent. It must not block."""



class Transport(Protocol):
    """What ``ArbiterClient`` sends and hears through: Kafka directly, or a front door."""

    forged: int

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def send(self, topic: str, key: str, record: Record) -> None: ...


_NOT_STARTED = "ArbiterClient is not started; use 'async with ArbiterClient(...)'"


class KafkaTransport:
    """Sends one agent's records to Arbiter's topics and reads its inbox. ``start`` before, ``close`` after."""

    def __init__(self, agent_id: str, settings: Settings, codec: Codec, on_record: OnRecord,
                 signer: Signer | None = None) -> None:
        if signer is not None and signer.name != agent_id:
            raise ValueError(f"the key given is {signer.name!r}'s, not {agent_id!r}'s")
        self.agent_id = agent_id
        self.settings = settings
        self.codec = codec
        self._on_record = on_record
        self.hub: hubs.InboxHub | None = None
        """The Kafka clients this transport shares with the process's others (None until started)."""
        self._signer: Signer | None = signer
        self._feed: RegistryFeed | None = None
        self.forged = 0
        """Inbox records for this agent that no worker signed (dropped, never acted on)."""
        self.on_forged: Callable[[int, str], None] | None = None
        """Told (inbox offset, why) of each forged record dropped: the front door tells the agent."""
        self.offset = -1
        """The inbox offset of the record being handed to ``on_record`` (of the last one, after)."""

    async def _identity(self) -> Signer | None:
        settings = self.settings
        key_text = settings.identity_key if settings.identity in ("", self.agent_id) else ""
        if not key_text and settings.auto_enroll and not key_file(settings.home, self.agent_id).exists():
            log.warning("auto_enroll (development only): issuing a key to agent %r with this home's admin key",
                        self.agent_id)
            return await ensure_identity(settings, self.agent_id)
        if not settings.verify_signatures and not key_text and not key_file(settings.home, self.agent_id).exists():
            return None  # development without verification: unsigned
        return signer_for(settings.home, self.agent_id, key_text)

    async def start(self) -> None:
        """Connect, and start reading this agent's inbox from its current end."""
        try:
            if self._signer is None:
                self._signer = await self._identity()  # (enrolling reads the registry from Kafka)
            hub = await hubs.join(self.settings, self.agent_id, self)
        except KafkaIOError as exc:  # (enrolling, the registry feed and the hub are all on the seam)
            raise ArbiterUnavailable(f"Kafka at {self.settings.bootstrap} could not be reached: "
                                     f"{describe(exc)}") from exc
        self._feed = hub.feed
        self.hub = hub

    async def close(self) -> None:
        """Stop reading; the last transport of a hub disconnects it."""
        hub, self.hub = self.hub, None
        if hub is not None:
            await hub.leave(self.agent_id, self)

    async def send(self, topic: str, key: str, record: Record) -> None:
        """Encode ``record`` and send it to ``topic`` under ``key``; return once the broker has it."""
        if self.hub is None or self.hub.sender is None:
            raise RuntimeError(_NOT_STARTED)
        value = self.codec.encode(record)
        raw_key = key.encode()
        headers = self._signer.sign(topic, raw_key, value, now_ms()) if self._signer is not None else None
        # A transport fault is retried here for up to ``send_retry_seconds``: every command carries an
        # id that is decided once, so sending it again (if the first one did reach the log) is harmless.
        deadline = time.monotonic() + self.settings.send_retry_seconds
        delay = 0.05
        while True:
            try:
                # A client holds a send while no broker answers (aiokafka up to its request timeout,
                # 40 s): bound it by this call's deadline. (``asyncio.timeout``, not ``wait_for``: that
                # wraps every send in a task of its own, ~25-40 us a call here against ~8.)
                async with asyncio.timeout(max(0.05, deadline - time.monotonic())):
                    await self.hub.sender.send(topic, raw_key, value, headers)
                return
            except TimeoutError:
                raise ArbiterUnavailable(
                    f"Kafka did not take {type(record).__name__} within {self.settings.send_retry_seconds:g} s "
                    "(no broker answered); it may or may not have reached the log") from None
            except KafkaIOError as exc:
                if not exc.retriable:
                    raise ArbiterError(f"Kafka refused {type(record).__name__} on {topic}: "
                                       f"{exc}") from exc
                if time.monotonic() + delay > deadline:
                    raise ArbiterUnavailable(
                        f"Kafka did not take {type(record).__name__} within {self.settings.send_retry_seconds:g} s "
                        f"({exc}); it may or may not have reached the log") from exc
                log.info("sending %s failed (%s); retrying in %.2f s", type(record).__name__, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    @property
    def signer(self) -> Signer | None:
        """The key this transport signs with (None: verification is off, and it sends unsigned)."""
        return self._signer

    async def inbox_end(self) -> int:
        """The offset the next record of this agent's inbox partition will get."""
        if self.hub is None or self.hub.reader is None:
            raise RuntimeError(_NOT_STARTED)
        try:
            return await self.hub.reader.end_offset(*self.hub.partition_of(self.agent_id))
        except KafkaIOError as exc:
            raise ArbiterUnavailable(f"Kafka at {self.settings.bootstrap}: {exc}") from exc

    async def deliver(self, message: Received) -> None:
        """One inbox message keyed by this agent (the hub's reader calls this): decode, verify, hand on."""
        record = await self.verify(message)
        if record is not None:
            self.offset = message.offset
            self._on_record(record)

    async def verify(self, message: Any) -> Record | None:
        """The record an inbox message carries, if it decodes and a worker signed it (else None; a forged
        one is counted and reported to ``on_forged``)."""
        if message.value is None:
            return None
        try:
            record: Record = self.codec.decode(message.value)
        except ContractError:
            return None  # not for a client this version understands; the workers dead-letter
        if self._feed is not None and not await self._from_worker(message):
            return None
        return record

    async def _from_worker(self, message: Any) -> bool:
        """Whether a worker identity signed this inbox message (else it is counted and dropped)."""
        assert self._feed is not None
        registry = self._feed.registry
        args = (message.topic, message.key, message.value, message.headers, message.timestamp)
        verdict = registry.verify(*args)
        if isinstance(verdict, Refused) and verdict.unknown_key:
            await self._feed.catch_up(timeout=5.0)  # a worker registered a moment ago
            verdict = registry.verify(*args)
        if isinstance(verdict, Refused) or verdict.role != ROLE_WORKER:
            self.forged += 1
            why = verdict.detail if isinstance(verdict, Refused) else f"signed by {verdict.role} {verdict.name!r}"
            if self.on_forged is not None:
                self.on_forged(message.offset, why)
            log.warning("dropped a forged inbox message for %s at %s[%d]@%d: %s", self.agent_id, message.topic,
                        message.partition, message.offset, why)
            return False
        return True
