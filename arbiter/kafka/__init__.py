"""The local Apache Kafka broker: fetched from Maven Central, run with the machine's Java.

Theory of operation
-------------------
``arbiter/kafka/pom.xml`` names the broker (``org.apache.kafka:kafka_2.13``) at the release
``settings.kafka_version`` gives (4.4.0 by default; 3.9.x for older clusters). ``fetch``
copies its jars into ``<home>/kafka/libs/<version>`` with Maven, once (a stamp of the pom's
hash and the version says when to fetch again). Kafka 4 logs through log4j 2, 3.x through
reload4j: both configurations are written, and the pom takes the matching slf4j binding.
The release a node's storage was formatted by is written next to it
(``data/arbiter-kafka-version``; none means 3.9.1, the release before this was recorded):
a newer release starts on it (Kafka upgrades a KRaft log from 3.3 on in place), an older one
is refused with the two ways out. ``up`` writes a KRaft ``server.properties`` (one
node, combined broker and controller, 127.0.0.1 only), formats the storage on first
use, starts ``kafka.Kafka`` as a detached process whose pid is kept in a file, and
waits until the broker answers a metadata request. ``down`` sends SIGTERM (a clean
shutdown flushes the logs) and waits. ``reset`` stops the broker and deletes its data,
keeping the jars.

All state lives under ``<home>/kafka`` (``.arbiter/`` by default, git-ignored), so a
restart keeps every message.

Several nodes (``up(nodes=3)``, ``arbiter kafka up --nodes 3``)
-----------------------------------------------------------------
A cluster on loopback: N KRaft nodes, each a combined broker and controller, all
formatted with one cluster id, ``controller.quorum.voters`` naming them all. Node ``i``
(1..N) listens for clients on ``kafka_port + 2*(i-1)`` and for the controllers on
``kafka_controller_port + 2*(i-1)`` (9092/9093, 9094/9095, 9096/9097 by default), and
keeps its config, pid, data and logs in ``<home>/kafka/nodes/<i>/``. The one-node
layout stays where it always was (``<home>/kafka/data`` ...). The count is written to
``<home>/kafka/arbiter-nodes`` when the storage is formatted, so ``down``, ``status``,
``reset`` and a later plain ``up`` act on every node; asking for another count on
existing data is an error that names ``arbiter kafka reset``. With three nodes or more,
internal topics get replication factor 3, ``min.insync.replicas`` is 2 (so is
``transaction.state.log.min.isr``), and a dead node is fenced after 2 s without
heartbeats (``broker.session.timeout.ms``; Kafka's default is 9 s) and a dead active
controller replaced within 1.5 s (quorum fetch and election timeouts), so its partitions'
leadership moves within seconds. ``up`` also restarts the nodes of a cluster that are
down (their data kept) and waits until every node answers and sees all N brokers.
``local_cluster_settings`` gives the settings that reach such a cluster (its bootstrap
list, replication factor 3): the ``arbiter`` commands use them when no bootstrap is given.
The secure mode runs one node only.

Secure mode (``up(secure=True)``, ``arbiter kafka up --secure``)
------------------------------------------------------------------
Kafka's own access control is the outer wall of the trust boundary (see
docs/security.md). The client listener then takes SASL/SCRAM-SHA-512 only (SASL_PLAINTEXT, on
127.0.0.1 alone), the broker runs ``StandardAuthorizer`` with no access for anyone an ACL
does not name, and three SCRAM users are created when the storage is formatted
(``--add-scram``, KIP-900): ``arbiter-admin`` (the only super user; the broker itself
logs in as it), ``arbiter-worker`` and ``arbiter-agent``. Their random passwords are
written to ``<home>/secure/credentials.json`` (0600, in a 0700 folder) and nowhere else
but the broker's own config (also 0600). Once the broker answers, the admin creates the
ACLs of ``secure_acls`` (idempotent, so every ``up`` brings them in line with the topic
names of the settings). The controller listener, which the broker alone uses, takes
SASL/PLAIN as the admin (SCRAM credentials live in the metadata log the controller
serves, so KRaft cannot use SCRAM there).

The mode is written next to the data (``data/arbiter-mode``), so ``down`` and ``up``
keep it; asking for the other mode on existing data is an error that names
``arbiter kafka reset``. ``reset`` wipes the data and the mode but keeps the credentials
file, whose passwords a later ``--secure`` format reuses.

Modules
-------
``localkafka`` (``LocalKafka``: fetch, up, down, reset; what it is), ``nodes`` (a node's ports and files),
``config`` (its server.properties and logging), ``storage`` (formatting, the release that wrote it),
``jvm`` (Java, the broker processes and their logs), ``jars`` (the pom and Maven), ``secure`` (the
principals and their credentials file), ``acls`` (what each principal may do), ``probe`` (whether a
broker answers), ``errors``.
"""

from .acls import Acl, Operation, create_acls, secure_acls
from .config import BROKER_SESSION_TIMEOUT_MS
from .errors import LocalKafkaError
from .jars import POM
from .jvm import MIN_JAVA
from .localkafka import LocalKafka, local_cluster_settings
from .nodes import MAX_NODES, Node
from .probe import broker_answers, broker_count
from .secure import ADMIN, AGENT, SCRAM_MECHANISM, SECURE_PROTOCOL, WORKER, Mode
from .storage import UNRECORDED_RELEASE

__all__ = [
    "ADMIN",
    "AGENT",
    "BROKER_SESSION_TIMEOUT_MS",
    "MAX_NODES",
    "MIN_JAVA",
    "POM",
    "SCRAM_MECHANISM",
    "SECURE_PROTOCOL",
    "UNRECORDED_RELEASE",
    "WORKER",
    "Acl",
    "LocalKafka",
    "LocalKafkaError",
    "Mode",
    "Node",
    "Operation",
    "broker_answers",
    "broker_count",
    "create_acls",
    "local_cluster_settings",
    "secure_acls",
]
