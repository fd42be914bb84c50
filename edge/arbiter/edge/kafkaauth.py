"""How a Kafka client authenticates: the ``kafka_*`` settings as client options.

Kafka's own access control is the outer wall of the trust boundary (see
docs/security.md): with ``arbiter kafka up --secure`` the broker takes only SASL/SCRAM clients
and its ACLs let each principal touch only its own topics. Every Kafka client Arbiter
makes (the SDK's, the CLI's, the workers') passes these options along.

This module builds keyword arguments and reads the credentials file the local broker writes.
Since every Arbiter Kafka client is made with its options, asking for them also installs the
connection guard (:mod:`arbiter.edge.kafkaconn`: backoff, no self-connects, quiet logs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .settings import Settings

CREDENTIALS_FILE = Path("secure") / "credentials.json"
"""Where ``arbiter kafka up --secure`` writes its principals' passwords, under the home."""

PRINCIPALS = ("arbiter-admin", "arbiter-worker", "arbiter-agent")
"""The SCRAM users the local secure broker creates: super user, stream processors, agents."""


class KafkaAuthError(RuntimeError):
    """The settings or the credentials file do not say how to log in to Kafka."""


def _uses_sasl(settings: Settings) -> bool:
    return settings.kafka_security_protocol.startswith("SASL_")


def kafka_client_options(settings: Settings) -> dict[str, Any]:
    """aiokafka keyword arguments (producer, consumer, admin client) for ``settings``.

    Empty for ``PLAINTEXT``, so ``AIOKafkaProducer(bootstrap_servers=..., **options)`` is
    unchanged on a broker without authentication. ``SASL_SSL`` uses the system's default
    TLS trust (an ``ssl_context`` from ``ssl.create_default_context()``).
    """
    from .kafkaconn import install

    install()
    if not _uses_sasl(settings):
        return {}
    if not settings.kafka_username or not settings.kafka_password:
        raise KafkaAuthError(
            f"ARBITER_KAFKA_SECURITY_PROTOCOL={settings.kafka_security_protocol} needs ARBITER_KAFKA_USERNAME "
            "and ARBITER_KAFKA_PASSWORD (the local secure broker writes them to "
            f"<home>/{CREDENTIALS_FILE})"
        )
    options: dict[str, Any] = {
        "security_protocol": settings.kafka_security_protocol,
        "sasl_mechanism": settings.kafka_sasl_mechanism,
        "sasl_plain_username": settings.kafka_username,
        "sasl_plain_password": settings.kafka_password,
    }
    if settings.kafka_security_protocol == "SASL_SSL":
        import ssl

        options["ssl_context"] = ssl.create_default_context()
    return options


def rdkafka_options(settings: Settings) -> dict[str, Any]:
    """librdkafka configuration properties (producer, consumer) for ``settings``: the same login
    as :func:`kafka_client_options`. ``SASL_SSL`` trusts the system's CA certificates (``probe``)."""
    options = kafka_client_options(settings)
    if not options:
        return {}
    rd: dict[str, Any] = {
        "security.protocol": options["security_protocol"],
        "sasl.mechanism": options["sasl_mechanism"],
        "sasl.username": options["sasl_plain_username"],
        "sasl.password": options["sasl_plain_password"],
    }
    if settings.kafka_security_protocol == "SASL_SSL":
        rd["ssl.ca.location"] = "probe"
    return rd


def faust_credentials(settings: Settings) -> dict[str, Any] | None:
    """What faust's ``SASLCredentials`` needs, or None for ``PLAINTEXT``.

    A plain dict, because the contract never imports faust; the runtime builds
    ``faust.SASLCredentials(username=..., password=..., mechanism=...)`` from it and
    passes it as the app's ``broker_credentials``; ``ssl`` (a bool) says whether to add a
    TLS context (``SASL_SSL``).
    """
    options = kafka_client_options(settings)
    if not options:
        return None
    return {
        "username": options["sasl_plain_username"],
        "password": options["sasl_plain_password"],
        "mechanism": options["sasl_mechanism"],
        "ssl": settings.kafka_security_protocol == "SASL_SSL",
    }


def credentials_path(home: Path) -> Path:
    """The credentials file under an Arbiter home."""
    return home / CREDENTIALS_FILE


def load_credentials(home: Path, principal: str) -> dict[str, str]:
    """One principal's entry of ``<home>/secure/credentials.json``.

    The entry has ``username``, ``password`` and ``mechanism``, and also the settings
    that use them (``security_protocol``, ``bootstrap``) when the broker wrote them.
    """
    path = credentials_path(home)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise KafkaAuthError(
            f"no Kafka credentials at {path}: start the local broker with 'arbiter kafka up --secure' "
            "(with the same ARBITER_HOME), or set ARBITER_KAFKA_USERNAME and ARBITER_KAFKA_PASSWORD"
        ) from None
    except (OSError, ValueError) as exc:
        raise KafkaAuthError(f"cannot read the Kafka credentials at {path}: {exc}") from exc
    principals = data.get("principals") if isinstance(data, dict) else None
    entry = principals.get(principal) if isinstance(principals, dict) else None
    if not isinstance(entry, dict) or not entry.get("password"):
        known = ", ".join(sorted(principals)) if isinstance(principals, dict) else "none"
        raise KafkaAuthError(f"{path} has no credentials for {principal!r} (it has: {known})")
    return {str(k): str(v) for k, v in entry.items()}
