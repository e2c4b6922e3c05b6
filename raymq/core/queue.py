"""QueueCore: one queue's behaviour, as plain asyncio code without Ray.

It owns the SegmentLog (the QueueArea), its HeadQueueCache and the TargetArea (the queue
side of every consumer's TargetList), runs the group-commit writer, matches arriving
messages against selectors and long-polls for consumers. The Ray actor in
``raymq.actors.queue_actor`` only wires it to Ray, so tests drive this class directly
with asyncio.

Interleaving: every public coroutine may interleave with the others at its ``await``;
each state change between two awaits is one synchronous step. Only the writer task
touches the log's write path, so at most one write is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from raymq.batch import EMPTY_DELIVERY, MessageBatch, check_sizes
from raymq.config import BrokerConfig, QueueConfig
from raymq.core.budget import QueueUsage, split_queue_bytes
from raymq.core.dead_letter import MOVE_BATCH_MESSAGES, REASON_REJECTED, dead_letter_batch
from raymq.core.head_cache import HeadQueueCache
from raymq.core.supervisor import Supervisor
from raymq.core.target_area import DEAD_LETTER_HOLDER, TargetArea
from raymq.errors import AddressFull, ConsumerClosed, StorageError
from raymq.properties import check_encoded_properties
from raymq.selector import Selector
from raymq.storage import RecoveryReport, SegmentLog

log = logging.getLogger("raymq.queue")

#: Longest a single fetch call waits in the actor (seconds); clients loop for longer waits.
MAX_POLL_SECONDS = 1.0
#: Offsets this close together are read as one range when materializing a delivery.
MATERIALIZE_GAP = 64
#: Group commits up to this many bytes are written in the event loop (bytes).
INLINE_WRITE_BYTES = 256 * 1024
#: Closed consumer ids remembered so that a fetch arriving after the close cannot
#: register the consumer again (ids).
CLOSED_CONSUMERS_REMEMBERED = 100_000
#: Longest wait between two attempts to move dead letters that failed (seconds).
DEAD_LETTER_RETRY_MAX_SECONDS = 5.0

#: Appends a batch durably to the named dead-letter queue (creating it if needed).
DeadLetterSink = Callable[[str, MessageBatch], Awaitable[None]]


@dataclass(frozen=True)
class QueueStats:
    """A snapshot of one queue (counts in messages, sizes in bytes, rates per second)."""

    name: str
    durable: bool
    depth: int
    in_flight: int
    next_offset: int
    consumers: int
    bytes_in_memory: int
    bytes_on_disk: int
    segment_files: int
    messages_in: int
    messages_out: int
    messages_acked: int
    messages_redelivered: int
    #: Bytes of messages stored (bodies, properties, offsets and timestamps) and delivered.
    bytes_in: int
    bytes_out: int
    in_rate: float
    out_rate: float
    ack_rate: float
    address_full_policy: str
    max_size_bytes: int
    recovery_seconds: float
    #: Messages lost to damage (found at recovery, by reads or by the scrub; logged
    #: with queue, file and offsets, the bytes kept aside).
    damaged_messages: int
    #: Write, repair, checkpoint and unlink failures (each logged with file and errno).
    storage_errors: int
    #: False while a failed write is not cut back yet: sends are refused, acks are not.
    writable: bool
    #: Bytes whose CRCs the background scrub verified.
    scrubbed_bytes: int
    head_cache_bytes: int
    head_cache_messages: int
    head_cache_hits: int
    head_cache_misses: int
    read_cache_hits: int
    read_cache_misses: int
    read_cache_bytes: int
    #: Bytes of unacknowledged messages, memory and disk (what max_size_bytes bounds).
    bytes_queued: int
    #: Bytes of indexes and per-message metadata in memory.
    index_bytes: int
    transient_bytes_in_memory: int
    #: Bytes the MemoryGovernor gave this queue actor's caches (-1: none yet).
    memory_budget: int
    #: True while new transient messages flow to disk.
    flowing_to_disk: bool
    messages_flowed_to_disk: int
    messages_dropped: int
    #: Messages moved to ``dead_letter_queue``, and those waiting to be moved.
    messages_dead_lettered: int
    dead_letters_pending: int
    dead_letter_queue: str
    #: Failed attempts to move dead letters (each logged; they are retried).
    dead_letter_failures: int
    blocked_producers: int
    blocked_seconds: float
    blocked_reason: str
    #: Restarts of the actor's internal tasks after an exception, and the last one.
    task_restarts: int
    last_task_error: str
    #: Errors after durable commits (logged; the sends succeeded).
    internal_errors: int

    def to_dict(self) -> dict:
        """The snapshot as a plain dict."""
        return asdict(self)


class QueueCore:
    """A queue: durable or in-memory log, group commit, dispatch and long polling."""

    def __init__(
        self,
        config: QueueConfig,
        broker: BrokerConfig,
        dead_letter_sink: DeadLetterSink | None = None,
    ):
        """``dead_letter_sink`` moves dead letters to the dead-letter queue; without one
        they wait (counted in ``dead_letters_pending``) and are never delivered again."""
        self.config = config
        self.broker = broker
        self.name = config.name
        self.directory = os.path.join(broker.paging_directory, config.name)
        self.log: SegmentLog
        self.recovery: RecoveryReport
        self.log, self.recovery = SegmentLog.open(
            self.directory,
            queue=config.name,
            page_size_bytes=config.page_size_bytes,
            durable=config.durable,
            read_cache_bytes=max(config.page_max_cache_size, 1) * config.page_size_bytes,
        )
        self.area = TargetArea(self.log, config.name, config.max_delivery_attempts)
        self._dead_letter_sink = dead_letter_sink
        self._dead_lettered = 0
        self._dead_letter_failures = 0
        self._dead_letter_kick: asyncio.Event | None = None
        self.head_cache = HeadQueueCache(0)
        #: Bytes for this actor's caches from the MemoryGovernor; None until it speaks.
        self.memory_budget: int | None = None
        self._apply_memory_limits()
        self._pending: list[tuple[MessageBatch, asyncio.Future]] = []
        self._reserved = 0  # bytes of admitted sends not yet published
        self._freed: asyncio.Event | None = None
        self._blocked: dict[int, float] = {}  # id of a blocked send -> monotonic start
        self._dropped = 0
        self._active_counters = (0, 0, 0)
        self._peak_transient = 0  # most bytes of messages held since the governor asked
        self._ack_waiters: list[asyncio.Future] = []
        self._kick: asyncio.Event | None = None
        self._arrival: asyncio.Event | None = None
        self._tasks = Supervisor(f"queue {config.name!r}", log)
        #: Failures after a commit was durable (deriving indexes, unlinking files): the
        #: sends succeeded; each is logged. Counted here.
        self._internal_errors = 0
        self._dirty_since_checkpoint = False
        self._last_checkpoint = time.monotonic()
        self._counters = {"in": 0, "out": 0, "acked": 0, "bytes_in": 0, "bytes_out": 0}
        self._samples: list[tuple[float, dict[str, int]]] = [
            (time.monotonic(), dict(self._counters))
        ]
        self._closed = False
        # A fetch of a TargetList can arrive after its close (sent before, or cut short by
        # it): it must not register the consumer again and take messages nobody will
        # ever ack or give back. Insertion-ordered, the oldest forgotten first.
        self._closed_consumers: dict[str, None] = {}

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the writer and housekeeping tasks on the running event loop."""
        self._kick = asyncio.Event()
        self._arrival = asyncio.Event()
        self._freed = asyncio.Event()
        self._dead_letter_kick = asyncio.Event()
        self._tasks.spawn("writer", self._write_loop)
        self._tasks.spawn("housekeeping", self._tick_loop)
        if self._dead_letter_sink is not None:
            self._tasks.spawn("dead-letter mover", self._move_dead_letters)

    def supervise(self, name: str, run) -> asyncio.Task:
        """Run ``run()`` as one of this queue's supervised tasks (restarted if it raises,
        counted in ``task_restarts``, cancelled by ``close``); for the actor shell's own
        background tasks."""
        return self._tasks.spawn(name, run)

    async def close(self) -> None:
        """Flush what is pending, stop the tasks and close the files."""
        if self._closed:
            return
        if self._pending or self.log.has_pending_acks:
            flushed = asyncio.get_running_loop().create_future()
            self._ack_waiters.append(flushed)  # resolved by the commit that takes them all
            self._kick.set()
            await flushed
        self._closed = True
        await self._tasks.cancel_all()
        self.log.close()

    # -- producing -------------------------------------------------------------------

    async def send_batch(
        self, batch: MessageBatch, timeout: float | None = None
    ) -> tuple[int, int]:
        """Append a batch; returns (first offset, count stored) once it is durable.

        Concurrent calls share one write and one fdatasync (group commit). At
        ``max_size_bytes`` the ``address_full_policy`` decides: PAGE stores everything,
        DROP stores the messages that fit (the count says how many; the rest are counted
        as dropped), FAIL raises ``AddressFull`` storing nothing, BLOCK waits up to
        ``timeout`` seconds (None: for ever) for acks to free room, then ``AddressFull``.
        """
        self._check_batch(batch)
        if len(batch) == 0:
            return self.log.next_offset, 0
        batch = await self._admit(batch, timeout)
        if len(batch) == 0:
            return self.log.next_offset, 0
        cost = _cost(batch)
        self._reserved += cost
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((batch, fut))
        self._kick.set()
        try:
            return await fut, len(batch)
        finally:
            self._reserved -= cost

    def _limited(self) -> bool:
        return self.config.max_size_bytes > 0 and self.config.address_full_policy != "PAGE"

    def _queued_bytes(self) -> int:
        """Bytes counted against ``max_size_bytes``: stored unacknowledged messages plus
        admitted sends not yet written."""
        return self.log.bytes_queued + self._reserved

    def _full_message(self, need: int) -> str:
        cfg = self.config
        return (
            f"queue {self.name!r} holds {self._queued_bytes():,} of max_size_bytes="
            f"{cfg.max_size_bytes:,} bytes; a batch of {need:,} bytes does not fit"
            f" (address_full_policy={cfg.address_full_policy})"
        )

    async def _admit(self, batch: MessageBatch, timeout: float | None) -> MessageBatch:
        """Apply ``address_full_policy``; returns what may be stored (maybe nothing)."""
        if not self._limited():
            return batch
        limit, policy = self.config.max_size_bytes, self.config.address_full_policy
        need = _cost(batch)
        if self._queued_bytes() + need <= limit:
            return batch
        if policy == "FAIL" or (policy == "BLOCK" and need > limit):
            raise AddressFull(self._full_message(need))
        if policy == "DROP":
            room = limit - self._queued_bytes()
            sizes = np.diff(batch.body_offsets) + np.diff(batch.prop_offsets) + 24
            fits = int(np.searchsorted(np.cumsum(sizes), room, side="right"))
            self._dropped += len(batch) - fits
            return batch.slice(0, fits)
        # BLOCK: wait for acks to free room; visible in stats while waiting.
        key, started = id(batch), time.monotonic()
        deadline = None if timeout is None else started + max(timeout, 0.0)
        self._blocked[key] = started
        try:
            while self._queued_bytes() + need > limit:
                freed = self._freed
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    raise AddressFull(
                        self._full_message(need) + f"; blocked {time.monotonic() - started:.1f} s"
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(freed.wait(), wait)
        finally:
            del self._blocked[key]
        return batch

    def _signal_freed(self) -> None:
        """Wake producers blocked on ``max_size_bytes`` (acks freed room)."""
        if self._freed is not None:
            self._freed.set()
            self._freed = asyncio.Event()

    def _check_batch(self, batch: MessageBatch) -> None:
        """Refuse, before anything is stored, a batch a client could have forged: a
        message over ``max_message_size`` (body and properties together) or property
        bytes that are not a valid msgpack map (checked once per distinct map)."""
        if not isinstance(batch, MessageBatch):
            raise TypeError(f"send_batch takes a MessageBatch, not {type(batch).__name__}")
        sizes = batch.body_sizes() + np.diff(batch.prop_offsets)
        check_sizes(sizes, self.broker.max_message_size, self.name)
        if len(batch.prop_data):
            groups = batch.property_groups()
            first_of = np.full(len(groups.distinct), len(batch), dtype=np.int64)
            np.minimum.at(first_of, groups.index, np.arange(len(batch)))
            for blob, i in zip(groups.distinct, first_of.tolist(), strict=True):
                check_encoded_properties(blob, where=f"message {i} for queue {self.name!r}")

    async def _write_loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            await self._commit_once()

    async def _commit_once(self) -> None:
        """One group commit of what is pending. Whatever happens, every caller waiting
        on it gets an answer (an error at worst): none waits for ever."""
        pending, self._pending = self._pending, []
        waiters, self._ack_waiters = self._ack_waiters, []
        try:
            await self._commit(pending, waiters)
        except BaseException as exc:
            for fut in [f for _, f in pending] + waiters:
                if not fut.done():
                    if isinstance(exc, Exception):
                        fut.set_exception(exc)
                    else:
                        fut.cancel()
            raise

    async def _commit(self, pending: list, waiters: list[asyncio.Future]) -> None:
        checkpoint = (
            self.config.durable
            and self._dirty_since_checkpoint
            and time.monotonic() - self._last_checkpoint >= self.broker.checkpoint_interval
        )
        batches = [b for b, _ in pending]
        prepared = None
        try:
            prepared = self.log.prepare(batches, int(time.time() * 1e6), checkpoint=checkpoint)
            to_disk = any(item[2] for item in prepared.items)  # transient ones may flow
            if self.config.durable or to_disk or prepared.ack_ranges is not None:
                if prepared.write_bytes <= INLINE_WRITE_BYTES:
                    # A small write and its fdatasync take well under a millisecond: doing
                    # them inline saves a thread hand-off, and sends arriving meanwhile
                    # wait in Ray's queue and join the next group commit anyway.
                    self.log.write(prepared)
                else:
                    await asyncio.to_thread(self.log.write, prepared)
        except StorageError as exc:
            if prepared is None:  # refused before anything was planned
                _fail(pending, waiters, exc)
                return
            # Otherwise each part's outcome is in ``prepared``: publish sorts it out.
        except Exception as exc:  # a bug: fail the callers, not the loop
            if prepared is not None:
                self.log.abort(prepared)
            _fail(pending, waiters, exc)
            return
        self.log.publish(prepared)
        stored = prepared.records_error is None
        if stored:
            try:  # the commit is durable: what follows derives state, it cannot undo it
                await self._after_commit(prepared)
            except Exception:
                self._internal_errors += 1
                log.exception("queue %r: after a durable commit", self.name)
            for (_, fut), first in zip(pending, prepared.firsts, strict=True):
                if not fut.done():
                    fut.set_result(first)
            self._counters["in"] += prepared.message_count
            self._counters["bytes_in"] += sum(item[3].nbytes for item in prepared.items)
        else:  # cut back: never served; the senders may retry
            _fail(pending, [], prepared.records_error)
        if prepared.checkpoint_written:
            self._last_checkpoint = time.monotonic()
            self._dirty_since_checkpoint = False
        if (batches and stored) or waiters:
            self._dirty_since_checkpoint = True
        if not self.config.durable:
            self._peak_transient = max(self._peak_transient, self.log.bytes_queued)
        # An ack is durable once in the ack log; if that failed it stays applied and is
        # written again with a later commit (the housekeeping retries).
        for fut in waiters:
            if not fut.done():
                if prepared.ack_error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(prepared.ack_error)
        if stored and prepared.items:
            self._wake_consumers()

    async def _after_commit(self, prepared) -> None:
        """Unlink deleted files, match the new messages against selectors, fill the
        HeadQueueCache."""
        if self.log.unlinkable:  # off the event loop; done before the acks return
            await asyncio.to_thread(self.log.unlink_deleted)
        for seg, _pos, _bufs, chunk, _size in prepared.items:
            groups = chunk.property_groups()
            seg.note_properties(groups)
            self.area.arrived(chunk, groups)
            if self.config.durable:
                self.head_cache.append(chunk)

    async def _tick_loop(self) -> None:
        """Housekeeping: checkpoint an idle queue, sample rates, trim and refill the
        HeadQueueCache, drop stale CacheReferences (once a second)."""
        while True:
            await asyncio.sleep(min(1.0, self.broker.checkpoint_interval))
            now = time.monotonic()
            self._samples.append((now, dict(self._counters)))
            self._samples = [s for s in self._samples if now - s[0] <= 10.0]
            if self._dirty_since_checkpoint or self.log.has_pending_acks:
                self._kick.set()  # checkpoint an idle queue; retry acks that failed
            self.housekeeping()
            self._scrub(min(1.0, self.broker.checkpoint_interval))

    def _scrub(self, seconds: float) -> None:
        """Verify the CRCs of about ``scrub_bytes_per_second * seconds`` stored bytes, so
        that rot is found (and quarantined) before a consumer needs the data."""
        rate = self.broker.scrub_bytes_per_second
        if not self.config.durable or rate <= 0:
            return
        try:
            self.log.scrub_step(max(1, int(rate * seconds)))
        except StorageError as exc:  # unreadable now; counted by the log, tried again
            log.warning("queue %r: scrub: %s", self.name, exc)
        self._forget_damaged()

    def _forget_damaged(self) -> None:
        """Take offsets the log found damaged out of delivery: nobody holds or waits for
        them any more (they are counted in ``damaged_messages``)."""
        damaged = self.log.drain_damaged()
        if len(damaged):
            self.area.forget(damaged)
            self._wake_consumers()

    def housekeeping(self) -> None:
        """Trim the HeadQueueCache to what is undelivered and refill it from the log;
        flow transient messages to disk while they are over their memory limit."""
        self.area.housekeeping()
        if self.log.memory_limit is not None and self.log.transient_bytes > self.log.memory_limit:
            self.log.flow_to_disk(self.log.memory_limit)
        if self.config.durable:
            undelivered = self.area.head() if self.area.selective else self.area.cursor
            self.head_cache.trim(undelivered)
            # Around the read cache: the HeadQueueCache keeps what it reads (no message
            # held twice, and bytes_in_memory + head_cache_bytes is a true sum).
            try:
                self.head_cache.refill(
                    lambda a, b: self.log.read(a, b, cache=False), undelivered, self.log.next_offset
                )
            except StorageError as exc:  # a cache fill is best effort; reads try again
                log.warning("queue %r: HeadQueueCache refill: %s", self.name, exc)
        self._forget_damaged()

    # -- memory budget ---------------------------------------------------------------

    def set_budget(self, queue_bytes: int) -> None:
        """Take the MemoryGovernor's budget for this actor's caches (bytes): the
        HeadQueueCache, the read cache and transient messages in memory."""
        self.memory_budget = max(0, int(queue_bytes))
        self._apply_memory_limits()
        self.housekeeping()

    def _apply_memory_limits(self) -> None:
        """Give the log's read cache, the HeadQueueCache (durable) or the transient
        messages (non-durable) their parts of the budget, as ``split_queue_bytes``
        divides it (bytes); before the governor speaks, ``head_cache_bytes`` stands in."""
        cfg = self.config
        memory = split_queue_bytes(
            self.memory_budget,
            durable=cfg.durable,
            read_cache_max_bytes=max(cfg.page_max_cache_size, 1) * cfg.page_size_bytes,
            max_size_bytes=cfg.max_size_bytes,
            default_bytes=self.broker.head_cache_bytes,
        )
        self.log.set_read_cache_bytes(memory.read_cache_bytes)
        if cfg.durable:
            self.head_cache.resize(memory.head_cache_bytes)
        else:
            self.log.memory_limit = memory.transient_bytes

    def usage(self, node_id: str = "") -> QueueUsage:
        """What the MemoryGovernor needs of this queue (sizes in bytes), on ``node_id``
        (the shell knows its node), with no consumers (the governor asks them itself).
        It is active with consumers, or with messages in, out or acked since the last
        call; ``transient_bytes`` is the most a non-durable queue held since then."""
        counters = (self._counters["in"], self._counters["out"], self._counters["acked"])
        active = bool(self.area.consumers) or counters != self._active_counters
        delivering = counters[1] != self._active_counters[1]
        self._active_counters = counters
        transient = 0
        if not self.config.durable:
            transient = max(self._peak_transient, self.log.bytes_queued)
            self._peak_transient = self.log.bytes_queued
        return QueueUsage(
            name=self.name,
            node_id=node_id,
            size_bytes=self.log.bytes_queued,
            memory_bytes=self.head_cache.bytes + self.log.bytes_in_memory,
            index_bytes=self.log.index_bytes + self.area.index_bytes,
            active=active,
            delivering=delivering,
            max_size_bytes=self.config.max_size_bytes,
            transient_bytes=transient,
        )

    def _wake_consumers(self) -> None:
        self._arrival.set()
        self._arrival = asyncio.Event()

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
        if consumer_id in self._closed_consumers:
            raise ConsumerClosed(f"consumer {consumer_id} of queue {self.name!r} is closed")
        if consumer_id not in self.area.consumers:
            self.register_consumer(consumer_id, prefetch, selector)
        target = self.area.consumers[consumer_id]
        deadline = time.monotonic() + min(max(timeout, 0.0), MAX_POLL_SECONDS)
        while True:
            if self.area.consumers.get(consumer_id) is not target:
                return EMPTY_DELIVERY  # closed (or closed and back) while we waited
            arrival = self._arrival
            offsets, counts = self.area.take(consumer_id, max_messages)
            if len(offsets):
                try:
                    batch = self._materialize(offsets, counts)
                except BaseException:
                    # Unread, so not delivered: nobody may hold them (uncounted).
                    self.area.release(consumer_id, offsets, count_delivery=False)
                    self._wake_consumers()
                    raise
                self._forget_damaged()  # what could not be read is not held by anyone
                self._counters["out"] += batch.num_rows
                self._counters["bytes_out"] += batch.nbytes
                return batch
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return EMPTY_DELIVERY
            # Nothing taken while its scan goes on means no credit: match ahead meanwhile
            # (a prefetch's worth), so that returning credit finds candidates ready,
            # then wait for the credit rather than ask again at once.
            if target.scanning and len(target.candidates) < target.prefetch:
                self.area.scan_step(target)
                await asyncio.sleep(0)  # let other calls in between scan steps
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(arrival.wait(), remaining)

    def _read(self, start: int, end: int) -> list[MessageBatch]:
        """Messages [start, end) from the HeadQueueCache, else the log (its read cache)."""
        cached = self.head_cache.get(start, end) if self.config.durable else None
        return cached if cached is not None else self.log.read(start, end)

    def _materialize(self, offsets: np.ndarray, counts: np.ndarray, *, read=None) -> pa.RecordBatch:
        """The messages of sorted ``offsets`` as one delivery RecordBatch.

        Offsets closer than ``MATERIALIZE_GAP`` are read as one range and picked with
        ``take``, so sparse selector matches cost one read and one Arrow conversion per
        range, not per message.
        """
        read = read or self._read
        if not len(offsets):
            return EMPTY_DELIVERY
        groups = np.split(
            np.arange(len(offsets)), np.flatnonzero(np.diff(offsets) > MATERIALIZE_GAP) + 1
        )
        parts = []
        for group in groups:
            wanted = offsets[group]
            batches = read(int(wanted[0]), int(wanted[-1]) + 1)
            if not batches:
                continue
            arrow = [b.to_arrow(np.zeros(len(b), dtype=np.int32)) for b in batches]
            whole = arrow[0] if len(arrow) == 1 else pa.concat_batches(arrow)
            have = whole.column(0).to_numpy()
            if not np.array_equal(have, wanted):
                # Only what was read: a damaged record's offsets are missing from it.
                found = np.isin(wanted, have)
                group, wanted = group[found], wanted[found]
                whole = whole.take(pa.array(np.searchsorted(have, wanted)))
            columns = whole.columns
            columns[2] = pa.array(counts[group], pa.int32())
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
        self._forget_damaged()
        return batch, pos

    async def ack(self, consumer_id: str, offsets: np.ndarray) -> int:
        """Acknowledge offsets; returns once the acks are durable (for a durable queue)."""
        offsets = self._offsets(offsets)
        self.area.check_ack(consumer_id, offsets)
        fresh = self.area.ack(consumer_id, offsets)
        self._counters["acked"] += fresh
        if fresh:
            self._wake_consumers()  # credit came back
            self._signal_freed()
        if self.config.durable and fresh:
            fut = asyncio.get_running_loop().create_future()
            self._ack_waiters.append(fut)
            self._kick.set()
            await fut
        return fresh

    def nack(self, consumer_id: str, offsets: np.ndarray) -> int:
        """Release offsets for redelivery with their delivery count raised."""
        offsets = self._offsets(offsets)
        self.area.check_ack(consumer_id, offsets)
        n = self.area.release(consumer_id, offsets)
        if n:
            self._wake_consumers()
            self._signal_dead_letters()
        return n

    def give_back(self, consumer_id: str, offsets: np.ndarray) -> int:
        """Release held offsets the application never received (delivery not counted)."""
        n = self.area.release(consumer_id, self._offsets(offsets), count_delivery=False)
        if n:
            self._wake_consumers()
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
            self._wake_consumers()
            self._signal_dead_letters()
        return n

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
        offsets = self._offsets(offsets)
        self.area.check_ack(consumer_id, offsets)
        n = self.area.dead_letter(consumer_id, offsets, REASON_REJECTED)
        self._signal_dead_letters()
        return n

    def _signal_dead_letters(self) -> None:
        if self.area.dead_letters and self._dead_letter_kick is not None:
            self._dead_letter_kick.set()

    async def _move_dead_letters(self) -> None:
        """Move waiting dead letters to the dead-letter queue, a batch at a time: append
        there durably, then ack here durably (a crash in between leaves a copy in both,
        never in neither). A failure is logged, counted and retried with backoff."""
        backoff = 0.1
        while True:
            if not self.area.dead_letters:
                self._dead_letter_kick.clear()
                await self._dead_letter_kick.wait()
                continue
            try:
                await self._move_dead_letter_batch()
                backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the DLQ unavailable or full: try again later
                self._dead_letter_failures += 1
                log.warning(
                    "queue %r: moving %d dead letters to %r failed (retry in %.1f s): %s",
                    self.name,
                    len(self.area.dead_letters),
                    self.config.dead_letter_address,
                    backoff,
                    exc,
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, DEAD_LETTER_RETRY_MAX_SECONDS)

    async def _move_dead_letter_batch(self) -> None:
        offsets, reasons = self.area.next_dead_letters(MOVE_BATCH_MESSAGES)
        runs = np.split(offsets, np.flatnonzero(np.diff(offsets) != 1) + 1)
        stored = [b for run in runs for b in self.log.read(int(run[0]), int(run[-1]) + 1)]
        self._forget_damaged()  # a damaged one is no longer a dead letter to move
        readable = np.isin(offsets, [o for o in offsets.tolist() if o in self.area.dead_letters])
        offsets = offsets[readable]
        reasons = [r for r, ok in zip(reasons, readable.tolist(), strict=True) if ok]
        if not len(offsets):
            return
        batch = dead_letter_batch(stored, offsets, reasons, self.name)
        await self._dead_letter_sink(self.config.dead_letter_address, batch)
        await self.ack(DEAD_LETTER_HOLDER, offsets)
        self._dead_lettered += len(offsets)
        log.info(
            "queue %r: %d messages moved to dead-letter queue %r",
            self.name,
            len(offsets),
            self.config.dead_letter_address,
        )

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
            "messages_scanned": t.messages_scanned,
            "segments_skipped": t.segments_skipped,
        }

    def silent_consumers(self, seconds: float) -> list[tuple[str, object]]:
        """(consumer id, watch) of consumers not heard from for ``seconds``."""
        now = time.monotonic()
        return [
            (t.consumer_id, t.watch)
            for t in self.area.consumers.values()
            if t.watch is not None and now - t.last_seen > seconds
        ]

    def heard_from(self, consumer_id: str) -> None:
        """Note that a consumer showed it is alive."""
        t = self.area.consumers.get(consumer_id)
        if t is not None:
            t.last_seen = time.monotonic()

    # -- statistics ------------------------------------------------------------------

    def stats(self) -> QueueStats:
        """A snapshot of depth, memory, disk, consumers and rates."""
        now = time.monotonic()
        t0, c0 = self._samples[0]
        span = max(now - t0, 1e-6)
        c = self._counters
        return QueueStats(
            name=self.name,
            durable=self.config.durable,
            depth=self.log.depth,
            in_flight=self.area.in_flight,
            next_offset=self.log.next_offset,
            consumers=len(self.area.consumers),
            bytes_in_memory=self.log.bytes_in_memory,
            bytes_on_disk=self.log.bytes_on_disk,
            segment_files=self.log.segment_files,
            messages_in=c["in"],
            messages_out=c["out"],
            messages_acked=c["acked"],
            messages_redelivered=self.area.redelivered_total,
            bytes_in=c["bytes_in"],
            bytes_out=c["bytes_out"],
            in_rate=(c["in"] - c0["in"]) / span,
            out_rate=(c["out"] - c0["out"]) / span,
            ack_rate=(c["acked"] - c0["acked"]) / span,
            address_full_policy=self.config.address_full_policy,
            max_size_bytes=self.config.max_size_bytes,
            recovery_seconds=self.recovery.seconds,
            damaged_messages=self.log.damaged_messages,
            storage_errors=self.log.storage_errors,
            writable=self.log.writable,
            scrubbed_bytes=self.log.scrubbed_bytes,
            head_cache_bytes=self.head_cache.bytes,
            head_cache_messages=self.head_cache.messages,
            head_cache_hits=self.head_cache.hits,
            head_cache_misses=self.head_cache.misses,
            read_cache_hits=self.log.cache_hits,
            read_cache_misses=self.log.cache_misses,
            read_cache_bytes=self.log.read_cache_used,
            bytes_queued=self.log.bytes_queued,
            index_bytes=self.log.index_bytes + self.area.index_bytes,
            transient_bytes_in_memory=self.log.transient_bytes,
            memory_budget=-1 if self.memory_budget is None else self.memory_budget,
            flowing_to_disk=self.log.flowing,
            messages_flowed_to_disk=self.log.flowed_messages,
            messages_dropped=self._dropped,
            messages_dead_lettered=self._dead_lettered,
            dead_letters_pending=len(self.area.dead_letters),
            dead_letter_queue=self.config.dead_letter_address,
            dead_letter_failures=self._dead_letter_failures,
            blocked_producers=len(self._blocked),
            blocked_seconds=max((now - t for t in self._blocked.values()), default=0.0),
            blocked_reason=self._full_message(0) if self._blocked else "",
            task_restarts=self._tasks.restarts,
            last_task_error=self._tasks.last_error,
            internal_errors=self._internal_errors,
        )


def _fail(pending: list, waiters: list[asyncio.Future], exc: BaseException) -> None:
    """Answer every sender of ``pending`` and every ack waiter with ``exc``."""
    for fut in [f for _, f in pending] + waiters:
        if not fut.done():
            fut.set_exception(exc)


def _cost(batch: MessageBatch) -> int:
    """Bytes a batch adds to a queue's size: bodies, properties and per-message
    metadata (offsets and timestamp, 24 bytes a message)."""
    return int(batch.body_offsets[-1] + batch.prop_offsets[-1]) + 24 * len(batch)


__all__ = ["QueueCore", "QueueStats"]
