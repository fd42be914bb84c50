"""One lock client per system for ``bench compare``: Arbiter's SDK, etcd, ZooKeeper, Redis.

Each ``Side`` hands out ``Locker``s: one locker is one client (its own connection or
session), with ``acquire(name) -> Held`` (blocks until granted, waiting in the system's
queue) and ``release(held)``. ``Held.started``/``Held.granted`` are ``perf_counter`` times
taken next to the library call (for ZooKeeper inside the thread that runs kazoo's
blocking recipe, so the hop to that thread is not counted in a latency); ``release``
returns the time just before the release went out.

The clients, and why:

- Arbiter: the public SDK, ``ArbiterClient(agent, settings)``, ``acquire(name, ttl=30)`` and
  ``release(lease)``, one client per locker, against a worker of its own (``bench_arbiter``).
- etcd: etcd's own lock service (``v3lockpb.Lock``, what ``etcdctl lock`` and Go's
  ``concurrency.Mutex`` use: a key under the name per session lease, granted in create-revision
  order, the waiter watching only its predecessor), called over native gRPC (``grpcio``, its
  asyncio API), the path etcd's own clients take. The few messages involved (a lease grant and
  revoke, Lock, Unlock) are encoded here by hand (``_pb``): the maintained Python clients
  (``aetcd``, ``etcd3``, which needs protobuf 3.x) ship a lock of their own (one key taken by a
  transaction, every waiter racing when it goes), not etcd's queue. Each locker is one channel
  (its own HTTP/2 connection) holding one lease, a session as etcd's clients have, granted with a
  TTL of 300 s when the locker starts and revoked when it closes. (Earlier runs went through
  etcd's JSON gateway, ``POST /v3/lock/lock``: a JSON decode and a second, loopback gRPC hop per
  call, which flattered Arbiter.)
- ZooKeeper: kazoo's ``Lock`` recipe (an ephemeral sequential node under the name; each waiter
  watches its predecessor), one ``KazooClient`` session per locker. kazoo's API blocks, so each
  call runs on a thread of a pool sized for the workload.
- Redis: redis-py's asyncio ``Lock`` (``SET name token NX PX``; release is a Lua script that
  deletes the key if it still holds the token), with its defaults: a blocked ``acquire``
  polls every 0.1 s, so a hand-off waits for the next poll. That is how the library works.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from arbiter.edge.settings import Settings

T = TypeVar("T")
LEASE_TTL_S = 30  # the lock's TTL where a lock has one (Arbiter, Redis); etcd's session lease is longer
ETCD_SESSION_TTL_S = 300


@dataclass
class Held:
    name: str
    started: float
    granted: float
    handle: Any


class Locker(Protocol):
    async def acquire(self, name: str) -> Held: ...
    async def release(self, held: Held) -> float: ...
    async def warm(self, concurrency: int) -> None:
        """Open the connections ``concurrency`` calls at once need, before anything is timed."""
        ...


class Side(Protocol):
    title: str

    def server_pids(self) -> list[int]: ...
    async def lockers(self, count: int, concurrency: int = 1) -> list[Locker]:
        """``count`` clients; each may have ``concurrency`` calls outstanding at once."""
        ...
    async def close_lockers(self, lockers: list[Locker]) -> None: ...


# -- Arbiter ----------------------------------------------------------------------------

class ArbiterLocker:
    def __init__(self, client: Any) -> None:
        self.client = client

    async def acquire(self, name: str) -> Held:
        started = time.perf_counter()
        lease = await self.client.acquire(name, ttl=LEASE_TTL_S, wait=120)
        return Held(name, started, time.perf_counter(), lease)

    async def release(self, held: Held) -> float:
        at = time.perf_counter()
        await self.client.release(held.handle)
        return at

    async def warm(self, concurrency: int) -> None:
        pass  # one producer connection, open since start


class ArbiterSide:
    title = "Arbiter"

    def __init__(self, settings: Settings, pids: list[int]) -> None:
        self.settings = settings
        self.pids = pids
        self._made = 0

    def server_pids(self) -> list[int]:
        return self.pids

    async def lockers(self, count: int, concurrency: int = 1) -> list[Locker]:
        from arbiter.agents import ArbiterClient

        # Agent ids are reused across runs: each is enrolled (issued a key) once.
        clients = [ArbiterClient(f"compare-{i}", self.settings) for i in range(count)]
        await asyncio.gather(*(c.start() for c in clients))
        return [ArbiterLocker(c) for c in clients]

    async def close_lockers(self, lockers: list[Locker]) -> None:
        await asyncio.gather(*(locker.client.close() for locker in lockers if isinstance(locker, ArbiterLocker)))


# -- etcd -------------------------------------------------------------------------------

class _pb:
    """The protobuf wire format of the handful of etcd messages used here (fields by number)."""

    @staticmethod
    def varint(value: int) -> bytes:
        value &= (1 << 64) - 1  # int64: two's complement
        out = bytearray()
        while True:
            byte, value = value & 0x7F, value >> 7
            out.append(byte | (0x80 if value else 0))
            if not value:
                return bytes(out)

    @classmethod
    def message(cls, *fields: tuple[int, int | bytes]) -> bytes:
        out = bytearray()
        for number, value in fields:
            if isinstance(value, bytes):
                out += cls.varint(number << 3 | 2) + cls.varint(len(value)) + value
            else:
                out += cls.varint(number << 3) + cls.varint(value)
        return bytes(out)

    @staticmethod
    def fields(data: bytes) -> dict[int, int | bytes]:
        """Each field's last value (varints and length-delimited fields: all these messages have)."""
        out: dict[int, int | bytes] = {}
        at = 0

        def varint() -> int:
            nonlocal at
            value = shift = 0
            while True:
                byte = data[at]
                at += 1
                value |= (byte & 0x7F) << shift
                shift += 7
                if not byte & 0x80:
                    return value

        while at < len(data):
            tag = varint()
            number, kind = tag >> 3, tag & 7
            if kind == 0:
                out[number] = varint()
            elif kind == 2:
                size = varint()
                out[number] = data[at:at + size]
                at += size
            else:
                raise ValueError(f"protobuf wire type {kind} is not used by these messages")
        return out


class EtcdLocker:
    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.lease = 0
        calls = {name: channel.unary_unary(path) for name, path in (
            ("grant", "/etcdserverpb.Lease/LeaseGrant"), ("revoke", "/etcdserverpb.Lease/LeaseRevoke"),
            ("lock", "/v3lockpb.Lock/Lock"), ("unlock", "/v3lockpb.Lock/Unlock"), ("range", "/etcdserverpb.KV/Range"))}
        self._calls = calls

    async def call(self, name: str, *fields: tuple[int, int | bytes]) -> dict[int, int | bytes]:
        return _pb.fields(await self._calls[name](_pb.message(*fields), timeout=180))

    async def start(self) -> EtcdLocker:
        granted = await self.call("grant", (1, ETCD_SESSION_TTL_S))  # LeaseGrantRequest.TTL
        self.lease = int(granted[2])  # LeaseGrantResponse.ID
        return self

    async def acquire(self, name: str) -> Held:
        started = time.perf_counter()
        answer = await self.call("lock", (1, name.encode()), (2, self.lease))  # LockRequest{name, lease}
        # LockResponse.key: the key's create revision orders holders, a fencing token.
        return Held(name, started, time.perf_counter(), answer[2])

    async def release(self, held: Held) -> float:
        at = time.perf_counter()
        await self.call("unlock", (1, held.handle))  # UnlockRequest{key}
        return at

    async def warm(self, concurrency: int) -> None:
        await asyncio.gather(*(self.call("range", (1, b"warm")) for _ in range(concurrency)))


class EtcdSide:
    title = "etcd"

    def __init__(self, port: int, pid: int) -> None:
        self.target = f"127.0.0.1:{port}"
        self.pid = pid

    def server_pids(self) -> list[int]:
        return [self.pid]

    async def lockers(self, count: int, concurrency: int = 1) -> list[Locker]:
        import grpc

        async def one() -> Locker:
            # Each its own connection (a subchannel of its own, not grpc's shared one per target).
            channel = grpc.aio.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)])
            return await EtcdLocker(channel).start()

        return list(await asyncio.gather(*(one() for _ in range(count))))

    async def close_lockers(self, lockers: list[Locker]) -> None:
        async def close(locker: EtcdLocker) -> None:
            try:
                await locker.call("revoke", (1, locker.lease))  # drops its keys too
            finally:
                await locker.channel.close()

        await asyncio.gather(*(close(locker) for locker in lockers if isinstance(locker, EtcdLocker)))


# -- ZooKeeper --------------------------------------------------------------------------

class ZooKeeperLocker:
    def __init__(self, side: ZooKeeperSide, client: Any) -> None:
        self.side = side
        self.client = client

    async def acquire(self, name: str) -> Held:
        def blocking() -> Held:
            lock = self.client.Lock(f"{self.side.root}/{name}")
            started = time.perf_counter()
            lock.acquire()  # the node's sequence number orders holders: a fencing token
            return Held(name, started, time.perf_counter(), lock)

        return await self.side.in_thread(blocking)

    async def release(self, held: Held) -> float:
        def blocking() -> float:
            at = time.perf_counter()
            held.handle.release()
            return at

        return await self.side.in_thread(blocking)

    async def warm(self, concurrency: int) -> None:
        pass  # one session; the pool's threads start on first use, cheaply


class ZooKeeperSide:
    title = "ZooKeeper"

    def __init__(self, port: int, pid: int, run: str) -> None:
        self.hosts = f"127.0.0.1:{port}"
        self.pid = pid
        self.root = f"/compare-{run}"
        self._pool = ThreadPoolExecutor(max_workers=96, thread_name_prefix="kazoo-call")
        self._lock = threading.Lock()

    def server_pids(self) -> list[int]:
        return [self.pid]

    async def in_thread(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def lockers(self, count: int, concurrency: int = 1) -> list[Locker]:
        from kazoo.client import KazooClient

        def one() -> Locker:
            client = KazooClient(hosts=self.hosts, timeout=30.0)
            client.start(timeout=30)
            return ZooKeeperLocker(self, client)

        return list(await asyncio.gather(*(self.in_thread(one) for _ in range(count))))

    async def close_lockers(self, lockers: list[Locker]) -> None:
        def close(locker: ZooKeeperLocker) -> None:
            locker.client.stop()
            locker.client.close()

        await asyncio.gather(*(self.in_thread(lambda lk=lk: close(lk))  # type: ignore[misc]
                               for lk in lockers if isinstance(lk, ZooKeeperLocker)))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# -- Redis ------------------------------------------------------------------------------

class RedisLocker:
    def __init__(self, client: Any) -> None:
        self.client = client

    async def acquire(self, name: str) -> Held:
        lock = self.client.lock(name, timeout=LEASE_TTL_S)  # redis-py's defaults: sleep=0.1 between polls
        started = time.perf_counter()
        await lock.acquire()
        return Held(name, started, time.perf_counter(), lock)

    async def release(self, held: Held) -> float:
        at = time.perf_counter()
        await held.handle.release()
        return at

    async def warm(self, concurrency: int) -> None:
        await asyncio.gather(*(self.client.ping() for _ in range(concurrency)))


class RedisSide:
    title = "Redis"

    def __init__(self, port: int, pid: int) -> None:
        self.port = port
        self.pid = pid

    def server_pids(self) -> list[int]:
        return [self.pid]

    async def lockers(self, count: int, concurrency: int = 1) -> list[Locker]:
        from redis.asyncio import BlockingConnectionPool, Redis

        lockers: list[Locker] = []
        for _ in range(count):
            pool = BlockingConnectionPool(host="127.0.0.1", port=self.port, max_connections=concurrency,
                                          timeout=None)
            client = Redis(connection_pool=pool)
            await client.ping()
            lockers.append(RedisLocker(client))
        return lockers

    async def close_lockers(self, lockers: list[Locker]) -> None:
        for locker in lockers:
            if isinstance(locker, RedisLocker):
                await locker.client.aclose()
                await locker.client.connection_pool.disconnect()
