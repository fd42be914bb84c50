"""Audit and replay: rebuild, verify and explain everything from the event log.

``audit(log, settings)`` replays every recorded input through the processors' own
code (``replay``), compares the re-derived decisions with the recorded ones, runs
the independent invariant checks (``checks``) and returns one JSON-friendly report
(``report``), which the terminal summary, ``--json`` and the HTML page (``html``) all
render; the report's timeline is drawn from the log by ``lanes``.

A log whose workers verified signatures needs the admin public keys (the trust
anchors: ``ARBITER_ADMIN_PUBLIC_KEYS`` or ``<home>/keys/admin.pub``), never read from
the log; without them ``audit`` raises ``TrustAnchorsMissing``, saying what to set.
"""

from __future__ import annotations

from .checkpoint import Checkpoint
from .lanes import timeline
from .replay import TrustAnchorsMissing
from .report import Audited, audit, audit_from

__all__ = ["Audited", "Checkpoint", "TrustAnchorsMissing", "audit", "audit_from", "timeline"]
