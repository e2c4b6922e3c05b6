"""Helpers that drive a SegmentLog the way the queue actor does, without Ray."""

from __future__ import annotations

import numpy as np

from raymq.batch import MessageBatch
from raymq.storage import SegmentLog

NOW_US = 1_700_000_000_000_000


def commit(
    log: SegmentLog, bodies: list[bytes] | None = None, props=None, *, checkpoint: bool = False
) -> list[int]:
    """Append ``bodies`` (maybe none) and flush pending acks in one group commit."""
    batches = []
    if bodies:
        batches.append(MessageBatch.from_bodies(bodies, props, max_message_size=2**30))
    prepared = log.prepare(batches, NOW_US, checkpoint=checkpoint)
    log.write(prepared)
    log.publish(prepared)
    log.unlink_deleted()  # as QueueCore does after each commit
    return [o for b in batches for o in range(b.first_offset, b.end_offset)]


def read_all(log: SegmentLog) -> dict[int, bytes]:
    """Every unacknowledged message as {offset: body}."""
    out = {}
    offsets = log.unacked(0, 10**12)
    if not len(offsets):
        return out
    for batch in log.read(int(offsets[0]), int(offsets[-1]) + 1):
        for i in range(len(batch)):
            out[batch.first_offset + i] = batch.body(i)
    acked = log.is_acked(np.fromiter(out, dtype=np.int64))
    return {o: b for (o, b), a in zip(out.items(), acked, strict=True) if not a}
