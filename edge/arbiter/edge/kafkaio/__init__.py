"""The Kafka seam: the few operations the SDK, the front door, the audit, enrollment and chaos need,
behind one interface.

Theory of operation
-------------------
Two implementations sit behind it, chosen by the ``kafka_client`` setting: ``librdkafka``
(confluent-kafka, the default; :mod:`.rdkafka`) and ``aiokafka`` (:mod:`.aio`). The same
contract suite (``tests/edge/test_kafkaio_contract.py``) runs against both on a real broker.

A :class:`Sender` sends one record and returns once every in-sync replica has it; keys go to
partitions by Kafka's Java rule (murmur2, :func:`arbiter.schemas.partitioning.partition_for`),
so a key's records land where the workers and the SDK look for them.

A :class:`Reader` reads an assignment it is told record by record: :meth:`Reader.add` starts a
partition at an offset, :meth:`Reader.drop` stops it, both synchronous, so a caller decides
its positions with no await in between. The reader keeps each partition's next offset itself
and hands out only records at or after it, so a batch fetched before an ``add`` or a ``drop``
took effect is never handed out twice, out of order, or for a partition no longer read.
Committed records only (``read_committed``): workers under ``exactly_once`` write in
transactions, and an aborted one is never acted on.

Two operations serve tools, not the request path: :meth:`Sender.append` puts a record on a
partition the caller chooses and says where it landed (chaos and the demo's rogue agent inject
records the workers must refuse, and look for each refusal's cause), and :meth:`Reader.committed`
asks what a consumer group committed (chaos waits until the workers processed every input).

Errors are :class:`KafkaIOError`, with ``retriable`` saying whether the same call may succeed
later (a broker restarting, a leader moving) or never will (a record too large, no access).
"""

from .seam import (
    CLIENTS,
    METADATA_TIMEOUT_S,
    Fetch,
    Headers,
    KafkaIOError,
    Positions,
    Reader,
    Received,
    Sender,
    TopicPartition,
    clients_of,
    reader_for,
    sender_for,
)

__all__ = [
    "CLIENTS",
    "METADATA_TIMEOUT_S",
    "Fetch",
    "Headers",
    "KafkaIOError",
    "Positions",
    "Reader",
    "Received",
    "Sender",
    "TopicPartition",
    "clients_of",
    "reader_for",
    "sender_for",
]
