"""A first check that the front door runs in tests (replaced by tests/test_door*.py)."""

import pytest

from agents import ArbiterClient

pytestmark = pytest.mark.kafka


async def test_sdk_over_the_door(kafka_settings, door):
    from agents.identities import Registrar

    signer = await Registrar(kafka_settings).add("alice")
    async with ArbiterClient("alice", kafka_settings, url=door.url, api_key=signer.api_key()) as client:
        lease = await client.acquire("doc:1", ttl=5)
        assert lease.token == 1
        await client.release(lease)
