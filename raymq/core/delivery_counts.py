"""DeliveryCounts: how many times each unacknowledged message was delivered.

A message's delivery count (``delivery_count`` on the consumer's side, and what
``max_delivery_attempts`` limits) is the deliveries before this one plus one. In
memory only the messages delivered and given back are kept (``previous``: most
messages are delivered once and acknowledged, and cost nothing here); a message
being delivered counts once more than its entry.

A durable queue's counts survive a restart and a failover (docs/FORMAT.md, "Delivery
counts"): each take and each give-back that is not a delivery goes to the ack log as
(count, ranges) sections with the next group commit that writes it anyway, or at most
``COUNTS_LINGER_SECONDS`` later (no write of its own: a run of takes from the shared
cursor is one range), every checkpoint carries the counts of what is
delivered and not acknowledged, and recovery gives them back (``restore``). Without it
a crash started every count again at 1, and ``max_delivery_attempts=3`` let a poison
message be delivered three more times after each one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np

from raymq.storage.acklog import deliveries_as_ranges, to_ranges


class DeliveryLog:
    """The part of ``SegmentLog`` counts are written to (a fake in tests)."""

    durable: bool

    def record_deliveries(self, offsets: np.ndarray, count: int) -> None: ...


class DeliveryCounts:
    """Deliveries so far of messages delivered and given back (offset -> count)."""

    def __init__(self, log: DeliveryLog | None = None):
        """``log``: where each change is recorded (None, or not durable: memory only)."""
        self.previous: dict[int, int] = {}
        self._log = log if log is not None and getattr(log, "durable", False) else None

    @property
    def durable(self) -> bool:
        """Whether the counts reach the log (and survive a restart)."""
        return self._log is not None

    def __bool__(self) -> bool:
        return bool(self.previous)

    def __len__(self) -> int:
        return len(self.previous)

    def of(self, offsets: np.ndarray) -> np.ndarray:
        """Deliveries so far of each of ``offsets`` (int32)."""
        prev = self.previous
        if not prev:
            return np.zeros(len(offsets), dtype=np.int32)
        return np.array([prev.get(o, 0) for o in offsets.tolist()], dtype=np.int32)

    def taken(self, offsets: np.ndarray, as_list: list[int]) -> np.ndarray:
        """``offsets`` (``as_list`` the same) are being delivered: their delivery counts
        (int32), recorded for the ack log."""
        prev = self.previous
        if not prev:
            log = self._log
            if log is not None:
                log.record_deliveries(as_list, 1)  # (a list: cheaper to look at)
            return np.ones(len(as_list), dtype=np.int32)
        counts = np.array([prev.get(o, 0) + 1 for o in as_list], dtype=np.int32)
        if self._log is not None:
            for n in np.unique(counts).tolist():
                self._log.record_deliveries(np.sort(offsets[counts == n]), n)
        return counts

    def counted(self, offset: int) -> int:
        """A delivery of ``offset`` ended without an ack (a nack, its consumer gone):
        it counts; returns the deliveries so far. (Its take recorded it already.)"""
        n = self.previous.get(offset, 0) + 1
        self.previous[offset] = n
        return n

    def not_counted(self, offsets: Iterable[int]) -> None:
        """``offsets`` were given back unseen (prefetched, never handed to the
        application): their take does not count, and the ack log says so."""
        if self._log is None:
            return
        by_count: dict[int, list[int]] = {}
        for o in offsets:
            by_count.setdefault(self.previous.get(o, 0), []).append(o)
        for n, listed in by_count.items():
            self._log.record_deliveries(np.array(sorted(listed), dtype=np.int64), n)

    def forget(self, offsets: Iterable[int]) -> None:
        """``offsets`` were acknowledged or taken out of delivery."""
        if self.previous:
            pop = self.previous.pop
            for o in offsets:
                pop(o, None)

    def restore(self, counts: Mapping[int, int]) -> None:
        """After a restart: the counts recovery found (offset -> deliveries so far)."""
        self.previous.update(counts)

    def sections(
        self, holder: Mapping[int, str], delivering: Callable[[str], bool]
    ) -> list[tuple[int, np.ndarray]]:
        """The counts of every unacknowledged message delivered so far, as (count,
        ranges) for a checkpoint: ``holder`` maps held offsets to who holds them, and
        ``delivering(who)`` says whether that is a delivery (a consumer's) under way."""
        counts = {
            o: n + 1 if o in holder and delivering(holder[o]) else n
            for o, n in self.previous.items()
        }
        sections = deliveries_as_ranges(counts)
        first = [o for o, who in holder.items() if o not in counts and delivering(who)]
        if first:
            sections.append((1, to_ranges(np.sort(np.array(first, dtype=np.int64)))))
        return sections
