"""The trust boundary without Kafka: signatures, the registry, and who may send what."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from arbiter.edge.keys import key_file, read_private_key, write_private_key
from arbiter.schemas import (
    CompensationRequested,
    IdentityRegistered,
    LockReleaseRequested,
    LockRequested,
    LockRevokeRequested,
    LockTick,
    SagaStep,
    ToolIntent,
    WaitEdgeAdded,
    default_codec,
)
from arbiter.schemas.identity import (
    ACTIVE,
    REVOKED,
    ROTATED,
    IdentityError,
    PublicKey,
    Refused,
    Registry,
    Signer,
    Verified,
    valid_name,
)
from arbiter.schemas.reasons import Reason
from arbiter.streams.cores.trust import authorize
from arbiter.streams.shells.trust import Gate

CODEC = default_codec()
TOPIC = "arbiter.resource.commands"
ADMIN = Signer.generate("admin")


def entry(signer: Signer, role: str = "agent", allow: list[str] | None = None, **changes: Any) -> IdentityRegistered:
    values: dict[str, Any] = dict(key_id=signer.key_id, name=signer.name, role=role, public_key=signer.public_raw,
                                  allow=allow or [], status=ACTIVE, valid_from_ms=1, at_ms=1)
    values.update(changes)
    return IdentityRegistered(**values)


def register(registry: Registry, record: IdentityRegistered, by: Signer = ADMIN) -> Refused | None:
    value = CODEC.encode(record)
    key = record.key_id.encode()
    return registry.apply("arbiter.registry", key, value, by.sign("arbiter.registry", key, value, 5), record)


def request(agent: str = "alice", resource: str = "ticket:1", **changes: Any) -> LockRequested:
    values: dict[str, Any] = dict(request_id="r1", agent_id=agent, resource=resource, mode="exclusive", ttl_ms=1000,
                                  at_ms=1)
    values.update(changes)
    return LockRequested(**values)


def signed(signer: Signer, record: Any, topic: str = TOPIC) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    value = CODEC.encode(record)
    key = record.resource.encode() if hasattr(record, "resource") else b"k"
    return key, value, signer.sign(topic, key, value, 10)


@pytest.fixture
def alice() -> Signer:
    return Signer.generate("alice")


@pytest.fixture
def registry(alice: Signer) -> Registry:
    registry = Registry([ADMIN.public_raw])
    assert register(registry, entry(alice)) is None
    return registry


# -- signatures ------------------------------------------------------------------------


def test_a_signed_command_verifies_as_its_signer(registry: Registry, alice: Signer) -> None:
    key, value, headers = signed(alice, request())
    verdict = registry.verify(TOPIC, key, value, headers, appended_at_ms=100)
    assert isinstance(verdict, Verified) and verdict.name == "alice" and verdict.role == "agent"


ORDER = 2**252 + 27742317777372353535851937790883648493
"""The order of Ed25519's base point: S and S + ORDER make the same equation hold."""


def test_libsodium_and_openssl_agree_on_what_a_signature_is(alice: Signer) -> None:
    """Signatures are made and checked with libsodium, while keys on disk and the audit checkpoint's
    admin signature go through ``cryptography`` (OpenSSL): each must accept the other's, and both
    refuse the same forgeries, or a worker and an auditor could disagree on one message."""
    from cryptography.exceptions import InvalidSignature

    public = PublicKey(alice.public_raw)
    openssl = alice.private_key.public_key()
    message = b"the message"
    ours = alice._sign(message)
    assert ours == alice.private_key.sign(message)  # Ed25519 is deterministic: the same 64 bytes
    public.verify(alice.private_key.sign(message), message)
    openssl.verify(ours, message)
    r, s = ours[:32], int.from_bytes(ours[32:], "little")
    forgeries = {
        "another message": (ours, b"the messagf"),
        "a flipped bit": (ours[:5] + bytes([ours[5] ^ 1]) + ours[6:], message),
        "S + the group order (malleable)": (r + (s + ORDER).to_bytes(32, "little"), message),
        "too short": (ours[:63], message),
        "too long": (ours + b"\0", message),
        "zeros": (bytes(64), message),
    }
    for signature, data in forgeries.values():
        with pytest.raises(InvalidSignature):
            public.verify(signature, data)
        with pytest.raises(InvalidSignature):
            openssl.verify(signature, data)


def test_a_public_key_is_32_bytes() -> None:
    with pytest.raises(ValueError):
        PublicKey(bytes(31))


@pytest.mark.parametrize("change", ["topic", "key", "value", "signature", "time", "unsigned", "key id"])
def test_any_change_to_a_signed_message_breaks_its_signature(registry: Registry, alice: Signer, change: str) -> None:
    key, value, headers = signed(alice, request())
    topic = TOPIC
    if change == "topic":
        topic = "arbiter.saga.commands"
    elif change == "key":
        key = b"ticket:2"
    elif change == "value":
        value = CODEC.encode(request(request_id="r2"))
    elif change == "signature":
        headers = [*headers[:2], ("arbiter-sig", bytes(64))]
    elif change == "time":
        headers = [headers[0], ("arbiter-at", b"11"), headers[2]]
    elif change == "unsigned":
        headers = []
    elif change == "key id":
        headers = [("arbiter-kid", b"0" * 32), *headers[1:]]
    verdict = registry.verify(topic, key, value, headers, appended_at_ms=100)
    assert isinstance(verdict, Refused) and verdict.reason == Reason.UNAUTHENTICATED


def test_a_key_nobody_registered_is_unauthenticated(registry: Registry) -> None:
    stranger = Signer.generate("alice")  # same name, another key
    key, value, headers = signed(stranger, request())
    verdict = registry.verify(TOPIC, key, value, headers, appended_at_ms=100)
    assert isinstance(verdict, Refused) and verdict.unknown_key and "unknown signing key" in verdict.detail


def test_the_registry_applies_only_what_an_admin_signed(registry: Registry) -> None:
    mallory = Signer.generate("mallory")
    assert isinstance(register(registry, entry(mallory, role="worker"), by=mallory), Refused)
    assert not registry.knows(mallory.key_id)
    # A record whose key id is not its public key's is refused even when the admin signed it.
    other = Signer.generate("x")
    assert isinstance(register(registry, entry(mallory, key_id=other.key_id)), Refused)


@pytest.mark.parametrize("status", [ROTATED, REVOKED])
def test_a_rotated_or_revoked_key_verifies_only_before_its_end(registry: Registry, alice: Signer, status: str) -> None:
    assert register(registry, entry(alice, status=status, valid_until_ms=1_000)) is None
    key, value, headers = signed(alice, request())
    assert isinstance(registry.verify(TOPIC, key, value, headers, appended_at_ms=999), Verified)
    late = registry.verify(TOPIC, key, value, headers, appended_at_ms=1_000)
    assert isinstance(late, Refused) and status in late.detail


@pytest.mark.parametrize("status", [ACTIVE, ROTATED])
def test_one_key_registered_twice_at_once_is_a_repeat_in_either_order(alice: Signer, status: str) -> None:
    """Two processes that register one key at once write two records that differ only in when they were
    written, and either may reach the log first: the second is a no-op, never a refusal (which the audit
    would call an intrusion), and the record in effect stays."""
    ended = {"valid_until_ms": 9_000} if status != ACTIVE else {}
    first = entry(alice, status=status, valid_from_ms=1_022, at_ms=1_022, **ended)
    second = entry(alice, status=status, valid_from_ms=1_000, at_ms=1_000, **ended)
    for one, other in ((first, second), (second, first)):
        registry = Registry([ADMIN.public_raw])
        assert register(registry, one) is None
        assert register(registry, other) is None and registry.repeats == 1
        assert registry.entries[alice.key_id] == one and not registry.refused
    # What differs in substance is still judged by the rule that records only move forward.
    registry = Registry([ADMIN.public_raw])
    assert register(registry, entry(alice, status=REVOKED, valid_until_ms=5_000, at_ms=2_000)) is None
    assert isinstance(register(registry, entry(alice, at_ms=3_000)), Refused)
    assert isinstance(register(registry, entry(alice, allow=["doc:"], at_ms=1)), Refused)
    assert registry.repeats == 0 and registry.entries[alice.key_id].status == REVOKED


def test_an_anchor_signs_as_admin_without_a_registry_record(registry: Registry) -> None:
    revoke = LockRevokeRequested(request_id="o1", resource="ticket:1", agent_id="alice", reason="stuck",
                                 requested_by="admin", at_ms=1)
    key, value, headers = signed(ADMIN, revoke)
    verdict = registry.verify(TOPIC, key, value, headers, appended_at_ms=100)
    assert isinstance(verdict, Verified) and verdict.role == "admin"


@given(st.text(min_size=0, max_size=30))
def test_reserved_and_path_like_names_are_refused(name: str) -> None:
    problem = valid_name(name)
    if name.startswith("saga:") or "/" in name or not name or name.strip() != name:
        assert problem is not None
    if problem is None:
        assert all(c.isascii() and (c.isalnum() or c in "-_.@:") for c in name)


def test_names_are_letters_digits_and_a_few_marks() -> None:
    for ok in ("triage-7", "agent_1", "worker", "drafter.js", "ops@acme", "team:ops", "7-of-nine"):
        assert valid_name(ok) is None, ok
    for bad in ("bad name!", "a b", "émile", "a/b", "-flag", ".hidden", "saga:x", "x" * 201, "tab\t"):
        assert valid_name(bad) is not None, bad
    assert "letters, digits" in (valid_name("bad name!") or "")


def test_key_files_are_private(tmp_path: Any) -> None:
    signer = Signer.generate("alice")
    path = key_file(tmp_path, "alice")
    assert write_private_key(path, signer)
    assert not write_private_key(path, Signer.generate("alice"))  # never over an existing key
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_private_key(path, "alice").key_id == signer.key_id
    path.chmod(0o644)
    with pytest.raises(IdentityError, match="readable by others"):
        read_private_key(path, "alice")


# -- who may send what --------------------------------------------------------------------

ALICE = IdentityRegistered(key_id="a", name="alice", role="agent", public_key=b"\0" * 32,
                           allow=["ticket:", "account:alice"], status=ACTIVE, valid_from_ms=1, at_ms=1)
WORKER = ALICE.model_copy(update={"name": "worker", "role": "worker", "allow": []})
OPERATOR = ALICE.model_copy(update={"name": "admin", "role": "admin", "allow": []})


def step(**changes: Any) -> SagaStep:
    values: dict[str, Any] = dict(saga_id="saga:alice/refund:1", step=0, agent_id="alice", status="completed",
                                  intent_id="i1", resource="account:alice", tool="refund", arguments_json="{}", at_ms=1)
    values.update(changes)
    return SagaStep(**values)


REVOKE = LockRevokeRequested(request_id="o1", resource="ticket:1", agent_id="bob", reason="stuck",
                             requested_by="admin", at_ms=1)
TICK = LockTick(request_id="t", partition=0, at_ms=1)
LOCK_EDGE = WaitEdgeAdded(edge_id="e", waiter="alice", holder="bob", source="lock", waiter_registered_at_ms=1,
                          at_ms=1)
DELEGATION = LOCK_EDGE.model_copy(update={"edge_id": "delegation|alice|bob|1", "source": "delegation"})


@pytest.mark.parametrize(("record", "why"), [
    (request(), None),
    (request(agent="bob"), "acts as 'bob'"),
    (request(resource="doc:1"), "only on resources"),
    (request(request_id="saga:alice/x|lock|0|1"), "namespace"),
    (LockReleaseRequested(request_id="r", agent_id="bob", resource="ticket:1", token=1, at_ms=1), "acts as"),
    (REVOKE, "only by workers"),
    (TICK, "only by workers"),
    (LOCK_EDGE, "delegation edges"),
    (DELEGATION, None),
    (DELEGATION.model_copy(update={"edge_id": "delegation|bob|alice|1"}), "delegation edges"),
    (step(), None),
    (step(saga_id="saga:bob/refund:1"), "is not 'alice'"),
    (step(resource="account:carol"), "only on resources"),
    (step(step=-1, status="saga_completed", resource=""), None),
    (CompensationRequested(saga_id="saga:alice/refund:1", reason="x", requested_by="alice", at_ms=1), None),
    (CompensationRequested(saga_id="saga:bob/refund:1", reason="x", requested_by="alice", at_ms=1), "is not"),
    (ToolIntent(intent_id="saga:alice/refund:1|undo|0|1", agent_id="alice", resource="account:alice", tool="t",
                arguments_json="{}", at_ms=1), "namespace"),
    (ToolIntent(intent_id="i", agent_id="alice", resource="account:alice", tool="t", arguments_json="{}",
                is_compensation=True, at_ms=1), "compensations"),
])
def test_an_agent_acts_only_as_itself_on_its_own_prefixes(record: Any, why: str | None) -> None:
    verdict = authorize(ALICE, record)
    if why is None:
        assert verdict is None
    else:
        assert verdict is not None and verdict[0] == Reason.FORBIDDEN and why in verdict[1], verdict


@pytest.mark.parametrize("record", [REVOKE, TICK, LOCK_EDGE, request(agent="saga:x/y:1"), step(agent_id="bob")])
def test_workers_send_what_the_processors_decided(record: Any) -> None:
    assert authorize(WORKER, record) is None


def test_an_admin_sends_overrides_with_a_reason_and_nothing_else() -> None:
    assert authorize(OPERATOR, REVOKE) is None
    assert authorize(OPERATOR, REVOKE.model_copy(update={"reason": " "})) is not None
    assert authorize(OPERATOR, REVOKE.model_copy(update={"requested_by": "someone-else"})) is not None
    assert authorize(OPERATOR, CompensationRequested(saga_id="saga:bob/x:1", reason="stuck", requested_by="admin",
                                                     at_ms=1)) is None
    denied = authorize(OPERATOR, request(agent="admin"))
    assert denied is not None and denied[0] == Reason.FORBIDDEN


def test_the_gate_combines_signature_and_rules(registry: Registry, alice: Signer) -> None:
    gate = Gate(registry)
    key, value, headers = signed(alice, request())
    assert isinstance(gate.admit(TOPIC, key, value, headers, request(), 100), Verified)
    forged = request(agent="bob")
    key, value, headers = signed(alice, forged)
    refused = gate.admit(TOPIC, key, value, headers, forged, 100)
    assert isinstance(refused, Refused) and refused.reason == Reason.FORBIDDEN
    assert Gate(registry, enabled=False).admit(TOPIC, key, value, [], forged, 100) is None


# -- batch signatures (one signature over a Merkle root; each message carries its proof) ----------


def batch(signer: Signer, n: int) -> list[tuple[str, bytes, bytes, list[tuple[str, bytes]]]]:
    messages = [(TOPIC if i % 2 else "arbiter.agent.inbox", f"k{i}".encode(), f"value {i}".encode()) for i in range(n)]
    return [(t, k, v, h) for (t, k, v), h in zip(messages, signer.sign_batch(messages, 10), strict=True)]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 65, 200])
def test_every_message_of_a_batch_verifies_on_its_own(registry: Registry, alice: Signer, n: int) -> None:
    signed_batch = batch(alice, n)
    assert len({h[2][1] for *_rest, h in signed_batch}) == -(-n // 64), "one signature per group of 64"
    for topic, key, value, headers in reversed(signed_batch):  # any order: each stands alone
        verdict = Registry([ADMIN.public_raw]) if n == 3 else registry  # a fresh registry has no cache
        if verdict is not registry:
            register(verdict, entry(alice))
        assert isinstance(verdict.verify(topic, key, value, headers, 20), Verified)


@pytest.mark.parametrize("change", ["value", "key", "topic", "proof-of-another", "proof-truncated",
                                    "proof-garbage", "no-proof"])
def test_a_changed_message_of_a_batch_is_refused_even_after_its_root_was_verified(
        registry: Registry, alice: Signer, change: str) -> None:
    signed_batch = batch(alice, 8)
    for topic, key, value, headers in signed_batch:  # every root is now verified (and cached)
        assert isinstance(registry.verify(topic, key, value, headers, 20), Verified)
    topic, key, value, headers = signed_batch[3]
    proof = dict(headers)["arbiter-proof"]
    if change == "value":
        value += b"!"
    elif change == "key":
        key = b"k4"
    elif change == "topic":
        topic = "arbiter.saga.commands"
    else:  # the proof: another message's, cut short, malformed, or none
        other = {"proof-of-another": dict(signed_batch[4][3])["arbiter-proof"], "proof-truncated": proof[:-33],
                 "proof-garbage": proof[:-1], "no-proof": None}[change]
        headers = [(h, v) for h, v in headers if h != "arbiter-proof"]
        if other is not None:
            headers.append(("arbiter-proof", other))
    verdict = registry.verify(topic, key, value, headers, 20)
    assert isinstance(verdict, Refused) and verdict.reason == Reason.UNAUTHENTICATED, change
