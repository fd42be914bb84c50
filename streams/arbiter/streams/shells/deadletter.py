"""Turning a message that does not decode into a dead letter (pure).

A processor that meets bytes it cannot use must neither crash nor stall its
partition: it records the message, the reason and where it sat, and moves on.
"""

from __future__ import annotations

import hashlib

from arbiter.schemas import Cause, ContractError, DeadLetter

ROOM_FOR_ENVELOPE = 16 * 1024


def dead_letter(
    error: ContractError,
    *,
    processor: str,
    source: Cause,
    key: bytes | None,
    value: bytes,
    now_ms: int,
    max_message_bytes: int,
) -> DeadLetter:
    """The dead letter for a message that failed with ``error``.

    The original bytes are kept whole unless the message was itself too large to
    carry; then the dead letter keeps its head and names the full size and SHA-256,
    and the original still sits at ``source`` in the log.
    """
    detail = error.detail[:2000]
    room = max_message_bytes - ROOM_FOR_ENVELOPE
    if key is not None and len(key) > room // 2:
        key = key[: room // 2]
        detail += " [key truncated]"
    room -= len(key or b"")
    if len(value) > room:
        digest = hashlib.sha256(value).hexdigest()
        detail += f" [value truncated from {len(value)} bytes, sha256 {digest}]"
        value = value[:room]
    return DeadLetter(
        reason=error.reason,
        detail=detail,
        processor=processor,
        source=source,
        key=key,
        value=value,
        at_ms=now_ms,
    )
