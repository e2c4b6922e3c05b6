"""Subscription: the delivery side of a queue, or of one subscription of an address.

A queue has one; an address (Artemis's address with several queues bound to it) has one
per subscription, all over the address's one stored copy. Each owns its TargetArea (the
queue side of its consumers' TargetLists), its closed-consumer memory and its
dead-letter mover; they share the host's one HeadQueueCache. What it reads and
acknowledges goes through ``log``: the queue's ``SegmentLog`` itself, or a
``SubscriptionLog`` (the address's log seen through the subscription's own
acknowledged set).

The ``QueueCore`` that hosts it runs the group commit: ``host.flush_acks()`` returns
once acks are durable, and the host fans new messages and damage out to every
subscription (``arrived``, ``forget``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import pyarrow as pa

from raymq.batch import (
    EMPTY_DELIVERY,
    MessageBatch,
    PropertyGroups,
    consecutive_rows,
    fixed_array,
    offsets_of,
    stored_in,
)
from raymq.config import QueueConfig
from raymq.core.dead_letter import (
    MOVE_BATCH_MESSAGES,
    REASON_EXPIRED,
    REASON_REJECTED,
)
from raymq.core.dead_letter_mover import DeadLetterMover
from raymq.core.expiry import SCAN_STEP_MESSAGES, TimesScan, expired_offsets, now_ms
from raymq.core.head_cache import HeadQueueCache, SharedPart
from raymq.core.schedule import due_times
from raymq.core.target_area import TargetArea
from raymq.errors import ConsumerClosed, InvalidAck
from raymq.selector import Selector


class SubscriptionHost(Protocol):
    """What a subscription needs of the queue that hosts it (``QueueCore``): named
    here so that this module does not import the queue's (no import cycle)."""

    config: QueueConfig
    head_cache: HeadQueueCache
    #: Moves a batch of dead letters to their address (None: the queue has none).
    dead_letter_sink: Callable[[str, MessageBatch], Awaitable[None]] | None

    @property
    def shares_deliveries(self) -> bool: ...
    def supervise(self, name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task: ...
    def forget_damaged(self) -> None: ...
    def found_damaged(self) -> np.ndarray: ...
    def count(self, counter: str, n: int) -> None: ...
    def shared_delivery(self, start: int, end: int) -> list[SharedPart]: ...
    def signal_freed(self) -> None: ...
    async def flush_acks(self) -> None: ...
    def delays_moved(self) -> None: ...
    def now(self) -> float: ...


log = logging.getLogger("raymq.queue")

#: Longest a single fetch call waits in the actor (seconds); clients loop for longer waits.
MAX_POLL_SECONDS = 1.0
#: Offsets this close together are read as one range when materializing a delivery.
MATERIALIZE_GAP = 64
#: Closed consumer ids remembered so that a fetch arriving after the close cannot
#: register the consumer again (ids).
CLOSED_CONSUMERS_REMEMBERED = 100_000


@dataclass
class Delivery:
    """What one fetch delivers, in offset order: rows of shared batches (``parts``,
    each a reference to one object every subscription's deliveries share), then, for
    what the HeadQueueCache cannot share (redeliveries, selector matches, reads from
    the log), one batch made for this delivery."""

    offsets: np.ndarray  # of every row, in order
    nbytes: int
    parts: list[SharedPart] = field(default_factory=list)
    batch: pa.RecordBatch | None = None

    def to_batch(self) -> pa.RecordBatch:
        """The delivery as one RecordBatch in ``DELIVERY_SCHEMA`` (slices, no copy when
        it is one piece)."""
        pieces = [p.arrow.slice(p.first_row, p.rows) for p in self.parts]
        if self.batch is not None and (self.batch.num_rows or not pieces):
            pieces.append(self.batch)
        if not pieces:
            return EMPTY_DELIVERY
        return pieces[0] if len(pieces) == 1 else pa.concat_batches(pieces)


NOTHING = Delivery(np.zeros(0, dtype=np.int64), 0, batch=EMPTY_DELIVERY)


#: A reader's credit: it holds everything it leases until it commits or aborts.
LEASE_PREFETCH = 2**31 - 1


class Subscription(DeadLetterMover):
    """Consumers, deliveries, acks and dead letters over one acknowledged set."""

    def __init__(
        self,
        host: SubscriptionHost,
        name: str,
        log,
        *,
        max_delivery_attempts: int | None,
        dead_letter_address: str,
        filter: str | None = None,
        sid: int | None = None,
        subscription_name: str | None = None,
    ):
        """``name``: how errors and logs name it (the queue, or ``address/subscription``);
        ``filter``: an address subscription's routing filter (a selector); ``sid`` and
        ``subscription_name``: its id and name in the address (None for a queue's own)."""
        self.host = host
        self.name = name
        self.subscription_name = subscription_name
        self.log = log
        self.sid = sid
        self.filter = None if filter is None else Selector(filter)
        self.dead_letter_address = dead_letter_address
        self.area = TargetArea(log, name, max_delivery_attempts, host.config.max_priority)
        self.head_cache_hits = 0  # reads the host's HeadQueueCache served
        self.head_cache_misses = 0  # reads that went to the log (pages)
        self.counters = {"out": 0, "acked": 0, "bytes_out": 0}
        self.dead_lettered = 0
        self.dead_letter_failures = 0
        self._dead_letter_kick: asyncio.Event | None = None
        self._arrival: asyncio.Event | None = None
        # A fetch of a TargetList can arrive after its close (sent before, or cut short by
        # it): it must not register the consumer again and take messages nobody will
        # ever ack or give back. Insertion-ordered, the oldest forgotten first.
        self._closed_consumers: dict[str, None] = {}
        self.closed = False
        self._mover: asyncio.Task | None = None
        #: The background pass's state (``raymq.core.expiry``): restarted with messages,
        #: any of them may carry an expiry or a delivery time until a pass has looked.
        self.times = TimesScan(may_have_times=bool(log.depth))
        self.messages_expired = 0
        self._dead_letters_moved: asyncio.Event | None = None
        self._moving = False  # a batch of dead letters is on its way (see below)
        #: Set when messages are set aside until a delivery time (see _schedule_loop).
        self._schedule_kick: asyncio.Event | None = None
        #: While a seek is under way (``AddressPart.seek``): set once it is durable or
        #: undone; acks wait for it, so that none is lost with an undone seek.
        self.seeking: asyncio.Event | None = None

    def start(self) -> None:
        """Create the events and start the dead-letter mover (on the running loop)."""
        self._arrival = asyncio.Event()
        self._dead_letter_kick = asyncio.Event()
        self._dead_letters_moved = asyncio.Event()
        self._schedule_kick = asyncio.Event()
        of = "" if self.subscription_name is None else f" of {self.subscription_name}"
        # (Without a sink, only expired messages with no expiry queue move: dropped.)
        self._mover = self.host.supervise("dead-letter mover" + of, self._move_dead_letters)
        self.host.supervise("expiry scan" + of, self._expiry_loop)
        self.host.supervise("scheduled delivery" + of, self._schedule_loop)

    # -- messages arriving, leaving ----------------------------------------------------

    def arrived(self, chunk: MessageBatch, groups: PropertyGroups) -> None:
        """A newly published chunk: route it (an address subscription's filter
        acknowledges what it does not select), match it against selectors, cache it."""
        if self.filter is not None:
            rejected = ~self.area._mask(self.filter, chunk, groups)
            if rejected.any():
                self.log.ack(np.flatnonzero(rejected) + chunk.first_offset)
        self.times.arrived(groups)
        self.area.arrived(chunk, groups)

    def rewound(self, offset: int) -> None:
        """The subscription sought ``offset`` (its acknowledged set was reset): deliver
        from its new head, matching selectors again from ``offset``; what comes again
        is checked for expiry and delivery times at delivery until a pass has looked."""
        self.area.rewind(offset)
        self.times.may_have_times = True
        self.wake()

    def route_again(self, start: int) -> int:
        """Apply the filter to unacknowledged messages from ``start`` on (after a
        restart: routing decided after the last checkpoint may not be on disk);
        returns how many it acknowledged."""
        if self.filter is None:
            return 0
        done, pos = 0, start
        while True:
            got = self.log.unacked(pos, 65536)
            if not len(got):
                return done
            pos = int(got[-1]) + 1
            rejected = got[~self.area.select(self.filter, got)]
            if len(rejected):
                done += self.log.ack(self._intact(rejected))

    def _intact(self, offsets: np.ndarray) -> np.ndarray:
        """Of sorted ``offsets`` whose properties were read without their record's CRC,
        those a checked read finds intact: a damaged record is quarantined and counted
        as damage, not taken for a routing decision on rotten properties."""
        intact = self.log.confirm(offsets)
        self.host.forget_damaged()
        return offsets[intact]

    def forget(self, damaged: np.ndarray) -> None:
        """Take offsets lost to damage out of delivery (nobody holds or waits for them)."""
        self.area.forget(damaged)
        self.wake()

    def wake(self) -> None:
        """Wake the fetches waiting for messages or credit."""
        if self._arrival is not None:
            self._arrival.set()
            self._arrival = asyncio.Event()

    def housekeeping(self) -> None:
        """Offer released messages to selector consumers again, and the like (see
        ``TargetArea.housekeeping``)."""
        self.area.housekeeping()

    def undelivered(self) -> int:
        """The first offset not yet delivered: where this subscription's consumers
        read next (with selectors, the first unacknowledged one)."""
        return self.area.head() if self.area.selective else self.area.cursor

    # -- consuming -------------------------------------------------------------------

    def register_consumer(
        self,
        consumer_id: str,
        prefetch: int,
        selector: str | None = None,
        watch: object = None,
    ) -> None:
        """Register a consumer with its prefetch (max unacknowledged messages held).

        ``selector`` is compiled here (``SelectorError`` if malformed, nothing
        registered). ``watch`` is what the shell uses to check the consumer is alive.
        """
        if self.closed:
            raise ConsumerClosed(f"{self.name!r} was deleted")
        compiled = None if selector is None else Selector(selector)
        self.area.register(consumer_id, prefetch, compiled, watch)

    async def fetch(
        self,
        consumer_id: str,
        max_messages: int,
        timeout: float,
        prefetch: int,
        selector: str | None = None,
    ) -> pa.RecordBatch:
        """Deliver up to ``max_messages``, waiting up to ``timeout`` seconds for some.

        Returns a RecordBatch in ``raymq.batch.DELIVERY_SCHEMA`` (empty when nothing came
        in time). An unknown consumer (e.g. after an actor restart) is registered again.
        """
        delivery = await self.fetch_delivery(consumer_id, max_messages, timeout, prefetch, selector)
        return delivery.to_batch()

    async def fetch_delivery(
        self,
        consumer_id: str,
        max_messages: int,
        timeout: float,
        prefetch: int,
        selector: str | None = None,
    ) -> Delivery:
        """``fetch``, as a ``Delivery``: shared batches' rows where the HeadQueueCache
        holds them (a reference each, not a copy), else a batch made for it."""
        if consumer_id in self._closed_consumers or self.closed:
            raise ConsumerClosed(f"consumer {consumer_id} of queue {self.name!r} is closed")
        if consumer_id not in self.area.consumers:
            self.register_consumer(consumer_id, prefetch, selector)
        target = self.area.consumers[consumer_id]
        deadline = time.monotonic() + min(max(timeout, 0.0), MAX_POLL_SECONDS)
        while True:
            if self.area.consumers.get(consumer_id) is not target:
                return NOTHING  # closed (or closed and back) while we waited
            arrival = self._arrival
            if self.area.scheduled:
                self.release_scheduled()
            offsets, counts = self.area.take(consumer_id, max_messages)
            if len(offsets):
                try:
                    if self.times.may_have_times:
                        offsets, counts = self._deliverable_now(consumer_id, offsets, counts)
                        if not len(offsets):
                            continue  # all expired or not due: take again
                    delivery = self._deliver(offsets, counts)
                except BaseException:
                    # Unread, so not delivered: nobody may hold them (uncounted).
                    self.area.release(consumer_id, offsets, count_delivery=False)
                    self.wake()
                    raise
                self.host.forget_damaged()  # what could not be read is not held by anyone
                if not len(delivery.offsets):  # all of it found damaged: take again
                    await asyncio.sleep(0)  # (each take reads: others go in between)
                    continue
                self._count("out", len(delivery.offsets))
                self._count("bytes_out", delivery.nbytes)
                return delivery
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return NOTHING
            # Nothing taken while its scan goes on means no credit: match ahead meanwhile
            # (a prefetch's worth), so that returning credit finds candidates ready,
            # then wait for the credit rather than ask again at once.
            if target.scanning and len(target.candidates) < target.prefetch:
                self.area.scan_step(target)
                await asyncio.sleep(0)  # let other calls in between scan steps
                continue
            await _wait_for_arrival(arrival, remaining)

    def _count(self, counter: str, n: int) -> None:
        self.counters[counter] += n
        self.host.count(counter, n)

    def _deliver(self, offsets: np.ndarray, counts: np.ndarray) -> Delivery:
        """The messages of sorted ``offsets`` (taken, with their delivery counts) as a
        Delivery: on an address, a first delivery of a run the HeadQueueCache holds is
        shared rows (as far as it holds them); anything else is materialized. None of
        a record found damaged meanwhile: a read from disk for one part of a take can
        find the record whose other part was taken from the HeadQueueCache's intact
        copy, and its messages are out of delivery (counted damaged) from then on."""
        while True:
            delivery = self._deliver_once(offsets, counts)
            damaged = self.host.found_damaged()
            if not len(damaged) or not np.isin(delivery.offsets, damaged).any():
                return delivery
            keep = ~np.isin(offsets, damaged)  # each round drops some: it ends
            offsets, counts = offsets[keep], counts[keep]
            if not len(offsets):
                return NOTHING

    def _deliver_once(self, offsets: np.ndarray, counts: np.ndarray) -> Delivery:
        n = len(offsets)
        first, end = int(offsets[0]), int(offsets[-1]) + 1
        parts: list[SharedPart] = []
        if self.host.shares_deliveries and end - first == n and int(counts.max()) == 1:
            try:
                parts = self.host.shared_delivery(first, end)
            except Exception as exc:  # the object store full, say: a batch of its own
                log.warning("queue %r: sharing a cached batch failed: %r", self.name, exc)
        shared = sum(p.rows for p in parts)
        nbytes = sum(p.nbytes for p in parts)
        if parts:
            self.head_cache_hits += 1
            if shared == n:
                return Delivery(offsets, nbytes, parts)
        batch = self._materialize(offsets[shared:], counts[shared:])
        have = offsets[shared:]
        if batch.num_rows != len(have):  # damaged records are missing from it
            have = offsets_of(batch)
        if shared:
            have = np.concatenate([offsets[:shared], have])
        # Its buffers' sizes: made for this delivery, they hold its rows alone (and
        # RecordBatch.nbytes walks them, 15 µs a batch here).
        return Delivery(have, nbytes + batch.get_total_buffer_size(), parts, batch)

    def _read(self, start: int, end: int) -> list[MessageBatch]:
        """Messages [start, end) from the HeadQueueCache, else the log (its read cache)."""
        cached = self.host.head_cache.get(start, end) if self.host.config.durable else None
        if cached is not None:
            self.head_cache_hits += 1
            return cached
        if self.host.config.durable:
            self.head_cache_misses += 1
        return self.log.read(start, end)

    def _materialize(self, offsets: np.ndarray, counts: np.ndarray, *, read=None) -> pa.RecordBatch:
        """The messages of sorted ``offsets`` as one delivery RecordBatch.

        Offsets closer than ``MATERIALIZE_GAP`` are read as one range and picked with
        ``take``, so sparse selector matches cost one read and one Arrow conversion per
        range, not per message.
        """
        read = read or self._read
        if not len(offsets):
            return EMPTY_DELIVERY
        n = len(offsets)
        if int(offsets[-1]) - int(offsets[0]) - (n - 1) <= MATERIALIZE_GAP:
            groups = [np.arange(n)]  # no gap over MATERIALIZE_GAP: one range (a take's)
        else:
            groups = np.split(np.arange(n), np.flatnonzero(np.diff(offsets) > MATERIALIZE_GAP) + 1)
        parts = []
        for group in groups:
            wanted = offsets[group]
            batches = read(int(wanted[0]), int(wanted[-1]) + 1)
            if not batches:
                continue
            run = consecutive_rows(batches, wanted)
            if run is not None:  # the common take: one stored batch's rows, in a row
                parts.append(run.to_arrow(counts[group]))
                continue
            arrow = [b.to_arrow(np.zeros(len(b), dtype=np.int32)) for b in batches]
            whole = arrow[0] if len(arrow) == 1 else pa.concat_batches(arrow)
            have = offsets_of(whole)
            if not np.array_equal(have, wanted):
                # Only what was read: a damaged record's offsets are missing from it.
                found = np.isin(wanted, have)
                group, wanted = group[found], wanted[found]
                whole = whole.take(fixed_array(pa.int64(), np.searchsorted(have, wanted)))
            columns = whole.columns
            columns[2] = fixed_array(pa.int32(), counts[group], np.int32)
            parts.append(pa.RecordBatch.from_arrays(columns, schema=whole.schema))
        if not parts:
            return EMPTY_DELIVERY
        return parts[0] if len(parts) == 1 else pa.concat_batches(parts)

    def browse(
        self, start: int, max_messages: int, selector: str | None = None
    ) -> tuple[pa.RecordBatch, int]:
        """Up to ``max_messages`` unacknowledged messages from ``start`` on, changing nothing.

        Returns the batch (delivery_count = deliveries so far) and the offset to continue
        from (``next_offset`` when the queue was walked to its end).
        """
        compiled = None if selector is None else Selector(selector)
        picked: list[np.ndarray] = []
        n, pos = 0, max(start, 0)
        while n < max_messages and pos < self.log.next_offset:
            got = self.log.unacked(pos, 4096)
            if not len(got):
                pos = self.log.next_offset
                break
            examined_end = int(got[-1]) + 1
            if compiled is not None:
                got = got[self.area.select(compiled, got)]
            got = got[: max_messages - n]
            picked.append(got)
            n += len(got)
            pos = int(got[-1]) + 1 if n >= max_messages and len(got) else examined_end
        offsets = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
        prev = self.area.previous_deliveries(offsets)
        batch = self._materialize(offsets, prev, read=self.log.read)
        self.host.forget_damaged()
        return batch, pos

    async def lease(
        self,
        consumer_id: str,
        max_messages: int,
        selector: str | None = None,
        timeout: float = 0.0,
    ) -> tuple[np.ndarray, bool]:
        """Take up to ``max_messages`` for a reader (``raymq.data.QueueReader``) without
        reading them: they are held by ``consumer_id`` as a delivery is, until acked or
        given back; when there is none, wait up to ``timeout`` seconds for one. Returns
        their offsets (sorted) and whether more may be there (a selector's scan goes
        on, or ``max_messages`` were taken)."""
        if consumer_id in self._closed_consumers or self.closed:
            raise ConsumerClosed(f"reader {consumer_id} of queue {self.name!r} is closed")
        if consumer_id not in self.area.consumers:
            self.register_consumer(consumer_id, LEASE_PREFETCH, selector)
        target = self.area.consumers[consumer_id]
        taken: list[np.ndarray] = []
        n = 0
        deadline = time.monotonic() + min(max(timeout, 0.0), MAX_POLL_SECONDS)
        while n < max_messages and self.area.consumers.get(consumer_id) is target:
            arrival = self._arrival
            if self.area.scheduled:
                self.release_scheduled()
            offsets, counts = self.area.take(consumer_id, max_messages - n)
            if len(offsets) and self.times.may_have_times:
                try:
                    offsets, counts = self._deliverable_now(consumer_id, offsets, counts)
                except BaseException:  # none leased after all: nobody may hold them
                    everything = np.concatenate([*taken, offsets])
                    self.area.release(consumer_id, everything, count_delivery=False)
                    self.wake()
                    raise
                if not len(offsets):
                    continue  # all expired or not due: take again
            if len(offsets):
                taken.append(offsets)
                n += len(offsets)
            elif target.scanning:
                self.area.scan_step(target)
                await asyncio.sleep(0)  # let other calls in between scan steps
            elif n == 0 and (remaining := deadline - time.monotonic()) > 0:
                await _wait_for_arrival(arrival, remaining)
            else:
                break
        self._count("out", n)
        offsets = np.sort(np.concatenate(taken)) if taken else np.zeros(0, np.int64)
        return offsets, n >= max_messages or target.scanning

    def read_leased(self, consumer_id: str, offsets: np.ndarray) -> pa.RecordBatch:
        """The messages of ``offsets`` that ``consumer_id`` holds (``lease``) as a
        delivery batch, changing nothing; ``InvalidAck`` if it holds not all of them
        (its lease was lost: the queue restarted, or the reader was taken for dead)."""
        offsets = np.sort(self._offsets(offsets))
        self.area.check_ack(consumer_id, offsets)
        batch = self._materialize(offsets, self.area.previous_deliveries(offsets))
        damaged = self.host.found_damaged()
        if len(damaged):  # none of a record found damaged, even from the cache (_deliver)
            kept = np.flatnonzero(~np.isin(offsets_of(batch), damaged))
            if len(kept) < batch.num_rows:
                batch = batch.take(fixed_array(pa.int64(), kept))
        self.host.forget_damaged()
        return batch

    async def ack(self, consumer_id: str, offsets: np.ndarray) -> int:
        """Acknowledge offsets; returns once the acks are durable (for a durable queue).
        During a seek it waits for the seek's outcome, and applies to that."""
        while self.seeking is not None:
            await self.seeking.wait()
        offsets = self._checked(consumer_id, offsets)
        fresh = self.area.ack(consumer_id, offsets)
        self._count("acked", fresh)
        if fresh:
            self.wake()  # credit came back
            self.host.signal_freed()
        if self.host.config.durable and fresh:
            await self.host.flush_acks()
        return fresh

    async def ack_acceptable(self, consumer_id: str, offsets: np.ndarray) -> tuple[int, str]:
        """``ack`` of the offsets ``consumer_id`` may ack, leaving the others alone;
        returns (how many were newly acked, the refusal of the others: "" if none)."""
        while self.seeking is not None:
            await self.seeking.wait()
        offsets = self._offsets(offsets)
        refused = self.area.refused(consumer_id, offsets)
        if len(refused):
            offsets = self.area.drop_stale(consumer_id, offsets)
            refused = self.area.refused(consumer_id, offsets)
        refusal = ""
        if len(refused):
            try:
                self.area.check_ack(consumer_id, refused)
            except InvalidAck as exc:
                refusal = str(exc)
            offsets = offsets[~np.isin(offsets, refused)]
        return (await self.ack(consumer_id, offsets) if len(offsets) else 0), refusal

    def nack(self, consumer_id: str, offsets: np.ndarray, delay_until: float | None = None) -> int:
        """Release offsets for redelivery with their delivery count raised; with
        ``delay_until`` (seconds since the epoch), not before then: a queue's delays
        go to its ack log with the next commit (``flush_acks`` makes them durable)."""
        offsets = self._checked(consumer_id, offsets)
        n = self.area.release(consumer_id, offsets, delay_until=delay_until)
        if n and delay_until is not None:
            delayed = [o for o in offsets.tolist() if self.area.delayed.get(o) == delay_until]
            if self.sid is None:  # an address's subscriptions keep their delays in memory
                self.log.delay(np.array(delayed, dtype=np.int64), round(delay_until * 1e6))
            self.host.delays_moved()
        if n:
            self.wake()
            self._signal_dead_letters()
        return n

    def give_back(self, consumer_id: str, offsets: np.ndarray) -> int:
        """Release held offsets the application never received (delivery not counted)."""
        n = self.area.release(consumer_id, self._offsets(offsets), count_delivery=False)
        if n:
            self.wake()
        return n

    def close_consumer(self, consumer_id: str, not_received: np.ndarray | None = None) -> int:
        """Remove a consumer; what it held is delivered again (``not_received`` uncounted)."""
        if not_received is not None:
            not_received = self._offsets(not_received)
        n = self.area.unregister(consumer_id, not_received)
        self._closed_consumers[consumer_id] = None
        if len(self._closed_consumers) > CLOSED_CONSUMERS_REMEMBERED:
            del self._closed_consumers[next(iter(self._closed_consumers))]
        if n:
            self.wake()
            self._signal_dead_letters()
        return n

    def close(self) -> None:
        """The subscription was deleted: every consumer's next call is ``ConsumerClosed``."""
        self.closed = True
        for consumer_id in list(self.area.consumers):
            self.close_consumer(consumer_id)
        if self._mover is not None:
            self._mover.cancel()
        self.wake()

    def _checked(self, consumer_id: str, offsets: object) -> np.ndarray:
        """``offsets`` that ``consumer_id`` may ack, nack or reject, stale copies left
        out (``TargetArea.drop_stale``); ``InvalidAck`` (changing nothing) if any other
        is not its to ack."""
        offsets = self._offsets(offsets)
        try:
            self.area.check_ack(consumer_id, offsets)
        except InvalidAck:  # (rare: the fast check first)
            offsets = self.area.drop_stale(consumer_id, offsets)
            self.area.check_ack(consumer_id, offsets)
        return offsets

    def _offsets(self, offsets: object) -> np.ndarray:
        """``offsets`` as int64; ``TypeError`` naming the queue for anything but integers
        (a float would otherwise be truncated to another message's offset)."""
        arr = np.asarray(offsets)
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"offsets for queue {self.name!r} must be integers, not {arr.dtype}")
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        return arr.astype(np.int64, copy=False)

    def reject(self, consumer_id: str, offsets: np.ndarray) -> int:
        """Dead-letter messages the consumer holds (reason ``"rejected"``) instead of
        delivering them again; returns how many. The move happens in the background."""
        offsets = self._checked(consumer_id, offsets)
        n = self.area.dead_letter(consumer_id, offsets, REASON_REJECTED)
        self._signal_dead_letters()
        return n

    # -- expiry and delivery times (raymq.core.expiry, raymq.core.schedule) ------------

    def _deliverable_now(
        self, consumer_id: str, offsets: np.ndarray, counts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Of offsets just taken by ``consumer_id``, those to deliver now (and their
        counts): the expired ones go to the expiry queue (or are dropped), those not
        due yet are set aside until their time."""
        now = now_ms(self.host.now())
        batches, unchecked = self._stored_properties(offsets)
        expired = expired_offsets(batches, offsets, now)
        dues = due_times(batches, offsets)
        later = np.zeros(len(offsets), dtype=np.bool_) if dues is None else (dues > now) & ~expired
        # Out of delivery for good: a record a read found damaged just now (even where
        # the HeadQueueCache holds a copy: its times were not read), and one whose
        # properties, read without their checksum, would set a message aside: rot must
        # not pass for a delivery time. (An expiry is confirmed by the mover's checked
        # read, ``_move_dead_letter_batch``.)
        gone = ~stored_in(batches, offsets)
        doubtful = later & unchecked & ~gone
        if doubtful.any():
            gone[doubtful] = ~self.log.confirm(offsets[doubtful])
        if gone.any():
            expired &= ~gone
            later &= ~gone
            self.host.forget_damaged()
        if expired.any():
            self.area.dead_letter(consumer_id, offsets[expired], REASON_EXPIRED)
            self._signal_dead_letters()
        if later.any():
            self.area.set_aside(consumer_id, offsets[later], dues[later])
            self._schedule_kick.set()
        keep = ~(expired | later | gone)
        return offsets[keep], counts[keep]

    def _stored_properties(self, offsets: np.ndarray) -> tuple[list[MessageBatch], np.ndarray]:
        """The stored batches holding sorted ``offsets``, properties at least: from the
        HeadQueueCache where it has them, else the log's properties; and which offsets'
        came from the log (read without the payload's checksum)."""
        groups = np.split(offsets, np.flatnonzero(np.diff(offsets) > MATERIALIZE_GAP) + 1)
        batches: list[MessageBatch] = []
        unchecked = np.zeros(len(offsets), dtype=np.bool_)
        at = 0
        for group in groups:
            start, end = int(group[0]), int(group[-1]) + 1
            cached = self.host.head_cache.get(start, end) if self.host.config.durable else None
            if cached is None:
                cached = self.log.properties(start, end)
                unchecked[at : at + len(group)] = True
            batches.extend(cached)
            at += len(group)
        return batches, unchecked

    def release_scheduled(self) -> int:
        """Make the messages whose delivery time came deliverable; returns how many."""
        n = self.area.release_scheduled(now_ms(self.host.now()))
        if n:
            self.wake()
        return n

    async def _schedule_loop(self) -> None:
        """Release set-aside messages at their delivery time (a fetch also releases
        what is due before it takes)."""
        while True:
            due = self.area.scheduled.next_due()
            self._schedule_kick.clear()
            wait = None if due is None else max(0.0, due / 1000 - self.host.now())
            if wait is None or wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._schedule_kick.wait(), wait)
                continue
            self.release_scheduled()

    def expire(self, consumer_id: str, offsets: np.ndarray) -> int:
        """Messages the consumer holds that expired before its application received
        them (found by the client): to the expiry queue, or dropped; returns how many."""
        offsets = self._checked(consumer_id, offsets)
        n = self.area.dead_letter(consumer_id, offsets, REASON_EXPIRED)
        self._signal_dead_letters()
        return n

    async def _expiry_loop(self) -> None:
        """A background pass every ``message_expiry_scan_period_s`` while any message
        may carry an expiry or a delivery time."""
        while True:
            # At once after a restart with messages: their delivery times are found so.
            if self.times.may_have_times:
                await self.expiry_pass()
            await asyncio.sleep(self.host.config.message_expiry_scan_period_s)

    async def expiry_pass(self) -> int:
        """Walk the unacknowledged messages once, a step at a time (their stored
        properties only), taking the expired ones nobody holds out of delivery for the
        mover (returns how many), setting aside those not due yet and indexing
        priorities (after a restart: ``raymq.core.priority``). At most two move
        batches wait at a time, so a paged backlog never comes into memory at once."""
        scan = self.times
        scan.start_pass()
        found = 0
        while not self.closed:
            got = self.log.unacked(scan.position, SCAN_STEP_MESSAGES)
            if not len(got):
                break
            scan.position = int(got[-1]) + 1
            batches = self.log.properties(int(got[0]), scan.position)
            self.host.forget_damaged()
            scan.met(batches)
            self.area.found_priorities(got, batches)
            now = now_ms(self.host.now())
            expired_mask = expired_offsets(batches, got, now)
            dues = due_times(batches, got)
            later = np.zeros(len(got), np.bool_) if dues is None else (dues > now) & ~expired_mask
            if later.any() and not self.log.confirm(got[later]).all():
                # Read without the checksum, and rot: the records quarantined, all
                # their messages out of delivery (the expired beside them too).
                self.host.forget_damaged()
                lost = self.log.is_acked(got)
                expired_mask &= ~lost
                later &= ~lost
            if later.any() and self.area.set_aside_unheld(got[later], dues[later]):
                self._schedule_kick.set()
            expired = got[expired_mask]
            taken = self.area.hold_expired(expired)
            found += taken
            if taken:
                self._signal_dead_letters()
            while len(self._movable(2 * MOVE_BATCH_MESSAGES + 1)[0]) > 2 * MOVE_BATCH_MESSAGES:
                self._dead_letters_moved.clear()
                await self._dead_letters_moved.wait()
            await asyncio.sleep(0)  # let other calls in between steps
        scan.end_pass()
        return found

    # -- consumers' liveness and statistics ----------------------------------------------

    def consumer_stats(self, consumer_id: str) -> dict:
        """The queue side of one consumer's TargetList (counts in messages, bytes)."""
        t = self.area.consumers.get(consumer_id)
        if t is None:
            return {}
        return {
            "selector": None if t.selector is None else t.selector.text,
            "held": len(t.held),
            "delivered": t.delivered,
            "acked": t.acked,
            "given_back": t.given_back,
            "cache_references": self.area.deliverable_estimate(consumer_id),
            "cache_reference_bytes": 0 if t.candidates is None else t.candidates.nbytes,
            "scan_remaining": max(0, t.scan_end - t.scan_pos),
            # The queue can tell its death (and deliver again what it holds).
            "death_watch": t.watch is not None,
            "messages_scanned": t.messages_scanned,
            "segments_skipped": t.segments_skipped,
        }


async def _wait_for_arrival(arrival: asyncio.Event, seconds: float) -> None:
    """Wait until ``arrival`` is set, at most ``seconds``. Not ``wait_for``: its inner
    task wakes the fetch two loop turns after the commit's ``wake``, and the group
    commit's writer, which yields one turn after each commit, would then write and
    fdatasync the next commit before the delivery."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await arrival.wait()
