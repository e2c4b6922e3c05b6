"""QueueCore: one queue's behaviour, as plain asyncio code without Ray.

It owns the SegmentLog (the QueueArea), its HeadQueueCache and the TargetArea (the queue
side of every consumer's TargetList), admits sends (``admission``), runs the group-commit
writer (``group_commit``), matches arriving messages against selectors and long-polls
for consumers. The Ray actor in
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

import numpy as np
import pyarrow as pa

from raymq.batch import MessageBatch
from raymq.config import BrokerConfig, QueueConfig, check_delay
from raymq.core.address import (
    address_subscription,
)
from raymq.core.admission import Admission, batch_cost, check_batch
from raymq.core.duplicate_ids import DuplicateIDCache
from raymq.core.expiry import expiration_ms, with_expiration
from raymq.core.group_commit import GroupCommit
from raymq.core.head_cache import HeadQueueCache
from raymq.core.queue_address import AddressPart
from raymq.core.queue_memory import QueueMemory
from raymq.core.queue_stats import (
    QueueStats,
    counter_fields,
    replica_fields,
    storage_fields,
    subscription_fields,
)
from raymq.core.replication import ReplicationLeader
from raymq.core.scrub_pacer import ScrubPacer
from raymq.core.subscription import Delivery, Subscription
from raymq.core.supervisor import Supervisor
from raymq.errors import SubscriptionNotFound
from raymq.storage import PreparedWrite, RecoveryReport, SegmentLog
from raymq.storage.subscriptions import (
    SubscriptionAcks,
    read_manifest,
)

log = logging.getLogger("raymq.queue")

#: Appends a batch durably to the named dead-letter queue (creating it if needed).
DeadLetterSink = Callable[[str, MessageBatch], Awaitable[None]]


class QueueCore(QueueMemory, AddressPart):
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
        self.log, self.recovery = self._open_log(replication)
        self.dead_letter_sink = dead_letter_sink
        self.replication = replication
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
        self.admission = Admission(self.name, config, self.log)
        self._active_counters = (0, 0, 0)
        self._peak_transient = 0  # most bytes of messages held since the governor asked
        self._tasks = Supervisor(f"queue {config.name!r}", log)
        self.commits = GroupCommit(self)
        self._counters = {"in": 0, "out": 0, "acked": 0, "bytes_in": 0, "bytes_out": 0}
        self.scrubber = ScrubPacer(self.log, config, broker)
        self._samples: list[tuple[float, dict[str, int]]] = [
            (time.monotonic(), dict(self._counters))
        ]
        self._closed = False
        self._started_at = time.monotonic()
        self.duplicate_ids = self._remembered_ids()
        self._delays_moved = asyncio.Event()
        #: Messages whose segment the retention let go (an address that retains).
        self.retention_deleted = 0
        self._delays_after_restart()
        #: Ids of sends being stored now: a duplicate arriving meanwhile awaits the
        #: first one's answer (its offset) instead of storing a second copy.
        self._storing_ids: dict[str, asyncio.Future] = {}

    def _remembered_ids(self) -> DuplicateIDCache:
        """The producer ids stored within the window, found again after a restart (the
        checkpoint's and the live segments'); every checkpoint carries them from now on."""
        cache = DuplicateIDCache(self.config.dedup_window_s, self.config.id_cache_size)
        if not cache.enabled:
            return cache
        kept = cache.restore(self.log.recovered_duplicate_ids)
        if kept:
            log.info("queue %r: %d producer ids remembered from before a restart", self.name, kept)
        self.log.checkpoint_duplicate_ids(cache)
        return cache

    def _open_log(self, replication: ReplicationLeader | None) -> tuple[SegmentLog, RecoveryReport]:
        """Open (and recover) the queue's files; a leader's log keeps the names of the
        files it deletes, for its followers."""
        cfg = self.config
        opened, recovery = SegmentLog.open(
            self.directory,
            queue=cfg.name,
            page_size_bytes=cfg.page_size_bytes,
            durable=cfg.durable,
            read_cache_bytes=max(cfg.page_max_cache_size, 1) * cfg.page_size_bytes,
            # The producer ids stored within the window (see ``_remembered_ids``).
            ids_since_us=int((time.time() - cfg.dedup_window_s) * 1e6)
            if cfg.dedup_window_s > 0 and cfg.id_cache_size > 0
            else None,
        )
        if replication is not None:
            opened.keep_deleted_names()
            replication.bind(
                opened.published_sizes, lambda: opened.next_offset, lambda: opened.records_end
            )
        return opened, recovery

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
        acks = self._subscription_acks = SubscriptionAcks(self.log, retains=cfg.retains)
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
            self.subscriptions[spec.name] = address_subscription(
                self, self.log, self._subscription_acks, spec
            )
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

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Start the writer and housekeeping tasks on the running event loop."""
        self.commits.start()
        self.admission.start()
        self._tasks.spawn("writer", self.commits.run)
        self._tasks.spawn("housekeeping", self._tick_loop)
        self._tasks.spawn("scrub", self._scrub_loop)
        self._tasks.spawn("delays", self._delay_loop)
        for sub in self.all_subscriptions():
            sub.start()

    def busy(self) -> bool:
        """True if closing this queue now (to hibernate it) could cost a client more than
        a delay: consumers registered, sends admitted or blocked and not yet published,
        a commit under way, acks not yet durable, deliveries not acknowledged, dead
        letters waiting, delivery counts that only this process remembers (they would
        start again from 0: ``max_delivery_attempts`` never reached), or a transient
        queue holding messages (its files are emptied when it starts again)."""
        admission = self.admission
        if self.commits.busy or admission.reserved or admission.blocked:
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
        # A commit under way took its sends out of ``pending``: the flush queued behind
        # it waits for it too (cancelling it would fail sends it may have written). One
        # flush, not a loop: acks whose write failed stay pending (retried by later
        # commits), and a close must not wait for a disk to heal.
        if self.commits.busy or self.log.has_pending_acks:
            await self.commits.flush()
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
        check_batch(batch, self.broker.max_message_size, self.name)
        if self.config.default_ttl_s is not None and len(batch):
            expires = expiration_ms(self.config.default_ttl_s, time.time())
            batch = with_expiration(batch, expires, keep_existing=True)
        if self.replication is not None:
            self.replication.require_quorum()  # refused before anything is stored
        if len(batch) == 0:
            return self.log.next_offset, 0
        batch = await self.admission.admit(batch, timeout)
        if len(batch) == 0:
            return self.log.next_offset, 0
        cost = batch_cost(batch)
        self.admission.reserved += cost
        try:
            return await self.commits.submit(batch), len(batch)
        finally:
            self.admission.reserved -= cost

    async def send_batch_ids(
        self, batch: MessageBatch, ids: list[str | None], timeout: float | None = None
    ) -> list[int | None]:
        """``send_batch`` of messages with producer ids (``ids[i]`` is message i's,
        carried as its ``_AMQ_DUPL_ID`` property; None: none): a message whose id was
        stored within ``dedup_window_s`` (or is being stored) is not stored again.
        Returns each message's offset (a duplicate's: the first one's), None for one
        the DROP policy dropped."""
        cache = self.duplicate_ids
        if not cache.enabled:
            first, count = await self.send_batch(batch, timeout)
            return [first + i if i < count else None for i in range(len(batch))]
        answers: list[int | None] = [None] * len(batch)
        keep: list[int] = []
        waits: list[tuple[int, asyncio.Future]] = []
        mine: dict[str, int] = {}  # ids of this batch to store, by index
        for i, mid in enumerate(ids):
            if mid is None:
                keep.append(i)
            elif (offset := cache.lookup(mid)) is not None:
                answers[i] = offset
                cache.duplicates_dropped += 1
            elif mid in self._storing_ids:  # by another send, or earlier in this batch
                waits.append((i, self._storing_ids[mid]))
            else:
                mine[mid] = i
                keep.append(i)
                self._storing_ids[mid] = asyncio.get_running_loop().create_future()
        futures = {mid: self._storing_ids[mid] for mid in mine}
        token = cache.storing(self.log.planned_next)
        try:
            if keep:
                part = batch if len(keep) == len(batch) else batch.take(keep)
                first, count = await self.send_batch(part, timeout)
                for k, i in enumerate(keep[:count]):
                    answers[i] = first + k
                now = cache.clock()
                for mid, i in mine.items():
                    if answers[i] is not None:
                        cache.remember(mid, answers[i], now)
            for mid, i in mine.items():
                futures[mid].set_result(answers[i])
        except BaseException as exc:
            for fut in futures.values():
                if not fut.done():
                    fut.set_exception(exc)
                    fut.exception()  # retrieved: a waiter may not be there to see it
            raise
        finally:
            cache.stored(token)
            for mid in mine:
                if self._storing_ids.get(mid) is futures[mid]:
                    del self._storing_ids[mid]
        for i, fut in waits:
            answers[i] = await asyncio.shield(fut)
            if answers[i] is not None:
                cache.duplicates_dropped += 1
        return answers

    def signal_freed(self) -> None:
        """Wake producers blocked on ``max_size_bytes`` (acks freed room)."""
        self.admission.signal_freed()

    async def after_commit(self, prepared: PreparedWrite) -> None:
        """After a durable commit: route the new messages and match them against
        selectors, fill the HeadQueueCache, then unlink deleted files.

        The commit is published already (fetches see its offsets): nothing may be
        awaited before each subscription's filter has routed them, or a fetch running
        meanwhile takes messages its filter rejects (found by ``bench.chaos``)."""
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
                nowhere = np.arange(chunk.first_offset, chunk.end_offset, dtype=np.int64)
                self._subscription_acks.release(nowhere)  # (kept if it retains)
        if self.log.unlinkable:  # off the event loop; done before the acks return
            await asyncio.to_thread(self.log.unlink_deleted)

    async def _tick_loop(self) -> None:
        """Housekeeping: checkpoint an idle queue, sample rates, trim and refill the
        HeadQueueCache, drop stale CacheReferences (once a second)."""
        while True:
            await asyncio.sleep(min(1.0, self.broker.checkpoint_interval))
            now = time.monotonic()
            self._samples.append((now, dict(self._counters)))
            self._samples = [s for s in self._samples if now - s[0] <= 10.0]
            if self.commits.dirty_since_checkpoint or self.log.has_pending_acks:
                self.commits.wake()  # checkpoint an idle queue; retry acks that failed
            self.housekeeping()

    async def _scrub_loop(self) -> None:
        """The background scrub (``ScrubPacer.run``)."""
        await self.scrubber.run(self._scrub)

    def _scrub(self, seconds: float) -> None:
        """Verify the CRCs of about ``scrub_bytes_per_second * seconds`` stored bytes, and
        take what was found damaged out of delivery."""
        if self.scrubber.step(seconds):
            self.forget_damaged()

    def found_damaged(self) -> np.ndarray:
        """Offsets the log found damaged that ``forget_damaged`` has not released yet."""
        return self.log.found_damaged()

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
        if self.config.retains:
            self._apply_retention()
        if self.config.durable:
            self._apply_memory_limits()  # consumers came or went: the cache's bound moves
            self._cache_housekeeping()

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

    def commit_done(self, stored_messages: bool) -> None:
        """After a group commit was answered: note a transient queue's peak size, and
        wake the consumers waiting if it ``stored_messages``."""
        if not self.config.durable:
            self._peak_transient = max(self._peak_transient, self.log.bytes_queued)
        if stored_messages:
            for sub in self.all_subscriptions():
                sub.wake()

    def count(self, counter: str, n: int) -> None:
        """Add ``n`` to one of the queue's counters ("in", "out", "acked", "bytes_in",
        "bytes_out")."""
        self._counters[counter] += n

    async def flush_acks(self) -> None:
        """Return once the acks applied so far are durable (the next group commit)."""
        await self.commits.flush()

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

    async def lease(
        self,
        consumer_id: str,
        max_messages: int,
        selector: str | None = None,
        timeout: float = 0.0,
        *,
        subscription: str | None = None,
    ) -> tuple[np.ndarray, bool]:
        """Hold up to ``max_messages`` for a reader, unread (``Subscription.lease``)."""
        sub = self.subscription(subscription)
        return await sub.lease(consumer_id, max_messages, selector, timeout)

    def read_leased(
        self, consumer_id: str, offsets: np.ndarray, *, subscription: str | None = None
    ) -> pa.RecordBatch:
        """Leased messages as a delivery batch (``Subscription.read_leased``)."""
        return self.subscription(subscription).read_leased(consumer_id, offsets)

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
        self,
        consumer_id: str,
        offsets: np.ndarray,
        *,
        subscription: str | None = None,
        delay: float | None = None,
    ) -> int:
        """Release offsets for redelivery with their delivery count raised, after
        ``delay`` seconds (None: the queue's ``redelivery_delay_s``; 0: at once). A
        durable queue's delays reach its ack log with the next commit (``flush_acks``)."""
        if delay is None:
            delay = self.config.redelivery_delay_s
        check_delay(delay, self.name)
        until = time.time() + delay if delay > 0 else None
        return self.subscription(subscription).nack(consumer_id, offsets, until)

    def delays_moved(self) -> None:
        """A nack with a delay: the delay task looks again at when the next is due."""
        self._delays_moved.set()

    async def _delay_loop(self) -> None:
        """Make nacked messages deliverable again when their delay is over."""
        while True:
            dues = [d for s in self.all_subscriptions() if (d := s.area.next_due()) is not None]
            wait = None if not dues else max(0.0, min(dues) - time.time())
            self._delays_moved.clear()
            if wait is None or wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._delays_moved.wait(), wait)
                continue
            now = time.time()
            for sub in self.all_subscriptions():
                if sub.area.release_due(now):
                    sub.wake()

    def _delays_after_restart(self) -> None:
        """Delivery counts are restored and messages still waiting out a nack's delay
        stay held until it ends; every checkpoint carries both from now on (a queue's:
        an address's subscriptions keep theirs in memory)."""
        if self._own is None:
            return
        area = self._own.area
        if self.config.durable:
            # Delivery counts too, so that a restart gives no message more deliveries
            # than max_delivery_attempts (an address's subscriptions: in memory).
            area.count_durably()
            spent = area.restore_deliveries(self.log.recovered_deliveries)
            if self.log.recovered_deliveries:
                log.info(
                    "queue %r: delivery counts of %d messages restored, %d of them "
                    "delivered max_delivery_attempts times (to the dead-letter queue)",
                    self.name,
                    len(self.log.recovered_deliveries),
                    spent,
                )
        area.hold_delayed({o: due / 1e6 for o, due in self.log.recovered_delays.items()})
        self.log.checkpoint_delays(
            lambda: [(o, round(due * 1e6)) for o, due in sorted(area.delayed.items())]
        )

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

    def expire(
        self, consumer_id: str, offsets: np.ndarray, *, subscription: str | None = None
    ) -> int:
        """Messages the consumer holds that expired before its application received
        them: to the expiry queue, or dropped (``raymq.core.expiry``)."""
        return self.subscription(subscription).expire(consumer_id, offsets)

    async def expiry_pass(self) -> int:
        """One background expiry pass over every subscription now (it also runs every
        ``message_expiry_scan_period_s``); returns the expired messages it found."""
        return sum([await s.expiry_pass() for s in self.all_subscriptions()])

    async def dead_letters_settled(self, subscription: str | None = None) -> None:
        """Return once every dead letter that can move now has moved or been dropped."""
        await self.subscription(subscription).dead_letters_settled()

    def now(self) -> float:
        """Seconds since the epoch, as this module's clock says (the fault simulator
        replaces it)."""
        return time.time()

    def consumer_stats(self, consumer_id: str, *, subscription: str | None = None) -> dict:
        """The queue side of one consumer's TargetList (counts in messages, bytes)."""
        return self.subscription(subscription).consumer_stats(consumer_id)

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
        acks = self._subscription_acks
        retained = 0 if acks is None else acks.retained()[0]
        # An address's depth: what some subscription still needs (not what it retains).
        name, depth = self.name, self.log.depth - retained
        dead_letter_queue = self.config.dead_letter_address
        if subscription is not None:
            sub = self.subscription(subscription)
            subs = [sub]
            c.update(sub.counters)
            # A subscription's rates: averages since the actor started.
            c0.update({k: 0 for k in sub.counters})
            span = max(now - self._started_at, 1e-6)
            name, depth, dead_letter_queue = sub.name, sub.log.depth, sub.dead_letter_address
        admission = self.admission
        return QueueStats(
            name=name,
            durable=self.config.durable,
            depth=depth,
            **counter_fields(c, c0, span),
            **subscription_fields(subs),
            **storage_fields(self.log, self.head_cache),  # one cache, shared by the subscriptions
            **replica_fields(self.replication),
            address_full_policy=self.config.address_full_policy,
            max_size_bytes=self.config.max_size_bytes,
            recovery_seconds=self.recovery.seconds,
            index_bytes=self._index_bytes(),
            memory_budget=-1 if self.memory_budget is None else self.memory_budget,
            messages_dropped=admission.dropped,
            dead_letter_queue=dead_letter_queue,
            blocked_producers=len(admission.blocked),
            blocked_seconds=admission.blocked_seconds(now),
            blocked_reason=admission.full_message(0) if admission.blocked else "",
            task_restarts=self._tasks.restarts,
            last_task_error=self._tasks.last_error,
            internal_errors=self.commits.internal_errors,
            group_commits=self.commits.group_commits,
            duplicates_dropped=self.duplicate_ids.duplicates_dropped,
            duplicate_ids=len(self.duplicate_ids),
            delayed_messages=sum(len(s.area.delayed) for s in subs),
            expiry_queue=self.config.expiry_queue or "",
            max_priority=self.config.max_priority or 0,
            retained=retained,
            retention_deleted=self.retention_deleted,
        )

    # -- an address's subscriptions come and go ----------------------------------------


__all__ = ["QueueCore", "QueueStats"]  # QueueStats: from queue_stats, for importers
