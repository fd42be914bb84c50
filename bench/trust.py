"""What the trust boundary costs: signing and verifying one command in-process, and the grant
latency through Kafka and a worker with verification on versus off, in one run."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Callable
from contextlib import AsyncExitStack

from arbiter.agents import ArbiterClient
from arbiter.edge.clock import now_ms
from arbiter.edge.settings import Settings
from arbiter.schemas import IdentityRegistered, LockRequested, default_codec
from arbiter.schemas.identity import ACTIVE, ROLE_ADMIN, ROLE_AGENT, Refused, Registry, Signer, Verified
from arbiter.streams.cores.trust import authorize
from arbiter.streams.shells.trust import Gate

from .env import bench_arbiter


def crypto(seconds: float) -> None:
    """Microseconds per signature, per verification and per gate admission of a typical acquire."""
    codec = default_codec()
    topic, registry_topic = "arbiter.resource.commands", "arbiter.registry"
    admin, agent = Signer.generate(ROLE_ADMIN), Signer.generate("billing-agent")
    registry = Registry([admin.public_raw])
    at = now_ms()
    entry = IdentityRegistered(key_id=agent.key_id, name=agent.name, role=ROLE_AGENT, public_key=agent.public_raw,
                               allow=["ticket:"], status=ACTIVE, valid_from_ms=at, at_ms=at)
    entry_value, entry_key = codec.encode(entry), agent.key_id.encode()
    refused = registry.apply(registry_topic, entry_key, entry_value,
                             admin.sign(registry_topic, entry_key, entry_value, at), entry)
    assert refused is None, refused

    # What the SDK sends for ``client.acquire("ticket:cust_8492", ttl=30, wait=0)``.
    record = LockRequested(request_id=uuid.uuid4().hex, agent_id=agent.name, resource="ticket:cust_8492",
                           mode="exclusive", ttl_ms=30_000, wait_ms=0, at_ms=at)
    key, value = record.resource.encode(), codec.encode(record)
    headers = agent.sign(topic, key, value, at)
    appended = at + 1
    gate = Gate(registry)
    assert isinstance(registry.verify(topic, key, value, headers, appended), Verified)
    assert isinstance(gate.admit(topic, key, value, headers, record, appended), Verified)
    assert authorize(entry, record) is None
    forged = [(name, bytes(64) if name == "arbiter-sig" else raw) for name, raw in headers]
    assert isinstance(registry.verify(topic, key, value, forged, appended), Refused)

    header_bytes = sum(len(name) + len(raw) for name, raw in headers)
    print(f"trust crypto, LockRequested of {len(value)} bytes, signature headers {header_bytes} bytes, one thread:")
    cases: list[tuple[str, Callable[[], object]]] = [
        ("codec decode (for scale)", lambda: codec.decode(value)),
        ("Signer.sign", lambda: agent.sign(topic, key, value, at)),
        ("Registry.verify", lambda: registry.verify(topic, key, value, headers, appended)),
        ("Registry.verify, forged", lambda: registry.verify(topic, key, value, forged, appended)),
        ("arbiter.streams.cores.trust.authorize", lambda: authorize(entry, record)),
        ("Gate.admit (verify+authorize)", lambda: gate.admit(topic, key, value, headers, record, appended)),
    ]
    # Short runs of each case in turn, repeated: the median per case shrugs off bursts of other load.
    repeats = 5
    rates: dict[str, list[float]] = {label: [] for label, _ in cases}
    for _ in range(repeats):
        for label, fn in cases:
            count, start = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds / repeats:
                for _ in range(100):
                    fn()
                count += 100
            rates[label].append(count / elapsed)
    for label, _ in cases:
        rate = statistics.median(rates[label])
        print(f"  {label:30s} {rate:>10,.0f} ops/s  {1e6 / rate:7.1f} µs/op  (median of {repeats})")


def _q(samples: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(samples, n=100, method="inclusive")
    return q[49], q[98]


async def _acquire_release(client: ArbiterClient, prefix: str, count: int, rate: float,
                           acquires: list[float], releases: list[float]) -> None:
    """``count`` uncontended acquire→granted and release→released round trips at ``rate``."""
    interval, next_at = 1.0 / rate, time.perf_counter()
    for i in range(count):
        started = time.perf_counter()
        lease = await client.acquire(f"{prefix}:{i}", ttl=30, wait=0)
        granted = time.perf_counter()
        await client.release_token(lease.resource, lease.token)
        acquires.append((granted - started) * 1000)
        releases.append((time.perf_counter() - granted) * 1000)
        next_at += interval
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))


async def latency(rate: float, count: int, rounds: int = 6) -> None:
    """Grant latency with verification on and off: two Arbiters (own topics, app id, home and
    worker) up side by side, measured in alternating rounds so drift in the machine's load hits
    both alike. On: the SDK signs, the worker verifies and signs, the SDK verifies the inbox.
    Off: ``verify_signatures=False`` for worker and client (the client sends unsigned)."""
    setups = {"on": {"auto_enroll": True}, "off": {"verify_signatures": False}}
    per_round = max(1, count // rounds)
    acquires: dict[str, list[float]] = {name: [] for name in setups}
    releases: dict[str, list[float]] = {name: [] for name in setups}
    round_p50: dict[str, list[float]] = {name: [] for name in setups}
    async with AsyncExitStack() as stack:
        clients: dict[str, ArbiterClient] = {}
        for name, overrides in setups.items():
            settings: Settings = await stack.enter_async_context(bench_arbiter(**overrides))
            assert settings.verify_signatures == (name == "on")
            clients[name] = await stack.enter_async_context(ArbiterClient("bench-agent", settings))
            # Warm-up (discarded): the worker learns the new agent key, first-use paths are taken.
            await _acquire_release(clients[name], f"warmup:{name}", 30, rate, [], [])
        for r in range(rounds):
            order = list(setups) if r % 2 == 0 else list(reversed(setups))
            for name in order:
                samples: list[float] = []
                await _acquire_release(clients[name], f"trust:{name}:{r}", per_round, rate, samples, releases[name])
                acquires[name] += samples
                round_p50[name].append(statistics.median(samples))
    print(f"trust latency, uncontended acquire→granted and release→released at ~{rate:.0f}/s, one worker each, "
          f"{rounds} alternating rounds of {per_round}:")
    print(f"  {'verification':12s} {'acquire p50':>11s} {'p99':>8s} {'release p50':>11s} {'p99':>8s} {'ops':>6s}"
          f"   acquire p50 per round")
    for name in setups:
        a50, a99 = _q(acquires[name])
        r50, r99 = _q(releases[name])
        per = "  ".join(f"{p:.2f}" for p in round_p50[name])
        print(f"  {name:12s} {a50:8.2f} ms {a99:5.2f} ms {r50:8.2f} ms {r99:5.2f} ms {len(acquires[name]):6d}   {per}")
    acquire_diff = _q(acquires["on"])[0] - _q(acquires["off"])[0]
    release_diff = _q(releases["on"])[0] - _q(releases["off"])[0]
    paired = statistics.median(on - off for on, off in zip(round_p50["on"], round_p50["off"], strict=True))
    verdict = "within" if acquire_diff <= 1.0 else "OVER"
    print(f"  p50 difference on - off: acquire {acquire_diff:+.2f} ms, release {release_diff:+.2f} ms "
          f"({verdict} the 1 ms budget); acquire, median of the per-round differences: {paired:+.2f} ms")
