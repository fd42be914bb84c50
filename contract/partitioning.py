"""Which partition a key lands on: the one rule that keeps topics co-partitioned.

Producers (the SDK, the workers), the audit and the expiry index must all agree on it,
so it lives here, once: Kafka's default murmur2 partitioner, as aiokafka implements it.
"""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner

_PARTITIONER = DefaultPartitioner()


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives ``key`` among ``partitions``."""
    every = list(range(partitions))
    return int(_PARTITIONER(key, every, every))


def key_for_partition(partition: int, partitions: int, prefix: str = "probe:") -> str:
    """A key (``prefix`` and a number) that lands on ``partition``: for probes, tests and benchmarks."""
    for i in range(100_000):
        key = f"{prefix}{i}"
        if partition_for(key.encode(), partitions) == partition:
            return key
    raise ValueError(f"no key with prefix {prefix!r} lands on partition {partition} of {partitions}")
