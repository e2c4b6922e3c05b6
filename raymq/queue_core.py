"""QueueCore: one queue's behaviour, as plain asyncio code without Ray.

It owns the SegmentLog (the QueueArea) and the Dispatcher, runs the group-commit writer
and long-polls for consumers. The Ray actor in ``raymq.actors.queue_actor`` only wires
it to Ray, so tests drive this class directly with asyncio.

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
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa

from raymq.batch import EMPTY_DELIVERY, MessageBatch, check_sizes
from raymq.config import BrokerConfig, QueueConfig
from raymq.dispatch import Dispatcher
from raymq.storage import RecoveryReport, SegmentLog

log = logging.getLogger("raymq.queue")

#: Longest a single fetch call waits in the actor (seconds); clients loop for longer waits.
MAX_POLL_SECONDS = 1.0
#: Group commits up to this many bytes are written in the event loop (bytes).
INLINE_WRITE_BYTES = 256 * 1024


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
    in_rate: float
    out_rate: float
    ack_rate: float
    address_full_policy: str
    max_size_bytes: int
    recovery_seconds: float
    damaged_messages: int

    def to_dict(self) -> dict:
        """The snapshot as a plain dict."""
        return asdict(self)


class QueueCore:
    """A queue: durable or in-memory log, group commit, dispatch and long polling."""

    def __init__(self, config: QueueConfig, broker: BrokerConfig):
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
        self.dispatcher = Dispatcher(self.log, config.name)
        self._pending: list[tuple[MessageBatch, asyncio.Future]] = []
        self._ack_waiters: list[asyncio.Future] = []
        self._kick: asyncio.Event | None = None
        self._arrival: asyncio.Event | None = None
        self._writer: asyncio.Task | None = None
        self._ticker: asyncio.Task | None = None
        self._dirty_since_checkpoint = False
        self._last_checkpoint = time.monotonic()
        self._counters = {"in": 0, "out": 0, "acked": 0}
        self._samples: list[tuple[float, dict[str, int]]] = [
            (time.monotonic(), dict(self._counters))
        ]
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the writer and housekeeping tasks on the running event loop."""
        self._kick = asyncio.Event()
        self._arrival = asyncio.Event()
        self._writer = asyncio.get_running_loop().create_task(self._write_loop())
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop())

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
        for task in (self._writer, self._ticker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self.log.close()

    # -- producing -------------------------------------------------------------------

    async def send_batch(self, batch: MessageBatch) -> tuple[int, int]:
        """Append a batch; returns (first offset, count) once it is durable.

        Concurrent calls share one write and one fdatasync (group commit).
        """
        self._check_batch(batch)
        if len(batch) == 0:
            return self.log.next_offset, 0
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((batch, fut))
        self._kick.set()
        return await fut, len(batch)

    def _check_batch(self, batch: MessageBatch) -> None:
        if not isinstance(batch, MessageBatch):
            raise TypeError(f"send_batch takes a MessageBatch, not {type(batch).__name__}")
        check_sizes(batch.body_sizes(), self.broker.max_message_size, self.name)

    async def _write_loop(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            await self._commit_once()

    async def _commit_once(self) -> None:
        pending, self._pending = self._pending, []
        waiters, self._ack_waiters = self._ack_waiters, []
        checkpoint = (
            self.config.durable
            and self._dirty_since_checkpoint
            and time.monotonic() - self._last_checkpoint >= self.broker.checkpoint_interval
        )
        batches = [b for b, _ in pending]
        prepared = None
        try:
            prepared = self.log.prepare(batches, int(time.time() * 1e6), checkpoint=checkpoint)
            if self.config.durable:
                if prepared.write_bytes <= INLINE_WRITE_BYTES:
                    # A small write and its fdatasync take well under a millisecond: doing
                    # them inline saves a thread hand-off, and sends arriving meanwhile
                    # wait in Ray's queue and join the next group commit anyway.
                    self.log.write(prepared)
                else:
                    await asyncio.to_thread(self.log.write, prepared)
        except Exception as exc:  # sticky StorageError or a bug: fail the callers, not the loop
            if prepared is not None:
                self.log.abort(prepared)
            for _, fut in pending:
                if not fut.done():
                    fut.set_exception(exc)
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(exc)
            return
        self.log.publish(prepared)
        if checkpoint:
            self._last_checkpoint = time.monotonic()
            self._dirty_since_checkpoint = False
        if batches or waiters:
            self._dirty_since_checkpoint = True
        for (_, fut), first in zip(pending, prepared.firsts, strict=True):
            if not fut.done():
                fut.set_result(first)
        self._counters["in"] += prepared.message_count
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        if prepared.items:
            self._wake_consumers()

    async def _tick_loop(self) -> None:
        """Housekeeping: checkpoint an idle queue, sample rates (once a second)."""
        while True:
            await asyncio.sleep(min(1.0, self.broker.checkpoint_interval))
            now = time.monotonic()
            self._samples.append((now, dict(self._counters)))
            self._samples = [s for s in self._samples if now - s[0] <= 10.0]
            if self._dirty_since_checkpoint:
                self._kick.set()

    def _wake_consumers(self) -> None:
        self._arrival.set()
        self._arrival = asyncio.Event()

    # -- consuming -------------------------------------------------------------------

    def register_consumer(self, consumer_id: str, prefetch: int) -> None:
        """Register a consumer with its prefetch (max unacknowledged messages held)."""
        self.dispatcher.register(consumer_id, prefetch)

    async def fetch(
        self, consumer_id: str, max_messages: int, timeout: float, prefetch: int
    ) -> pa.RecordBatch:
        """Deliver up to ``max_messages``, waiting up to ``timeout`` seconds for some.

        Returns a RecordBatch in ``raymq.batch.DELIVERY_SCHEMA`` (empty when nothing came in time).
        """
        if consumer_id not in self.dispatcher.consumers:  # e.g. after an actor restart
            self.dispatcher.register(consumer_id, prefetch)
        deadline = time.monotonic() + min(max(timeout, 0.0), MAX_POLL_SECONDS)
        while True:
            offsets, counts = self.dispatcher.take(consumer_id, max_messages)
            if len(offsets):
                self._counters["out"] += len(offsets)
                return self._materialize(offsets, counts)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return EMPTY_DELIVERY
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._arrival.wait(), remaining)

    def _materialize(self, offsets: np.ndarray, counts: np.ndarray) -> pa.RecordBatch:
        breaks = np.flatnonzero(np.diff(offsets) != 1) + 1
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [len(offsets)]))
        parts = []
        for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
            lo = int(offsets[s])
            pos = s
            for batch in self.log.read(lo, int(offsets[e - 1]) + 1):
                n = len(batch)
                parts.append(batch.to_arrow(counts[pos : pos + n]))
                pos += n
        if len(parts) == 1:
            return parts[0]
        return pa.concat_batches(parts)

    async def ack(self, consumer_id: str, offsets: np.ndarray) -> int:
        """Acknowledge offsets; returns once the acks are durable (for a durable queue)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        self.dispatcher.check_ack(consumer_id, offsets)
        fresh = self.dispatcher.ack(consumer_id, offsets)
        self._counters["acked"] += fresh
        if self.config.durable and fresh:
            fut = asyncio.get_running_loop().create_future()
            self._ack_waiters.append(fut)
            self._kick.set()
            await fut
        return fresh

    def nack(self, consumer_id: str, offsets: np.ndarray) -> int:
        """Release offsets for redelivery with their delivery count raised."""
        offsets = np.asarray(offsets, dtype=np.int64)
        self.dispatcher.check_ack(consumer_id, offsets)
        n = self.dispatcher.release(consumer_id, offsets)
        if n:
            self._wake_consumers()
        return n

    def close_consumer(self, consumer_id: str, not_received: np.ndarray | None = None) -> int:
        """Remove a consumer; what it held is delivered again (``not_received`` uncounted)."""
        if not_received is not None:
            not_received = np.asarray(not_received, dtype=np.int64)
        n = self.dispatcher.unregister(consumer_id, not_received)
        if n:
            self._wake_consumers()
        return n

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
            in_flight=self.dispatcher.in_flight,
            next_offset=self.log.next_offset,
            consumers=len(self.dispatcher.consumers),
            bytes_in_memory=self.log.bytes_in_memory,
            bytes_on_disk=self.log.bytes_on_disk,
            segment_files=self.log.segment_files,
            messages_in=c["in"],
            messages_out=c["out"],
            messages_acked=c["acked"],
            messages_redelivered=self.dispatcher.redelivered_total,
            in_rate=(c["in"] - c0["in"]) / span,
            out_rate=(c["out"] - c0["out"]) / span,
            ack_rate=(c["acked"] - c0["acked"]) / span,
            address_full_policy=self.config.address_full_policy,
            max_size_bytes=self.config.max_size_bytes,
            recovery_seconds=self.recovery.seconds,
            damaged_messages=self.recovery.lost_messages,
        )


__all__ = ["QueueCore", "QueueStats"]
