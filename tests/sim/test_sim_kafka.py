"""The simulation's foundations: virtual time, and the simulated Kafka keeping the seam's contract.

Pure tier: no broker, no wall-clock waits. The properties are the ones the real clients keep
(``tests/edge/test_kafkaio_contract.py``), so what runs on the simulated log behaves as on Kafka.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arbiter.edge.clock import now_ms
from arbiter.edge.kafkaio import KafkaIOError, Reader, Received, Sender, TopicPartition
from arbiter.schemas.partitioning import partition_for
from arbiter.sim import EPOCH_MS, Faults, SimKafka, SimReader, SimSender, SimStuck, run
from arbiter.sim.kafka import SimProducer


def test_a_thirty_second_lease_expires_in_no_time() -> None:
    async def main() -> tuple[int, int]:
        start = now_ms()
        await asyncio.sleep(30)
        waited = now_ms()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 5)
        return waited - start, now_ms() - start

    began = time.monotonic()
    assert run(main()) == (30_000, 35_000)
    assert time.monotonic() - began < 1.0
    assert abs(now_ms() - time.time() * 1000) < 60_000, "the wall clock is back once the run ends"


def test_a_run_where_everyone_waits_forever_is_stuck_not_hung() -> None:
    async def main() -> None:
        await asyncio.Event().wait()

    with pytest.raises(SimStuck):
        run(main())


def test_a_background_failure_is_raised_not_lost() -> None:
    kafka = SimKafka()

    async def broken() -> None:
        await asyncio.sleep(1)
        raise ValueError("the coordinator broke")

    async def main() -> None:
        kafka.spawn(broken())
        await asyncio.Event().wait()  # waits for what the broken task would have done

    with pytest.raises(SimStuck) as stuck:
        run(main())
    assert isinstance(stuck.value.__cause__, ValueError)


def test_the_clock_starts_where_a_simulation_says() -> None:
    async def main() -> int:
        return now_ms()

    assert run(main()) == EPOCH_MS
    assert run(main(), start_ms=5_000) == 5_000


async def _read_until(reader: Reader, count: int) -> list[Received]:
    got: list[Received] = []
    while len(got) < count:
        got.extend(await reader.read(1.0))
    got.extend(await reader.read(0.5))  # anything extra shows up here
    return got


def test_a_record_sent_is_read_back_whole_once_on_its_keys_partition() -> None:
    kafka = SimKafka()
    kafka.create_topic("inbox", 2)

    async def main() -> list[Received]:
        sender: Sender = SimSender(kafka)
        reader: Reader = SimReader(kafka)
        await sender.start()
        await reader.start()
        for p in (0, 1):
            reader.add("inbox", p, await reader.end_offset("inbox", p))
        for i in range(20):
            await sender.send("inbox", f"agent-{i}".encode(), f"v{i}".encode(), [("sig", bytes([i]))])
        return await _read_until(reader, 20)

    got = run(main())
    assert sorted(r.value for r in got) == sorted(f"v{i}".encode() for i in range(20))
    for r in got:
        assert r.partition == partition_for(r.key or b"", 2)
        assert r.timestamp == EPOCH_MS  # appended at once: no virtual time passed
        assert r.headers[0][0] == "sig"


def test_a_reader_starts_where_told_stops_when_dropped_and_knows_nothing_it_does_not_read() -> None:
    kafka = SimKafka()
    kafka.create_topic("t", 1)
    for i in range(5):
        kafka.append("t", 0, b"k", bytes([i]), [])

    async def main() -> tuple[list[int], list[int], int]:
        reader = SimReader(kafka)
        reader.add("t", 0, 2)
        first = [r.offset for r in await reader.read(0)]
        position = await reader.position("t", 0)
        reader.drop("t", 0)
        kafka.append("t", 0, b"k", b"late", [])
        after_drop = [r.offset for r in await reader.read(0.1)]
        with pytest.raises(KafkaIOError):
            await reader.position("t", 0)
        return first, after_drop, position

    assert run(main()) == ([2, 3, 4], [], 5)


def test_an_outage_refuses_every_call_as_retriable_then_passes() -> None:
    kafka = SimKafka(faults=Faults(outages=((1.0, 3.0),)))
    kafka.create_topic("t", 1)

    async def main() -> list[str]:
        sender = SimSender(kafka)
        seen = []
        for _ in range(5):
            try:
                await sender.send("t", b"k", b"v", None)
                seen.append("sent")
            except KafkaIOError as exc:
                assert exc.retriable
                seen.append("refused")
            await asyncio.sleep(1)
        return seen

    assert run(main()) == ["sent", "refused", "refused", "sent", "sent"]


def _busy_log(seed: int) -> list[tuple[int, bytes, int]]:
    """Six senders at once with delays and lost acknowledgements, under one seed: the log they leave."""
    kafka = SimKafka(rng=random.Random(seed), faults=Faults(send_delay_s=0.05, duplicate_p=0.2))
    kafka.create_topic("t", 2)

    async def sender(n: int) -> None:
        out = SimSender(kafka)
        for i in range(10):
            await out.send("t", f"s{n}".encode(), f"{n}:{i}".encode(), None)

    async def main() -> None:
        await asyncio.gather(*(sender(n) for n in range(6)))

    run(main())
    return [(r.partition, r.value or b"", r.timestamp) for p in (0, 1) for r in kafka.records("t", p)]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32))
def test_one_seed_one_log_and_each_senders_records_land_in_its_order(seed: int) -> None:
    """The same seed replays the same interleaving, to the millisecond; a send that lands twice lands next to
    itself (a retry), and one sender's records keep their order (it waits for each)."""
    log = _busy_log(seed)
    assert _busy_log(seed) == log
    for n in range(6):
        mine = [int(v.split(b":")[1]) for _p, v, _t in log if v.startswith(f"{n}:".encode())]
        assert sorted(set(mine)) == list(range(10))
        assert [i for k, i in enumerate(mine) if k == 0 or i != mine[k - 1]] == list(range(10))


def test_different_seeds_interleave_differently() -> None:
    assert len({tuple(_busy_log(seed)) for seed in range(5)}) > 1


def test_committed_offsets_are_what_a_group_committed() -> None:
    kafka = SimKafka()
    kafka.create_topic("t", 2)
    kafka.committed["workers"] = {TopicPartition("t", 1): 7}

    async def main() -> dict[TopicPartition, int]:
        return await SimReader(kafka).committed("workers", [TopicPartition("t", 0), TopicPartition("t", 1)])

    assert run(main()) == {TopicPartition("t", 1): 7}


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32))
def test_a_workers_produces_land_in_order_even_when_a_caller_stops_waiting(seed: int) -> None:
    """A worker's produce lands a while later (``Faults.produce_s``), each after the one before, also when the
    caller of one stopped waiting for it (its future cancelled, as a cancelled gather does): what was queued is
    still sent, in its place. A crash loses what had not landed, and nothing after it lands."""
    kafka = SimKafka(rng=random.Random(seed), faults=Faults(produce_s=0.2))
    kafka.create_topic("t", 1)

    async def main() -> list[bytes | None]:
        producer = SimProducer(kafka, owner="w1")
        futures = [await producer.produce([("t", 0, None, f"{n}".encode(), [])]) for n in range(20)]
        for n in random.Random(seed).sample(range(20), 5):
            futures[n].cancel()
        await asyncio.sleep(5.0)
        later = [await producer.produce([("t", 0, None, f"{n}".encode(), [])]) for n in range(20, 30)]
        await asyncio.sleep(0.01)
        kafka.kill("w1")
        await asyncio.sleep(5.0)
        assert all(f.done() for f in later)
        return [r.value for r in kafka.records("t", 0)]

    values = [int(v or b"") for v in run(main())]
    assert values == list(range(len(values))) and 20 <= len(values) <= 30
