"""Whether something answers: a Kafka broker's metadata, or any listener on a loopback port."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Mapping
from typing import Any


def broker_answers(bootstrap: str, timeout: float = 3.0, options: Mapping[str, Any] | None = None) -> bool:
    """True when a Kafka broker at ``bootstrap`` answers a metadata request.

    ``options`` are aiokafka client options (``arbiter.edge.kafkaauth.kafka_client_options``):
    a SASL listener answers only a client that logs in.
    """
    return broker_count(bootstrap, timeout, options) > 0


def broker_count(bootstrap: str, timeout: float = 3.0, options: Mapping[str, Any] | None = None) -> int:
    """How many brokers the metadata of the first broker at ``bootstrap`` that answers names (0: none answers)."""
    from aiokafka import AIOKafkaClient
    from aiokafka.errors import KafkaError

    # A probe that fails is an answer, not an error worth aiokafka's log lines, nor the connection
    # guard's "unreachable, reconnecting" (the caller says no Kafka answers, once, and does not retry).
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    guard = logging.getLogger("arbiter.kafka")
    level = guard.level

    async def probe() -> int:
        client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000),
                                **dict(options or {}))
        try:
            await asyncio.wait_for(client.bootstrap(), timeout)
            return len(client.cluster.brokers())
        except (TimeoutError, KafkaError, OSError):
            return 0
        finally:
            await client.close()

    guard.setLevel(max(level, logging.ERROR))
    try:
        return asyncio.run(probe())
    finally:
        guard.setLevel(level)


def port_open(port: int) -> bool:
    """True when something accepts connections on ``127.0.0.1:port`` (another process holds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0
