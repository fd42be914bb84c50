"""A repository's merge train, in the log: who waits to merge, in which order, and what was checked.

Theory of operation
-------------------
Everything that affects a train lives in this file. A merge intent (``ToolIntent``, tool ``merge``, on
``repo:<name>``) that passes the gate and the host's preflight joins its repository's train as an
``Entry``: the agent's branch commit at that moment, its lease's token, and the repository's check as the
host had it configured (``check_digest``; None: merges land unchecked). Trains are kept per target branch;
each lands in the order its entries joined.

A check runner, its own process and identity, follows the train from the log and checks up to ``depth``
entries at once, each on top of the ones ahead: it builds each entry's merge commit on its ``base`` (the
target's head once the entries ahead have landed) deterministically, so the host lands exactly that
commit, runs the repository's check on it, and sends a signed ``CheckVerdict``. The host records a
verdict of an entry it holds as ``MergeChecked`` (the newest verdict per entry counts).

The front entry of a target lands only when (``front``):

- its lease is still live (an entry whose lease died leaves the train, ``lease_not_live``);
- the repository has no check, or it has a verdict of its own check whose ``base`` is the target's head
  (checked on exactly what it lands on): passed, it lands that commit; failed, it is evicted
  (``check_failed``, ``check_timed_out``), and so is one that conflicts (``version_conflict``);
- a runner whose check is another than the entry's says so (``CHECK_CHANGED``): the entry is evicted
  (``check_changed``) and its agent merges again, with the repository's check as it is now.

A verdict on another base waits: once the entries ahead land as checked, its base is the head. Landing
is the host's ref update (``arbiter.streams.tools.git``); when the target is not where the log says
(moved outside Arbiter), the host records ``MergeReplanned`` with the head it found, and the entry
waits for a verdict on that head. Every change of a train is one of the events this module folds
(``evolve``), so the host's state, a replay and a runner's view are the same fold of the same log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from arbiter.schemas import MergeChecked, MergeQueued, MergeReplanned, ToolApplied, ToolIntent, ToolRejected
from arbiter.schemas.reasons import Reason
from arbiter.streams.cores.fencing import token_problem
from arbiter.streams.cores.leases import LeaseBook

TrainEvent = MergeQueued | MergeChecked | MergeReplanned | ToolApplied | ToolRejected
REPLANNED = "merge_replanned"
CHECK_CHANGED = "check_changed"
"""A verdict's ``stopped`` when the runner's check is not the one the entry joined with: it cannot check it, and
says so, so the entry leaves the train (``check_changed``) rather than wait for ever."""
"""A landing's outcome when the target is not where the train had it: the front waits for a check there."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One merge waiting in its train."""

    intent_id: str
    agent_id: str
    token: int
    commit: str
    """The sandbox branch's commit the merge takes."""
    target: str
    check_digest: str | None
    joined_at_ms: int
    """When it joined (the merge commit's date, so runner and host make the same commit)."""
    arguments_json: str
    """The merge intent's arguments: its message and strategy."""
    at_ms: int

    def intent(self, resource: str) -> ToolIntent:
        """The merge intent this entry answers (what its final outcome is built from)."""
        return ToolIntent(intent_id=self.intent_id, agent_id=self.agent_id, resource=resource, token=self.token,
                          tool="merge", arguments_json=self.arguments_json, at_ms=self.at_ms)

    def arguments(self) -> dict[str, Any]:
        """The merge's arguments (message, target, strategy)."""
        parsed = json.loads(self.arguments_json)
        return parsed if isinstance(parsed, dict) else {}


@dataclass(frozen=True, slots=True)
class Verdict:
    """The newest recorded verdict on one entry."""

    verdict_id: str
    base: str
    commit: str
    tree: str
    check_digest: str
    passed: bool
    conflicts: tuple[str, ...]
    exit_code: int | None
    stopped: str
    output_tail: str
    output_digest: str
    command: str = ""


@dataclass(slots=True)
class Train:
    """One repository's trains (one per target branch)."""

    entries: list[Entry] = field(default_factory=list)
    heads: dict[str, str] = field(default_factory=dict)
    """Each target's head as the log last recorded it."""
    verdicts: dict[str, Verdict] = field(default_factory=dict)

    def copy(self) -> Train:
        """An independent copy (entries and verdicts are immutable and shared)."""
        return Train(list(self.entries), dict(self.heads), dict(self.verdicts))

    def entry(self, intent_id: str) -> Entry | None:
        """The entry of ``intent_id``, if it waits in the train."""
        return next((e for e in self.entries if e.intent_id == intent_id), None)

    def queue(self, target: str) -> list[Entry]:
        """``target``'s train, front first."""
        return [e for e in self.entries if e.target == target]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly form (inside the repository's content state)."""
        return {"entries": [_row(e) for e in self.entries], "heads": dict(self.heads),
                "verdicts": {k: _row(v) for k, v in self.verdicts.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Train:
        """Inverse of ``to_dict``."""
        verdicts = {}
        for key, row in data["verdicts"].items():
            values = dict(zip(Verdict.__slots__, row, strict=False))
            values["conflicts"] = tuple(values["conflicts"])
            verdicts[key] = Verdict(**values)
        return cls([Entry(*row) for row in data["entries"]], dict(data["heads"]), verdicts)


def _row(item: Entry | Verdict) -> list[Any]:
    return [list(v) if isinstance(v, tuple) else v for v in (getattr(item, name) for name in item.__slots__)]


# -- what the front of a train needs ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Land:
    """Land ``entry``: its merge commit on ``head`` (``verdict``'s, or, unchecked, the one the host makes)."""

    entry: Entry
    head: str
    verdict: Verdict | None


@dataclass(frozen=True, slots=True)
class Evict:
    """Answer ``entry`` with a refusal: it leaves the train."""

    entry: Entry
    reason: Reason
    details: dict[str, Any]


Action = Land | Evict


def dead(train: Train, book: LeaseBook, now_ms: int) -> list[Evict]:
    """Entries whose lease is gone (expired, released, revoked): they leave the train, wherever they are."""
    return [Evict(e, Reason.LEASE_NOT_LIVE, {"left_the_train": "its lease on the repository is gone"})
            for e in train.entries if token_problem(book.holders, book.last_token, e.agent_id, e.token, now_ms)]


def front(train: Train, target: str, book: LeaseBook, now_ms: int) -> Action | None:
    """What the front of ``target``'s train needs now (None: it waits for a verdict, or the train is empty)."""
    queue = train.queue(target)
    if not queue:
        return None
    entry = queue[0]
    if token_problem(book.holders, book.last_token, entry.agent_id, entry.token, now_ms):
        return Evict(entry, Reason.LEASE_NOT_LIVE, {"left_the_train": "its lease on the repository is gone"})
    head = train.heads[target]
    if entry.check_digest is None:
        return Land(entry, head, None)
    verdict = train.verdicts.get(entry.intent_id)
    if verdict is not None and verdict.stopped == CHECK_CHANGED and verdict.check_digest != entry.check_digest:
        return Evict(entry, Reason.CHECK_CHANGED, {"joined_with_check": entry.check_digest,
                                                   "runner_check": verdict.check_digest})
    if verdict is None or verdict.base != head or verdict.check_digest != entry.check_digest:
        return None
    if verdict.conflicts:
        return Evict(entry, Reason.VERSION_CONFLICT, {"conflicts": list(verdict.conflicts), "head": head})
    if not verdict.passed:
        reason = Reason.CHECK_TIMED_OUT if verdict.stopped == "time" else Reason.CHECK_FAILED
        return Evict(entry, reason, {"check": verdict_facts(verdict)})
    return Land(entry, head, verdict)


def verdict_facts(verdict: Verdict) -> dict[str, Any]:
    """What an agent is told of a verdict (its output's tail, the tree it ran on)."""
    return {"command": verdict.command, "passed": verdict.passed, "exit_code": verdict.exit_code,
            "stopped": verdict.stopped, "tree": verdict.tree, "commit": verdict.commit, "base": verdict.base,
            "output": verdict.output_tail, "output_digest": verdict.output_digest, "verdict_id": verdict.verdict_id}


def position(train: Train, target: str) -> int:
    """Where a merge joining ``target``'s train now stands (0: the front)."""
    return len(train.queue(target))


# -- folding the log ---------------------------------------------------------------------


def evolve(train: Train, event: TrainEvent) -> Train:
    """Fold one of a repository's train events into ``train`` (in place) and return it."""
    if isinstance(event, MergeQueued):
        if train.entry(event.intent_id) is None:
            train.entries.append(Entry(event.intent_id, event.agent_id, event.token, event.commit, event.target,
                                       event.check_digest, event.at_ms, event.arguments_json,
                                       event.request_sent_at_ms or event.at_ms))
        train.heads.setdefault(event.target, event.head)
    elif isinstance(event, MergeChecked):
        if train.entry(event.intent_id) is not None:
            train.verdicts[event.intent_id] = Verdict(
                event.verdict_id, event.base, event.commit, event.tree, event.check_digest, event.passed,
                tuple(event.conflicts), event.exit_code, event.stopped, event.output_tail, event.output_digest,
                event.command)
    elif isinstance(event, MergeReplanned):
        train.heads[event.target] = event.head
        train.verdicts.pop(event.intent_id, None)
    elif event.tool == "merge":
        entry = train.entry(event.intent_id)
        if entry is not None:
            train.entries.remove(entry)
            train.verdicts.pop(entry.intent_id, None)
            if isinstance(event, ToolApplied):
                train.heads[entry.target] = str(json.loads(event.result_json)["head"])
    return train
