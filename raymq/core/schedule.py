"""Scheduled delivery: a message sent with a delivery time is not delivered before it.

Its time travels as its ``RayMQScheduledDelivery`` property (ms since the epoch, as
Artemis's ``_AMQ_SCHED_DELIVERY``), durable with it: a producer sets it from
``send(..., deliver_at=, delay=)``. The queue finds it where it finds an expiry
(``raymq.core.expiry``): when it hands messages to a consumer's TargetList, and in its
background pass. A message not due yet is set aside in the ``ScheduleIndex`` (runs of
offsets with one time each, not a message or an entry per message), which the takes
skip, until its time; then it is delivered as a released message is. After a restart
the index is found again the same way from the stored properties: on disk, the
property is the index.
"""

from __future__ import annotations

import datetime
import heapq
import math

import msgpack
import numpy as np

from raymq.batch import MessageBatch
from raymq.errors import InvalidSetting
from raymq.properties import count_property

#: The property holding a message's delivery time, ms since the epoch (stable).
SCHEDULED_PROPERTY = "RayMQScheduledDelivery"
#: The property name as msgpack encodes it: properties without it are not decoded.
SCHEDULED_KEY_BYTES = msgpack.packb(SCHEDULED_PROPERTY)


def delivery_time(deliver_at: object, delay: object, now: float, where: str) -> int | None:
    """A message's delivery time (ms since the epoch, rounded up: never early) from
    ``deliver_at`` (seconds since the epoch, or a ``datetime``; a naive one is local
    time) or ``delay`` (seconds from ``now``); None if neither. ``InvalidSetting``
    naming ``where`` for both, or a bad one."""
    if deliver_at is None and delay is None:
        return None
    if deliver_at is not None and delay is not None:
        raise InvalidSetting(f"{where}: give deliver_at or delay, not both")
    if delay is not None:
        if isinstance(delay, bool) or not isinstance(delay, int | float):
            raise InvalidSetting(f"delay={delay!r} for {where} must be a number of seconds")
        if not math.isfinite(delay) or delay < 0:
            raise InvalidSetting(f"delay={delay!r} for {where} must be finite and >= 0")
        return math.ceil((now + delay) * 1000)
    if isinstance(deliver_at, datetime.datetime):
        return math.ceil(deliver_at.timestamp() * 1000)
    if isinstance(deliver_at, bool) or not isinstance(deliver_at, int | float):
        raise InvalidSetting(
            f"deliver_at={deliver_at!r} for {where} must be seconds since the epoch or a datetime"
        )
    if not math.isfinite(deliver_at) or deliver_at < 0:
        raise InvalidSetting(f"deliver_at={deliver_at!r} for {where} must be a finite time")
    return math.ceil(deliver_at * 1000)


def scheduled_in(blob: bytes) -> int | None:
    """The delivery time (ms since the epoch) in one message's encoded properties."""
    return count_property(blob, SCHEDULED_PROPERTY, SCHEDULED_KEY_BYTES)


def due_times(batches: list[MessageBatch], offsets: np.ndarray) -> np.ndarray | None:
    """Each of sorted ``offsets``' delivery time (ms since the epoch; 0: none) from
    ``batches`` (stored, with offsets), or None if none of them has one."""
    due: np.ndarray | None = None
    for b in batches:
        if not len(b) or SCHEDULED_KEY_BYTES not in b.prop_data.tobytes():
            continue
        groups = b.property_groups()
        times = np.array([scheduled_in(d) or 0 for d in groups.distinct], dtype=np.int64)
        if not times.any():
            continue
        if due is None:
            due = np.zeros(len(offsets), dtype=np.int64)
        lo, hi = np.searchsorted(offsets, [b.first_offset, b.end_offset])
        due[lo:hi] = times[groups.index][offsets[lo:hi] - b.first_offset]
    return due


class ScheduleIndex:
    """Offsets set aside until their delivery time: runs ``[start, end)`` with one time
    each (ms since the epoch), kept sorted by start (for ``contains``) and in a heap by
    time (for ``pop_due``). Messages sent together with one time are one run."""

    def __init__(self) -> None:
        self._starts = np.zeros(0, dtype=np.int64)
        self._ends = np.zeros(0, dtype=np.int64)
        self._heap: list[tuple[int, int, int]] = []  # (due, start, end)
        self.count = 0  # offsets in the runs

    def __bool__(self) -> bool:
        return self.count > 0

    @property
    def nbytes(self) -> int:
        """Bytes of the index (its arrays and heap, approximately)."""
        return self._starts.nbytes + self._ends.nbytes + 80 * len(self._heap)

    def contains(self, offsets: np.ndarray) -> np.ndarray:
        """Which of ``offsets`` are set aside."""
        if not self.count or not len(offsets):
            return np.zeros(len(offsets), dtype=np.bool_)
        i = np.searchsorted(self._starts, offsets, side="right") - 1
        inside = i >= 0
        inside[inside] = offsets[inside] < self._ends[i[inside]]
        return inside

    def add(self, offsets: np.ndarray, dues: np.ndarray) -> None:
        """Set sorted ``offsets`` aside until ``dues`` (ms since the epoch, each); ones
        set aside already are left as they are."""
        fresh = ~self.contains(offsets)
        offsets, dues = offsets[fresh], dues[fresh]
        if not len(offsets):
            return
        cut = np.flatnonzero((np.diff(offsets) != 1) | (np.diff(dues) != 0)) + 1
        starts = offsets[np.concatenate(([0], cut))]
        ends = offsets[np.concatenate((cut - 1, [len(offsets) - 1]))] + 1
        firsts = dues[np.r_[0, cut]].tolist()
        for s, e, d in zip(starts.tolist(), ends.tolist(), firsts, strict=True):
            heapq.heappush(self._heap, (d, s, e))
        order = np.argsort(np.concatenate((self._starts, starts)), kind="stable")
        self._starts = np.concatenate((self._starts, starts))[order]
        self._ends = np.concatenate((self._ends, ends))[order]
        self.count += len(offsets)

    def discard(self, offsets: np.ndarray) -> int:
        """Take sorted ``offsets`` out of their runs (lost to damage: never released);
        returns how many were set aside. Rare: the runs are rebuilt."""
        offsets = offsets[self.contains(offsets)]
        if not len(offsets):
            return 0
        heap: list[tuple[int, int, int]] = []
        for due, start, end in self._heap:
            lo, hi = np.searchsorted(offsets, [start, end]).tolist()
            cuts = offsets[lo:hi].tolist()
            # The pieces of [start, end) between the offsets taken out.
            for a, b in zip([start, *(c + 1 for c in cuts)], [*cuts, end], strict=True):
                if b > a:
                    heap.append((due, a, b))
        heapq.heapify(heap)
        self._heap = heap
        runs = sorted((s, e) for _, s, e in heap)
        self._starts = np.array([s for s, _ in runs], dtype=np.int64)
        self._ends = np.array([e for _, e in runs], dtype=np.int64)
        self.count -= len(offsets)
        return len(offsets)

    def next_due(self) -> int | None:
        """The earliest time of a run (ms since the epoch), or None."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: int) -> np.ndarray:
        """The offsets of every run due at ``now`` (ms since the epoch), taken out."""
        runs = []
        while self._heap and self._heap[0][0] <= now:
            _due, s, e = heapq.heappop(self._heap)
            runs.append((s, e))
        if not runs:
            return np.zeros(0, dtype=np.int64)
        gone = np.isin(self._starts, [s for s, _ in runs])
        self._starts, self._ends = self._starts[~gone], self._ends[~gone]
        out = np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in runs])
        self.count -= len(out)
        return np.sort(out)


__all__ = [
    "SCHEDULED_KEY_BYTES",
    "SCHEDULED_PROPERTY",
    "ScheduleIndex",
    "delivery_time",
    "due_times",
    "scheduled_in",
]
