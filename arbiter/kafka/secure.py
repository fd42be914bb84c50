"""The secure mode's logins: its three principals, how a client logs in as one, and the credentials
file that holds their passwords (readable by its owner alone)."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from arbiter.edge.kafkaauth import PRINCIPALS

Mode = Literal["plain", "secure"]

ADMIN, WORKER, AGENT = PRINCIPALS
SCRAM_MECHANISM = "SCRAM-SHA-512"
SECURE_PROTOCOL = "SASL_PLAINTEXT"


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner may read (it holds passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)
        out.write(text)


def read_passwords(path: Path) -> dict[str, str]:
    """Each principal's password, from the credentials file at ``path``."""
    data = json.loads(path.read_text())
    return {name: entry["password"] for name, entry in data["principals"].items()}


def complete(passwords: Mapping[str, str]) -> bool:
    """``passwords`` name every principal, each with a password."""
    return set(passwords) == set(PRINCIPALS) and all(passwords.values())


def new_passwords() -> dict[str, str]:
    """A random password for each principal."""
    return {name: secrets.token_urlsafe(24) for name in PRINCIPALS}


def write_credentials(path: Path, bootstrap: str, passwords: Mapping[str, str]) -> None:
    """Write the credentials file: each principal's login to the broker at ``bootstrap``, and how to use it."""
    document = {
        "about": "SASL/SCRAM logins of the local secure Kafka broker ('arbiter kafka up --secure'); "
                 "keep private. Use as ARBITER_KAFKA_SECURITY_PROTOCOL, ARBITER_KAFKA_SASL_MECHANISM, "
                 "ARBITER_KAFKA_USERNAME, ARBITER_KAFKA_PASSWORD.",
        "bootstrap": bootstrap,
        "principals": {
            name: {"username": name, "password": passwords[name], "mechanism": SCRAM_MECHANISM,
                   "security_protocol": SECURE_PROTOCOL, "bootstrap": bootstrap}
            for name in PRINCIPALS
        },
    }
    write_private(path, json.dumps(document, indent=2) + "\n")


def login_options(principal: str, password: str) -> dict[str, Any]:
    """aiokafka options to log in to the secure broker as ``principal``."""
    return {"security_protocol": SECURE_PROTOCOL, "sasl_mechanism": SCRAM_MECHANISM,
            "sasl_plain_username": principal, "sasl_plain_password": password}
