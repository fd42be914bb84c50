"""The secure broker's ACLs: what each principal may do (everything else is denied), and their creation
through Kafka's admin protocol."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from arbiter.edge.settings import Settings

from .errors import LocalKafkaError
from .secure import AGENT, WORKER

# Kafka's wire codes for ACLs (org.apache.kafka.common.acl / resource).
_RESOURCE_TYPES = {"topic": 2, "group": 3, "cluster": 4, "transactional_id": 5}
_PATTERN_TYPES = {"literal": 3, "prefixed": 4}
_OPERATIONS = {"read": 3, "write": 4, "create": 5, "describe": 8, "describe_configs": 10}
_ALLOW = 3


Operation = Literal["read", "write", "create", "describe", "describe_configs"]


@dataclass(frozen=True)
class Acl:
    """One ALLOW entry: ``principal`` may do ``operation`` on the resource, from any host."""

    principal: str
    resource_type: Literal["topic", "group", "transactional_id"]
    pattern: Literal["literal", "prefixed"]
    name: str
    operation: Operation

    def __str__(self) -> str:
        return (f"User:{self.principal} {self.operation.upper()} {self.resource_type} "
                f"{self.name}{'*' if self.pattern == 'prefixed' else ''}")


def secure_acls(settings: Settings) -> list[Acl]:
    """What each principal may do on the secure broker; everything else is denied.

    - ``arbiter-agent`` writes only the topics agents send on (lock and saga commands,
      and wait-for edges, which the SDK's ``delegate``/``waiting_on`` send) and reads only
      its inbox and the identity registry (to verify decisions). Not the event topics.
    - ``arbiter-worker`` reads, writes, creates and describes every ``arbiter.`` topic and
      every faust changelog (``<app_id>-``), joins the ``<app_id>`` consumer group and owns
      the ``<app_id>`` transactional ids (exactly-once).
    - ``arbiter-admin`` is a super user and needs no ACL.
    """
    t = settings.topics
    acls: list[Acl] = []
    for topic in (t.resource_commands, t.saga_commands, t.wait_edges):
        acls += [Acl(AGENT, "topic", "literal", topic, op) for op in ("write", "describe")]
    for topic in (t.agent_inbox, t.registry):
        acls += [Acl(AGENT, "topic", "literal", topic, op) for op in ("read", "describe")]
    prefixes = sorted({"arbiter.", f"{settings.app_id}-"})
    literal = [name for name in t.all() if not any(name.startswith(p) for p in prefixes)]
    worker_ops: tuple[Operation, ...] = ("read", "write", "describe", "create", "describe_configs")
    for prefix in prefixes:
        acls += [Acl(WORKER, "topic", "prefixed", prefix, op) for op in worker_ops]
    for topic in literal:
        acls += [Acl(WORKER, "topic", "literal", topic, op) for op in worker_ops]
    acls += [Acl(WORKER, "group", "prefixed", settings.app_id, op) for op in ("read", "describe")]
    acls += [Acl(WORKER, "transactional_id", "prefixed", settings.app_id, op) for op in ("write", "describe")]
    return acls


async def create_acls(bootstrap: str, options: Mapping[str, Any], acls: list[Acl]) -> None:
    """Create ``acls`` as the principal of ``options`` (a super user). Existing ones are kept."""
    from aiokafka import AIOKafkaClient
    from aiokafka.errors import KafkaError
    from aiokafka.protocol.admin import CreateAclsRequest

    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=15000, **dict(options))
    try:
        await client.bootstrap()
        node = client.get_random_node()
        for acl in acls:
            request = CreateAclsRequest(
                resource_type=_RESOURCE_TYPES[acl.resource_type],
                resource_name=acl.name,
                resource_pattern_type_filter=_PATTERN_TYPES[acl.pattern],
                principal=f"User:{acl.principal}",
                host="*",
                operation=_OPERATIONS[acl.operation],
                permission_type=_ALLOW,
            )
            response = await client.send(node, request)
            for code, message in response.creation_responses:
                if code != 0:
                    raise LocalKafkaError(f"the broker refused the ACL {acl}: error {code} {message or ''}")
    except KafkaError as exc:
        raise LocalKafkaError(f"creating the ACLs at {bootstrap} as {options.get('sasl_plain_username')} "
                              f"failed: {exc}") from exc
    finally:
        await client.close()
