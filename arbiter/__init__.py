"""Arbiter: concurrency control for fleets of AI agents, on Apache Kafka."""

__version__ = "0.1.0"
