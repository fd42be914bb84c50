"""The rules that change decisions, as one value a worker records in the log when it starts.

``arbiter audit`` and ``arbiter replay`` read them back (``WorkerStarted`` on the workers
topic, and the archive's header), so a log is re-derived with the rules its workers
decided by, not with whatever the auditor's own settings say today.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from arbiter.edge.settings import Settings
from arbiter.streams.cores.gateway import GatewayRules
from arbiter.streams.cores.leases import LeaseRules
from arbiter.streams.cores.waitgraph import VICTIM_POLICIES, VictimPolicy

BEFORE_THEY_EXISTED: dict[str, dict[str, Any]] = {
    "leases": {"forget_window_refusals": False},
    "gateway": {"forget_window_refusals": False, "trains": False, "shared_tools": ()},
}
"""What a lease or gateway rule that recorded rules do not name means: how decisions were made before
it existed (a rule whose default is its old behaviour, as ``hide_tokens``'s, needs no entry)."""


@dataclass(frozen=True)
class Rules:
    """Everything besides the log that a decision depends on."""

    leases: LeaseRules = field(default_factory=LeaseRules)
    gateway: GatewayRules = field(default_factory=GatewayRules)
    graph_key: str = "global"
    victim_policy: VictimPolicy = "priority"
    verify_signatures: bool = False
    """Whether inputs pass the trust gate (``arbiter.streams.shells.trust``). Rules recorded before the gate
    existed say nothing, and mean False: those logs were decided without it."""

    @classmethod
    def from_settings(cls, settings: Settings) -> Rules:
        """The rules a worker with ``settings`` decides by."""
        return cls(
            leases=LeaseRules(max_ttl_ms=settings.max_ttl_ms, max_wait_ms=settings.max_wait_ms,
                              lock_order=settings.lock_order, id_window_ms=settings.id_window_ms,
                              clock_skew_ms=settings.clock_skew_ms, max_remembered_ids=settings.max_remembered_ids,
                              hide_tokens=settings.verify_signatures),
            gateway=GatewayRules(policies=Settings.parse_policies(settings.policies),
                                 max_arguments_bytes=settings.max_patch_bytes, id_window_ms=settings.id_window_ms,
                                 clock_skew_ms=settings.clock_skew_ms,
                                 max_remembered_ids=settings.max_remembered_ids,
                                 hide_tokens=settings.verify_signatures),
            graph_key=settings.graph_key,
            verify_signatures=settings.verify_signatures,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form (what ``WorkerStarted.rules_json`` holds)."""
        gateway = asdict(self.gateway)
        gateway.pop("_cache", None)
        out: dict[str, Any] = {"leases": asdict(self.leases), "gateway": gateway, "graph_key": self.graph_key,
                               "victim_policy": self.victim_policy}
        if self.verify_signatures:
            out["verify_signatures"] = True  # absent when off, so older logs' rules read back the same
        return out

    def to_json(self) -> str:
        """Canonical JSON: equal rules give equal text."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Rules:
        """Inverse of ``to_json``; a ``ValueError`` names what does not fit."""
        try:
            data = json.loads(text)
            # Rules recorded before a rule existed were decided without it: its absence means its old
            # behaviour, whatever its default is now.
            leases = {**BEFORE_THEY_EXISTED["leases"], **data["leases"]}
            gateway = {**BEFORE_THEY_EXISTED["gateway"], **data["gateway"]}
            gateway["policies"] = tuple(tuple(pair) for pair in gateway["policies"])
            gateway["shared_tools"] = tuple(gateway["shared_tools"])
            victim = data.get("victim_policy", "priority")
            if victim not in VICTIM_POLICIES:
                raise ValueError(f"unknown victim policy {victim!r}")
            return cls(leases=LeaseRules(**leases), gateway=GatewayRules(**gateway),
                       graph_key=str(data["graph_key"]), victim_policy=victim,
                       verify_signatures=bool(data.get("verify_signatures", False)))
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"rules do not fit this Arbiter: {exc}") from None
