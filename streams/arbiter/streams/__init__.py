"""The stream processors: pure decision cores, their shells, the tools behind the gateway, and the
Kafka runtime that runs them (``arbiter.streams.cores``, ``.shells``, ``.tools``, ``.runtime``)."""
