"""Every Kafka connection Arbiter makes: capped backoff with jitter, never to itself, quiet logs.

aiokafka reconnects as fast as a refused connection fails: with the broker down, a worker's
consumer, producer and coordinator retried ~3,000 times a second and logged each attempt. And a
client that connects to a port on this host that nothing listens on can be handed that same port
as its own (Linux picks source ports in ``net.ipv4.ip_local_port_range``, 32768-60999 by
default): a TCP "simultaneous open" connects the socket to itself, the client reads its own
requests back (``CorrelationIdError``) and the broker that comes back cannot bind its port.

:func:`install` wraps aiokafka's one connection factory (``aiokafka.client.create_conn``, which
bootstrap, metadata, coordinator and fetch connections all go through) so that, per address:

- after a failed connect the next waits ``BACKOFF_START`` doubling to ``BACKOFF_CAP``, with
  +-20% jitter (Kafka's own ``reconnect.backoff.ms`` / ``reconnect.backoff.max.ms`` scheme);
- a socket connected to itself is closed at once and counts as a failed connect;
- the state changes are logged once each on ``arbiter.kafka``: unreachable, still unreachable
  every ``STILL_DOWN_EVERY`` seconds, reachable again;

and puts a :class:`Repeats` filter on aiokafka's loggers, so each of their messages appears at
most once per ``REPEAT_WINDOW`` seconds, with a count of the ones held back.

It is installed by :func:`arbiter.edge.kafkaauth.kafka_client_options`, which every Kafka client
Arbiter makes passes its options through; installing twice does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("arbiter.kafka")

T = TypeVar("T")

BACKOFF_START = 0.05
"""Seconds before the first reconnect after a failed connect (Kafka: reconnect.backoff.ms=50)."""
BACKOFF_CAP = 1.0
"""The most seconds between two connects to one address (Kafka: reconnect.backoff.max.ms=1000)."""
STILL_DOWN_EVERY = 30.0
"""Seconds between two "still unreachable" lines for one address."""
REPEAT_WINDOW = 30.0
"""Each aiokafka message is logged at most once in this many seconds."""

EPHEMERAL_DEFAULT = (32768, 60999)


def ephemeral_ports(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """This host's range of source ports for outgoing connections (Linux's default when unknown)."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT
    return low, high


def in_ephemeral_range(port: int) -> bool:
    low, high = ephemeral_ports()
    return low <= port <= high


@dataclass
class _Address:
    """What the connections to one ``host:port`` have met."""

    failures: int = 0
    next_try: float = 0.0
    down_since: float | None = None
    reported: float = 0.0
    attempts: int = 0


_addresses: dict[tuple[str, int], _Address] = {}
_original: Any = None


def backoff(failures: int) -> float:
    """Seconds to wait after ``failures`` failed connects in a row: doubling, capped, jittered."""
    if failures <= 0:
        return 0.0
    base = min(BACKOFF_CAP, BACKOFF_START * 2.0 ** min(failures - 1, 30))
    return base * random.uniform(0.8, 1.2)


def connected_to_itself(conn: Any) -> bool:
    """Whether an aiokafka connection's socket has the same address at both ends."""
    writer = getattr(conn, "_writer", None)
    if writer is None:
        return False
    local, remote = writer.get_extra_info("sockname"), writer.get_extra_info("peername")
    return local is not None and remote is not None and tuple(local[:2]) == tuple(remote[:2])


def describe(exc: BaseException) -> str:
    """``Type: message`` once (aiokafka's errors already start with their type's name)."""
    name, text = type(exc).__name__, str(exc)
    if not text:
        return name
    return text if text.startswith(name) else f"{name}: {text}"


class SelfConnection(ConnectionError):
    """A connect to a local port nothing listens on was handed that port as its own source port."""


async def _guarded_create_conn(host: str, port: int, **options: Any) -> Any:
    state = _addresses.setdefault((host, port), _Address())
    wait = state.next_try - time.monotonic()
    if wait > 0:
        await asyncio.sleep(wait)
    state.attempts += 1
    try:
        conn = await _original(host, port, **options)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        _failed(state, host, port, exc)
        raise
    if connected_to_itself(conn):
        conn.close()
        looped = SelfConnection(
            f"the connection to {host}:{port} was connected to itself (nothing listens there, and the port "
            "lies in this host's ephemeral range); closed it so the broker can bind the port")
        _failed(state, host, port, looped)
        raise looped
    _succeeded(state, host, port)
    return conn


def _failed(state: _Address, host: str, port: int, exc: BaseException) -> None:
    now = time.monotonic()
    state.failures += 1
    state.next_try = now + backoff(state.failures)
    why = describe(exc)
    if state.down_since is None:
        state.down_since = state.reported = now
        state.attempts = 1
        log.warning("Kafka at %s:%d is unreachable (%s); reconnecting with backoff up to %g s",
                    host, port, why, BACKOFF_CAP)
    elif now - state.reported >= STILL_DOWN_EVERY:
        state.reported = now
        log.warning("Kafka at %s:%d still unreachable after %.0f s (%d attempts; last: %s)",
                    host, port, now - state.down_since, state.attempts, why)


def _succeeded(state: _Address, host: str, port: int) -> None:
    if state.down_since is not None:
        log.warning("Kafka at %s:%d reachable again after %.0f s (%d attempts)",
                    host, port, time.monotonic() - state.down_since, state.attempts)
    state.failures = 0
    state.next_try = 0.0
    state.down_since = None
    state.attempts = 0


def unreachable() -> list[str]:
    """The addresses this process currently cannot connect to."""
    return [f"{host}:{port}" for (host, port), state in _addresses.items() if state.down_since is not None]


class Repeats(logging.Filter):
    """Let a message (by logger and format string) through at most once per ``window`` seconds.

    The first one held back after a pass is counted; the next one let through says how many were.
    """

    def __init__(self, window: float = REPEAT_WINDOW) -> None:
        super().__init__()
        self.window = window
        self.seen: dict[tuple[str, str], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, str(record.msg))
        now = time.monotonic()
        last = self.seen.get(key)
        if last is not None and now - last[0] < self.window:
            self.seen[key] = (last[0], last[1] + 1)
            return False
        held = last[1] if last is not None else 0
        self.seen[key] = (now, 0)
        if held and last is not None:
            record.msg = f"{record.msg} (and {held} more like it in the last {now - last[0]:.0f} s)"
        return True


_repeats = Repeats()


def install() -> None:
    """Guard aiokafka's connections and quieten its loggers, once per process."""
    global _original
    if _original is not None:
        return
    import aiokafka.admin
    import aiokafka.client
    import aiokafka.consumer.fetcher
    import aiokafka.consumer.group_coordinator
    import aiokafka.producer.sender

    _original = aiokafka.client.create_conn
    aiokafka.client.create_conn = _guarded_create_conn
    for name in list(logging.root.manager.loggerDict):
        if name == "aiokafka" or name.startswith("aiokafka."):
            logger = logging.getLogger(name)
            if _repeats not in logger.filters:
                logger.addFilter(_repeats)


CLOSE_TIMEOUT = 3.0
"""Seconds a Kafka client is given to close cleanly (flush, leave its group) before its
connections are closed under it: a producer with unsent records and no broker would otherwise
wait out its request timeout (40 s)."""


async def close_client(client: Any, timeout: float = CLOSE_TIMEOUT) -> None:
    """Stop an aiokafka producer or consumer (``stop``) or admin client (``close``) within
    ``timeout``, whatever the broker's state; never raises but for this task's own cancellation.

    aiokafka's consumer ``stop`` can raise the ``CancelledError`` of the fetches it cancels itself
    (aio-libs/aiokafka#647) and leave its connections open; a producer's ``stop`` waits for unsent
    records. Either way what is left is closed here, so no "Unclosed AIOKafka..." warning follows.
    """
    stop = getattr(client, "stop", None) or client.close
    stopping = asyncio.ensure_future(stop())
    deadline = time.monotonic() + timeout
    try:
        while not (await asyncio.wait({stopping}, timeout=max(0.0, min(0.5, deadline - time.monotonic()))))[0]:
            if time.monotonic() >= deadline:
                log.info("a Kafka client did not close within %g s; closing its connections", timeout)
                break
            _cancel_fetch_routine(client)
        if stopping.done():
            stopping.result()
            return  # closed cleanly
    except asyncio.CancelledError:
        me = asyncio.current_task()
        if me is not None and me.cancelling():
            stopping.cancel()
            raise
    except Exception as exc:
        log.info("closing a Kafka client: %s", exc)
    _cancel_fetch_routine(client)
    if not stopping.done():
        stopping.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await stopping
    sender = getattr(client, "_sender", None)
    task = getattr(sender, "sender_task", None)
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    inner = getattr(client, "_client", None) or getattr(client, "client", None)
    if inner is not None and hasattr(inner, "close"):
        with contextlib.suppress(Exception):
            await asyncio.wait_for(inner.close(), timeout)
    if hasattr(client, "_closed"):
        client._closed = True  # what stop() would have set had it finished


def _cancel_fetch_routine(client: Any) -> None:
    """A consumer's fetch routine cancelled while it waits for fetches it cancelled itself swallows its
    own cancellation and fetches on (aio-libs/aiokafka#983, #1007); cancel it until it ends."""
    routine = getattr(getattr(client, "_fetcher", None), "_fetch_task", None)
    if routine is not None and not routine.done() and getattr(client, "_closed", False):
        routine.cancel()


@contextlib.asynccontextmanager
async def started(client: T) -> AsyncIterator[T]:
    """``async with started(AIOKafkaProducer(...)) as producer``: started, and closed on the way out
    (by :func:`close_client`), a failed start included."""
    try:
        await client.start()  # type: ignore[attr-defined]  # any aiokafka client: they share no base that has start
        yield client
    finally:
        await close_client(client)
