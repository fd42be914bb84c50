"""Transport faults reach an agent as Arbiter errors that say whether to retry, and the SDK
retries by itself what is safe to retry (every command's id is decided once)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest
from aiokafka.errors import KafkaError

from arbiter.agents import ArbiterClient, ArbiterError, ArbiterUnavailable
from arbiter.edge.settings import Settings
from arbiter.kafka import LocalKafka
from arbiter.processes import WorkerPool, free_port, wait_until_served
from arbiter.schemas.partitioning import key_for_partition
from arbiter.streams.runtime.topics import ensure_topics
from tests.conftest import assert_clean_audit, isolated_settings, share_broker_jars


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _private_broker(home: Path) -> LocalKafka:
    """A broker of the test's own on free ports (it gets killed), with the main broker's jars."""
    port = free_port()
    own = Settings(home=home, kafka_port=port, kafka_controller_port=free_port(), bootstrap=f"127.0.0.1:{port}",
                   kafka_heap="384m")
    share_broker_jars(home)
    return LocalKafka(own)


@pytest.mark.e2e
@pytest.mark.kafka
async def test_a_dead_broker_is_a_retriable_arbiter_error_and_a_patient_send_goes_through(tmp_path: Path) -> None:
    broker = _private_broker(tmp_path / "broker")
    await asyncio.to_thread(broker.up)
    settings = isolated_settings(broker.bootstrap, tmp_path / "arbiter", send_retry_seconds=2.0)
    patient = settings.model_copy(update={"send_retry_seconds": 120.0})
    pool = WorkerPool(settings)
    try:
        await ensure_topics(settings)
        pool.start(1)
        async with ArbiterClient("prober", settings) as client:
            keys = [key_for_partition(p, settings.partitions) for p in range(settings.partitions)]
            await wait_until_served(client, pool, keys)
        async with ArbiterClient("hasty", settings) as hasty, ArbiterClient("patient", patient) as calm:
            lease = await hasty.acquire("fault:1", ttl=120)
            pid = broker.pid()
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while _listening(broker.settings.kafka_port):
                assert time.monotonic() < deadline, "the killed broker still listens"
                await asyncio.sleep(0.1)

            # No broker: the hasty agent's call fails within its retry budget, as an Arbiter error
            # that says it may be retried, never as aiokafka's own exception.
            started = time.monotonic()
            with pytest.raises(ArbiterError) as caught:
                await hasty.renew(lease, timeout=5)
            assert caught.value.retriable, repr(caught.value)
            assert not isinstance(caught.value, KafkaError)
            assert isinstance(caught.value, ArbiterUnavailable | TimeoutError), repr(caught.value)
            assert time.monotonic() - started < 15

            # The patient agent's acquire, sent while no broker answers, goes through by itself
            # once the broker is back (same data: nothing acknowledged is lost).
            waiting = asyncio.create_task(calm.acquire("fault:2", ttl=120, wait=0))
            await asyncio.sleep(0)  # the send is under way before the broker returns
            await asyncio.to_thread(broker.up)
            granted = await asyncio.wait_for(waiting, 120)
            assert granted.token == 1

            # And the hasty agent's retry of its refused call succeeds: its lease is still its own.
            await hasty.renew(lease, timeout=30)
            assert not lease.lost
            await hasty.release(lease)
            await calm.release(granted)
        pool.check_alive()  # the worker carried on by itself
        await assert_clean_audit(settings)
    finally:
        pool.stop()
        await asyncio.to_thread(broker.down)
