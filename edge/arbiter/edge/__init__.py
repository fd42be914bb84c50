"""The edge: the I/O everything above the wire contract shares (settings, the clock, key files, the
registry feed, Kafka credentials). The contract itself (``arbiter.schemas``) does none."""
