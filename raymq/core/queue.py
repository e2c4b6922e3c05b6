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
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import pyarrow as pa

from raymq.batch import MessageBatch, check_sizes
from raymq.config import BrokerConfig, QueueConfig, check_int, validate_queue_name
from raymq.core.budget import QueueUsage, head_cache_want, split_queue_bytes
from raymq.core.head_cache import REFILL_STEP_BYTES, HeadQueueCache, SharedPart
from raymq.core.replication import ReplicationLeader, _Round
from raymq.core.subscription import Delivery, Subscription
from raymq.core.supervisor import Supervisor
from raymq.core.target_area import TargetArea
from raymq.errors import (
    AddressFull,
    BrokerUnavailable,
    InvalidSetting,
    NotEnoughReplicas,
    NotLeader,
    StorageError,
    SubscriptionExists,
    SubscriptionNotFound,
)
from raymq.properties import check_encoded_properties
from raymq.selector import Selector
from raymq.storage import RecoveryReport, SegmentLog
from raymq.storage.ack_ranges import AckRanges
from raymq.storage.files import storage_error
from raymq.storage.mirror import mirror_write
from raymq.storage.subscriptions import (
    MANIFEST_NAME,
    Manifest,
    SubscriptionAcks,
    SubscriptionLog,
    SubscriptionSpec,
    read_manifest,
    write_manifest,
)

log = logging.getLogger("raymq.queue")

#: Group commits up to this many bytes are written in the event loop (bytes).
INLINE_WRITE_BYTES = 256 * 1024
#: Period of the background scrub's steps (seconds): each reads
#: ``scrub_bytes_per_second`` times this on the event loop (200 KiB at 4 MiB/s).
SCRUB_STEP_SECONDS = 0.05
#: Shortest time from the start of one scrub pass over a queue's records to the start
#: of the next (seconds). Without it a queue of a few records re-read them from disk at
#: every step, 20 times a second, idle or not.
SCRUB_PASS_SECONDS = 10.0

#: Appends a batch durably to the named dead-letter queue (creating it if needed).
DeadLetterSink = Callable[[str, MessageBatch], Awaitable[None]]
#: Fewest rows per shared batch, on average, for a delivery to be shared: single sends
#: make batches of one message, and a put and a reference each would cost more than one
#: batch made for the delivery.
SHARED_MIN_ROWS = 64
#: Stored messages a new subscription's filter is applied to between two turns of the
#: event loop (about 30 ms of property reads here).
ROUTE_STEP_MESSAGES = 16384


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
    #: Acks, nacks and rejects of stale copies, dropped: a copy an earlier process of
    #: the queue (or this one, before the consumer left) delivered, that another
    #: consumer holds now (``TargetArea.drop_stale``) (messages).
    stale_acks: int
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
    #: Cached batches put in the object store for deliveries (once each, however many
    #: subscriptions and consumers receive them).
    head_cache_shared_batches: int
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
    #: A replicated queue's replicas (``ReplicaStatus.to_dict()``: replica_id,
    #: node_id, role, in_sync, lag_messages, lag_bytes), the leader first; [] if not
    #: replicated.
    replicas: list = field(default_factory=list)
    #: Sends refused for want of in-sync replicas (``NotEnoughReplicas``).
    unreplicated_commits: int = 0
    #: Replicas holding every answered send (the leader included; 1 if not replicated),
    #: and the most messages a follower out of sync lacks.
    replicas_in_sync: int = 1
    replica_lag_messages: int = 0
    #: Group commits that stored messages (each one write and one fdatasync of its
    #: records): ``messages_in / group_commits`` is the messages each commit took.
    group_commits: int = 0

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
        share: Callable[[pa.RecordBatch], object] | None = None,
        *,
        directory: str | None = None,
        replication: ReplicationLeader | None = None,
    ):
        """``dead_letter_sink`` moves dead letters to the dead-letter queue; without one
        they wait (counted in ``dead_letters_pending``) and are never delivered again.
        ``share`` makes a cached batch's one shared copy for deliveries (the shell's
        ``ray.put``; without it deliveries carry the batch itself). ``directory``: the
        queue's files (default: its name under the paging directory; a replica's own
        directory for a replicated queue). ``replication``: this queue leads a
        replicated queue; every commit goes to its followers before it is answered."""
        self.config = config
        self.broker = broker
        self.name = config.name
        self.directory = directory or os.path.join(broker.paging_directory, config.name)
        self.log: SegmentLog
        self.recovery: RecoveryReport
        self.log, self.recovery = SegmentLog.open(
            self.directory,
            queue=config.name,
            page_size_bytes=config.page_size_bytes,
            durable=config.durable,
            read_cache_bytes=max(config.page_max_cache_size, 1) * config.page_size_bytes,
        )
        self.dead_letter_sink = dead_letter_sink
        self.replication = replication
        if replication is not None:
            self.log.keep_deleted_names()
            replication.bind(
                self.log.published_sizes, lambda: self.log.next_offset, lambda: self.log.records_end
            )
        #: One for the queue or the whole address (see ``_cache_housekeeping``).
        self.head_cache = HeadQueueCache(0, share)
        #: An address's subscriptions by name (a queue has only ``_own``).
        self.subscriptions: dict[str, Subscription] = {}
        self._own: Subscription | None = None
        self._subscription_acks: SubscriptionAcks | None = None
        try:
            self._open_subscriptions()
        except BaseException:
            self.log.close()
            raise
        #: Bytes for this actor's caches from the MemoryGovernor; None until it speaks.
        self.memory_budget: int | None = None
        self._apply_memory_limits()
        self._pending: list[tuple[MessageBatch, asyncio.Future]] = []
        self._reserved = 0  # bytes of admitted sends not yet published
        self._freed: asyncio.Event | None = None
        self._blocked: dict[object, float] = {}  # blocked sends, in order -> monotonic start
        self._dropped = 0
        self._active_counters = (0, 0, 0)
        self._peak_transient = 0  # most bytes of messages held since the governor asked
        self._ack_waiters: list[asyncio.Future] = []
        self._kick: asyncio.Event | None = None
        #: True while a group commit runs (its batches are out of ``_pending`` then, and
        #: a large write awaits a thread): ``close`` and ``busy`` must wait for it.
        self._committing = False
        self._tasks = Supervisor(f"queue {config.name!r}", log)
        #: Failures after a commit was durable (deriving indexes, unlinking files): the
        #: sends succeeded; each is logged. Counted here.
        self._internal_errors = 0
        self._group_commits = 0  # commits that stored messages (QueueStats.group_commits)
        self._dirty_since_checkpoint = False
        self._last_checkpoint = time.monotonic()
        self._counters = {"in": 0, "out": 0, "acked": 0, "bytes_in": 0, "bytes_out": 0}
        #: Bytes the scrub may read now (negative: read ahead of its rate; ``_scrub``).
        self._scrub_credit = 0.0
        self._samples: list[tuple[float, dict[str, int]]] = [
            (time.monotonic(), dict(self._counters))
        ]
        self._closed = False
        self._started_at = time.monotonic()

    def _open_subscriptions(self) -> None:
        """A queue's own subscription; or an address's subscriptions, from its
        ``subscriptions`` file and the ranges recovery found."""
        cfg = self.config
        if not cfg.address:
            self._own = Subscription(
                self,
                cfg.name,
                self.log,
                max_delivery_attempts=cfg.max_delivery_attempts,
                dead_letter_address=cfg.dead_letter_address,
            )
            return
        # A durable address's file was read by SegmentLog.open, before recovery changed
        # anything (a damaged one failed the open there): not read again.
        self._manifest = self.log.manifest or read_manifest(self.directory, cfg.name)
        acks = self._subscription_acks = SubscriptionAcks(self.log)
        self.log.attach_subscriptions(acks)
        recovered = self.log.recovered_subscriptions or {}
        specs = list(self._manifest.subscriptions.values())
        # All loaded before any is settled: one of which nothing was found (created just
        # before a crash, or its ranges lost to rot) must not lose what the others
        # acknowledged. Then each filter is applied again where routing may not be on
        # disk, and what every one acknowledged is acknowledged in the log (one deleted
        # before a crash releases its hold).
        for spec in specs:
            acks.load(spec.id, recovered.get(spec.id), spec.start_offset)
            self.subscriptions[spec.name] = self._subscription_of(spec)
        for spec in specs:
            start = self.log.route_from if spec.id in recovered else spec.start_offset
            self.subscriptions[spec.name].route_again(start)
        acks.settle()
        if acks.has_pending and self.config.durable:
            self._commit_acks_now()

    def _commit_acks_now(self) -> None:
        """Make the acks applied so far durable before the address opens: recovery's
        checkpoint is written already, so a crash before the next commit would leave the
        messages routed again here past the next recovery's scan (when recovery found
        damage, it left that checkpoint to this commit: written after the acks). Raises
        ``StorageError``: the open fails, and the next one finds the damage again."""
        prepared = self.log.prepare([], int(time.time() * 1e6))
        try:
            self.log.write(prepared)
        finally:
            self.log.publish(prepared)

    def _subscription_of(self, spec: SubscriptionSpec) -> Subscription:
        cfg = self.config
        attempts = spec.max_delivery_attempts or cfg.max_delivery_attempts
        return Subscription(
            self,
            f"{cfg.name}/{spec.name}",
            SubscriptionLog(self.log, self._subscription_acks, spec.id),
            max_delivery_attempts=attempts,
            dead_letter_address=spec.dead_letter_queue or f"{cfg.name}.{spec.name}.DLQ",
            filter=spec.filter,
            sid=spec.id,
            subscription_name=spec.name,
        )

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the writer and housekeeping tasks on the running event loop."""
        self._kick = asyncio.Event()
        self._freed = asyncio.Event()
        self._tasks.spawn("writer", self._write_loop)
        self._tasks.spawn("housekeeping", self._tick_loop)
        self._tasks.spawn("scrub", self._scrub_loop)
        for sub in self.all_subscriptions():
            sub.start()

    def busy(self) -> bool:
        """True if closing this queue now (to hibernate it) could cost a client more than
        a delay: consumers registered, sends admitted or blocked and not yet published,
        a commit under way, acks not yet durable, deliveries not acknowledged, dead
        letters waiting, delivery counts that only this process remembers (they would
        start again from 0: ``max_delivery_attempts`` never reached), or a transient
        queue holding messages (its files are emptied when it starts again)."""
        if self._pending or self._reserved or self._committing or self._blocked:
            return True
        if self.log.has_pending_acks:
            return True
        if not self.config.durable and self.log.bytes_queued:
            return True
        return any(
            area.consumers or area.in_flight or area.dead_letters or area.remembers_deliveries
            for area in (sub.area for sub in self.all_subscriptions())
        )

    def supervise(self, name: str, run) -> asyncio.Task:
        """Run ``run()`` as one of this queue's supervised tasks (restarted if it raises,
        counted in ``task_restarts``, cancelled by ``close``); for the actor shell's own
        background tasks."""
        return self._tasks.spawn(name, run)

    async def close(self) -> None:
        """Flush what is pending, stop the tasks and close the files."""
        if self._closed:
            return
        # A commit under way took its sends out of ``_pending``: the flush queued behind
        # it waits for it too (cancelling it would fail sends it may have written). One
        # flush, not a loop: acks whose write failed stay pending (retried by later
        # commits), and a close must not wait for a disk to heal.
        if self._pending or self.log.has_pending_acks or self._committing:
            flushed = asyncio.get_running_loop().create_future()
            self._ack_waiters.append(flushed)  # resolved by the commit that takes them all
            self._kick.set()
            await flushed
        self._closed = True
        await self._tasks.cancel_all()
        if self.replication is not None:  # its followers' catch-ups read the files
            self.replication.close()
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
        if self.replication is not None:
            self.replication.require_quorum()  # refused before anything is stored
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
        # Under BLOCK a send that fits still queues behind blocked ones (FIFO), or a
        # stream of small sends would starve a blocked larger one.
        if self._queued_bytes() + need <= limit and not (policy == "BLOCK" and self._blocked):
            return batch
        if policy == "FAIL" or (policy == "BLOCK" and need > limit):
            raise AddressFull(self._full_message(need))
        if policy == "DROP":
            room = limit - self._queued_bytes()
            sizes = np.diff(batch.body_offsets) + np.diff(batch.prop_offsets) + 24
            fits = int(np.searchsorted(np.cumsum(sizes), room, side="right"))
            self._dropped += len(batch) - fits
            return batch.slice(0, fits)
        # BLOCK: wait for acks to free room, first blocked first admitted; visible in
        # stats while waiting.
        key, started = object(), time.monotonic()
        deadline = None if timeout is None else started + max(timeout, 0.0)
        self._blocked[key] = started  # dicts keep insertion order: the FIFO
        try:
            while next(iter(self._blocked)) is not key or self._queued_bytes() + need > limit:
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
            if self._blocked:  # the next in line may fit now, or its turn came
                self.signal_freed()
        return batch

    def signal_freed(self) -> None:
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
        limit, n = self.broker.max_message_size, len(batch)
        ends = batch.body_offsets + batch.prop_offsets  # where each message's bytes end
        if n <= 0:
            too_big = False
        elif n <= 64 and ends.dtype.kind == "i":  # a single send's gather: Python ints
            # beat NumPy's cost per call (a forged batch of other dtypes takes NumPy's way)
            e = ends.tolist()
            too_big = max(map(int.__sub__, e[1:], e[:-1])) > limit
        else:
            too_big = bool(np.diff(ends).max() > limit)
        if too_big:
            check_sizes(np.diff(ends), limit, self.name)
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
        self._committing = True
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
        finally:
            self._committing = False

    async def _commit(self, pending: list, waiters: list[asyncio.Future]) -> None:
        if self.replication is None:
            await self._commit_here(pending, waiters)
        else:  # a catch-up installs between two commits
            async with self.replication.commit_lock:
                await self._commit_here(pending, waiters)

    def _replicate(self, prepared) -> _Round | None:
        """Send a prepared commit to the followers in sync (None: nothing to send)."""
        write = mirror_write(prepared, self.log.take_deleted_names(), self.log.planned_next)
        if not (write.records or write.ack_record or write.checkpoint or write.deleted):
            return None
        first = prepared.items[0][3].first_offset if prepared.items else self.log.next_offset
        return self.replication.start(write, first)

    async def _commit_here(self, pending: list, waiters: list[asyncio.Future]) -> None:
        checkpoint = (
            self.config.durable
            and self._dirty_since_checkpoint
            and time.monotonic() - self._last_checkpoint >= self.broker.checkpoint_interval
        )
        batches = [b for b, _ in pending]
        prepared = None
        replicating: _Round | None = None
        if self.replication is not None and self.replication.needs_epoch:
            try:  # a commit was cut back after followers took it: a new epoch first
                await self.replication.renew_epoch()
            except (NotEnoughReplicas, NotLeader) as exc:
                _fail(pending, waiters, exc)
                return
        try:
            prepared = self.log.prepare(batches, int(time.time() * 1e6), checkpoint=checkpoint)
            if self.replication is not None:
                replicating = self._replicate(prepared)
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
            if replicating is not None:
                await self.replication.abandon(replicating)
            _fail(pending, waiters, exc)
            return
        unreplicated: Exception | None = None
        fenced: NotLeader | None = None
        if replicating is not None:
            try:
                await self.replication.finish(replicating)
            except (NotEnoughReplicas, NotLeader) as exc:
                # Acks stay (durable here; a follower that missed them is caught up);
                # records too few replicas have are cut back, never served. A leader
                # replaced answers nothing as durable, acks included.
                unreplicated = exc if prepared.items else None
                fenced = exc if isinstance(exc, NotLeader) else None
        if unreplicated is not None:
            self.log.abort(prepared)
        else:
            self.log.publish(prepared)
        stored = prepared.records_error is None and unreplicated is None
        told = True
        if replicating is not None and prepared.items and not stored:
            told = await self.replication.abandon(replicating)  # followers may hold them
        if not told:
            cause = prepared.records_error or unreplicated
            unreplicated = BrokerUnavailable(
                f"queue {self.name!r}: a send failed ({cause}) and the controller could not"
                " be told which replicas hold it: it may be delivered later"
            )
        if stored:
            try:  # the commit is durable: what follows derives state, it cannot undo it
                await self._after_commit(prepared)
            except Exception:
                self._internal_errors += 1
                log.exception("queue %r: after a durable commit", self.name)
            for (_, fut), first in zip(pending, prepared.firsts, strict=True):
                if not fut.done():
                    fut.set_result(first)
            if prepared.items:
                self._group_commits += 1
            self._counters["in"] += prepared.message_count
            self._counters["bytes_in"] += sum(item[3].nbytes for item in prepared.items)
        else:  # cut back: never served; the senders may retry
            _fail(pending, [], unreplicated or prepared.records_error)
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
                if fenced is not None:
                    fut.set_exception(fenced)
                elif prepared.ack_error is None:
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
        subscriptions = self.all_subscriptions()
        for seg, _pos, _bufs, chunk, _size in prepared.items:
            groups = chunk.property_groups()
            seg.note_properties(groups)
            for sub in subscriptions:
                sub.arrived(chunk, groups)
            if self.config.durable and len(chunk):
                cache, start = self.head_cache, None
                # The window is worked out only where it decides: a full cache may
                # make room (the leading ones moved on), an empty one that fell
                # behind may start again here. Never for what cannot be added.
                fits = chunk.nbytes <= cache.max_bytes and not (len(cache) and cache.behind)
                full = cache.bytes + chunk.nbytes > cache.max_bytes
                if fits and (full or (cache.behind and not len(cache))):
                    start = self._trim_head_cache(chunk.end_offset)
                cache.append(chunk, start)
            if not subscriptions:  # an address with none: routed nowhere (as Artemis)
                self.log.ack(np.arange(chunk.first_offset, chunk.end_offset, dtype=np.int64))

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

    async def _scrub_loop(self) -> None:
        """The background scrub, in steps of ``SCRUB_STEP_SECONDS``' worth of its rate:
        each step reads on the event loop, so one step a second held sends and fetches
        for tens of milliseconds (a delivery latency spike every second). A pass starts
        at most every ``SCRUB_PASS_SECONDS``."""
        loop = asyncio.get_running_loop()
        started = loop.time()  # the current pass's start
        while True:
            await asyncio.sleep(SCRUB_STEP_SECONDS)
            passes = self.log.scrub_passes
            self._scrub(SCRUB_STEP_SECONDS)
            if self.log.scrub_passes != passes:  # a pass ended: the next one waits
                await asyncio.sleep(max(0.0, started + SCRUB_PASS_SECONDS - loop.time()))
                started = loop.time()

    def _scrub(self, seconds: float) -> None:
        """Verify the CRCs of about ``scrub_bytes_per_second * seconds`` stored bytes, so
        that rot is found (and quarantined) before a consumer needs the data."""
        rate = self.broker.scrub_bytes_per_second
        if not self.config.durable or rate <= 0:
            return
        # A step reads at least one whole record, which may be far over its share (a
        # 1 MiB producer batch against 200 KiB): the overshoot is a debt that later
        # steps pay by reading nothing, so the average stays at the rate. Unused share
        # does not pile up (an idle queue's next step is no bigger than any other).
        share = rate * seconds
        self._scrub_credit = min(self._scrub_credit + share, share)
        if self._scrub_credit <= 0:
            return
        try:
            self._scrub_credit -= self.log.scrub_step(max(1, int(self._scrub_credit)))
        except StorageError as exc:  # unreadable now; counted by the log, tried again
            log.warning("queue %r: scrub: %s", self.name, exc)
        self.forget_damaged()

    def forget_damaged(self) -> None:
        """Take offsets the log found damaged out of delivery: nobody holds or waits for
        them any more (they are counted in ``damaged_messages``)."""
        damaged = self.log.drain_damaged()
        if len(damaged):
            if self._subscription_acks is not None:
                self._subscription_acks.ack_everywhere(damaged)
            for sub in self.all_subscriptions():
                sub.forget(damaged)

    def housekeeping(self) -> None:
        """Trim the HeadQueueCache to what is undelivered and refill it from the log;
        flow transient messages to disk while they are over their memory limit."""
        if self.log.memory_limit is not None and self.log.transient_bytes > self.log.memory_limit:
            self.log.flow_to_disk(self.log.memory_limit)
        for sub in self.all_subscriptions():
            sub.housekeeping()
        self.forget_damaged()
        if self.config.durable:
            self._apply_memory_limits()  # consumers came or went: the cache's bound moves
            self._cache_housekeeping()

    def _trim_head_cache(self, newest: int | None = None, keep: int | None = None) -> int:
        """Drop what the HeadQueueCache holds below its window (see
        ``HeadQueueCache.window_start``; ``newest``: one past a batch to add), but not
        from ``keep`` on (a delivery under way); returns where it now starts."""
        end = self.log.next_offset
        # A subscription that delivered everything leads (its head is the log's end).
        heads = [sub.undelivered() for sub in self.all_subscriptions()]
        cache = self.head_cache
        start = cache.window_start(heads, newest=newest)
        start = end if start is None else start
        if keep is not None:
            start = min(start, keep)
        cache.trim(start)
        return start

    def _cache_housekeeping(self, until: int | None = None, keep: int | None = None) -> None:
        """Trim the HeadQueueCache to its window and refill it from the log (up to
        ``until`` only, when given: see ``HeadQueueCache.refill``; ``keep`` as for
        ``_trim_head_cache``)."""
        start = self._trim_head_cache(keep=keep)
        # Around the read cache: the HeadQueueCache keeps what it reads (no message
        # held twice, and bytes_in_memory + head_cache_bytes is a true sum).
        try:
            self.head_cache.refill(
                lambda a, b: self.log.read(a, b, cache=False),
                start,
                self.log.next_offset,
                until,
                self._acked_everywhere,
                # A delivery's need is read whole; housekeeping reads a step a tick.
                step_bytes=None if until is not None else REFILL_STEP_BYTES,
            )
        except StorageError as exc:  # a cache fill is best effort; reads try again
            log.warning("queue %r: HeadQueueCache refill: %s", self.name, exc)

    @property
    def shares_deliveries(self) -> bool:
        """True for a durable address with two subscriptions or more: its deliveries
        are shared batches' rows. A queue's batches are delivered once each: one made
        for each delivery costs the queue actor less than a shared one (a Ray task's
        return is written to the object store off its event loop, a put is not)."""
        return self.config.durable and self.config.address and len(self.subscriptions) > 1

    def _acked_everywhere(self, start: int, end: int) -> bool:
        """True if every offset of [start, end) is acknowledged in the log (by every
        subscription, or lost): no delivery will ask for them."""
        return bool(self.log.is_acked(np.arange(start, end, dtype=np.int64)).all())

    def shared_delivery(self, start: int, end: int) -> list[SharedPart]:
        """As much of [start, end) from ``start`` on as the HeadQueueCache holds, as
        shared parts of its batches (empty when ``start`` is not cached). Where the
        cache fell behind just there it reads ahead first: a deep backlog is then read
        and shared once for every subscription."""
        cache = self.head_cache
        if cache.behind and cache.end < end and (not len(cache) or cache.start <= start):
            # The delivery's offsets are taken already: its subscription's head is past
            # them, but they are what is read ahead for.
            self._cache_housekeeping(until=end, keep=start)
        if not len(cache) or not cache.start <= start < cache.end:
            return []
        return cache.shared(start, min(end, cache.end), SHARED_MIN_ROWS) or []

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
        divides it (bytes); before the governor speaks, ``head_cache_bytes`` stands in.
        The HeadQueueCache holds at most what the consumers can take plus
        ``head_cache_bytes`` (``head_cache_want``), however large the budget."""
        cfg = self.config
        prefetches = [
            target.prefetch
            for sub in self.all_subscriptions()
            for target in sub.area.consumers.values()
        ]
        memory = split_queue_bytes(
            self.memory_budget,
            durable=cfg.durable,
            read_cache_max_bytes=max(cfg.page_max_cache_size, 1) * cfg.page_size_bytes,
            max_size_bytes=cfg.max_size_bytes,
            default_bytes=self.broker.head_cache_bytes,
            head_cache_want=head_cache_want(
                prefetches, self.head_cache.message_bytes, self.broker.head_cache_bytes
            ),
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
        subscriptions = self.all_subscriptions()
        consumers = any(sub.area.consumers for sub in subscriptions)
        active = consumers or counters != self._active_counters
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
            index_bytes=self._index_bytes(),
            active=active,
            delivering=delivering,
            max_size_bytes=self.config.max_size_bytes,
            transient_bytes=transient,
            shared_groups=tuple(
                tuple(sub.area.consumers) for sub in subscriptions if self.shares_deliveries
            ),
        )

    def _index_bytes(self) -> int:
        subscriptions = self.all_subscriptions()
        acks = self._subscription_acks
        ranges = 0 if acks is None else sum(r.nbytes for r in acks.acked.values())
        return self.log.index_bytes + ranges + sum(s.area.index_bytes for s in subscriptions)

    # -- subscriptions -----------------------------------------------------------------

    def subscription(self, name: str | None = None) -> Subscription:
        """A queue's own subscription (``name`` None), or an address's by name;
        ``SubscriptionNotFound`` names the address and lists what exists."""
        if not self.config.address:
            if name:
                raise SubscriptionNotFound(f"{self.name!r} is a queue, not an address")
            return self._own
        sub = self.subscriptions.get(name) if name else None
        if sub is None:
            known = ", ".join(sorted(self.subscriptions)) or "none"
            raise SubscriptionNotFound(
                f"address {self.name!r} has no subscription {name!r} (it has: {known})"
            )
        return sub

    @property
    def area(self):
        """A queue's TargetArea (its own subscription's)."""
        return self.subscription().area

    def all_subscriptions(self) -> list[Subscription]:
        """The queue's own subscription, or every subscription of the address."""
        return list(self.subscriptions.values()) if self.config.address else [self._own]

    def _wake_consumers(self) -> None:
        for sub in self.all_subscriptions():
            sub.wake()

    def count(self, counter: str, n: int) -> None:
        """Add ``n`` to one of the queue's counters ("out", "acked", "bytes_out")."""
        self._counters[counter] += n

    async def flush_acks(self) -> None:
        """Return once the acks applied so far are durable (the next group commit)."""
        fut = asyncio.get_running_loop().create_future()
        self._ack_waiters.append(fut)
        self._kick.set()
        await fut

    # -- consuming (see Subscription) ------------------------------------------------

    def register_consumer(
        self,
        consumer_id: str,
        prefetch: int,
        selector: str | None = None,
        watch: object = None,
        *,
        subscription: str | None = None,
    ) -> None:
        """Register a consumer with its prefetch, selector and liveness watch."""
        self.subscription(subscription).register_consumer(consumer_id, prefetch, selector, watch)

    async def fetch(
        self,
        consumer_id: str,
        max_messages: int,
        timeout: float,
        prefetch: int,
        selector: str | None = None,
        *,
        subscription: str | None = None,
    ) -> pa.RecordBatch:
        """Deliver up to ``max_messages``, waiting up to ``timeout`` seconds for some."""
        sub = self.subscription(subscription)
        return await sub.fetch(consumer_id, max_messages, timeout, prefetch, selector)

    async def fetch_delivery(
        self,
        consumer_id: str,
        max_messages: int,
        timeout: float,
        prefetch: int,
        selector: str | None = None,
        *,
        subscription: str | None = None,
    ) -> Delivery:
        """``fetch`` as a ``Delivery`` (shared batches' rows where it can)."""
        if self.replication is not None:
            self.replication.check_leading()  # its consumers go to the new leader
        sub = self.subscription(subscription)
        return await sub.fetch_delivery(consumer_id, max_messages, timeout, prefetch, selector)

    def browse(
        self,
        start: int,
        max_messages: int,
        selector: str | None = None,
        *,
        subscription: str | None = None,
    ) -> tuple[pa.RecordBatch, int]:
        """Unacknowledged messages from ``start`` on, changing nothing; and where to go on."""
        return self.subscription(subscription).browse(start, max_messages, selector)

    async def ack(
        self, consumer_id: str, offsets: np.ndarray, *, subscription: str | None = None
    ) -> int:
        """Acknowledge offsets; returns once the acks are durable (for a durable queue)."""
        return await self.subscription(subscription).ack(consumer_id, offsets)

    async def ack_acceptable(
        self, consumer_id: str, offsets: np.ndarray, *, subscription: str | None = None
    ) -> tuple[int, str]:
        """``ack`` of the offsets the consumer may ack, the others left alone; returns
        (how many were newly acked, the refusal of the others: "" if none)."""
        return await self.subscription(subscription).ack_acceptable(consumer_id, offsets)

    def nack(
        self, consumer_id: str, offsets: np.ndarray, *, subscription: str | None = None
    ) -> int:
        """Release offsets for redelivery with their delivery count raised."""
        return self.subscription(subscription).nack(consumer_id, offsets)

    def give_back(
        self, consumer_id: str, offsets: np.ndarray, *, subscription: str | None = None
    ) -> int:
        """Release held offsets the application never received (delivery not counted)."""
        return self.subscription(subscription).give_back(consumer_id, offsets)

    def close_consumer(
        self,
        consumer_id: str,
        not_received: np.ndarray | None = None,
        *,
        subscription: str | None = None,
    ) -> int:
        """Remove a consumer; what it held is delivered again (``not_received`` uncounted)."""
        return self.subscription(subscription).close_consumer(consumer_id, not_received)

    def reject(
        self, consumer_id: str, offsets: np.ndarray, *, subscription: str | None = None
    ) -> int:
        """Dead-letter messages the consumer holds instead of delivering them again."""
        return self.subscription(subscription).reject(consumer_id, offsets)

    def consumer_stats(self, consumer_id: str, *, subscription: str | None = None) -> dict:
        """The queue side of one consumer's TargetList (counts in messages, bytes)."""
        return self.subscription(subscription).consumer_stats(consumer_id)

    def silent_consumers(self, seconds: float) -> list[tuple[str, object, str | None]]:
        """(consumer id, watch, subscription) of consumers not heard from for ``seconds``."""
        return [
            (cid, watch, sub.subscription_name)
            for sub in self.all_subscriptions()
            for cid, watch in sub.silent_consumers(seconds)
        ]

    def heard_from(self, consumer_id: str, *, subscription: str | None = None) -> None:
        """Note that a consumer showed it is alive."""
        self.subscription(subscription).heard_from(consumer_id)

    # -- statistics ------------------------------------------------------------------

    def stats(self, subscription: str | None = None) -> QueueStats:
        """A snapshot of depth, memory, disk, consumers and rates: of the queue (or the
        address as a whole: its depth counts what some subscription still needs), or
        of one subscription of an address (its own depth, deliveries and caches)."""
        now = time.monotonic()
        t0, c0 = self._samples[0]
        span = max(now - t0, 1e-6)
        subs = self.all_subscriptions()
        c, c0 = dict(self._counters), dict(c0)
        name, depth, dead_letter_queue = self.name, self.log.depth, self.config.dead_letter_address
        if subscription is not None:
            sub = self.subscription(subscription)
            subs = [sub]
            c.update(sub.counters)
            # A subscription's rates: averages since the actor started.
            c0.update({k: 0 for k in sub.counters})
            span = max(now - self._started_at, 1e-6)
            name, depth, dead_letter_queue = sub.name, sub.log.depth, sub.dead_letter_address
        replicas = self.replication.statuses() if self.replication else []
        return QueueStats(
            name=name,
            durable=self.config.durable,
            depth=depth,
            in_flight=sum(s.area.in_flight for s in subs),
            next_offset=self.log.next_offset,
            consumers=sum(len(s.area.consumers) for s in subs),
            bytes_in_memory=self.log.bytes_in_memory,
            bytes_on_disk=self.log.bytes_on_disk,
            segment_files=self.log.segment_files,
            messages_in=c["in"],
            messages_out=c["out"],
            messages_acked=c["acked"],
            messages_redelivered=sum(s.area.redelivered_total for s in subs),
            stale_acks=sum(s.area.stale_acks for s in subs),
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
            head_cache_bytes=self.head_cache.bytes,  # one, shared by the subscriptions
            head_cache_messages=self.head_cache.messages,
            head_cache_hits=sum(s.head_cache_hits for s in subs),
            head_cache_misses=sum(s.head_cache_misses for s in subs),
            head_cache_shared_batches=self.head_cache.shared_batches,
            read_cache_hits=self.log.cache_hits,
            read_cache_misses=self.log.cache_misses,
            read_cache_bytes=self.log.read_cache_used,
            bytes_queued=self.log.bytes_queued,
            index_bytes=self._index_bytes(),
            transient_bytes_in_memory=self.log.transient_bytes,
            memory_budget=-1 if self.memory_budget is None else self.memory_budget,
            flowing_to_disk=self.log.flowing,
            messages_flowed_to_disk=self.log.flowed_messages,
            messages_dropped=self._dropped,
            messages_dead_lettered=sum(s.dead_lettered for s in subs),
            dead_letters_pending=sum(len(s.area.dead_letters) for s in subs),
            dead_letter_queue=dead_letter_queue,
            dead_letter_failures=sum(s.dead_letter_failures for s in subs),
            blocked_producers=len(self._blocked),
            blocked_seconds=max((now - t for t in self._blocked.values()), default=0.0),
            blocked_reason=self._full_message(0) if self._blocked else "",
            task_restarts=self._tasks.restarts,
            last_task_error=self._tasks.last_error,
            internal_errors=self._internal_errors,
            replicas=[r.to_dict() for r in replicas],
            unreplicated_commits=self.replication.failed_commits if self.replication else 0,
            replicas_in_sync=sum(r.in_sync for r in replicas) if replicas else 1,
            replica_lag_messages=max((r.lag_messages for r in replicas), default=0),
            group_commits=self._group_commits,
        )

    # -- an address's subscriptions come and go ----------------------------------------

    async def create_subscription(
        self,
        name: str,
        *,
        filter: str | None = None,
        start: str = "latest",
        max_delivery_attempts: int | None = None,
        dead_letter_queue: str | None = None,
    ) -> SubscriptionSpec:
        """Bind a subscription to this address; returns its definition once durable.

        ``filter``: a selector; only the messages it selects are routed to the
        subscription. ``start``: ``"latest"`` (from the next message sent) or
        ``"earliest"`` (from the oldest the address still stores). Idempotent with the
        same settings; ``SubscriptionExists`` with others.
        """
        spec = self._new_spec(name, filter, start, max_delivery_attempts, dead_letter_queue)
        existing = self._existing_subscription(spec)
        if existing is not None:
            return existing
        # A filter over what is stored (start="earliest"): routed step by step, the
        # actor serving everything else in between, in a set of its own that no ack
        # record or checkpoint holds until the file lists the subscription.
        initial, routed_to = None, spec.start_offset
        if spec.filter is not None and spec.start_offset < self.log.next_offset:
            initial = self._subscription_acks.starting_set(spec.start_offset)
            routed_to = await self._route_backlog(initial, Selector(spec.filter), routed_to)
            existing = self._existing_subscription(spec)  # made meanwhile by another call
            if existing is not None:
                return existing
            spec = replace(spec, id=self._manifest.next_id)
        manifest = Manifest({**self._manifest.subscriptions, name: spec}, spec.id + 1)
        # Routed before it exists on disk (a read that fails leaves nothing behind), and
        # with nothing awaited until it is in the file: nothing may publish in between.
        self._subscription_acks.create(spec.id, spec.start_offset, initial)
        sub = self._subscription_of(spec)
        try:
            sub.route_again(routed_to)  # what was published during the steps, if any
            self._write_manifest(manifest)
        except BaseException:
            self._subscription_acks.remove(spec.id)
            raise
        self.subscriptions[name] = sub
        if self._kick is not None:
            sub.start()
        self._apply_memory_limits()
        if self.config.durable:
            await self.flush_acks()  # its starting set
        log.info("address %r: subscription %r created (%s)", self.name, name, start)
        return spec

    def _existing_subscription(self, spec: SubscriptionSpec) -> SubscriptionSpec | None:
        """The subscription named as ``spec`` if it exists with its settings (None if
        there is none); ``SubscriptionExists`` if it has others."""
        existing = self._manifest.subscriptions.get(spec.name)
        if existing is None:
            return None
        if replace(existing, id=spec.id, start_offset=spec.start_offset) != spec:
            raise SubscriptionExists(
                f"address {self.name!r} has a subscription {spec.name!r} with other settings:"
                f" {existing}"
            )
        return existing

    async def _route_backlog(self, acked: AckRanges, selector: Selector, start: int) -> int:
        """Add to ``acked`` the stored messages from ``start`` on that ``selector`` does
        not select, ``ROUTE_STEP_MESSAGES`` at a time with the event loop free between
        steps; returns the offset it routed up to (the log's end when it returned)."""
        area = TargetArea(self.log, self.name)  # reads properties for the selector
        pos = start
        while True:
            end = self.log.next_offset
            got = acked.gaps(pos, end, ROUTE_STEP_MESSAGES)
            if not len(got):
                return end
            pos = int(got[-1]) + 1
            got = got[~self.log.is_acked(got)]  # gone meanwhile: nothing to route
            if len(got):
                acked.add(got[~area.select(selector, got)])
            await asyncio.sleep(0)

    def _new_spec(
        self,
        name: str,
        filter: str | None,
        start: str,
        max_delivery_attempts: int | None,
        dead_letter_queue: str | None,
    ) -> SubscriptionSpec:
        """A new subscription's definition, every setting checked (typed errors)."""
        if not self.config.address:
            raise InvalidSetting(f"{self.name!r} is a queue, not an address: no subscriptions")
        validate_queue_name(name)
        if start not in ("earliest", "latest"):
            raise InvalidSetting(
                f"start={start!r} for subscription {name!r} of address {self.name!r}"
                " is not 'earliest' or 'latest'"
            )
        if filter is not None:
            Selector(filter)  # SelectorError if malformed
        if max_delivery_attempts is not None:
            check_int("max_delivery_attempts", max_delivery_attempts, minimum=1)
        validate_queue_name(dead_letter_queue or f"{self.name}.{name}.DLQ")
        return SubscriptionSpec(
            name=name,
            id=self._manifest.next_id,
            filter=filter,
            start_offset=0 if start == "earliest" else self.log.next_offset,
            max_delivery_attempts=max_delivery_attempts,
            dead_letter_queue=dead_letter_queue,
        )

    async def delete_subscription(self, name: str) -> None:
        """Unbind a subscription: its consumers are closed, and what every other
        subscription has acknowledged is acknowledged in the address (segments go)."""
        sub = self.subscription(name)
        left = {n: s for n, s in self._manifest.subscriptions.items() if n != name}
        self._write_manifest(Manifest(left, self._manifest.next_id))
        del self.subscriptions[name]
        sub.close()
        self._subscription_acks.remove(sub.sid)
        self._apply_memory_limits()
        self.signal_freed()
        if self.config.durable:
            await self.flush_acks()
        log.info("address %r: subscription %r deleted", self.name, name)

    def list_subscriptions(self) -> list[SubscriptionSpec]:
        """The address's subscriptions, in the order they were created."""
        return list(self._manifest.subscriptions.values())

    def _write_manifest(self, manifest: Manifest) -> None:
        try:
            write_manifest(self.directory, manifest)
        except OSError as exc:
            path = os.path.join(self.directory, MANIFEST_NAME)
            raise storage_error(self.name, "writing the subscriptions file", path, exc) from exc
        self._manifest = manifest

    def subscription_depths(self) -> dict[str, int]:
        """Each subscription's depth (its lag: messages it has not acknowledged)."""
        return {name: sub.log.depth for name, sub in self.subscriptions.items()}


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
