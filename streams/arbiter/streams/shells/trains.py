"""The resource processor's part for a repository's merge trains (``arbiter.streams.cores.train``).

Theory of operation
-------------------
Three inputs touch a train, each decided in its repository's order by the resource shell:

- a ``merge`` intent (``join``): through the gateway's gate (a shared lease is enough), then the host's
  preflight; it joins as ``MergeQueued`` (asked again, it is answered again: it never joins twice), or is
  refused at once;
- a runner's ``CheckVerdict`` (``checked``): recorded as ``MergeChecked`` when it is of an entry of the
  train, ignored otherwise (a verdict on a merge that left decides nothing);
- any lease decision on the repository (``settle``): an entry whose lease is gone leaves the train.

After each, ``settle`` lands or evicts fronts while the core says so. A landing is the host's side effect
(``ToolRunner.land``); its outcome is an event of the log (``ToolApplied``, a refusal, or
``MergeReplanned``), so a replay gives the same train. Final answers are built by the gateway's own
functions and folded into the repository's content, so the intent's id is decided once, ever.
"""

from __future__ import annotations

import json
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from arbiter.schemas import Cause, CheckVerdict, MergeChecked, MergeQueued, MergeReplanned, ToolIntent
from arbiter.schemas.reasons import Reason
from arbiter.streams.cores import gateway, train
from arbiter.streams.cores.gateway import Accepted, ContentState, GatewayEvent, GatewayRules, ToolOutcome
from arbiter.streams.cores.leases import LeaseBook, new_book
from arbiter.streams.cores.train import REPLANNED, Entry, Evict, Land, Train, Verdict
from arbiter.streams.shells.routes import Routes, Send


class TrainTools(Protocol):
    """What the train needs of a worker's tools (``ToolRegistry`` is one; the audit's replay another)."""

    def names(self) -> frozenset[str]:
        """Registered tool names."""

    def parse(self, intent: ToolIntent) -> Any:
        """Validated arguments, or a string saying why they are invalid."""

    async def join(self, intent: ToolIntent, arguments: Any) -> ToolOutcome:
        """A merge's preflight on the repository host."""

    async def land(self, resource: str, entry: Entry, head: str, verdict: Verdict | None) -> ToolOutcome:
        """Land a front entry on ``head``."""


def is_train_intent(intent: ToolIntent, rules: GatewayRules) -> bool:
    """Whether the intent joins a train (rules recorded before trains: never)."""
    return rules.trains and intent.tool == "merge" and intent.resource.startswith("repo:")


@dataclass
class TrainShell:
    """A repository's trains, over the resource shell's tables."""

    books: MutableMapping[bytes, LeaseBook]
    contents: MutableMapping[bytes, ContentState]
    rules: GatewayRules
    tools: TrainTools
    routes: Routes
    send: Send
    after_land: Callable[[ToolIntent], None] = lambda _intent: None
    """Called between a landing and the record of its outcome (fault injection in tests)."""

    def _state(self, key: bytes) -> tuple[LeaseBook, ContentState, Train]:
        resource = key.decode("utf-8", errors="replace")
        book = self.books.get(key) or new_book(resource)
        stored = self.contents.get(key)
        content = ContentState(resource) if stored is None else stored.copy()
        if content.train is None:
            content.train = Train()
        return book, content, content.train

    async def join(self, key: bytes, intent: ToolIntent, now_ms: int, cause: Cause) -> None:
        """A merge intent: answered again, refused, or joined (and then the train settles)."""
        book, content, trains = self._state(key)
        entry = trains.entry(intent.intent_id)
        if entry is not None and entry.agent_id == intent.agent_id:  # asked again while it waits
            await self.send(self.routes.reply_to(intent.agent_id), intent.agent_id.encode(),
                            self._queued(intent, entry, trains, now_ms, cause))
            return
        if entry is not None:  # another agent's merge waits under this id
            await self.send(self.routes.reply_to(intent.agent_id), intent.agent_id.encode(), gateway.reject(
                content, book, intent, Reason.REQUEST_ID_TAKEN, now_ms, cause, hide_tokens=self.rules.hide_tokens))
            return
        verdict = gateway.check(book, content, intent, now_ms, cause, self.rules, self.tools.names())
        if verdict is content.outcomes.get(intent.intent_id):
            assert not isinstance(verdict, Accepted)
            await self.send(self.routes.reply_to(intent.agent_id), intent.agent_id.encode(), verdict)
            return
        if not isinstance(verdict, Accepted):
            await self._final(key, content, verdict)
        else:
            arguments = self.tools.parse(intent)
            if isinstance(arguments, str):
                await self._final(key, content, gateway.reject(content, book, intent, Reason.INVALID_ARGUMENTS, now_ms,
                                                               cause, hide_tokens=self.rules.hide_tokens,
                                                               problem=arguments))
            else:
                outcome = await self.tools.join(intent, arguments)
                if not outcome.ok:
                    await self._final(key, content, gateway.complete(book, content, intent, outcome, now_ms, cause,
                                                                     self.rules.hide_tokens))
                else:
                    await self._enqueue(key, content, trains, intent, json.loads(outcome.result_json), now_ms, cause)
                    await self._settle(key, book, content, now_ms, cause)
        self.contents[key] = content

    async def _enqueue(self, key: bytes, content: ContentState, trains: Train, intent: ToolIntent,
                       joined: dict[str, Any], now_ms: int, cause: Cause) -> None:
        queued = MergeQueued(intent_id=intent.intent_id, agent_id=intent.agent_id, resource=intent.resource,
                             target=str(joined["target"]), token=intent.token or 0, commit=str(joined["commit"]),
                             head=str(joined["head"]), check_digest=joined.get("check_digest"),
                             arguments_json=intent.arguments_json, position=train.position(trains, joined["target"]),
                             request_sent_at_ms=intent.at_ms, at_ms=now_ms, cause=cause)
        await self._event(key, queued, trains)

    def _queued(self, intent: ToolIntent, entry: Entry, trains: Train, now_ms: int, cause: Cause) -> MergeQueued:
        return MergeQueued(intent_id=entry.intent_id, agent_id=entry.agent_id, resource=intent.resource,
                           target=entry.target, token=entry.token, commit=entry.commit,
                           head=trains.heads.get(entry.target, ""), check_digest=entry.check_digest,
                           arguments_json=entry.arguments_json, position=trains.queue(entry.target).index(entry),
                           request_sent_at_ms=entry.at_ms, at_ms=now_ms, cause=cause)

    async def checked(self, key: bytes, verdict: CheckVerdict, now_ms: int, cause: Cause) -> None:
        """A runner's verdict: recorded when it is of an entry of the train, and the train settles."""
        book, content, trains = self._state(key)
        entry = trains.entry(verdict.intent_id)
        if entry is None or entry.check_digest is None:
            return  # of a merge that left, or of one that needs no check: it decides nothing
        fields = verdict.model_dump(exclude={"at_ms"})
        await self._event(key, MergeChecked(agent_id=entry.agent_id, **fields, at_ms=now_ms, cause=cause),
                          trains)
        await self._settle(key, book, content, now_ms, cause)
        self.contents[key] = content

    async def settle(self, key: bytes, now_ms: int, cause: Cause) -> None:
        """After a lease decision on the repository: entries whose lease is gone leave; fronts move on."""
        stored = self.contents.get(key)
        if stored is None or not stored.train or not stored.train.entries:
            return
        book, content, _ = self._state(key)
        await self._settle(key, book, content, now_ms, cause)
        self.contents[key] = content

    async def _settle(self, key: bytes, book: LeaseBook, content: ContentState, now_ms: int, cause: Cause) -> None:
        trains = content.train
        assert trains is not None
        for evict in train.dead(trains, book, now_ms):
            await self._evict(key, book, content, evict, now_ms, cause)
        for target in sorted({e.target for e in trains.entries}):
            while (action := train.front(trains, target, book, now_ms)) is not None:
                if isinstance(action, Evict):
                    await self._evict(key, book, content, action, now_ms, cause)
                elif not await self._land(key, book, content, action, now_ms, cause):
                    break

    async def _evict(self, key: bytes, book: LeaseBook, content: ContentState, evict: Evict, now_ms: int,
                     cause: Cause) -> None:
        intent = evict.entry.intent(content.resource)
        event = gateway.reject(content, book, intent, evict.reason, now_ms, cause, hide_tokens=self.rules.hide_tokens,
                               **evict.details)
        await self._final(key, content, event)

    async def _land(self, key: bytes, book: LeaseBook, content: ContentState, land: Land, now_ms: int,
                    cause: Cause) -> bool:
        """Land the front (True: the train moved on; False: it waits for a check on the head found)."""
        outcome = await self.tools.land(content.resource, land.entry, land.head, land.verdict)
        self.after_land(land.entry.intent(content.resource))
        if outcome.reason == REPLANNED and not outcome.ok:
            head = str(dict(outcome.details)["head"])
            assert content.train is not None
            await self._event(key, MergeReplanned(intent_id=land.entry.intent_id, agent_id=land.entry.agent_id,
                                                  resource=content.resource, target=land.entry.target, head=head,
                                                  reason=outcome.error[:2000], at_ms=now_ms, cause=cause),
                              content.train)
            return False
        intent = land.entry.intent(content.resource)
        await self._final(key, content, gateway.complete(book, content, intent, outcome, now_ms, cause,
                                                         self.rules.hide_tokens))
        return True

    async def _event(self, key: bytes, event: MergeQueued | MergeChecked | MergeReplanned, trains: Train) -> None:
        train.evolve(trains, event)
        await self.send(self.routes.resource_events, key, event)
        await self.send(self.routes.reply_to(event.agent_id), event.agent_id.encode(), event)

    async def _final(self, key: bytes, content: ContentState, event: GatewayEvent) -> None:
        """A merge's one final answer: recorded as the gateway records any, and the entry leaves its train."""
        gateway.evolve(content, event, self.rules)
        if content.train is not None:
            train.evolve(content.train, event)
        await self.send(self.routes.resource_events, key, event)
        await self.send(self.routes.reply_to(event.agent_id), event.agent_id.encode(), event)
