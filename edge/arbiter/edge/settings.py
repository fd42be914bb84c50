"""One typed settings object for every Arbiter command, read from ``ARBITER_*``.

Precedence: command-line option > environment variable > default. Nested values use
a double underscore, e.g. ``ARBITER_TOPICS__RESOURCE_COMMANDS=acme.resource.commands``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Topics(BaseModel):
    """Topic names. Keys: what the messages on the topic are keyed (and so ordered) by."""

    model_config = ConfigDict(frozen=True)

    resource_commands: str = "arbiter.resource.commands"
    """Lock commands, ticks and tool intents; key: resource. One order per resource."""
    resource_events: str = "arbiter.resource.events"
    """Lease and gateway decisions; key: resource. Co-partitioned with the commands."""
    agent_inbox: str = "arbiter.agent.inbox"
    """Every decision an agent must hear about; key: agent id."""
    wait_edges: str = "arbiter.wait.edges"
    """Wait-for edges added and removed; key: graph namespace."""
    saga_commands: str = "arbiter.saga.commands"
    """Saga steps and abort requests; key: saga id."""
    saga_events: str = "arbiter.saga.events"
    """Saga decisions; key: saga id."""
    dead_letter: str = "arbiter.deadletter"
    """Messages a processor could not use, with the reason and the original bytes."""
    operator: str = "arbiter.operator"
    """Notices a human must act on (a saga whose compensation failed for good); key: saga id."""
    workers: str = "arbiter.workers"
    """Each worker's announcement when it starts: the rules it decides by; key: worker id."""
    registry: str = "arbiter.registry"
    """Who may act: each identity's public key, role and allowed prefixes, signed by the admin
    key; compacted; key: identity name (``arbiter.schemas.identity``)."""

    def all(self) -> list[str]:
        """Every topic, in a stable order."""
        return list(self.model_dump().values())


DEFAULT_CHECK_TREE_BYTES = 1 << 30
"""``Repository.check_tree_bytes`` unless the operator sets it: 1 GiB."""


class Repository(BaseModel):
    """One repository a deployment serves, as the operator configured it (``ARBITER_REPOS`` or
    ``repos.toml``): where it is, and its check. Nothing in it comes from an agent."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,100}$")
    path: Path
    check: tuple[str, ...] | None = None
    """The check's command as an argument list (a string in ``repos.toml`` runs with ``/bin/sh -c``);
    None: merges land unchecked."""
    check_timeout_seconds: float = Field(default=600.0, gt=0, le=86_400)
    check_output_bytes: int = Field(default=1_000_000, ge=1, le=1_000_000_000)
    """A check that prints more is stopped, and fails."""
    check_tree_bytes: int = Field(default=DEFAULT_CHECK_TREE_BYTES, ge=1, le=1 << 50)
    """The most a tree to check may take written out: its files' sizes, and 256 bytes for each file and
    folder (``arbiter.streams.tools.checks.tree_bytes``). A bigger one is not written: its check fails."""
    check_env: dict[str, str] = Field(default_factory=dict)
    """Variables the check gets besides its own ``PATH``, ``HOME``, ``TMPDIR``, locale and ``CI``."""
    check_path: str = "/usr/local/bin:/usr/bin:/bin"
    """The check's ``PATH``."""

    @field_validator("path")
    @classmethod
    def _home(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("check", mode="before")
    @classmethod
    def _command(cls, value: Any) -> Any:
        if isinstance(value, str):
            return ("/bin/sh", "-c", value) if value.strip() else None
        if isinstance(value, list | tuple) and not value:
            return None
        return value

    def check_text(self) -> str:
        """The check's command as a person reads it."""
        if self.check is None:
            return ""
        if self.check[:2] == ("/bin/sh", "-c") and len(self.check) == 3:
            return self.check[2]
        return " ".join(self.check)

    def check_digest(self) -> str:
        """What identifies the check's configuration: a verdict for another configuration is not its."""
        import hashlib
        import json

        spec: list[Any] = [list(self.check or ()), self.check_timeout_seconds, self.check_output_bytes,
                           sorted(self.check_env.items()), self.check_path]
        # The default is left out: a configuration made before check_tree_bytes existed keeps its digest, so
        # the merges queued under it are still checked after an upgrade.
        if self.check_tree_bytes != DEFAULT_CHECK_TREE_BYTES:
            spec.append(self.check_tree_bytes)
        return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:32]


class Settings(BaseSettings):
    """Arbiter's settings. Every field can be set as ``ARBITER_<FIELD>``."""

    model_config = SettingsConfigDict(
        env_prefix="ARBITER_", env_nested_delimiter="__", frozen=True, extra="ignore"
    )

    bootstrap: str = "127.0.0.1:9092"
    """Kafka bootstrap servers, comma separated (``ARBITER_BOOTSTRAP``). Unset, it
    follows ``kafka_port`` so that it points at the local broker."""

    partitions: int = Field(default=4, ge=1, le=1024)
    """Partitions per topic. Every topic gets the same count, so keyed topics are
    co-partitioned; it is also the most workers that can share the load."""

    replication_factor: int = Field(default=1, ge=1)
    """Replication factor for new topics (1 for the local single-node broker)."""

    processing_guarantee: Literal["at_least_once", "exactly_once"] = "at_least_once"
    """at_least_once relies on idempotent decisions; exactly_once writes each batch's
    decisions, state and offsets in one Kafka transaction."""

    max_batch: int = Field(default=1000, ge=1, le=100_000)
    """The most inputs the batched runtime decides per fetch (a batch is whatever has arrived,
    up to this; it never waits to fill one)."""

    topics: Topics = Topics()

    app_id: str = "arbiter"
    """faust application id: the consumer group and the changelog topic prefix."""

    home: Path = Path(".arbiter")
    """Where the local broker's jars, data and logs live (git-ignored)."""

    kafka_port: int = Field(default=9092, ge=1, le=65535)
    """Port of the local broker's client listener on 127.0.0.1."""

    kafka_controller_port: int = Field(default=9093, ge=1, le=65535)
    """Port of the local broker's KRaft controller listener on 127.0.0.1."""

    kafka_heap: str = "512m"
    """JVM heap for the local broker."""

    kafka_version: str = Field(default="4.4.0", pattern=r"^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$")
    """The Apache Kafka release the local broker runs (``arbiter kafka up``): the current 4.x by default;
    a 3.9.x for the smoke run against older clusters. Its jars are fetched once per version."""

    max_message_bytes: int = Field(default=2 * 1024 * 1024, ge=1024)
    """Largest message the codec encodes or decodes; the local broker accepts twice this."""

    # -- worker tuning; see docs/architecture.md "Worker tuning" for why each differs from faust's --
    fetch_max_wait_ms: int = Field(default=10, ge=0, le=1500)
    """How long the broker holds an empty fetch. faust hard-codes 1500."""

    commit_interval: float = Field(default=0.2, gt=0)
    """Seconds between offset commits. faust: 2.8."""

    session_timeout: float = Field(default=1.2, gt=0)
    """Seconds without heartbeats before the group evicts a worker: after a crash, the largest part
    of the time until its partitions are decided again. The brokers' group.min.session.timeout.ms
    must allow it (Kafka's default minimum is 6 s; 'arbiter kafka up' sets 1 s); a worker uses the
    nearest value they allow, and says so. faust: 60. (Measured with 'bench failover': 2 s gave a
    p99 failover of 3.8 s, 1.2 s gave 2.8 s; a shorter session risks evicting a busy worker.)"""

    heartbeat_interval: float = Field(default=0.3, gt=0)
    """Seconds between consumer heartbeats (at most a third of the session timeout). faust: 3."""

    group_protocol: Literal["classic", "consumer"] = "classic"
    """The workers' consumer group protocol: ``classic`` (eager rebalances: every member stops while the
    group rebalances; the session and heartbeat above are the client's), or ``consumer`` (KIP-848, Kafka
    4.0+: the broker assigns, incrementally, and a member keeps deciding the partitions it keeps; the
    session and heartbeat are the brokers' group.consumer.session.timeout.ms and
    group.consumer.heartbeat.interval.ms, which 'arbiter kafka up' sets to 1.2 s and 0.3 s)."""

    producer_linger_ms: int = Field(default=0, ge=0)
    """Producer batching delay."""

    tick_interval_ms: int = Field(default=100, ge=10, le=60_000)
    """How often each worker sends a tick into every partition it owns: the
    resolution of lease expiry and wait time-outs."""

    max_ttl_ms: int = Field(default=3_600_000, ge=1)
    """Longest lease TTL a request may ask for."""

    max_wait_ms: int = Field(default=3_600_000, ge=0)
    """Longest time a request may wait in a queue."""

    lock_order: Literal["warn", "reject", "off"] = "warn"
    """What to do with a request from an agent that already holds a resource later in
    the global (sorted) order: grant it with a warning, deny it, or not check."""

    id_window_ms: int = Field(default=600_000, ge=1_000)
    """How long after it was sent a command (or intent) may still be decided. Its id is
    remembered that long, so a repeat is never decided twice; a command older than this is
    refused ``request_expired``."""

    clock_skew_ms: int = Field(default=60_000, ge=0)
    """How far ahead of the broker's clock a sender's may be (``clock_skew`` beyond)."""

    max_remembered_ids: int = Field(default=256, ge=16)
    """Per resource, the most request ids (and intent outcomes) remembered. On a resource
    busier than this within the window the oldest are forgotten early and the window shrinks
    with them (nothing sent before a forgotten id is decided any more)."""

    ledger_dsn: str = ""
    """The ledger database: a ``postgresql://`` DSN, or empty for SQLite at
    ``<home>/ledger.sqlite3``."""

    repos: str = ""
    """The git repositories the workers merge into, ``name=path`` comma separated: resource
    ``repo:<name>`` is the repository at ``path`` (its sandboxes, its merge queue). Empty: none."""

    repos_file: Path | None = None
    """The operator's repository configuration (TOML): default ``<home>/repos.toml`` when it exists.
    ``[repos.<name>]`` tables with ``path``, and the check: ``check`` (a command line, run with
    ``/bin/sh -c``, or an argument list), ``check_timeout_seconds``, ``check_output_bytes``,
    ``check_tree_bytes``, ``check_env``, ``check_path`` (``Repository``)."""

    check_user: str = ""
    """The user a check runs as. Empty: ``nobody`` when the runner runs as root (an agent's code never runs
    as root); a runner that is not root refuses to check unless this names its own user, which accepts that
    checks can read its key (one user that trusts its agents)."""

    sandbox_root: str = ""
    """Where sandboxes (one clone of the repository per agent) are made, ``<root>/<repository>/<agent>``;
    default ``<repository's git dir>/arbiter/sandboxes/<agent>``."""

    sandbox_group: str = ""
    """A group the agents' users share: each sandbox is made read-write for it (the host keeps its own
    repository to itself). Empty: sandboxes belong to the host's user alone (agents run as that user)."""

    policies: str = "account:=both,doc:=optimistic,ticket:=pessimistic,repo:=pessimistic,tenant:=pessimistic"
    """Write policy per resource-name prefix, ``prefix=policy`` comma separated; the
    longest prefix wins. ``pessimistic`` needs a fencing token, ``optimistic`` a base
    version, ``both`` both. A resource no prefix matches cannot be written."""

    max_patch_bytes: int = Field(default=1024 * 1024, ge=1)
    """Largest tool-argument payload (a patch, say) the gateway accepts."""

    graph_key: str = "global"
    """Key of wait-for edges on the wait-edge topic: one graph, one partition."""

    recovery_stall_seconds: float = Field(default=20.0, gt=0)
    """A worker whose table recovery makes no progress this long restarts itself."""

    worker_id: str = ""
    """Name of this worker in Pong and diagnostics; defaults to host:pid."""

    web_port: int = Field(default=0, ge=0, le=65535)
    """faust's web server port; 0 disables it (several workers share one host)."""

    # -- trust (docs/security.md) --
    verify_signatures: bool = True
    """Workers refuse unsigned and forged commands, and the SDK unsigned and forged decisions.
    Off is for development only and is announced loudly on every start."""

    identity: str = ""
    """The identity this process signs as (an agent's name, ``worker``, ``admin``); the
    private key is read from ``<home>/keys/<identity>.key`` unless ``identity_key`` is set."""

    identity_key: str = ""
    """A private key (PEM or base64 raw), for keys kept in a secret store instead of a file."""

    send_retry_seconds: float = Field(default=10.0, ge=0)
    """How long the SDK retries a command Kafka did not take (a broker restarting, a leader moving)
    before it raises ``ArbiterUnavailable``. Safe: a command's id is decided once."""

    kafka_client: Literal["librdkafka", "aiokafka"] = "librdkafka"
    """The Kafka client under the SDK and the front door (``arbiter.edge.kafkaio``): librdkafka
    (confluent-kafka), or aiokafka, which took ~3.5x the latency and ~5x the CPU a round trip."""

    url: str = ""
    """The SDK's front door (``arbiter serve``): one URL or a comma-separated list. Set, an
    ``ArbiterClient`` talks to it over a WebSocket instead of to Kafka."""

    api_key: str = ""
    """The agent's API key for the front door (``arbiter agents add NAME --print-api-key``). Empty:
    made from the agent's key file under the home."""

    door_host: str = "127.0.0.1"
    """Where ``arbiter serve`` listens. Loopback by default: put TLS in front (or pass
    ``--ssl-certfile``) before exposing it, since API keys are bearer secrets."""

    door_port: int = Field(default=8080, ge=0, le=65535)

    door_allowed_hosts: str = ""
    """Host names (comma separated) a door answers besides ``localhost`` and loopback addresses (and, when
    it listens beyond loopback, any IP address): the names its clients reach it by, such as
    ``arbiter.example.com``. A request for another name is refused (421), so no web page reaches the door
    through DNS rebinding. ``*``: any name, only behind a proxy that checks ``Host`` itself."""

    door_max_body_bytes: int = Field(default=256 * 1024, ge=1024)
    """Largest HTTP request body or WebSocket frame the door reads; larger ones get 413 / close 1009."""

    door_rate: float = Field(default=2000.0, gt=0)
    """Commands per second one agent may send through a door (a token bucket); over it, 429."""

    door_burst: int = Field(default=200, ge=1)
    """How many commands one agent may send at once before ``door_rate`` applies."""

    door_max_sessions_per_agent: int = Field(default=8, ge=1)
    """WebSocket sessions one agent may hold open on one door."""

    door_max_inflight_per_agent: int = Field(default=256, ge=1)
    """HTTP calls of one agent a door serves at once (waiting acquires included); more get 429."""

    door_max_open_sagas_per_agent: int = Field(default=256, ge=1)
    """Sagas one agent may have open (started, not ended) on one door; another start gets 429. A door
    keeps each open saga in memory until it ends: without a bound, an agent that starts sagas and
    never ends them grows the door without end."""

    door_max_connections: int = Field(default=10_000, ge=1)
    """Connections one door serves at once (uvicorn's limit); more get 503."""

    door_session_buffer: int = Field(default=1000, ge=1)
    """Events a WebSocket session may leave unread; past it the door closes it (code 1008, a
    reason that says so), and the agent resumes from the log on its next session."""

    door_idle_seconds: float = Field(default=60.0, gt=0)
    """How long a door keeps an agent's state after its last call and session (held leases keep it)."""

    console_operators: str = ""
    """Identities (comma separated) whose front-door API keys open the live console on a door that listens
    beyond loopback; on loopback it is open to this machine. Empty: nobody, beyond loopback."""

    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Serve a worker's Prometheus metrics on ``http://<metrics_host>:<port>/metrics``; 0: none. Give each
    worker on one machine its own port (a taken port is logged, and the worker decides anyway)."""

    metrics_host: str = "127.0.0.1"
    """Where a worker's metrics listen (``0.0.0.0`` for a Prometheus on another machine)."""

    metrics_allowed_hosts: str = ""
    """Host names (comma separated) a worker's metrics answer besides ``localhost`` and IP addresses:
    the names a Prometheus scrapes it by, such as ``worker-1``. A request for another name is
    refused (421), so no web page reads them through DNS rebinding. ``*``: any name."""

    mcp_idle_seconds: float = Field(default=300.0, gt=0)
    """``arbiter mcp``: how long an agent may be silent (no tool call, no hook heartbeat) before the
    server stops renewing its leases and lets them lapse at their TTL (a model turn can take minutes)."""

    mcp_max_hold_seconds: float = Field(default=3600.0, gt=0)
    """``arbiter mcp``: the longest the server keeps renewing one lease for an active agent; past it
    the lease lapses at its TTL unless the agent renews it itself."""

    admin_public_keys: str = ""
    """The trust anchors: admin public keys (base64, comma separated) that sign the registry.
    Empty: ``<home>/keys/admin.pub``, which ``arbiter agents`` writes when it creates the admin key."""

    auto_enroll: bool = False
    """Development only: an SDK client whose agent has no key, in a home that holds the admin
    key, is enrolled on first use (allowed every resource). Announced on every use."""

    kafka_security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How Kafka clients connect; ``SASL_PLAINTEXT`` for ``arbiter kafka up --secure``."""

    kafka_sasl_mechanism: Literal["SCRAM-SHA-256", "SCRAM-SHA-512", "PLAIN"] = "SCRAM-SHA-512"
    """SASL mechanism, when the protocol uses SASL."""

    kafka_username: str = ""
    """SASL user (a Kafka principal), when the protocol uses SASL."""

    kafka_password: str = ""
    """SASL password, when the protocol uses SASL."""

    @model_validator(mode="before")
    @classmethod
    def _local_bootstrap_follows_port(cls, data: Any) -> Any:
        # With no bootstrap given, talk to the local broker on whatever port it uses.
        if isinstance(data, dict) and not data.get("bootstrap") and data.get("kafka_port"):
            data = {**data, "bootstrap": f"127.0.0.1:{data['kafka_port']}"}
        return data

    @field_validator("bootstrap")
    @classmethod
    def _bootstrap_not_empty(cls, value: str) -> str:
        servers = [s.strip() for s in value.split(",") if s.strip()]
        if not servers:
            raise ValueError("bootstrap must name at least one host:port")
        for server in servers:
            host, sep, port = server.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"bootstrap server {server!r} is not host:port")
        return ",".join(servers)

    @field_validator("policies")
    @classmethod
    def _policies_parse(cls, value: str) -> str:
        cls.parse_policies(value)
        return value

    @field_validator("repos")
    @classmethod
    def _repos_parse(cls, value: str) -> str:
        cls.parse_repos(value)
        return value

    @staticmethod
    def parse_repos(value: str) -> dict[str, Path]:
        """``"app=/src/app,docs=/src/docs"`` as {name: path}."""
        repos: dict[str, Path] = {}
        for item in filter(None, (part.strip() for part in value.split(","))):
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"repository {item!r} is not name=path")
            if not set(name.strip()) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_."):
                raise ValueError(f"repository name {name!r}: letters, digits and -_. only")
            repos[name.strip()] = Path(path.strip()).expanduser()
        return repos

    def repositories(self) -> dict[str, Repository]:
        """Every repository this deployment serves: ``ARBITER_REPOS`` and ``repos.toml`` (a name in both is
        an error). ``ValueError`` says what is wrong with the file."""
        found = {name: Repository(name=name, path=path) for name, path in self.parse_repos(self.repos).items()}
        path = self.repos_file or self.home / "repos.toml"
        if self.repos_file is None and not path.exists():
            return found
        import tomllib

        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"the repository configuration {path} cannot be read: {exc}") from None
        tables = data.get("repos", {})
        if not isinstance(tables, dict) or set(data) - {"repos"}:
            raise ValueError(f"{path}: expected only [repos.<name>] tables")
        for name, table in tables.items():
            if name in found:
                raise ValueError(f"repository {name!r} is configured twice: in ARBITER_REPOS and in {path}")
            if not isinstance(table, dict):
                raise ValueError(f"{path}: [repos.{name}] is not a table")
            try:
                found[name] = Repository(name=name, **table)
            except ValidationError as exc:
                problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                raise ValueError(f"{path}: [repos.{name}]: {problems}") from None
        return found

    @staticmethod
    def parse_policies(value: str) -> tuple[tuple[str, Literal["pessimistic", "optimistic", "both"]], ...]:
        """``"account:=both,doc:=optimistic"`` as (prefix, policy) pairs."""
        pairs: list[tuple[str, Literal["pessimistic", "optimistic", "both"]]] = []
        for item in filter(None, (part.strip() for part in value.split(","))):
            prefix, sep, policy = item.rpartition("=")
            if not sep or policy not in ("pessimistic", "optimistic", "both"):
                raise ValueError(f"policy {item!r} is not prefix=pessimistic|optimistic|both")
            pairs.append((prefix, cast(Literal["pessimistic", "optimistic", "both"], policy)))  # (checked just above)
        return tuple(pairs)

    def ledger_url(self) -> str:
        """The ledger DSN, with the SQLite default filled in."""
        return self.ledger_dsn or str((self.home / "ledger.sqlite3").resolve())

    def operator_names(self) -> set[str]:
        """``console_operators`` as a set."""
        return {n.strip() for n in self.console_operators.split(",") if n.strip()}

    def bootstrap_list(self) -> list[str]:
        """Bootstrap servers as a list."""
        return self.bootstrap.split(",")


def load_settings(**overrides: object) -> Settings:
    """Settings from the environment, with explicit overrides (``None`` is ignored)."""
    given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**given)
