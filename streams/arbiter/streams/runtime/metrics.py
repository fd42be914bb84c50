"""A worker's Prometheus metrics: what it decided, how fast, and how far behind it is.

Counted from each input's outcome, in the one place every input passes (``Worker._decide``): the
events an input led to (a decision is sent to several topics; it is counted once), its dead letter,
and the time from the command's append to its decision. Lag is set after each batch from the
consumer's high-water marks; leases held and queued are read from the lease books at scrape time.

Labels are bounded: a resource is labelled by its prefix (``doc`` for ``doc:42``; at most
``MAX_PREFIXES`` of them, the rest ``other``), never by its name; reasons are the stable codes;
partitions are the topic's partitions. Names follow Prometheus' conventions: ``arbiter_`` prefix,
``_total`` counters, base units (seconds). ``ARBITER_METRICS_PORT`` serves them on ``/metrics``.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import Any, cast
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from arbiter.edge.hosts import HostNames
from arbiter.schemas import (
    Compensated,
    DeadLetter,
    DeadlockDetected,
    LockCancelled,
    LockDenied,
    LockExpired,
    LockGranted,
    LockQueued,
    LockReleased,
    LockRenewed,
    LockRevoked,
    LockWaitTimedOut,
    Record,
    SagaFinished,
    ToolApplied,
    ToolRejected,
)
from arbiter.schemas.reasons import Reason

MAX_PREFIXES = 64
"""Distinct resource prefixes a worker labels; past them a prefix is ``other`` (a label set stays bounded)."""
PREFIX = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
CODE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,47}$")


def code(reason: str) -> str:
    """A reason as a label: the stable codes pass; anything else (free text, should one ever come) is
    ``other``, so a label set stays bounded whatever a record carries."""
    return reason if CODE.match(reason) else "other"
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)

NAMES = (
    "arbiter_lease_grants_total", "arbiter_lease_queued_total", "arbiter_lease_renewals_total",
    "arbiter_lease_releases_total", "arbiter_lease_expiries_total", "arbiter_lease_revocations_total",
    "arbiter_lease_denials_total", "arbiter_lease_wait_timeouts_total", "arbiter_lease_cancellations_total",
    "arbiter_lease_ttl_seconds", "arbiter_lease_hold_seconds", "arbiter_lease_wait_seconds",
    "arbiter_leases_held", "arbiter_lease_queue_depth", "arbiter_gateway_decisions_total",
    "arbiter_deadlocks_total", "arbiter_deadlock_victims_total", "arbiter_sagas_finished_total",
    "arbiter_saga_compensations_total", "arbiter_decision_latency_seconds", "arbiter_inputs_total",
    "arbiter_dead_letters_total", "arbiter_quarantined_inputs_total", "arbiter_signature_failures_total",
    "arbiter_partition_lag_messages", "arbiter_partition_lag_seconds", "arbiter_partitions_owned",
)
"""Every metric a worker exports (docs/metrics.md's table and the Grafana dashboard name only these)."""


class Prefixes:
    """A resource's label: its prefix, among the first ``MAX_PREFIXES`` seen (others: ``other``)."""

    def __init__(self, limit: int = MAX_PREFIXES) -> None:
        self.limit = limit
        self.seen: set[str] = set()

    def __call__(self, resource: str) -> str:
        head = resource.split(":", 1)[0] if ":" in resource else ""
        if not PREFIX.match(head):
            return "other"
        if head in self.seen:
            return head
        if len(self.seen) >= self.limit:
            return "other"
        self.seen.add(head)
        return head


class _Books(Collector):
    """Leases held and queued per prefix, read from the lease books when scraped."""

    def __init__(self, books: Callable[[], Mapping[bytes, Any] | None], prefixes: Prefixes) -> None:
        self.books = books
        self.prefixes = prefixes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = GaugeMetricFamily("arbiter_leases_held", "Live leases on this worker's partitions, by resource prefix",
                                 labels=["prefix"])
        queued = GaugeMetricFamily("arbiter_lease_queue_depth", "Requests waiting in lease queues on this worker's "
                                   "partitions, by resource prefix", labels=["prefix"])
        counts: dict[str, list[int]] = {}
        for book in _snapshot(self.books()):
            resource = getattr(book, "resource", "")
            row = counts.setdefault(self.prefixes(resource), [0, 0])
            row[0] += len(getattr(book, "holders", None) or ())
            row[1] += len(getattr(book, "queue", None) or ())
        for prefix, (h, q) in sorted(counts.items()):
            held.add_metric([prefix], h)
            queued.add_metric([prefix], q)
        yield held
        yield queued


def _snapshot(books: Mapping[bytes, Any] | None) -> list[Any]:
    """The books' values, read from the scrape thread while the worker runs (retried if they change)."""
    if books is None:
        return []
    for _ in range(5):
        try:
            return list(books.values())
        except RuntimeError:  # changed size during the copy
            continue
    return []


class WorkerMetrics:
    """One worker's metrics, on a registry of its own."""

    def __init__(self, books: Callable[[], Mapping[bytes, Any] | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        self.prefix = Prefixes()
        r = self.registry
        self.grants = Counter("arbiter_lease_grants", "Leases granted", ["prefix", "mode"], registry=r)
        self.queued = Counter("arbiter_lease_queued", "Lease requests that waited in a queue", ["prefix"], registry=r)
        self.renewals = Counter("arbiter_lease_renewals", "Leases renewed", ["prefix"], registry=r)
        self.releases = Counter("arbiter_lease_releases", "Leases released", ["prefix"], registry=r)
        self.expiries = Counter("arbiter_lease_expiries", "Leases expired (their holder went silent)", ["prefix"],
                                registry=r)
        self.revocations = Counter("arbiter_lease_revocations", "Leases revoked by an operator", ["prefix"],
                                   registry=r)
        self.denials = Counter("arbiter_lease_denials", "Lease commands refused, by reason", ["prefix", "reason"],
                               registry=r)
        self.wait_timeouts = Counter("arbiter_lease_wait_timeouts", "Queued requests that waited out their wait",
                                     ["prefix"], registry=r)
        self.cancellations = Counter("arbiter_lease_cancellations", "Queued requests withdrawn or cancelled",
                                     ["prefix", "reason"], registry=r)
        self.ttl = Histogram("arbiter_lease_ttl_seconds", "The TTL of each lease granted", ["prefix"],
                             buckets=SECONDS, registry=r)
        self.hold = Histogram("arbiter_lease_hold_seconds", "How long leases were held, until released, expired "
                              "or revoked", ["prefix", "end"], buckets=SECONDS, registry=r)
        self.wait = Histogram("arbiter_lease_wait_seconds", "From an acquire's sending to its grant (the queue "
                              "wait included)", ["prefix"], buckets=SECONDS, registry=r)
        self.gateway = Counter("arbiter_gateway_decisions", "Tool intents decided by the gateway, by outcome and "
                               "reason", ["prefix", "outcome", "reason"], registry=r)
        self.deadlocks = Counter("arbiter_deadlocks", "Wait-for cycles detected", registry=r)
        self.victims = Counter("arbiter_deadlock_victims", "Agents chosen to break a deadlock", registry=r)
        self.sagas = Counter("arbiter_sagas_finished", "Sagas finished, by outcome", ["outcome"], registry=r)
        self.compensations = Counter("arbiter_saga_compensations", "Saga steps compensated", registry=r)
        self.latency = Histogram("arbiter_decision_latency_seconds", "From a command's append to its decision, by "
                                 "processor", ["processor"], buckets=SECONDS, registry=r)
        self.inputs = Counter("arbiter_inputs", "Inputs decided, by processor", ["processor"], registry=r)
        self.dead_letters = Counter("arbiter_dead_letters", "Inputs dead-lettered, by reason", ["reason"], registry=r)
        self.quarantined = Counter("arbiter_quarantined_inputs", "Inputs a stage failed on (quarantined), by stage",
                                   ["stage"], registry=r)
        self.signatures = Counter("arbiter_signature_failures", "Inputs refused by the trust gate, by reason",
                                  ["reason"], registry=r)
        self.lag_messages = Gauge("arbiter_partition_lag_messages", "Inputs appended but not yet decided",
                                  ["topic", "partition"], registry=r)
        self.lag_seconds = Gauge("arbiter_partition_lag_seconds", "Age of the oldest input not yet decided (0 when "
                                 "caught up)", ["topic", "partition"], registry=r)
        self.owned = Gauge("arbiter_partitions_owned", "Input partitions this worker decides", registry=r)
        r.register(_Books(books, self.prefix))
        self._granted: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def _of(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept: the label sets are bounded, and a decision is the hot path."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    # -- one input

    def observe(self, processor: str, appended_ms: int, records: Iterable[Record], letter: DeadLetter | None,
                stage: str, now_ms: int | None = None) -> None:
        """Count what one input led to: its distinct output records, its dead letter, its latency."""
        now = time.time() * 1000 if now_ms is None else now_ms
        self._of(self.inputs, processor).inc()
        if appended_ms > 0:
            self._of(self.latency, processor).observe(max(0.0, now - appended_ms) / 1000)
        seen: set[int] = set()
        for record in records:
            if id(record) in seen or isinstance(record, DeadLetter):
                continue
            seen.add(id(record))
            self._record(record)
        if letter is not None:
            self._of(self.dead_letters, code(letter.reason)).inc()
            if letter.reason == Reason.PROCESSOR_FAILED.value:
                self._of(self.quarantined, stage).inc()
            if stage == "trust" and letter.reason == Reason.UNAUTHENTICATED.value:
                self._of(self.signatures, code(letter.reason)).inc()

    def _record(self, record: Record) -> None:
        if isinstance(record, LockGranted):
            prefix = self.prefix(record.resource)
            self._of(self.grants, prefix, record.mode).inc()
            self._of(self.ttl, prefix).observe(max(0, record.expires_at_ms - record.at_ms) / 1000)
            if record.request_sent_at_ms:
                self._of(self.wait, prefix).observe(max(0, record.at_ms - record.request_sent_at_ms) / 1000)
            self._remember(record.resource, record.token, record.at_ms)
        elif isinstance(record, LockQueued):
            self._of(self.queued, self.prefix(record.resource)).inc()
        elif isinstance(record, LockRenewed):
            self._of(self.renewals, self.prefix(record.resource)).inc()
        elif isinstance(record, LockReleased):
            self._of(self.releases, self.prefix(record.resource)).inc()
            self._ended(record.resource, record.token, record.at_ms, "released")
        elif isinstance(record, LockExpired):
            self._of(self.expiries, self.prefix(record.resource)).inc()
            self._ended(record.resource, record.token, record.at_ms, "expired")
        elif isinstance(record, LockRevoked):
            self._of(self.revocations, self.prefix(record.resource)).inc()
            self._ended(record.resource, record.token, record.at_ms, "revoked")
        elif isinstance(record, LockDenied):
            self._of(self.denials, self.prefix(record.resource), code(record.reason)).inc()
        elif isinstance(record, LockWaitTimedOut):
            self._of(self.wait_timeouts, self.prefix(record.resource)).inc()
        elif isinstance(record, LockCancelled):
            self._of(self.cancellations, self.prefix(record.resource), code(record.reason)).inc()
        elif isinstance(record, ToolApplied):
            self._of(self.gateway, self.prefix(record.resource), "applied", "applied").inc()
        elif isinstance(record, ToolRejected):
            self._of(self.gateway, self.prefix(record.resource), "rejected", code(record.reason)).inc()
        elif isinstance(record, DeadlockDetected):
            self.deadlocks.inc()
            self.victims.inc()
        elif isinstance(record, SagaFinished):
            self._of(self.sagas, code(record.outcome)).inc()
        elif isinstance(record, Compensated):
            self.compensations.inc()

    def _remember(self, resource: str, token: int, at_ms: int) -> None:
        self._granted[(resource, token)] = at_ms
        while len(self._granted) > 100_000:  # leases held across a rebalance are never ended here
            self._granted.popitem(last=False)

    def _ended(self, resource: str, token: int, at_ms: int, end: str) -> None:
        granted = self._granted.pop((resource, token), None)
        if granted is not None:
            self._of(self.hold, self.prefix(resource), end).observe(max(0, at_ms - granted) / 1000)

    # -- the partitions

    def lag(self, topic: str, partition: int, behind: int, oldest_ms: int | None) -> None:
        """Set one partition's lag: ``behind`` inputs not yet decided, the oldest appended at ``oldest_ms``."""
        self.lag_messages.labels(topic, str(partition)).set(max(0, behind))
        age = 0.0 if behind <= 0 or not oldest_ms else max(0.0, time.time() - oldest_ms / 1000)
        self.lag_seconds.labels(topic, str(partition)).set(age)

    def forget_partitions(self, tps: Iterable[tuple[str, int]]) -> None:
        """Drop the lag series of partitions this worker no longer decides."""
        for topic, partition in tps:
            for gauge in (self.lag_messages, self.lag_seconds):
                with contextlib.suppress(KeyError):
                    gauge.remove(topic, str(partition))

    def serve(self, port: int, host: str = "0.0.0.0", allowed_hosts: str = "") -> Any:
        """Serve ``/metrics`` on ``port`` (a thread of its own); returns the server, to ``shutdown()``.
        It answers requests for IP addresses, loopback names and ``allowed_hosts`` (comma separated;
        ``*``: any), and refuses others (421): see ``arbiter.edge.hosts``."""
        names = HostNames.of(allowed_hosts, addresses=True)
        app = make_wsgi_app(self.registry)

        def guarded(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            if not names.allows_header(environ.get("HTTP_HOST", "")):
                start_response("421 Misdirected Request", [("Content-Type", "text/plain; charset=utf-8")])
                return [b"these metrics answer requests for IP addresses, localhost, and the names in "
                        b"ARBITER_METRICS_ALLOWED_HOSTS; not for this Host\n"]
            return cast(Iterable[bytes], app(environ, start_response))

        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsServer", (_MetricsServer,), {"address_family": family})
        server: WSGIServer = make_server(host, port, guarded, server_class, handler_class=_Quiet)
        threading.Thread(target=server.serve_forever, name="arbiter-metrics", daemon=True).start()
        return server


class _MetricsServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass
