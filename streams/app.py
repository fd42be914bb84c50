"""The faust application: settings reviewed for latency, and the processors wired up.

Processors stay thin: decode (dead-lettering what does not decode), hand the command
to a pure decision function, send the events it returns. Nothing else lives here.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import faust

from arbiter.contract import Cause, ContractError, Ping, Pong, Record, default_codec
from arbiter.settings import Settings

from .deadletter import dead_letter
from .transport import Transport

RESOURCE_PROCESSOR = "resource"


class ArbiterApp(faust.App):
    """faust App that uses Arbiter's transport (see ``streams.transport``)."""

    arbiter_fetch_max_wait_ms: int | None = None

    def _new_transport(self) -> Any:
        return Transport(self.conf.broker_consumer, self)


def worker_id(settings: Settings) -> str:
    """This worker's name in answers and diagnostics."""
    return settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"


def faust_settings(settings: Settings) -> dict[str, Any]:
    """faust settings, each chosen for Arbiter (README "Worker tuning" says why)."""
    settings.home.mkdir(parents=True, exist_ok=True)
    return {
        "broker": [f"kafka://{server}" for server in settings.bootstrap_list()],
        "processing_guarantee": settings.processing_guarantee,
        "topic_partitions": settings.partitions,
        "topic_replication_factor": settings.replication_factor,
        "broker_commit_interval": settings.commit_interval,
        "broker_session_timeout": settings.session_timeout,
        "broker_heartbeat_interval": settings.heartbeat_interval,
        "producer_linger_ms": settings.producer_linger_ms,
        "producer_max_request_size": 2 * settings.max_message_bytes,
        "consumer_auto_offset_reset": "earliest",
        "web_enabled": settings.web_port != 0,
        "web_port": settings.web_port or 6066,
        "datadir": str((settings.home / "worker-data").resolve()),
    }


def create_app(settings: Settings) -> ArbiterApp:
    """Build the faust app and register every processor."""
    app = ArbiterApp(settings.app_id, **faust_settings(settings))
    app.arbiter_fetch_max_wait_ms = settings.fetch_max_wait_ms
    codec = default_codec(settings.max_message_bytes)
    me = worker_id(settings)

    def raw_topic(name: str) -> Any:
        return app.topic(name, key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")

    commands = raw_topic(settings.topics.resource_commands)
    inbox = raw_topic(settings.topics.agent_inbox)
    dead_letters = raw_topic(settings.topics.dead_letter)

    async def send(topic: Any, key: str, record: Record) -> None:
        await topic.send(key=key.encode(), value=codec.encode(record))

    async def decode_or_dead_letter(event: Any, processor: str) -> tuple[Record, Cause] | None:
        msg = event.message
        cause = Cause(topic=msg.topic, partition=msg.partition, offset=msg.offset)
        try:
            return codec.decode(event.value), cause
        except ContractError as error:
            letter = dead_letter(
                error, processor=processor, source=cause, key=event.key, value=bytes(event.value or b""),
                now_ms=time.time_ns() // 1_000_000, max_message_bytes=settings.max_message_bytes,
            )
            await dead_letters.send(key=event.key, value=codec.encode(letter))
            app.log.warning("dead-lettered %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, error)
            return None

    @app.agent(commands, name=RESOURCE_PROCESSOR)
    async def resource_processor(stream: Any) -> None:
        async for event in stream.events():
            decoded = await decode_or_dead_letter(event, RESOURCE_PROCESSOR)
            if decoded is None:
                continue
            command, cause = decoded
            now_ms = time.time_ns() // 1_000_000
            if isinstance(command, Ping):
                pong = Pong(ping_id=command.ping_id, agent_id=command.agent_id, worker_id=me,
                            decided_at_ms=now_ms, cause=cause)
                await send(inbox, command.agent_id, pong)
                continue
            # No decision core handles this command type in this version: keep it, say why.
            error = ContractError("unsupported_command", f"{type(command).__name__} has no handler in this worker")
            letter = dead_letter(error, processor=RESOURCE_PROCESSOR, source=cause, key=event.key,
                                 value=bytes(event.value), now_ms=now_ms,
                                 max_message_bytes=settings.max_message_bytes)
            await dead_letters.send(key=event.key, value=codec.encode(letter))

    return app
