"""The connection guard every Arbiter Kafka client goes through (``arbiter.edge.kafkaconn``), without a
broker: reconnects back off (doubling, capped, jittered), a socket connected to itself is refused, the
state changes are logged once each, aiokafka's repeats are held back, and a client closes within its
budget with no resource warning, whatever it was doing."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import socket
import time
import warnings
from typing import Any

import pytest

from arbiter.edge import kafkaconn
from arbiter.edge.kafkaconn import Repeats, backoff, close_client, connected_to_itself, started


def test_backoff_doubles_to_its_cap_with_jitter() -> None:
    assert backoff(0) == 0.0
    for failures, base in [(1, 0.05), (2, 0.1), (3, 0.2), (5, 0.8), (6, 1.0), (60, 1.0)]:
        waits = [backoff(failures) for _ in range(200)]
        assert all(0.8 * base - 1e-9 <= w <= 1.2 * base + 1e-9 for w in waits), (failures, min(waits), max(waits))
        assert max(waits) - min(waits) > 0.1 * base, "jittered, so clients that failed together spread out"


class _Conn:
    def __init__(self, writer: Any) -> None:
        self._writer = writer
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _self_connected() -> socket.socket:
    """A TCP socket connected to itself: bound to a free port, then connected to that same port (a
    "simultaneous open", what the kernel can do to a client that connects to a port nothing listens on)."""
    for _ in range(20):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        try:
            sock.connect(sock.getsockname())
            return sock
        except OSError:
            sock.close()
    raise AssertionError("could not make a self-connected socket")


async def test_a_socket_connected_to_itself_is_recognised_and_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    looped = _self_connected()
    _reader, writer = await asyncio.open_connection(sock=looped)
    try:
        assert connected_to_itself(_Conn(writer))
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _r2, normal = await asyncio.open_connection("127.0.0.1", port)
        assert not connected_to_itself(_Conn(normal))
        normal.close()
        server.close()

        handed = _Conn(writer)

        async def original(host: str, port: int, **_options: Any) -> _Conn:
            return handed

        monkeypatch.setattr(kafkaconn, "_original", original)
        monkeypatch.setattr(kafkaconn, "_addresses", {})
        host, where = looped.getsockname()
        with pytest.raises(kafkaconn.SelfConnection, match="connected to itself"):
            await kafkaconn._guarded_create_conn(host, where)
        assert handed.closed, "the looped connection is closed at once, freeing the port for the broker"
        assert kafkaconn.unreachable() == [f"{host}:{where}"]
    finally:
        writer.close()


async def test_reconnects_back_off_and_each_state_change_is_logged_once(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(kafkaconn, "BACKOFF_START", 0.01)
    monkeypatch.setattr(kafkaconn, "BACKOFF_CAP", 0.08)
    monkeypatch.setattr(kafkaconn, "_addresses", {})
    attempts: list[float] = []
    up = False

    async def original(host: str, port: int, **_options: Any) -> _Conn:
        attempts.append(time.monotonic())
        if not up:
            raise ConnectionRefusedError(111, "Connection refused")
        return _Conn(None)

    monkeypatch.setattr(kafkaconn, "_original", original)
    caplog.set_level(logging.INFO, logger="arbiter.kafka")
    for _ in range(8):  # what aiokafka does: try again at once, as often as it can
        with pytest.raises(ConnectionRefusedError):
            await kafkaconn._guarded_create_conn("127.0.0.1", 1)
    gaps = [b - a for a, b in itertools.pairwise(attempts)]
    assert gaps[0] >= 0.008 and all(g >= 0.8 * 0.08 - 0.002 for g in gaps[4:]), gaps
    assert gaps[-1] <= 0.08 * 1.2 + 0.05, f"capped: {gaps}"
    up = True
    await kafkaconn._guarded_create_conn("127.0.0.1", 1)
    lines = [r.getMessage() for r in caplog.records if r.name == "arbiter.kafka"]
    assert len(lines) == 2, lines
    assert "127.0.0.1:1 is unreachable" in lines[0] and "reachable again" in lines[1] and "9 attempts" in lines[1]
    assert kafkaconn.unreachable() == []


def test_repeated_messages_are_held_back_and_counted() -> None:
    repeats = Repeats(window=0.2)

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("aiokafka", logging.ERROR, __file__, 1, msg, ("x",), None)

    assert repeats.filter(record("Unable connect to node %s"))
    assert not any(repeats.filter(record("Unable connect to node %s")) for _ in range(50))
    assert repeats.filter(record("Another message %s")), "each message on its own"
    time.sleep(0.25)
    later = record("Unable connect to node %s")
    assert repeats.filter(later)
    assert "(and 50 more like it in the last" in later.getMessage()


async def test_a_client_that_cannot_reach_kafka_closes_at_once_without_a_warning() -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.errors import KafkaConnectionError

    nobody = f"127.0.0.1:{_closed_port()}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for make in (lambda: AIOKafkaProducer(bootstrap_servers=nobody),
                     lambda: AIOKafkaConsumer(bootstrap_servers=nobody, group_id=None)):
            started_at = time.monotonic()
            with pytest.raises(KafkaConnectionError):
                async with started(make()):
                    raise AssertionError("it started with no broker")
            assert time.monotonic() - started_at < kafkaconn.CLOSE_TIMEOUT + 5
            never = make()
            await close_client(never, timeout=1.0)  # never started: closing it is harmless
        gc.collect()
    unclosed = [str(w.message) for w in caught if "Unclosed" in str(w.message)]
    assert not unclosed, unclosed


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
