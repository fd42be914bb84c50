"""The local Kafka's one error: the broker could not be fetched, started or stopped."""

from __future__ import annotations


class LocalKafkaError(RuntimeError):
    """The local broker could not be fetched, started or stopped. ``log_tail`` says why."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail
