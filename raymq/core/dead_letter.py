"""Dead letters: messages a queue gives up delivering move to its dead-letter queue.

Artemis's dead letter address: a message whose next delivery would exceed the queue's
``max_delivery_attempts``, or that a consumer rejects, is not delivered again but moved
to the dead-letter queue (``f"{name}.DLQ"`` unless the queue names one). The moved copy
keeps its body and properties and gains three properties saying where it came from
and why.

The move is two durable steps in this order: append to the dead-letter queue, then
acknowledge in the source. A crash between them leaves the message in both (it is
delivered again from the source: at-least-once); no crash leaves it in neither.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from raymq.batch import MessageBatch
from raymq.core.expiry import without_expiration
from raymq.properties import decode_properties, encode_properties

#: Property names a dead-lettered message gains (stable: consumers of a DLQ match on them).
ORIGINAL_QUEUE = "RayMQOriginalQueue"
ORIGINAL_OFFSET = "RayMQOriginalOffset"
DEAD_LETTER_REASON = "RayMQDeadLetterReason"

#: Why a message was dead-lettered (the value of ``RayMQDeadLetterReason``).
REASON_MAX_DELIVERY_ATTEMPTS = "max_delivery_attempts"
REASON_REJECTED = "rejected"
#: A message whose ``RayMQExpiration`` passed (moved to the queue's ``expiry_queue``).
REASON_EXPIRED = "expired"

#: Most messages moved to the dead-letter queue in one batch (one write there, one ack
#: here).
MOVE_BATCH_MESSAGES = 1000


def dead_letter_batch(
    stored: Sequence[MessageBatch], offsets: np.ndarray, reasons: Sequence[str], queue: str
) -> MessageBatch:
    """The messages at sorted ``offsets`` (found in ``stored``, batches read from the
    source queue's log) as a batch for the dead-letter queue, each with its reason.

    Raises ``LookupError`` naming the queue if an offset is in none of ``stored``.
    """
    by_offset: dict[int, tuple[MessageBatch, int]] = {}
    for b in stored:
        for i in range(len(b)):
            by_offset[b.first_offset + i] = (b, i)
    bodies: list[bytes] = []
    props: list[bytes] = []
    for offset, reason in zip(offsets.tolist(), reasons, strict=True):
        found = by_offset.get(offset)
        if found is None:
            raise LookupError(f"queue {queue!r}: offset {offset} to dead-letter is not stored")
        b, i = found
        bodies.append(b.body(i))
        raw = b.properties_bytes(i)
        merged = decode_properties(raw) if raw else {}
        if reason == REASON_EXPIRED:
            merged = without_expiration(merged)
        merged[ORIGINAL_QUEUE] = queue
        merged[ORIGINAL_OFFSET] = offset
        merged[DEAD_LETTER_REASON] = reason
        props.append(encode_properties(merged))
    return MessageBatch.from_encoded(bodies, props)


__all__ = [
    "DEAD_LETTER_REASON",
    "MOVE_BATCH_MESSAGES",
    "ORIGINAL_OFFSET",
    "ORIGINAL_QUEUE",
    "REASON_EXPIRED",
    "REASON_MAX_DELIVERY_ATTEMPTS",
    "REASON_REJECTED",
    "dead_letter_batch",
]
