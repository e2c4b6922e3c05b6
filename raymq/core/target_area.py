"""TargetArea: which consumer may get which message, and which one holds it.

The seed's TargetArea keeps a TargetList per consumer: the messages that matched its
selector. Here the queue side of each TargetList is a ``ConsumerTarget``:

- consumers without a selector share one cursor over the log (every unacknowledged
  message matches them), so they cost nothing per message;
- a consumer with a selector has ``candidates``, an ``OffsetSet`` of matching offsets
  not yet delivered to it: its CacheReferences (an offset names its segment and
  position through the log's index). New messages are matched when they arrive; a
  consumer that arrives later scans the stored properties (never the bodies), and a
  segment whose property summary cannot match is skipped unread. Messages that match
  nobody cost no one's credit.

Delivery state lives in memory (acks are what is durable): after a restart every
unacknowledged message is deliverable again. A message is held by at most one consumer
at a time (``_holder``); released messages (nack, close, death) go to a heap for the
shared cursor and back into every matching selector consumer's candidates, unless they
have been delivered ``max_delivery_attempts`` times: those, and rejected ones, are held
by ``DEAD_LETTER_HOLDER`` (so no consumer takes them) until the queue has moved them to
its dead-letter queue (``raymq.core.dead_letter``).
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict, deque
from itertools import repeat

import numpy as np

from raymq.batch import MessageBatch, PropertyGroups, stored_property_groups
from raymq.core.consumer_target import ConsumerTarget
from raymq.core.dead_letter import REASON_EXPIRED, REASON_MAX_DELIVERY_ATTEMPTS
from raymq.core.delivery_counts import DeliveryCounts
from raymq.core.offset_set import OffsetSet
from raymq.core.priority import PriorityIndex, priorities_in_groups, priorities_of
from raymq.core.schedule import ScheduleIndex
from raymq.errors import InvalidAck, StorageError
from raymq.selector import HEADER_DELIVERY_COUNT, HEADER_OFFSET, HEADER_TIMESTAMP, Selector
from raymq.storage import SegmentLog

log = logging.getLogger("raymq.queue")

#: Departed consumers remembered (``TargetArea.drop_stale``): a consumer id each.
DEPARTED_REMEMBERED = 10_000

#: Offsets a late consumer's scan examines per step before yielding (messages).
SCAN_STEP_MESSAGES = 200_000
#: The holder of messages waiting to be moved to the dead-letter queue (no consumer id
#: is a NUL: consumer ids are hex).
DEAD_LETTER_HOLDER = "\x00dead-letter"
#: The holder of nacked messages waiting out a redelivery delay (``release``'s
#: ``delay_until``): nobody takes them until ``release_due``.
DELAYED_HOLDER = "\x00delayed"


def _is_consumer(holder: str) -> bool:
    """Whether ``holder`` is a consumer (a delivery under way), not a hold of the queue."""
    return not holder.startswith("\x00")


def selector_headers(batch: MessageBatch, delivery_counts: np.ndarray) -> dict[str, np.ndarray]:
    """Header columns of a batch for selectors that use headers."""
    n = len(batch)
    ts = batch.timestamps if batch.timestamps is not None else np.zeros(n, dtype=np.int64)
    return {
        HEADER_OFFSET: np.arange(batch.first_offset, batch.first_offset + n, dtype=np.int64),
        HEADER_TIMESTAMP: ts // 1000,
        HEADER_DELIVERY_COUNT: delivery_counts,
    }


class TargetArea:
    """Delivery bookkeeping of one queue over its SegmentLog."""

    def __init__(
        self,
        log: SegmentLog,
        queue: str,
        max_delivery_attempts: int | None = None,
        max_priority: int | None = None,
    ):
        """``max_priority``: deliver higher priorities first (``raymq.core.priority``);
        None: in order."""
        self.log = log
        self.queue = queue
        self.max_delivery_attempts = max_delivery_attempts
        self.cursor = self.head()
        self._redeliver: list[int] = []  # heap of released offsets (shared cursor side)
        #: Released offsets whose properties could not be read to offer them to the
        #: selector consumers; offered again by ``housekeeping``.
        self._unoffered: list[np.ndarray] = []
        #: Deliveries so far of messages delivered and given back; the log records
        #: them once ``count_durably`` was called (a durable queue's own area).
        self.deliveries = DeliveryCounts()
        self._holder: dict[int, str] = {}
        #: The highest offset ever taken (-1: none): no offset above it is held.
        self._highest_taken = -1
        #: offset -> reason, for messages held by DEAD_LETTER_HOLDER until moved.
        self.dead_letters: dict[int, str] = {}
        #: offset -> when it may be delivered again (seconds since the epoch), for
        #: messages held by DELAYED_HOLDER; and the same as a heap of (due, offset).
        self.delayed: dict[int, float] = {}
        self._due: list[tuple[float, int]] = []
        #: Messages not due yet (``send(deliver_at=)``), set aside as runs: no consumer
        #: takes them until ``release_scheduled`` (``raymq.core.schedule``).
        self.scheduled = ScheduleIndex()
        #: The offsets of each priority above 0 (None: the queue has no priorities).
        self.priorities = None if max_priority is None else PriorityIndex(max_priority)
        self.consumers: dict[str, ConsumerTarget] = {}
        self.redelivered_total = 0
        #: Offsets below this existed before this process: an earlier process of the
        #: queue may have delivered them to any consumer, whose application may ack
        #: that copy after this process delivered the message again.
        self.recovered_end = log.next_offset
        #: consumer id -> ``next_offset`` when it was unregistered (the newest
        #: ``DEPARTED_REMEMBERED``): one that comes back may ack copies it had then.
        self._departed: OrderedDict[str, int] = OrderedDict()
        #: Acks, nacks and rejects of stale copies: dropped, not refused (see
        #: ``drop_stale``).
        self.stale_acks = 0

    def head(self) -> int:
        """The first unacknowledged offset (``next_offset`` when there is none)."""
        first = self.log.unacked(0, 1)
        return int(first[0]) if len(first) else self.log.next_offset

    @property
    def selective(self) -> list[ConsumerTarget]:
        """Consumers with a selector."""
        return [c for c in self.consumers.values() if c.selector is not None]

    def register(
        self,
        consumer_id: str,
        prefetch: int,
        selector: Selector | None = None,
        watch: object = None,
    ) -> ConsumerTarget:
        """Add a consumer (or update its prefetch); idempotent."""
        target = self.consumers.get(consumer_id)
        if target is None:
            target = ConsumerTarget(consumer_id, prefetch, selector, watch=watch)
            target.stale_below = self._departed.pop(consumer_id, 0)
            if selector is not None:
                target.candidates = OffsetSet()
                target.scan_pos, target.scan_end = self.head(), self.log.next_offset
                self._match_priorities(target)
            self.consumers[consumer_id] = target
        target.prefetch = prefetch
        if watch is not None:
            target.watch = watch
        return target

    @property
    def in_flight(self) -> int:
        """Messages delivered and not yet acked or released (dead letters and delayed
        ones not counted)."""
        return len(self._holder) - len(self.dead_letters) - len(self.delayed)

    @property
    def index_bytes(self) -> int:
        """Bytes of delivery bookkeeping: CacheReference bitmaps, and the holder, held
        and redelivery entries of messages in flight (about 100 bytes each in CPython),
        and the runs of messages set aside until their delivery time."""
        bitmaps = sum(t.candidates.nbytes for t in self.selective)
        per_message = (
            2 * len(self._holder)
            + len(self._redeliver)
            + len(self.deliveries)
            + len(self.dead_letters)
        )
        ranked = 0 if self.priorities is None else self.priorities.nbytes
        return bitmaps + 100 * per_message + self.scheduled.nbytes + ranked

    # -- matching --------------------------------------------------------------------

    def _match(
        self, target: ConsumerTarget, batch: MessageBatch, groups: PropertyGroups
    ) -> np.ndarray:
        """Offsets of ``batch`` that ``target``'s selector selects."""
        return np.flatnonzero(self._mask(target.selector, batch, groups)) + batch.first_offset

    def _mask(self, selector: Selector, batch: MessageBatch, groups: PropertyGroups) -> np.ndarray:
        headers = None
        if selector.uses_headers:
            counts = self.previous_deliveries(
                np.arange(batch.first_offset, batch.end_offset, dtype=np.int64)
            )
            headers = selector_headers(batch, counts + 1)
        return selector.match_groups(groups.distinct, groups.index, headers)

    def rewind(self, offset: int) -> None:
        """The acknowledged set was reset at ``offset`` (a seek): the shared cursor
        starts again at the head, and every selector consumer's scan covers what lies
        from ``offset`` on again."""
        self.cursor = self.head()
        end = self.log.next_offset
        for t in self.selective:
            if t.scanning:
                t.scan_pos = min(t.scan_pos, offset)
            else:
                t.scan_pos, t.scan_end = offset, end

    def select(self, selector: Selector, offsets: np.ndarray) -> np.ndarray:
        """Mask of ``offsets`` (sorted, published) that ``selector`` selects."""
        return np.isin(offsets, self._selected_offsets(selector, offsets))

    def _selected_offsets(self, selector: Selector, offsets: np.ndarray) -> np.ndarray:
        out = [
            np.flatnonzero(self._mask(selector, b, b.property_groups())) + b.first_offset
            for b in self._properties_of(offsets)
        ]
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    @property
    def remembers_deliveries(self) -> bool:
        """True while a message not yet acknowledged has been delivered and given back:
        its delivery count lives only in this process (not a durable queue's)."""
        return bool(self.deliveries) and not self.deliveries.durable

    def previous_deliveries(self, offsets: np.ndarray) -> np.ndarray:
        """How many times each offset was delivered and given back (int32)."""
        return self.deliveries.of(offsets)

    def count_durably(self) -> None:
        """Record every delivery count in the log from now on (a durable queue's own
        area: ``raymq.core.delivery_counts``)."""
        self.deliveries = DeliveryCounts(self.log)
        self.log.checkpoint_deliveries(lambda: self.deliveries.sections(self._holder, _is_consumer))

    def restore_deliveries(self, counts: dict[int, int]) -> int:
        """After a restart: the delivery counts recovery found. A message delivered
        ``max_delivery_attempts`` times already is held for the dead-letter queue;
        returns how many."""
        self.deliveries.restore(counts)
        limit = self.max_delivery_attempts
        spent = [] if limit is None else [o for o, n in counts.items() if n >= limit]
        for o in spent:
            if o not in self._holder:
                self._holder[o] = DEAD_LETTER_HOLDER
                self.dead_letters[o] = REASON_MAX_DELIVERY_ATTEMPTS
                self._highest_taken = max(self._highest_taken, o)
        return len(spent)

    def arrived(self, batch: MessageBatch, groups: PropertyGroups) -> None:
        """Index a newly published batch's priorities, match it against every selector
        consumer."""
        if self.priorities is not None:
            levels = priorities_in_groups(groups, self.priorities.max_priority)
            if levels is not None:
                self.priorities.add(
                    np.arange(batch.first_offset, batch.end_offset, dtype=np.int64), levels
                )
        by_text: dict[str, np.ndarray] = {}
        for target in self.selective:
            if batch.first_offset < target.scan_end:
                continue  # its scan covers this batch
            text = target.selector.text
            if text not in by_text or target.selector.uses_headers:
                by_text[text] = self._match(target, batch, groups)
            target.candidates.add(by_text[text])

    def scan_step(self, target: ConsumerTarget, budget: int = SCAN_STEP_MESSAGES) -> None:
        """Match up to ``budget`` stored messages of a late consumer's scan range.

        Segments whose property summary matches nothing are skipped without reading.
        """
        while target.scanning and budget > 0:
            seg = self.log.segment_of(target.scan_pos)
            if seg is None:  # a gap: a deleted segment or the queue's end
                later = [s for s in self.log.segments if s.base_offset > target.scan_pos]
                target.scan_pos = (
                    min(later[0].base_offset, target.scan_end) if later else (target.scan_end)
                )
                continue
            end = min(seg.end_offset, target.scan_end, target.scan_pos + budget)
            if self._summary_rules_out(target, seg):
                target.segments_skipped += 1
                target.scan_pos = min(seg.end_offset, target.scan_end)
                continue
            whole = target.scan_pos == seg.base_offset and end == seg.end_offset
            stored = self.log.properties(target.scan_pos, end)
            if stored:
                groups, offsets = stored_property_groups(stored)
                if target.selector.uses_headers:  # headers differ per message: per batch
                    matched = np.concatenate(
                        [self._match(target, b, b.property_groups()) for b in stored]
                    )
                else:  # the whole range at once: one evaluation per distinct map
                    matched = offsets[target.selector.match_groups(groups.distinct, groups.index)]
                if len(matched):
                    matched = matched[~self.log.is_acked(matched)]
                    target.candidates.add(matched)
                if whole and seg.summary is None and not seg.summary_overflow:
                    seg.summary = {}
                    seg.note_properties(groups)
            target.messages_scanned += end - target.scan_pos
            budget -= end - target.scan_pos
            target.scan_pos = end

    @staticmethod
    def _summary_rules_out(target: ConsumerTarget, seg) -> bool:
        if seg.summary is None or target.selector.uses_headers:
            return False
        blobs = list(seg.summary)
        return bool(blobs) and not target.selector.match_encoded(blobs).any()

    # -- delivering ------------------------------------------------------------------

    def take(self, consumer_id: str, max_messages: int) -> tuple[np.ndarray, np.ndarray]:
        """Deliver up to ``max_messages`` (within the consumer's prefetch credit).

        Returns sorted offsets and each one's delivery count (1 on first delivery).
        """
        target = self.consumers[consumer_id]
        want = min(max_messages, target.prefetch - len(target.held))
        if want <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        if target.selector is None:
            offsets = self._take_shared(want)
        else:
            offsets = self._take_candidates(target, want)
        as_list = offsets.tolist()
        if as_list:
            self._highest_taken = max(self._highest_taken, as_list[-1])
        target.held.update(as_list)
        self._holder.update(dict.fromkeys(as_list, consumer_id))
        target.delivered += len(as_list)
        return offsets, self.deliveries.taken(offsets, as_list)

    def _usable(self, offsets: np.ndarray) -> np.ndarray:
        """Which of ``offsets`` may be taken now: unacknowledged, held by nobody, not
        set aside until a delivery time."""
        holder = self._holder
        ok = ~self.log.is_acked(offsets)
        ok &= np.fromiter((o not in holder for o in offsets.tolist()), bool, len(offsets))
        if self.scheduled:
            ok &= ~self.scheduled.contains(offsets)
        return ok

    def _take_shared(self, want: int) -> np.ndarray:
        if self.priorities:  # one level a delivery, the highest first (see priority.py)
            ranked = self.priorities.take(want, self._usable)
            if len(ranked):
                return ranked
        picked = self._pop_redeliverable(want)
        fresh: list[int] = []
        holder = self._holder
        # Offsets beyond the shared cursor are held only if something was taken there: by
        # a selector consumer, or from the redelivery heap after one released it (found by
        # the ownership model: skipping the check then delivered such an offset twice).
        # Below that mark nothing ahead is held and the per-offset check is skipped.
        ahead_may_be_held = self._highest_taken >= self.cursor
        while len(picked) + len(fresh) < want and self.cursor < self.log.next_offset:
            need = want - len(picked) - len(fresh)
            got = self.log.unacked(self.cursor, need)
            self.cursor = int(got[-1]) + 1 if len(got) == need else self.log.next_offset
            # Selector consumers may hold offsets beyond the cursor: skip those (they come
            # back through the redelivery heap if released).
            if self.scheduled:
                got = got[~self.scheduled.contains(got)]
            listed = got.tolist()
            fresh.extend([o for o in listed if o not in holder] if ahead_may_be_held else listed)
        if picked and fresh:  # a released offset can be ahead of the cursor as well
            again = set(picked)
            fresh = [o for o in fresh if o not in again]
        return np.sort(np.array(picked + fresh, dtype=np.int64))

    def _take_candidates(self, target: ConsumerTarget, want: int) -> np.ndarray:
        if self.priorities:  # as _take_shared, among the consumer's candidates
            ranked = self.priorities.take(want, self._usable, among=target.candidates)
            if len(ranked):
                target.candidates.discard(ranked)
                return ranked
        picked: list[np.ndarray] = []
        chosen: set[int] = set()
        n = 0
        while n < want:
            examined = target.candidates.first(want - n)
            if not len(examined):
                if not target.scanning:
                    break
                self.scan_step(target)
                continue
            target.candidates.discard(examined)  # set-aside ones come back at their time
            ok = examined[self._usable(examined)]
            # Not picked already: a scan step may find again what this call took before
            # it (they are held only once the call returns).
            if chosen:
                ok = ok[np.fromiter((o not in chosen for o in ok.tolist()), bool, len(ok))]
            chosen.update(ok.tolist())
            picked.append(ok)
            n += len(ok)
        # Sorted: a late consumer's scan finds candidates below those taken already.
        return np.sort(np.concatenate(picked)) if picked else np.zeros(0, dtype=np.int64)

    def _pop_redeliverable(self, want: int) -> list[int]:
        """Pop up to ``want`` released offsets that are still unacked and unheld."""
        picked: list[int] = []
        while self._redeliver and len(picked) < want:
            k = min(want - len(picked), len(self._redeliver))
            popped = [heapq.heappop(self._redeliver) for _ in range(k)]
            # An offset released twice (by two consumers in turn) is in the heap twice.
            candidates = np.array(list(dict.fromkeys(popped)), dtype=np.int64)
            if picked:
                candidates = candidates[candidates != picked[-1]]
            picked.extend(candidates[self._usable(candidates)].tolist())
        return picked

    def deliverable_estimate(self, consumer_id: str) -> int:
        """Messages this consumer could be given now or after its scan (CacheReferences)."""
        target = self.consumers[consumer_id]
        if target.selector is None:
            return max(0, self.log.depth - self.in_flight)
        return len(target.candidates) + (target.scan_end - target.scan_pos)

    # -- acknowledging and releasing -------------------------------------------------

    def drop_stale(self, consumer_id: str, offsets: np.ndarray) -> np.ndarray:
        """``offsets`` less the stale copies among them (counted in ``stale_acks``).

        A stale copy is a message another consumer holds now that this consumer's
        application may have received before: from an earlier process of the queue
        (an offset below ``recovered_end``), or before this consumer was released and
        came back (below its ``stale_below``); from a consumer this process does not
        know, any. Its ack, nack or reject is dropped: refusing it would fail an
        application that acked what it was given, and the holder's copy decides.
        Everything else is left for ``check_ack``.
        """
        holder = self._holder
        target = self.consumers.get(consumer_id)
        if target is None:
            below = self.log.next_offset
        else:
            below = max(self.recovered_end, target.stale_below)
        if below <= 0:
            return offsets
        stale = np.fromiter(
            (o < below and holder.get(o, consumer_id) != consumer_id for o in offsets.tolist()),
            bool,
            len(offsets),
        )
        n = int(stale.sum())
        if not n:
            return offsets
        self.stale_acks += n
        log.info(
            "queue %r: dropped %d stale copies acked by consumer %s (first %d): another"
            " consumer holds them now",
            self.queue,
            n,
            consumer_id,
            int(offsets[stale][0]),
        )
        return offsets[~stale]

    def check_ack(self, consumer_id: str, offsets: np.ndarray) -> None:
        """Raise ``InvalidAck`` (changing nothing) unless ``consumer_id`` may ack ``offsets``.

        A consumer may ack what it holds, and also what nobody holds (it received it
        before a restart of the queue actor); never what another consumer holds, nor
        offsets the queue never published.
        """
        bad = offsets[(offsets < 0) | (offsets >= self.log.next_offset)]
        if len(bad):
            raise InvalidAck(f"queue {self.queue!r}: offsets {bad[:5].tolist()} were never sent")
        target = self.consumers.get(consumer_id)
        listed = offsets.tolist()
        if target is not None and target.held.issuperset(listed):
            return  # the common case, checked in C: it holds them all
        holder = self._holder
        others = [o for o in listed if holder.get(o, consumer_id) != consumer_id]
        if others:
            raise InvalidAck(
                f"queue {self.queue!r}: offsets {others[:5]} are held by another consumer"
            )

    def refused(self, consumer_id: str, offsets: np.ndarray) -> np.ndarray:
        """The offsets of ``offsets`` that ``check_ack`` refuses (never sent, or held by
        another consumer), in their order."""
        never = (offsets < 0) | (offsets >= self.log.next_offset)
        target = self.consumers.get(consumer_id)
        listed = offsets.tolist()
        if not never.any() and target is not None and target.held.issuperset(listed):
            return offsets[:0]
        holder = self._holder
        other = np.fromiter(
            (holder.get(o, consumer_id) != consumer_id for o in listed), bool, len(listed)
        )
        return offsets[never | other]

    def ack(self, consumer_id: str, offsets: np.ndarray) -> int:
        """Acknowledge offsets (after ``check_ack``); returns how many were newly acked."""
        target = self.consumers.get(consumer_id)
        listed = offsets.tolist()
        # check_ack passed: each is held by this consumer or by nobody, so all of them
        # leave the holder map, in C (a comprehension calling pop per offset cost a deep
        # queue's consume 0.1 µs a message, measured).
        deque(map(self._holder.pop, listed, repeat(None)), maxlen=0)
        if target is not None:
            target.held.difference_update(listed)
        self.deliveries.forget(listed)  # usually empty: only redelivered messages
        if consumer_id == DEAD_LETTER_HOLDER:
            for o in listed:
                self.dead_letters.pop(o, None)
        fresh = self.log.ack(offsets)
        if self.priorities:
            self.priorities.forget(offsets)
        if target is not None:
            target.acked += fresh
        return fresh

    def release(
        self,
        consumer_id: str,
        offsets: np.ndarray | None = None,
        *,
        count_delivery: bool = True,
        delay_until: float | None = None,
    ) -> int:
        """Give messages back for redelivery (nack, close, death).

        ``offsets`` None means all the consumer holds. ``count_delivery`` False is for
        messages prefetched but never handed to the application. ``delay_until``
        (seconds since the epoch): not delivered again before then (``release_due``).
        Returns how many.
        """
        target = self.consumers.get(consumer_id)
        if target is None:
            return 0
        chosen = self._held_by(target, offsets)
        limit = self.max_delivery_attempts if count_delivery else None
        again: list[int] = []
        if not count_delivery:
            self.deliveries.not_counted(chosen)
        for o in chosen:
            target.held.discard(o)
            if count_delivery:
                self.deliveries.counted(o)
            if limit is not None and self.deliveries.previous[o] >= limit:
                # Its next delivery would exceed max_delivery_attempts: dead-letter it.
                self._holder[o] = DEAD_LETTER_HOLDER
                self.dead_letters[o] = REASON_MAX_DELIVERY_ATTEMPTS
                continue
            if delay_until is not None:
                self._hold_delayed(o, delay_until)
                continue
            del self._holder[o]
            heapq.heappush(self._redeliver, o)
            again.append(o)
        if count_delivery:
            self.redelivered_total += len(again)
        else:
            target.given_back += len(chosen)
        if again:
            self._offer_again(np.array(again, dtype=np.int64))
        return len(chosen)

    def _hold_delayed(self, offset: int, due: float) -> None:
        self._holder[offset] = DELAYED_HOLDER
        self.delayed[offset] = due
        heapq.heappush(self._due, (due, offset))

    def hold_delayed(self, delays: dict[int, float]) -> None:
        """After a restart: messages still waiting out a nack's delay (offset -> due,
        seconds since the epoch) are held until then."""
        for o, due in delays.items():
            if o not in self._holder:
                self._hold_delayed(o, due)
                # Held ahead of the shared cursor: its takes must check the holders.
                self._highest_taken = max(self._highest_taken, o)

    def next_due(self) -> float | None:
        """When the next delayed message may be delivered again (None: none waits)."""
        while self._due and self.delayed.get(self._due[0][1]) != self._due[0][0]:
            heapq.heappop(self._due)  # acked, forgotten or delayed again since
        return self._due[0][0] if self._due else None

    def release_due(self, now: float) -> int:
        """Make delayed messages due by ``now`` deliverable again; returns how many."""
        again: list[int] = []
        while (due := self.next_due()) is not None and due <= now:
            _due, o = heapq.heappop(self._due)
            del self.delayed[o]
            if self._holder.get(o) == DELAYED_HOLDER:
                del self._holder[o]
                heapq.heappush(self._redeliver, o)
                again.append(o)
        if again:
            self.redelivered_total += len(again)
            self._offer_again(np.array(sorted(again), dtype=np.int64))
        return len(again)

    @staticmethod
    def _held_by(target: ConsumerTarget, offsets: np.ndarray | None) -> list[int]:
        """Sorted offsets of ``offsets`` (None: all) that ``target`` holds."""
        if offsets is None:
            return sorted(target.held)
        return [o for o in np.unique(offsets).tolist() if o in target.held]

    def dead_letter(self, consumer_id: str, offsets: np.ndarray, reason: str) -> int:
        """Take messages a consumer holds out of delivery, for the dead-letter queue;
        returns how many (those it does not hold are left alone)."""
        target = self.consumers.get(consumer_id)
        if target is None:
            return 0
        chosen = self._held_by(target, offsets)
        target.held.difference_update(chosen)
        for o in chosen:
            self._holder[o] = DEAD_LETTER_HOLDER
            self.dead_letters[o] = reason
        return len(chosen)

    def set_aside(self, consumer_id: str, offsets: np.ndarray, dues: np.ndarray) -> None:
        """Messages just taken by ``consumer_id`` that are not due yet (sorted, with their
        times, ms since the epoch): not its, and not delivered, until their time."""
        target = self.consumers.get(consumer_id)
        listed = offsets.tolist()
        if target is not None:
            target.held.difference_update(listed)
            target.delivered -= len(listed)
        for o in listed:
            self._holder.pop(o, None)
        self.deliveries.not_counted(listed)  # their take was no delivery
        self.scheduled.add(offsets, dues)

    def set_aside_unheld(self, offsets: np.ndarray, dues: np.ndarray) -> int:
        """Messages not due yet that nobody holds (found by a background pass): set
        aside until their time; returns how many."""
        free = np.array([o not in self._holder for o in offsets.tolist()], dtype=np.bool_)
        before = self.scheduled.count
        self.scheduled.add(offsets[free], dues[free])
        return self.scheduled.count - before

    def release_scheduled(self, now: int) -> int:
        """Make the messages set aside until ``now`` (ms since the epoch) deliverable, as
        released ones are (not counted as redelivered); returns how many."""
        due = self.scheduled.pop_due(now)
        if not len(due):
            return 0
        due = due[~self.log.is_acked(due)]
        again = [o for o in due.tolist() if o not in self._holder]
        for o in again:
            heapq.heappush(self._redeliver, o)
        if again:
            self._offer_again(np.array(again, dtype=np.int64))
        return len(again)

    def hold_expired(self, offsets: np.ndarray) -> int:
        """Take expired messages nobody holds out of delivery, for the expiry queue (as
        dead letters, reason ``"expired"``); returns how many (held ones are left to
        their holder: the consumer finds them expired, or they come back released)."""
        holder = self._holder
        chosen = [o for o in offsets.tolist() if o not in holder]
        if not chosen:
            return 0
        for o in chosen:
            holder[o] = DEAD_LETTER_HOLDER
            self.dead_letters[o] = REASON_EXPIRED
        # The shared cursor skips held offsets ahead of it only below this mark.
        self._highest_taken = max(self._highest_taken, chosen[-1])
        return len(chosen)

    def found_priorities(self, offsets: np.ndarray, batches: list[MessageBatch]) -> None:
        """A background pass read ``batches`` holding sorted unacknowledged ``offsets``
        (after a restart): index their priorities, those nobody holds as waiting."""
        if self.priorities is None:
            return
        levels = priorities_of(batches, offsets, self.priorities.max_priority)
        if levels is None:
            return
        ranked = levels > 0
        offsets, levels = offsets[ranked], levels[ranked]
        free = np.fromiter((o not in self._holder for o in offsets.tolist()), bool, len(offsets))
        self.priorities.add(offsets, levels, free)
        # A selector consumer whose scan has not reached them yet: matched now, from
        # the batches in hand (what it took or saw acked already is skipped at a take).
        holding = [
            b for b in batches if np.any((offsets >= b.first_offset) & (offsets < b.end_offset))
        ]
        for target in self.selective:
            for b in holding:
                matched = self._match(target, b, b.property_groups())
                target.candidates.add(matched[np.isin(matched, offsets)])

    def _match_priorities(self, target: ConsumerTarget) -> None:
        """A new selector consumer's scan meets stored messages in order: the waiting
        ones of a priority above 0 (up to a scan step's worth) are matched at once, so
        that they come first for it too."""
        if not self.priorities:
            return
        waiting = self.priorities.all_waiting(SCAN_STEP_MESSAGES)
        if len(waiting):
            waiting = waiting[~self.log.is_acked(waiting)]
        if not len(waiting):
            return
        try:
            target.candidates.add(waiting[self.select(target.selector, waiting)])
        except StorageError as exc:  # its scan meets them in order; housekeeping retries
            self._unoffered.append(waiting)
            log.warning("queue %r: matching waiting priorities: %s", self.queue, exc)

    def next_dead_letters(self, limit: int) -> tuple[np.ndarray, list[str]]:
        """Up to ``limit`` messages waiting for the dead-letter queue: sorted offsets
        and each one's reason. They stay waiting until ``ack(DEAD_LETTER_HOLDER, ...)``."""
        chosen = sorted(self.dead_letters)[:limit]
        return np.array(chosen, dtype=np.int64), [self.dead_letters[o] for o in chosen]

    def _offer_again(self, offsets: np.ndarray) -> None:
        """Released offsets (sorted): back to waiting at their priority, and into the
        candidates of every selector that matches."""
        if self.priorities:
            self.priorities.released(offsets)
        targets = self.selective
        if not targets:
            return
        try:
            batches = self._properties_of(offsets)
        except StorageError as exc:
            # The release stands (it happened); the selectors see these once they can
            # be read. Raising here would leave the caller's transition half done.
            self._unoffered.append(offsets)
            log.warning("queue %r: offering released messages to selectors: %s", self.queue, exc)
            return
        for batch in batches:
            groups = batch.property_groups()
            for t in targets:
                t.candidates.add(self._match(t, batch, groups))

    def _properties_of(self, offsets: np.ndarray) -> list[MessageBatch]:
        """Properties-only batches covering exactly ``offsets`` (sorted)."""
        breaks = np.flatnonzero(np.diff(offsets) != 1) + 1
        out: list[MessageBatch] = []
        for run in np.split(offsets, breaks):
            out.extend(self.log.properties(int(run[0]), int(run[-1]) + 1))
        return out

    def forget(self, offsets: np.ndarray) -> None:
        """Take damaged offsets out of delivery: released from whoever holds them (not
        counted as a delivery), out of the dead letters, the messages set aside until
        their time and every selector's candidates.
        The log counts them as damaged and acknowledged."""
        listed = offsets.tolist()
        for o in listed:
            holder = self._holder.pop(o, None)
            target = self.consumers.get(holder) if holder is not None else None
            if target is not None:
                target.held.discard(o)
            self.dead_letters.pop(o, None)
            self.delayed.pop(o, None)
        self.deliveries.forget(listed)
        if self.scheduled:
            self.scheduled.discard(offsets)
        for t in self.selective:
            t.candidates.discard(offsets)
        if self.priorities:
            self.priorities.forget(offsets)

    def unregister(self, consumer_id: str, not_received: np.ndarray | None = None) -> int:
        """Remove a consumer, releasing what it holds; returns how many were released."""
        n = 0
        if not_received is not None and len(not_received):
            n += self.release(consumer_id, not_received, count_delivery=False)
        n += self.release(consumer_id)
        if self.consumers.pop(consumer_id, None) is not None:
            self._departed[consumer_id] = self.log.next_offset
            if len(self._departed) > DEPARTED_REMEMBERED:
                self._departed.popitem(last=False)
        return n

    def housekeeping(self) -> None:
        """Drop CacheReferences below the queue's head (acknowledged long ago)."""
        head = self.head()
        for t in self.selective:
            t.candidates.discard_below(head)
        if self.priorities:
            self.priorities.forget_below(head)
        if self._unoffered:
            pending = np.unique(np.concatenate(self._unoffered))
            self._unoffered = []
            pending = pending[~self.log.is_acked(pending)]
            if len(pending):
                self._offer_again(pending)
