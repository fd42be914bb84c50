"""The processors' input checks that decide whether a message is dead-lettered."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arbiter.audit.replay import Engine
from arbiter.edge.settings import Settings
from arbiter.schemas import (
    MODELS,
    Cause,
    CompensationRequested,
    ContractError,
    LockRequested,
    Ping,
    Record,
    SagaFinished,
    SagaStep,
    WaitEdgeAdded,
)
from arbiter.schemas.codec import SCHEMA_DIR
from arbiter.streams.cores.gateway import ToolOutcome
from arbiter.streams.shells.routes import Routes
from arbiter.streams.shells.saga import NOTHING_TO_DO, SagaShell, saga_key_problem
from tests.avro_strategies import for_record


def step(saga_id: str) -> SagaStep:
    return SagaStep(saga_id=saga_id, step=0, agent_id="a", status="completed", intent_id="i", resource="r",
                    tool="t", arguments_json="{}", at_ms=0)


def test_saga_keys_must_be_utf8_saga_ids_matching_the_record() -> None:
    assert saga_key_problem(b"saga:x", step("saga:x")) is None
    assert saga_key_problem(b"saga:x", step("saga:y")).reason == "key_mismatch"  # type: ignore[union-attr]
    assert saga_key_problem(b"other", step("other")).reason == "key_mismatch"  # type: ignore[union-attr]
    assert saga_key_problem(None, step("saga:x")).reason == "key_mismatch"  # type: ignore[union-attr]
    # Not UTF-8, and a record without a saga id: dead-lettered, not a crash loop.
    ping = Ping(request_id="p", agent_id="a", at_ms=0)
    assert saga_key_problem(b"saga:\xff", ping).reason == "key_mismatch"  # type: ignore[union-attr]


@pytest.mark.parametrize("end", [
    SagaStep(saga_id="saga:ann/empty:1", step=-1, agent_id="ann", status="saga_completed", intent_id="",
             resource="", tool="", arguments_json="{}", at_ms=0),
    CompensationRequested(saga_id="saga:ann/empty:1", reason="stuck", requested_by="admin", at_ms=0)])
def test_a_saga_that_ends_before_any_step_tells_its_owner(end: Record) -> None:
    """Its owner is in its id: without a step on record it was told nothing, and waited for good."""
    sent: list[tuple[str, bytes, Record]] = []

    async def send(topic: str, key: bytes, record: Record) -> None:
        sent.append((topic, key, record))

    routes = Routes.of(Settings().topics, "global")
    shell = SagaShell({}, routes, send)
    assert asyncio.run(shell.handle(b"saga:ann/empty:1", end, 1_000, Cause(topic="s", partition=0, offset=0))) is None
    told = [(key, record) for topic, key, record in sent if topic == routes.agent_inbox]
    assert [(key, type(record)) for key, record in told] == [(b"ann", SagaFinished)], sent


# -- no single input stops a processor ------------------------------------------------------------

_SCHEMAS = {raw["namespace"] + "." + raw["name"]: raw for raw in
            (json.loads(p.read_text()) for p in SCHEMA_DIR.rglob("*.avsc")
             if "history" not in p.relative_to(SCHEMA_DIR).parts)}


class _Tools:
    def names(self) -> frozenset[str]:
        return frozenset({"refund"})

    def parse(self, intent: object) -> object:
        return {}

    async def run(self, intent: object, arguments: object) -> ToolOutcome:
        return ToolOutcome(True, "{}")

    async def read(self, request: object) -> str | None:
        return '{"body": {}}'


def _records() -> st.SearchStrategy[Record]:
    """Any well-typed record of any model, with values the schema allows (absurd ones included)."""
    return st.one_of(*[for_record(_SCHEMAS[model.AVRO_NAME]).map(lambda d, m=model: m.model_validate(d))
                       for model in MODELS])


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=_records(), topic=st.sampled_from(["commands", "edges", "sagas"]),
       key=st.one_of(st.none(), st.binary(max_size=12), st.just(b"saga:x"), st.just(b"global")))
def test_any_well_typed_record_on_any_topic_is_decided_or_refused_never_raises(record: Record, topic: str,
                                                                               key: bytes | None) -> None:
    settings_ = Settings()
    engine = Engine(settings_, _Tools())
    name = {"commands": settings_.topics.resource_commands, "edges": settings_.topics.wait_edges,
            "sagas": settings_.topics.saga_commands}[topic]
    shell = engine.pipeline.shells.for_topic(name)
    assert shell is not None
    problem = asyncio.run(shell.handle(key, record, 1_000_000, Cause(topic=name, partition=0, offset=0)))
    assert problem is None or isinstance(problem, ContractError)


@pytest.mark.parametrize("topic", ["resource_commands", "wait_edges", "saga_commands"])
def test_records_of_another_topic_are_refused_not_decided(topic: str) -> None:
    settings_ = Settings()
    engine = Engine(settings_, _Tools())
    name = getattr(settings_.topics, topic)
    shell = engine.pipeline.shells.for_topic(name)
    assert shell is not None
    lock = LockRequested(request_id="r", agent_id="a", resource="saga:x", mode="exclusive", ttl_ms=1000,
                         wait_ms=0, at_ms=1_000_000)
    edge = WaitEdgeAdded(edge_id="e", waiter="a", holder="b", source="delegation", resource=None,
                         waiter_priority=0, waiter_registered_at_ms=0, at_ms=0)
    cause = Cause(topic=name, partition=0, offset=0)
    for record, home in ((lock, "resource_commands"), (edge, "wait_edges")):
        problem = asyncio.run(shell.handle(b"saga:x" if topic == "saga_commands" else None, record, 1_000_000,
                                           cause))
        if home != topic:
            assert isinstance(problem, ContractError), (record, topic)
    assert engine.books == {} and engine.sagas == {} and not engine.wait_edges()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(answer=st.one_of(*[for_record(_SCHEMAS[model.AVRO_NAME]).map(lambda d, m=model: m.model_validate(d))
                          for model in NOTHING_TO_DO]))
def test_answers_that_move_no_saga_on_are_let_be_not_refused(answer: Record) -> None:
    """The resource processor routes every answer for a saga's agent to the saga topic (a queued
    compensation lease, its merge's progress): none is refused, none changes a saga."""
    routes = Routes.of(Settings().topics, "global")
    sent: list[object] = []

    async def send(topic: str, key: bytes, record: Record) -> None:
        sent.append((topic, key, record))

    saga = "saga:ann/work:1"  # an answer to the saga's agent: its id is the saga's
    answer = answer.model_copy(update={f: saga for f in ("agent_id", "saga_id") if f in type(answer).model_fields})
    sagas: dict[bytes, object] = {}
    shell = SagaShell(sagas, routes, send)  # type: ignore[arg-type]
    problem = asyncio.run(shell.handle(saga.encode(), answer, 1_000, Cause(topic="s", partition=0, offset=0)))
    assert problem is None and sent == [] and sagas == {}
