"""The floor under a grant, measured with the client Arbiter uses (``arbiter.edge.kafkaio``).

A grant on the topics is two hops: the SDK produces a command, a worker reads it and produces the
answer, the SDK reads the answer. These take away everything Arbiter adds (signing, deciding, the
changelog and the commit), so a grant's latency can be read against what Kafka itself costs here:

- ``one_produce``: one record produced (acks=all) until acknowledged;
- ``two_hops``: one record produced; a relay, a process of its own (``python -m bench.floor relay``),
  reads it and produces it to a second topic; the caller has it back. Sequential, one in flight.

Each on topics of its own, deleted at the end. ``python -m bench.floor [COUNT]`` prints both.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator

from arbiter.edge.kafkaio import reader_for, sender_for
from arbiter.edge.settings import Settings, Topics, load_settings
from arbiter.processes import settings_env
from arbiter.streams.runtime.topics import delete_topics_named, ensure_topics

PAYLOAD = b"x" * 200
"""About a command's size."""


@contextlib.asynccontextmanager
async def _topics(settings: Settings) -> AsyncIterator[Settings]:
    """Settings whose topics are a fresh set (``into`` and ``back`` are two of them), deleted after."""
    run = f"floor{time.time_ns()}"
    own = settings.model_copy(update={"topics": Topics(**{n: f"{run}.{n}" for n in Topics.model_fields}),
                                      "partitions": 1})
    await ensure_topics(own)
    try:
        yield own
    finally:
        with contextlib.suppress(Exception):
            await delete_topics_named(own, (f"{run}.",))


async def one_produce(settings: Settings, count: int, pause: float = 0.01) -> list[float]:
    """Milliseconds from producing one record to its acknowledgement, ``count`` times."""
    async with _topics(settings) as own:
        sender = sender_for(own)
        await sender.start()
        try:
            samples = []
            for i in range(count):
                started = time.perf_counter()
                await sender.send(own.topics.resource_commands, str(i).encode(), PAYLOAD, None)
                samples.append((time.perf_counter() - started) * 1000)
                await asyncio.sleep(pause)
            return samples
        finally:
            await sender.stop()


async def two_hops(settings: Settings, count: int, pause: float = 0.01) -> list[float]:
    """Milliseconds from producing one record to reading it back after a relay process forwarded it."""
    async with _topics(settings) as own:
        into, back = own.topics.resource_commands, own.topics.agent_inbox
        relay = await asyncio.to_thread(subprocess.Popen, [sys.executable, "-m", "bench.floor", "relay", into, back],
                                        env=settings_env(own), stdout=subprocess.PIPE, text=True)
        sender, reader = sender_for(own), reader_for(own)
        await sender.start()
        await reader.start()
        try:
            assert relay.stdout is not None
            await asyncio.to_thread(relay.stdout.readline)  # "ready": it reads from the end of ``into``
            reader.add(back, 0, await reader.end_offset(back, 0))
            samples = []
            for i in range(count):
                started = time.perf_counter()
                await sender.send(into, str(i).encode(), PAYLOAD, None)
                while not await reader.read(5.0):
                    if relay.poll() is not None:
                        raise RuntimeError(f"the relay stopped (exit {relay.returncode})")
                samples.append((time.perf_counter() - started) * 1000)
                await asyncio.sleep(pause)
            return samples
        finally:
            relay.terminate()
            await asyncio.to_thread(relay.wait, 10)
            await sender.stop()
            await reader.stop()


async def relay(into: str, back: str) -> None:
    """Forward every record of ``into`` (from its end as of now) to ``back``, one at a time, until killed."""
    settings = load_settings()
    sender, reader = sender_for(settings), reader_for(settings)
    await sender.start()
    await reader.start()
    reader.add(into, 0, await reader.end_offset(into, 0))
    print("ready", flush=True)
    while True:
        for record in await reader.read(1.0):
            await sender.send(back, record.key or b"", record.value or b"", None)


def quantile(samples: list[float], q: int) -> float:
    """The ``q``-th percentile."""
    return samples[0] if len(samples) == 1 else statistics.quantiles(samples, n=100, method="inclusive")[q - 1]


async def _print(count: int) -> None:
    settings = load_settings()
    for name, measure in (("one acknowledged produce", one_produce), ("two hops through a relay", two_hops)):
        samples = await measure(settings, count)
        print(f"floor: {name} (librdkafka, the SDK's client; n={count}): p50 {quantile(samples, 50):.2f} ms, "
              f"p99 {quantile(samples, 99):.2f} ms")


def main(argv: list[str]) -> None:
    if argv[:1] == ["relay"]:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(relay(argv[1], argv[2]))
        return
    asyncio.run(_print(int(argv[0]) if argv else 400))


if __name__ == "__main__":
    main(sys.argv[1:])
