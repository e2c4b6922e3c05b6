"""Dispatcher: which consumer holds which message, and what to deliver next.

Delivery state lives in memory only (acks are what is durable): after a restart every
unacknowledged message is deliverable again. Memory is bounded by what consumers hold
(their prefetch), not by the depth of the queue: undelivered messages are found through
a cursor over the log's ack bitmaps.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from raymq.errors import InvalidAck
from raymq.storage import SegmentLog


@dataclass
class ConsumerState:
    """What one consumer holds: offsets delivered to it and not yet acked or released."""

    consumer_id: str
    prefetch: int
    held: set[int] = field(default_factory=set)
    delivered: int = 0
    acked: int = 0


class Dispatcher:
    """Delivery bookkeeping of one queue over its SegmentLog."""

    def __init__(self, log: SegmentLog, queue: str):
        self.log = log
        self.queue = queue
        first = log.unacked(0, 1)
        self.cursor = int(first[0]) if len(first) else log.next_offset
        self._redeliver: list[int] = []  # heap of released offsets
        self._previous: dict[int, int] = {}  # offset -> deliveries so far, when > 0
        self._holder: dict[int, str] = {}
        self.consumers: dict[str, ConsumerState] = {}
        self.redelivered_total = 0

    def register(self, consumer_id: str, prefetch: int) -> ConsumerState:
        """Add a consumer (or update its prefetch); idempotent."""
        state = self.consumers.get(consumer_id)
        if state is None:
            state = self.consumers[consumer_id] = ConsumerState(consumer_id, prefetch)
        state.prefetch = prefetch
        return state

    @property
    def in_flight(self) -> int:
        """Messages delivered and not yet acked or released."""
        return len(self._holder)

    @property
    def has_deliverable(self) -> bool:
        """True if a consumer with credit would get something now."""
        return bool(self._redeliver) or self.cursor < self.log.next_offset

    def take(self, consumer_id: str, max_messages: int) -> tuple[np.ndarray, np.ndarray]:
        """Deliver up to ``max_messages`` (within the consumer's prefetch credit).

        Returns sorted offsets and each one's delivery count (1 on first delivery).
        """
        state = self.consumers[consumer_id]
        want = min(max_messages, state.prefetch - len(state.held))
        if want <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        picked = self._pop_redeliverable(want)
        fresh = np.zeros(0, dtype=np.int64)
        if len(picked) < want and self.cursor < self.log.next_offset:
            fresh = self.log.unacked(self.cursor, want - len(picked))
            self.cursor = (
                int(fresh[-1]) + 1 if len(fresh) == want - len(picked) else self.log.next_offset
            )
        offsets = np.sort(np.concatenate([np.array(picked, dtype=np.int64), fresh]))
        as_list = offsets.tolist()
        state.held.update(as_list)
        self._holder.update(dict.fromkeys(as_list, consumer_id))
        state.delivered += len(as_list)
        prev = self._previous
        if prev:
            counts = np.array([prev.get(o, 0) + 1 for o in as_list], dtype=np.int32)
        else:
            counts = np.ones(len(as_list), dtype=np.int32)
        return offsets, counts

    def _pop_redeliverable(self, want: int) -> list[int]:
        """Pop up to ``want`` released offsets that are still unacked and unheld."""
        picked: list[int] = []
        while self._redeliver and len(picked) < want:
            k = min(want - len(picked), len(self._redeliver))
            candidates = [heapq.heappop(self._redeliver) for _ in range(k)]
            candidates = [o for o in candidates if o not in self._holder]
            if candidates:
                acked = self.log.is_acked(np.array(candidates, dtype=np.int64))
                picked.extend(o for o, a in zip(candidates, acked, strict=True) if not a)
        return picked

    def check_ack(self, consumer_id: str, offsets: np.ndarray) -> None:
        """Raise ``InvalidAck`` (changing nothing) unless ``consumer_id`` may ack ``offsets``.

        A consumer may ack what it holds, and also what nobody holds (it received it
        before a restart of the queue actor); never what another consumer holds, nor
        offsets the queue never published.
        """
        bad = offsets[(offsets < 0) | (offsets >= self.log.next_offset)]
        if len(bad):
            raise InvalidAck(f"queue {self.queue!r}: offsets {bad[:5].tolist()} were never sent")
        holder = self._holder
        others = [o for o in offsets.tolist() if holder.get(o, consumer_id) != consumer_id]
        if others:
            raise InvalidAck(
                f"queue {self.queue!r}: offsets {others[:5]} are held by another consumer"
            )

    def ack(self, consumer_id: str, offsets: np.ndarray) -> int:
        """Acknowledge offsets (after ``check_ack``); returns how many were newly acked."""
        state = self.consumers.get(consumer_id)
        for o in offsets.tolist():
            if self._holder.pop(o, None) is not None and state is not None:
                state.held.discard(o)
            self._previous.pop(o, None)
        fresh = self.log.ack(offsets)
        if state is not None:
            state.acked += fresh
        return fresh

    def release(
        self, consumer_id: str, offsets: np.ndarray | None = None, *, count_delivery: bool = True
    ) -> int:
        """Give messages back for redelivery (nack, close, death).

        ``offsets`` None means all the consumer holds. ``count_delivery`` False is for
        messages prefetched but never handed to the application. Returns how many.
        """
        state = self.consumers.get(consumer_id)
        if state is None:
            return 0
        chosen = (
            list(state.held)
            if offsets is None
            else [o for o in offsets.tolist() if o in state.held]
        )
        for o in chosen:
            state.held.discard(o)
            del self._holder[o]
            heapq.heappush(self._redeliver, o)
            if count_delivery:
                self._previous[o] = self._previous.get(o, 0) + 1
        if count_delivery:
            self.redelivered_total += len(chosen)
        return len(chosen)

    def unregister(self, consumer_id: str, not_received: np.ndarray | None = None) -> int:
        """Remove a consumer, releasing what it holds; returns how many were released."""
        n = 0
        if not_received is not None and len(not_received):
            n += self.release(consumer_id, not_received, count_delivery=False)
        n += self.release(consumer_id)
        self.consumers.pop(consumer_id, None)
        return n
