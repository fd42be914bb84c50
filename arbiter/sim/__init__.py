"""Deterministic simulation: virtual time on a seeded schedule, and a simulated Kafka behind the seam.

``loop`` runs a coroutine on virtual time (a 30 s lease expires in no time; one seed, one
schedule); ``kafka`` is the log the simulated processes share, with faults drawn from the seed;
``group`` its consumer groups (rebalances, commits fenced by generation) and transactions.
"""

from .group import GroupMetadata, SimGroup, SimTxnProducer
from .kafka import Faults, SimKafka, SimReader, SimSender
from .loop import EPOCH_MS, SimStuck, VirtualLoop, run

__all__ = ["EPOCH_MS", "Faults", "GroupMetadata", "SimGroup", "SimKafka", "SimReader", "SimSender", "SimStuck",
           "SimTxnProducer", "VirtualLoop", "run"]
