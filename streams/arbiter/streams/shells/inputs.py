"""One input record as Kafka holds it: what the pipeline (``arbiter.streams.shells.pipeline``) takes."""

from __future__ import annotations

from dataclasses import dataclass

from arbiter.schemas import Cause, Record
from arbiter.schemas.identity import Headers


@dataclass(frozen=True, slots=True)
class RawInput:
    """One input record as Kafka holds it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    """The exact value bytes (None only with ``record`` given: a replay's trust gate encodes it again)."""
    headers: Headers
    timestamp_ms: int
    """The broker's append time: the decision's time, the same on every redelivery."""
    record: Record | None = None
    """The value already decoded (the audit's log holds it), else None: decoded here."""

    @property
    def cause(self) -> Cause:
        """Where it sits: what every decision made from it names."""
        return Cause(topic=self.topic, partition=self.partition, offset=self.offset)

    @property
    def where(self) -> str:
        """``topic[partition]@offset``."""
        return f"{self.topic}[{self.partition}]@{self.offset}"
