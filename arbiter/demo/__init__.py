"""``arbiter demo``: a live swarm of agents on shared state, with Arbiter, and (``--unsafe``) without.

Start-up: with nothing configured, the demo starts the local Kafka broker, creates
this run's own topics, starts ``--workers`` stream processors and opens an embedded
SQLite ledger; given ``--bootstrap`` and ``--ledger-dsn`` it uses those. It stops
what it started on the way out, Ctrl-C included, and audits the log it wrote (a
partial one too).

Trust: the demo is secure by default, as a deployment is. It issues each agent of the
swarm a key of its own (``Registrar.add``, signed by the home's admin key), allowed only
its story's resources, and hands it to the agent's SDK in memory; the workers issue
theirs as they start (``arbiter worker``); nothing is enrolled on first use. Mid-run a
rogue agent, mallory (``arbiter.demo.rogue``), joins with prefixes of her own and attacks
on the wire; the summary lists each attempt and how it was refused, and one that is not
refused fails the demo.

The swarm (``arbiter.demo.swarm``) uses only the public SDK. While it runs, a read-only
consumer of the run's decision topics draws the live view: leases held and queued per
resource, grants, rejections by reason, deadlocks and compensations, and progress.
"""

from __future__ import annotations

from arbiter.demo.command import demo

__all__ = ["demo"]
