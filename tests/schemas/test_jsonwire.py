"""Records as JSON (the front door's wire) and API keys: lossless, and strict about what they accept."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings

from arbiter.schemas import ContractError, LockGranted, LockRequested, ToolIntent
from arbiter.schemas.identity import IdentityError, Signer
from arbiter.schemas.jsonwire import from_json, to_json
from arbiter.schemas.models import MODELS
from arbiter.streams.cores.trust import AGENT_COMMANDS
from tests.avro_strategies import for_record
from tests.schemas.test_contract import BY_NAME, MODEL_BY_NAME

# Models with bytes fields never travel as JSON (the registry and dead letters are not an agent's).
JSON_NAMES = sorted(n for n in BY_NAME
                    if not any(f.annotation in (bytes, bytes | None) for f in MODEL_BY_NAME[n].model_fields.values()))


@pytest.mark.parametrize("name", JSON_NAMES)
def test_every_record_an_agent_sees_or_sends_round_trips_through_json(name: str) -> None:
    model = MODEL_BY_NAME[name]

    @settings(max_examples=30, deadline=None)
    @given(for_record(BY_NAME[name]))
    def round_trip(values: dict[str, Any]) -> None:
        record = model.model_validate(values)
        text = json.dumps(to_json(record))
        assert from_json(json.loads(text), MODELS) == record

    round_trip()


def _request(**change: Any) -> dict[str, Any]:
    return {**to_json(LockRequested(request_id="r1", agent_id="alice", resource="doc:1", mode="exclusive",
                                    ttl_ms=1000, at_ms=1)), **change}


def test_a_type_outside_the_allowed_ones_is_refused() -> None:
    granted = to_json(LockGranted.model_validate({
        "request_id": "r", "agent_id": "a", "resource": "x", "token": 1, "mode": "exclusive", "expires_at_ms": 1,
        "holders": [],
        "resource_version": 0, "at_ms": 1, "cause": {"topic": "t", "partition": 0, "offset": 0}}))
    with pytest.raises(ContractError) as refused:
        from_json(granted, AGENT_COMMANDS)  # an agent never sends a decision
    assert refused.value.reason == "wrong_schema"
    for bad in (_request(type="Nope"), {k: v for k, v in _request().items() if k != "type"}, [1], "x", None):
        with pytest.raises(ContractError):
            from_json(bad, AGENT_COMMANDS)


def test_a_bad_field_is_named() -> None:
    for bad, field in ((_request(ttl_ms="soon"), "ttl_ms"), ({**_request(), "extra": 1}, "extra"),
                       ({k: v for k, v in _request().items() if k != "resource"}, "resource")):
        with pytest.raises(ContractError) as refused:
            from_json(bad, AGENT_COMMANDS)
        assert refused.value.reason == "malformed_body"
        assert f"LockRequested.{field}" in str(refused.value), str(refused.value)
    assert isinstance(from_json(to_json(ToolIntent(
        intent_id="i", agent_id="a", resource="r", tool="commit", arguments_json="{}", at_ms=1)),
        AGENT_COMMANDS), ToolIntent)


def test_an_api_key_carries_the_agents_name_and_key() -> None:
    for name in ("alice", "triage.1_b-2", "ünïcode"):
        signer = Signer.generate(name)
        back = Signer.from_api_key(signer.api_key())
        assert (back.name, back.key_id) == (name, signer.key_id)
        # The same key signs the same bytes the same way (Ed25519 is deterministic).
        assert back.sign("t", b"k", b"v", 1) == signer.sign("t", b"k", b"v", 1)


@pytest.mark.parametrize("text", ["", "arb1", "arb1.YQ", "arb2.YQ.AAAA", "arb1.YQ.AAAA", "arb1..", "Bearer x",
                                  "arb1.YQ." + "A" * 500, "arb1.%%%.AAAA"])
def test_a_malformed_api_key_is_refused(text: str) -> None:
    with pytest.raises(IdentityError):
        Signer.from_api_key(text)
