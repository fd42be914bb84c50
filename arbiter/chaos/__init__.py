"""``arbiter chaos CAMPAIGN``: run a fault campaign against a live Arbiter it starts itself, then audit.

The run starts what it needs (``rig``: its own topics, workers, ledger, agents' keys; a
private broker for ``broker-restart``), drives honest agents through leases and gateway
writes (``workload``) while the campaign injects its faults (``campaigns``), brings the run
to rest, audits the whole log, checks the ledger and the campaign's invariants, and prints
one table (``report``). Exit code 1 when the audit fails or an invariant breaks.

Campaigns: ``calm`` (no faults), ``worker-kill``, ``freeze-agent``, ``broker-restart``,
``duplicates``, ``malformed`` (see ``arbiter.chaos.campaigns``). ``--calm`` runs the same
workload without faults first, on the same setup, and prints the two side by side with the
issue's targets (at least half the calm rate of successful operations, acquire p99 within
5 s, zero audit violations).
"""

from arbiter.chaos.command import chaos

__all__ = ["chaos"]
