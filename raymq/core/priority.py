"""Priorities: among the messages a consumer may have, higher priority first.

A message's priority travels as its ``RayMQPriority`` property (an int, 0 when absent),
durable with it: a producer sets it from ``send(..., priority=)``. A queue created with
``max_priority`` (1 to 255, RabbitMQ's ``x-max-priority``) delivers by it; one without
delivers in order and ignores it, and a priority above ``max_priority`` counts as
``max_priority`` (as RabbitMQ does).

Nothing else changes on disk or in the log's order: the ``PriorityIndex`` keeps, per
level above 0, the offsets of that priority in two ``OffsetSet`` bitmaps (a bit per
offset, never a message in memory): ``members`` (not acknowledged) and ``waiting``
(not handed out since they were last given back). A take serves the highest level
that has a usable waiting offset, in offset order (FIFO within a priority), before the
shared cursor's level-0 messages; a delivery holds one level only, so its rows are in
offset order as every delivery's are. Messages found when they arrive are indexed then;
after a restart the subscription's background pass (``raymq.core.expiry``) finds them
again from the stored properties.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgpack
import numpy as np

from raymq.batch import MessageBatch, PropertyGroups
from raymq.core.offset_set import OffsetSet
from raymq.properties import count_property

#: The property holding a message's priority (stable: selectors may read it).
PRIORITY_PROPERTY = "RayMQPriority"
#: The property name as msgpack encodes it: properties without it are not decoded.
PRIORITY_KEY_BYTES = msgpack.packb(PRIORITY_PROPERTY)


def priority_in(blob: bytes, max_priority: int) -> int:
    """One message's priority from its encoded properties, at most ``max_priority``
    (0: none, or one that is not a non-negative int)."""
    found = count_property(blob, PRIORITY_PROPERTY, PRIORITY_KEY_BYTES)
    return 0 if found is None else min(found, max_priority)


def priorities_in_groups(groups: PropertyGroups, max_priority: int) -> np.ndarray | None:
    """Each row's priority (int16) of a batch by its property groups, or None if every
    one is 0. Each distinct property map is decoded once, and only if it has the key."""
    levels = [priority_in(d, max_priority) for d in groups.distinct]
    if not any(levels):
        return None
    return np.array(levels, dtype=np.int16)[groups.index]


def priorities_of(
    batches: Sequence[MessageBatch], offsets: np.ndarray, max_priority: int
) -> np.ndarray | None:
    """Each of sorted ``offsets``' priority from ``batches`` (stored, with offsets; an
    offset in none is 0), or None if all are 0."""
    out: np.ndarray | None = None
    for b in batches:
        if not len(b) or PRIORITY_KEY_BYTES not in b.prop_data.tobytes():
            continue
        rows = priorities_in_groups(b.property_groups(), max_priority)
        if rows is None:
            continue
        if out is None:
            out = np.zeros(len(offsets), dtype=np.int16)
        lo, hi = np.searchsorted(offsets, [b.first_offset, b.end_offset])
        out[lo:hi] = rows[offsets[lo:hi] - b.first_offset]
    return out


class PriorityIndex:
    """The offsets of each priority level above 0: ``members`` (unacknowledged) and
    ``waiting`` (not handed out since last given back), a bitmap each.

    ``waiting`` may hold offsets that became unusable meanwhile (taken by a selector
    consumer, acknowledged, set aside until a delivery time): a take checks them and
    drops those; what is given back later is ``released`` into it again."""

    def __init__(self, max_priority: int):
        self.max_priority = max_priority
        self._members: dict[int, OffsetSet] = {}
        self._waiting: dict[int, OffsetSet] = {}

    def __bool__(self) -> bool:
        return self.count > 0

    @property
    def nbytes(self) -> int:
        """Bytes of the bitmaps."""
        return sum(s.nbytes for s in (*self._members.values(), *self._waiting.values()))

    @property
    def count(self) -> int:
        """Unacknowledged offsets indexed at a level above 0."""
        return sum(len(s) for s in self._members.values())

    def add(self, offsets: np.ndarray, levels: np.ndarray, free: np.ndarray | None = None) -> None:
        """Index ``offsets`` at their ``levels`` (0s are left out); ``free``: which are
        waiting (default all; a held one becomes waiting when it is released)."""
        for level in np.unique(levels).tolist():
            if level <= 0:
                continue
            at = levels == level
            self._members.setdefault(level, OffsetSet()).add(offsets[at])
            if free is not None:
                at &= free
            self._waiting.setdefault(level, OffsetSet()).add(offsets[at])

    def levels_of(self, offsets: np.ndarray) -> np.ndarray:
        """Each offset's level (0: not indexed)."""
        out = np.zeros(len(offsets), dtype=np.int16)
        for level, members in self._members.items():
            out[members.contains(offsets)] = level
        return out

    def released(self, offsets: np.ndarray) -> None:
        """``offsets`` were given back (or came due): those indexed wait again."""
        if not self._members or not len(offsets):
            return
        for level, members in self._members.items():
            self._waiting[level].add(offsets[members.contains(offsets)])

    def forget(self, offsets: np.ndarray) -> None:
        """``offsets`` were acknowledged (or lost to damage): out of every level."""
        for sets in (self._members, self._waiting):
            for s in sets.values():
                if len(s):
                    s.discard(offsets)

    def forget_below(self, offset: int) -> None:
        """Every offset below ``offset`` (the queue's head) is acknowledged."""
        for sets in (self._members, self._waiting):
            for s in sets.values():
                s.discard_below(offset)

    def take(
        self,
        want: int,
        usable: Callable[[np.ndarray], np.ndarray],
        among: OffsetSet | None = None,
    ) -> np.ndarray:
        """Up to ``want`` waiting offsets of the highest level that has usable ones
        (``usable`` gives a mask), ascending, taken out of ``waiting`` with the unusable
        ones met on the way; ``among``: only offsets in it too (a selector consumer's
        candidates). Empty when no level has any."""
        for level in sorted(self._waiting, reverse=True):
            waiting = self._waiting[level]
            picked: list[np.ndarray] = []
            n = 0
            while n < want and len(waiting):
                if among is None:
                    got = waiting.first(want - n)
                else:
                    got = waiting.first_common(among, want - n)
                if not len(got):
                    break
                waiting.discard(got)
                ok = got[usable(got)]
                picked.append(ok)
                n += len(ok)
            if n:
                return np.concatenate(picked)
        return np.zeros(0, dtype=np.int64)

    def all_waiting(self, limit: int) -> np.ndarray:
        """Up to ``limit`` waiting offsets of any level, sorted (for a new selector
        consumer to match at once)."""
        parts = [s.first(limit) for s in self._waiting.values() if len(s)]
        return np.unique(np.concatenate(parts))[:limit] if parts else np.zeros(0, dtype=np.int64)


__all__ = [
    "PRIORITY_KEY_BYTES",
    "PRIORITY_PROPERTY",
    "PriorityIndex",
    "priorities_in_groups",
    "priorities_of",
    "priority_in",
]
