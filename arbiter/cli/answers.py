"""One JSON answer per call, and the exit code of its kind: what ``arbiter lock`` and ``arbiter sandbox``
print (agents parse these answers)."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import click

from arbiter.edge.kafkaconn import describe
from arbiter.edge.kafkaio import KafkaIOError
from arbiter.edge.settings import Settings
from arbiter.schemas.identity import IdentityError

LOCK_EXITS = {"refused": 1, "timeout": 2, "unavailable": 3, "no_identity": 4}
"""``arbiter lock``'s exit code for each way a call can end without being done."""


def answer(body: dict[str, Any], kind: str | None = None) -> None:
    """Print one JSON object; exit with the code of ``kind`` (None: done)."""
    click.echo(json.dumps(body, sort_keys=True))
    if kind is not None:
        sys.exit(LOCK_EXITS[kind])


def lock_run(settings: Settings, work: Any) -> Any:
    """Run one ``arbiter lock`` call; every way it can fail is answered as one JSON object and its exit code."""
    from arbiter.agents import ArbiterTimeout, ArbiterUnavailable, LeaseDenied
    from arbiter.audit.replay import TrustAnchorsMissing
    from arbiter.edge.tail import TopicMissing

    try:
        return asyncio.run(work)
    except IdentityError as exc:
        answer({"reason": "no_identity", "detail": str(exc), "what_to_do": "Each agent signs its commands with its "
                 "own key: 'arbiter agents add NAME' issues one (or set ARBITER_IDENTITY_KEY)."}, "no_identity")
    except TrustAnchorsMissing as exc:
        answer({"reason": "no_identity", "detail": str(exc), "what_to_do": "This home holds no admin public key "
                 "to check the workers' signatures with: set ARBITER_ADMIN_PUBLIC_KEYS."}, "no_identity")
    except LeaseDenied as exc:
        answer({"reason": exc.reason, **exc.diagnostic}, "refused")
    except ArbiterTimeout as exc:
        answer({"reason": "timeout", "detail": str(exc), "retriable": True,
                 "what_to_do": "No decision arrived in time; it may still be decided. Check with 'arbiter lock "
                               "status', or retry."}, "timeout")
    except TopicMissing as exc:
        answer({"reason": "unavailable", "detail": str(exc), "retriable": False,
                 "what_to_do": "Create the topics ('arbiter topics create') and start a worker."}, "unavailable")
    except ArbiterUnavailable as exc:
        answer({"reason": "unavailable", "detail": str(exc), "retriable": True,
                 "what_to_do": "Retry shortly; is Kafka up ('arbiter kafka status')?"}, "unavailable")
    except (KafkaIOError, ConnectionError) as exc:
        answer({"reason": "unavailable", "detail": f"Kafka at {settings.bootstrap} could not be reached: "
                                                    f"{describe(exc)}",
                 "retriable": True, "what_to_do": "Retry shortly; is Kafka up ('arbiter kafka status')?"},
                "unavailable")
