"""The fetch-wait override relies on an aiokafka detail; this fails if aiokafka changes it."""

from __future__ import annotations

import inspect

from aiokafka import AIOKafkaConsumer
from faust.transport.drivers import aiokafka as faust_aiokafka

from arbiter.edge.settings import Settings
from arbiter.schemas.identity import Signer
from bench.faust import faust_app, faust_settings
from bench.faust.transport import Consumer, Transport


async def test_aiokafka_reads_the_fetch_wait_from_the_attribute_we_set() -> None:
    consumer = AIOKafkaConsumer(fetch_max_wait_ms=123)
    assert consumer._fetch_max_wait_ms == 123
    assert "fetch_max_wait_ms=self._fetch_max_wait_ms" in inspect.getsource(AIOKafkaConsumer.start)


WORKER_KEY = Signer.generate("worker").private_pem().decode()
"""A worker identity from a secret store (no key file, no registry: these tests start no worker)."""


def test_faust_still_hard_codes_its_fetch_wait() -> None:
    # When this fails, faust exposes the setting: drop streams/transport.py and use it.
    source = inspect.getsource(faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer)
    assert "fetch_max_wait_ms=1500" in source


def test_app_uses_arbiter_transport_and_tuned_settings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(home=tmp_path, fetch_max_wait_ms=7, commit_interval=0.3, identity_key=WORKER_KEY)
    app = faust_app(settings)
    assert isinstance(app.transport, Transport)
    assert app.transport.Consumer is Consumer
    assert app.arbiter_fetch_max_wait_ms == 7
    assert app.conf.broker_commit_interval == 0.3
    assert app.conf.broker_session_timeout == settings.session_timeout
    assert faust_settings(settings)["processing_guarantee"] == "at_least_once"


async def test_the_worker_consumer_really_gets_our_fetch_wait(tmp_path) -> None:  # type: ignore[no-untyped-def]
    app = faust_app(Settings(home=tmp_path, fetch_max_wait_ms=7, identity_key=WORKER_KEY))
    consumer = app.consumer._thread._create_worker_consumer(app.transport)
    try:
        assert consumer._fetch_max_wait_ms == 7
    finally:
        await consumer.stop()


def test_the_gap_guard_sees_skipped_offsets_only_within_a_generation() -> None:
    from bench.faust.transport import GapGuard

    guard = GapGuard()
    assert guard.observe("commands", 0, 1, 28) is None  # first delivery of the generation
    assert guard.observe("commands", 0, 1, 29) is None
    assert guard.observe("commands", 0, 1, 32) == (30, 31), "30 and 31 were skipped"
    assert guard.observe("commands", 1, 1, 5) is None, "partitions are independent"
    assert guard.observe("commands", 0, 1, 30) is None, "after a restart or seek, the hole is read again"
    assert guard.observe("commands", 0, 1, 28) is None, "a redelivery after a seek back is no hole"
    assert guard.observe("commands", 0, 2, 40) is None, "a new generation starts at its committed offset"
    assert guard.observe("commands", 0, 2, 42) == (41, 41)


def test_a_hole_still_there_after_the_restart_is_let_through() -> None:
    from bench.faust.transport import GapGuard

    guard = GapGuard(permanent=GapGuard.describe("commands", 0, 30))
    assert guard.observe("commands", 0, 1, 29) is None
    assert guard.observe("commands", 0, 1, 32) is None, "the hole the worker restarted for: real, let through"
    assert guard.observe("commands", 0, 1, 35) == (33, 34), "any other hole still restarts"
