"""Message expiry: a message sent with a time to live is never delivered after it.

A message's expiry travels as its ``RayMQExpiration`` property (milliseconds since the
epoch, as JMS's ``JMSExpiration``), durable with it under its record's CRC: a producer
sets it from ``send(..., ttl=)``, the queue from its ``default_ttl_s`` for messages
sent without one (Artemis's expiry-delay). Nothing else on disk changes.

The queue checks it twice, as Artemis does: when it hands messages to a consumer's
TargetList (``Subscription``) and when the consumer hands them to the application
(``raymq.client.consumer``): what expired between the two is taken out there. An
expired message moves to the queue's ``expiry_queue`` (with the dead-letter
properties, reason ``"expired"``) or, without one, is acknowledged and dropped; either
way it is counted in ``messages_expired``. A background pass (``TimesScan``) finds the
expired messages nobody asks for, a step at a time, reading stored properties only, so
a paged backlog's expired messages free their segment files as acks do.

Properties without the key's bytes are never decoded: a queue whose messages carry no
expiry pays one byte search per published chunk.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import msgpack
import numpy as np
import pyarrow as pa

from raymq.batch import MessageBatch, PropertyGroups
from raymq.core.schedule import SCHEDULED_KEY_BYTES
from raymq.properties import count_property

#: The property holding a message's expiry, ms since the epoch (stable: applications
#: and selectors may read it).
EXPIRATION_PROPERTY = "RayMQExpiration"
#: The property name as msgpack encodes it: properties without these bytes carry no
#: expiry and are not decoded.
EXPIRATION_KEY_BYTES = msgpack.packb(EXPIRATION_PROPERTY)
#: Messages a background pass examines per step before it yields (see ``TimesScan``).
SCAN_STEP_MESSAGES = 10_000


def expiration_ms(ttl: float, now: float) -> int:
    """The expiry of a message sent at ``now`` (seconds since the epoch) with ``ttl``
    seconds to live, in ms since the epoch (rounded up: never before ``now + ttl``)."""
    return math.ceil((now + ttl) * 1000)


def now_ms(now: float) -> int:
    """``now`` (seconds since the epoch) in whole ms, as expiries are compared."""
    return math.floor(now * 1000)


def carries_expiry(blob: bytes) -> bool:
    """Whether msgpack-encoded properties may hold an expiry (a byte search)."""
    return EXPIRATION_KEY_BYTES in blob


def carries_times(blob: bytes) -> bool:
    """Whether msgpack-encoded properties may hold an expiry or a delivery time."""
    return EXPIRATION_KEY_BYTES in blob or SCHEDULED_KEY_BYTES in blob


def expiration_in(blob: bytes) -> int | None:
    """The expiry (ms since the epoch) in one message's encoded properties, or None."""
    return count_property(blob, EXPIRATION_PROPERTY, EXPIRATION_KEY_BYTES)


def expired_in_groups(groups: PropertyGroups, now: int) -> np.ndarray | None:
    """Which messages of a batch (by its property groups) expired at ``now`` (ms since
    the epoch), or None if none did. Each distinct property map is decoded once."""
    expired = np.zeros(len(groups.distinct), dtype=np.bool_)
    for i, blob in enumerate(groups.distinct):
        exp = expiration_in(blob)
        expired[i] = exp is not None and exp <= now
    if not expired.any():
        return None
    return expired[groups.index]


def expired_offsets(batches: Sequence[MessageBatch], offsets: np.ndarray, now: int) -> np.ndarray:
    """Which of sorted ``offsets`` (found in ``batches``, stored batches with their
    offsets) expired at ``now`` (ms since the epoch); an offset in none is not."""
    mask = np.zeros(len(offsets), dtype=np.bool_)
    for b in batches:
        if not len(b) or not carries_expiry(b.prop_data.tobytes()):
            continue
        rows = expired_in_groups(b.property_groups(), now)
        if rows is None:
            continue
        lo, hi = np.searchsorted(offsets, [b.first_offset, b.end_offset])
        mask[lo:hi] = rows[offsets[lo:hi] - b.first_offset]
    return mask


def expired_rows(properties: pa.Array, now: int) -> np.ndarray | None:
    """Which rows of a delivery batch's ``properties`` column (msgpack binary) expired
    at ``now`` (ms since the epoch), or None if none did (the common case costs one
    byte search of the column's data)."""
    n = len(properties)
    _validity, offsets, data = properties.buffers()
    if data is None or not data.size or not n:
        return None  # (no message has properties: the common case, ~1 µs)
    # Only this array's bytes: a slice's buffers are its parent's (a consumer's buffer
    # handed out a message at a time would search the whole parent each time).
    fmt = "<q" if pa.types.is_large_binary(properties.type) else "<i"
    width = struct.calcsize(fmt)
    (start,) = struct.unpack_from(fmt, offsets, properties.offset * width)
    (end,) = struct.unpack_from(fmt, offsets, (properties.offset + n) * width)
    if end <= start or EXPIRATION_KEY_BYTES not in data.slice(start, end - start).to_pybytes():
        return None
    expired = np.array(
        [
            (exp := expiration_in(blob)) is not None and exp <= now
            for blob in properties.to_pylist()
        ],
        dtype=np.bool_,
    )
    return expired if expired.any() else None


def with_expiration(batch: MessageBatch, expires: int, *, keep_existing: bool) -> MessageBatch:
    """``batch`` with every message's ``RayMQExpiration`` set to ``expires`` (ms since the
    epoch); ``keep_existing``: a message that has one keeps it (a queue's default TTL)."""
    return batch.with_property(EXPIRATION_PROPERTY, expires, keep_existing=keep_existing)


def without_expiration(props: dict) -> dict:
    """Properties of a message moved to its expiry queue: its expiry goes (it would
    expire there at once), kept as ``RayMQOriginalExpiration``."""
    exp = props.pop(EXPIRATION_PROPERTY, None)
    if exp is not None:
        props["RayMQOriginalExpiration"] = exp
    return props


class TimesScan:
    """Where a subscription's background pass is, and whether it needs one.

    ``may_have_times`` is True while any unacknowledged message may carry an expiry or a
    delivery time (``raymq.core.schedule``): after a restart with messages (not known
    until a pass), and whenever one arrives with one. A whole pass that met none, with
    none arriving meanwhile, sets it False again, so a queue whose messages carry no
    times stops paying for the check at delivery.
    """

    def __init__(self, may_have_times: bool):
        self.may_have_times = may_have_times
        self.position = 0  # the next offset the pass examines
        self.arrivals = 0  # chunks that arrived carrying an expiry
        self._pass_arrivals = 0
        self._pass_met = False
        self.passes = 0

    def arrived(self, groups: PropertyGroups) -> None:
        """A newly published chunk (its property groups)."""
        if any(carries_times(d) for d in groups.distinct):
            self.arrivals += 1
            self.may_have_times = True

    def start_pass(self) -> None:
        """A pass begins at offset 0."""
        self.position = 0
        self._pass_arrivals = self.arrivals
        self._pass_met = False

    def met(self, batches: Sequence[MessageBatch]) -> None:
        """The pass read ``batches``: note whether any message in them carries an expiry."""
        if not self._pass_met:
            self._pass_met = any(carries_times(b.prop_data.tobytes()) for b in batches)

    def end_pass(self) -> None:
        """The pass reached the end of the log."""
        self.passes += 1
        if not self._pass_met and self.arrivals == self._pass_arrivals:
            self.may_have_times = False


__all__ = [
    "EXPIRATION_KEY_BYTES",
    "EXPIRATION_PROPERTY",
    "SCAN_STEP_MESSAGES",
    "TimesScan",
    "carries_expiry",
    "carries_times",
    "expiration_in",
    "expiration_ms",
    "expired_in_groups",
    "expired_offsets",
    "expired_rows",
    "now_ms",
    "with_expiration",
    "without_expiration",
]
