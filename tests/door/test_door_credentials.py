"""Front-door credentials: the agent's own key never travels, and each credential is revoked alone.

A recording TCP proxy sits between the clients (the SDK over the door's WebSocket session, and
curl over REST) and a real front door in front of a real worker; every byte the clients send is
searched for the agent's private key in each of its encodings. Then one of the agent's two
credentials is revoked: calls with it are refused (at the door, and by the workers for a command
signed with it), calls with the other keep working, and the audit passes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlparse

import pytest
from aiokafka import AIOKafkaProducer
from cryptography.hazmat.primitives import serialization

from arbiter.agents import ArbiterClient, DoorRefused
from arbiter.agents.identities import Registrar
from arbiter.edge.clock import now_ms
from arbiter.edge.settings import Settings
from arbiter.processes import DoorProcess
from arbiter.schemas import DeadLetter, LockRequested, default_codec
from arbiter.schemas.identity import Signer
from tests.conftest import assert_clean_audit
from tests.door.test_door_http import curl
from tests.streams.shells.test_trust_kafka import read_topic

pytestmark = pytest.mark.kafka


class Recorder:
    """A TCP proxy to ``target`` that keeps every byte its clients send."""

    def __init__(self, target: str) -> None:
        parsed = urlparse(target)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self.sent = bytearray()
        self.server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, keep: bool) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if keep:
                    self.sent += data
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        door_r, door_w = await asyncio.open_connection(self.host, self.port)
        await asyncio.gather(self._pipe(client_r, door_w, True), self._pipe(door_r, client_w, False))

    async def __aenter__(self) -> Recorder:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def encodings(signer: Signer) -> dict[str, bytes]:
    """Every form a private key could take on the wire."""
    raw = signer.private_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())
    pem = signer.private_pem()
    body = b"".join(line for line in pem.splitlines() if not line.startswith(b"-----"))
    return {"raw": raw, "base64": base64.b64encode(raw).rstrip(b"="),
            "base64url": base64.urlsafe_b64encode(raw).rstrip(b"="), "hex": raw.hex().encode(), "pem body": body,
            "pkcs8 der": base64.b64decode(body)}


@pytest.fixture
async def recorded(door: DoorProcess) -> AsyncIterator[Recorder]:
    async with Recorder(door.url) as recorder:
        yield recorder


async def test_the_agents_key_never_travels_and_one_credential_is_revoked_alone(
        kafka_settings: Settings, door: DoorProcess, recorded: Recorder) -> None:
    settings = kafka_settings
    registrar = Registrar(settings)
    alice = await registrar.add("alice", allow=["doc:alice/"])
    laptop, _ = await registrar.issue_credential("alice", label="laptop")
    ci, ci_entry = await registrar.issue_credential("alice", label="ci", allow=["doc:alice/ci/"])
    assert ci_entry.allow == ["doc:alice/ci/"] and laptop.key_id != alice.key_id != ci.key_id
    url = recorded.url

    # Both clients work, over the WebSocket session and over REST.
    async with ArbiterClient("alice", settings, url=url, api_key=laptop.api_key()) as sdk:
        lease = await sdk.acquire(f"doc:alice/{uuid.uuid4().hex}", ttl=10, wait=5)
        await sdk.release(lease)
    resource = f"doc:alice/ci/{uuid.uuid4().hex}"
    granted = await asyncio.to_thread(curl, "POST", f"{url}/v1/leases/acquire", key=ci.api_key(),
                                      body={"resource": resource, "ttl": 10})
    assert granted.status == 200, granted.text
    scoped = await asyncio.to_thread(curl, "POST", f"{url}/v1/leases/acquire", key=ci.api_key(),
                                     body={"resource": f"doc:alice/{uuid.uuid4().hex}", "ttl": 10})
    assert (scoped.status, scoped.json["reason"]) == (403, "forbidden"), scoped.text
    # What went over the wire: the credentials (bearer secrets), and never the agent's own key.
    wire = bytes(recorded.sent)
    assert laptop.api_key().encode() in wire and ci.api_key().encode() in wire, "the recorder saw nothing"
    leaked = [form for form, data in encodings(alice).items() if data in wire]
    assert leaked == [], f"the agent's private key crossed the wire as {leaked}"
    # And the agent's own key is refused as an API key (sent on purpose here, around the recorder).
    own = await asyncio.to_thread(curl, "POST", f"{door.url}/v1/leases/acquire", key=alice.api_key(),
                                  body={"resource": resource})
    assert own.status == 401 and "own signing key" in own.json["detail"], own.text

    # Revoke the laptop's credential alone.
    revoked = await registrar.revoke_credential("alice", "laptop", "laptop lost")
    refused = await asyncio.to_thread(curl, "POST", f"{url}/v1/leases/acquire", key=laptop.api_key(),
                                      body={"resource": f"doc:alice/{uuid.uuid4().hex}"})
    assert refused.status == 401 and "'laptop'" in refused.json["detail"], refused.text
    with pytest.raises(DoorRefused) as door_refused:
        async with ArbiterClient("alice", settings, url=url, api_key=laptop.api_key()):
            pass
    assert door_refused.value.status == 401
    still = await asyncio.to_thread(curl, "POST", f"{url}/v1/leases/acquire", key=ci.api_key(),
                                    body={"resource": f"doc:alice/ci/{uuid.uuid4().hex}", "ttl": 10})
    assert still.status == 200, still.text
    # A command signed with the revoked credential, straight to Kafka, is refused by the workers too.
    codec = default_codec()
    topic, name = settings.topics.resource_commands, f"doc:alice/{uuid.uuid4().hex}"
    late = codec.encode(LockRequested(request_id=uuid.uuid4().hex, agent_id="alice", resource=name,
                                      mode="exclusive", ttl_ms=10_000, wait_ms=0, at_ms=now_ms()))
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(topic, late, key=name.encode(),
                                     headers=laptop.sign(topic, name.encode(), late, now_ms()))
    finally:
        await producer.stop()
    assert revoked.valid_until_ms is not None
    letters = await read_topic(settings, settings.topics.dead_letter, until=lambda s: any(
        isinstance(m.record, DeadLetter) and m.record.value == late for m in s))
    (letter,) = [m.record for m in letters if isinstance(m.record, DeadLetter) and m.record.value == late]
    assert letter.reason == "unauthenticated" and "revoked" in letter.detail
    await assert_clean_audit(settings)
