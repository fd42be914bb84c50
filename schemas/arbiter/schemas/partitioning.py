"""Which partition a key lands on: the one rule that keeps topics co-partitioned.

Producers (the SDK, the workers, the front door), the audit and the expiry index must all
agree on it, and so must a client in any other language, so it is written out here:
Kafka's default partitioner as its Java client has it, murmur2 of the key bytes (seed
``0x9747b28c``), made positive, modulo the partition count. (aiokafka's default
partitioner is the same; librdkafka's default is not: use its ``murmur2_random``.)
"""

from __future__ import annotations

_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash of ``data`` (``org.apache.kafka.common.utils.Utils.murmur2``), as an unsigned 32-bit int."""
    length = len(data)
    h = (0x9747B28C ^ length) & _MASK
    whole = length - length % 4
    for i in range(0, whole, 4):
        k = (data[i] | data[i + 1] << 8 | data[i + 2] << 16 | data[i + 3] << 24) * _M & _MASK
        k ^= k >> 24
        k = k * _M & _MASK
        h = (h * _M & _MASK) ^ k
    left = length % 4
    if left == 3:
        h ^= data[whole + 2] << 16
    if left >= 2:
        h ^= data[whole + 1] << 8
    if left >= 1:
        h ^= data[whole]
        h = h * _M & _MASK
    h ^= h >> 13
    h = h * _M & _MASK
    h ^= h >> 15
    return h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives ``key`` among ``partitions``."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


def key_for_partition(partition: int, partitions: int, prefix: str = "probe:") -> str:
    """A key (``prefix`` and a number) that lands on ``partition``: for probes, tests and benchmarks."""
    for i in range(100_000):
        key = f"{prefix}{i}"
        if partition_for(key.encode(), partitions) == partition:
            return key
    raise ValueError(f"no key with prefix {prefix!r} lands on partition {partition} of {partitions}")
