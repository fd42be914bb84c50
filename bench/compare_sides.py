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
  order, the waiter watching only its predecessor) through etcd's JSON gRPC gateway,
  ``POST /v3/lock/lock`` / ``/v3/lock/unlock``, with ``aiohttp``. Why not a gRPC client: Debian's
  etcd-server is 3.4.23, and the maintained async client (``aetcd``) and ``etcd3`` (which
  needs protobuf pinned to 3.x) ship a lock of their own: one key taken by a transaction,
  every waiter watching it and racing when it goes, not etcd's queue. The gateway is part of
  etcd (on its client port, on by default); it costs a JSON decode and a loopback gRPC hop per
  call, which shows in etcd's CPU. Why aiohttp, not httpx: measured here on this lock/unlock
  loop, httpx spent ~1.4 ms of client CPU per request and aiohttp ~0.35 ms; with httpx the
  client, not etcd, set the pace. Each locker holds one lease (a session, as etcd's clients
  do), granted with a TTL of 300 s when the locker starts and revoked when it closes.
- ZooKeeper: kazoo's ``Lock`` recipe (an ephemeral sequential node under the name; each waiter
  watches its predecessor), one ``KazooClient`` session per locker. kazoo's API blocks, so each
  call runs on a thread of a pool sized for the workload.
- Redis: redis-py's asyncio ``Lock`` (``SET name token NX PX``; release is a Lua script that
  deletes the key if it still holds the token), with its defaults: a blocked ``acquire``
  polls every 0.1 s, so a hand-off waits for the next poll. That is how the library works.
"""

from __future__ import annotations

import asyncio
import base64
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

def _b64(data: str) -> str:
    return base64.b64encode(data.encode()).decode()


class EtcdLocker:
    def __init__(self, http: Any, lease: str) -> None:
        self.http = http
        self.lease = lease

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.http.post(path, json=body) as response:
            response.raise_for_status()
            answer: dict[str, Any] = await response.json()
            return answer

    async def acquire(self, name: str) -> Held:
        started = time.perf_counter()
        answer = await self._post("/v3/lock/lock", {"name": _b64(name), "lease": self.lease})
        # The key's create revision (<= answer["header"]["revision"]) orders holders: a fencing token.
        return Held(name, started, time.perf_counter(), answer["key"])

    async def release(self, held: Held) -> float:
        at = time.perf_counter()
        await self._post("/v3/lock/unlock", {"key": held.handle})
        return at

    async def warm(self, concurrency: int) -> None:
        await asyncio.gather(*(self._post("/v3/kv/range", {"key": _b64("warm")}) for _ in range(concurrency)))


class EtcdSide:
    title = "etcd"

    def __init__(self, port: int, pid: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.pid = pid

    def server_pids(self) -> list[int]:
        return [self.pid]

    async def lockers(self, count: int, concurrency: int = 1) -> list[Locker]:
        import aiohttp

        async def one() -> Locker:
            http = aiohttp.ClientSession(self.base, connector=aiohttp.TCPConnector(limit=concurrency),
                                         timeout=aiohttp.ClientTimeout(total=180))
            locker = EtcdLocker(http, "")
            locker.lease = (await locker._post("/v3/lease/grant", {"TTL": ETCD_SESSION_TTL_S}))["ID"]
            return locker

        return list(await asyncio.gather(*(one() for _ in range(count))))

    async def close_lockers(self, lockers: list[Locker]) -> None:
        async def close(locker: EtcdLocker) -> None:
            try:
                await locker._post("/v3/lease/revoke", {"ID": locker.lease})  # drops its keys too
            finally:
                await locker.http.close()

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
