"""A queue's memory: its HeadQueueCache kept to its window, and the MemoryGovernor's
budget divided between the HeadQueueCache, the read cache and transient messages.

``QueueMemory`` is a part of ``QueueCore`` (``raymq.core.queue``), written apart so
that each file has one job: what the queue keeps in memory, and how much.
"""

from __future__ import annotations

import logging

import numpy as np

from raymq.config import BrokerConfig, QueueConfig
from raymq.core.budget import QueueUsage, head_cache_want, split_queue_bytes
from raymq.core.head_cache import REFILL_STEP_BYTES, HeadQueueCache, SharedPart
from raymq.errors import StorageError
from raymq.storage import SegmentLog
from raymq.storage.subscriptions import SubscriptionAcks

log = logging.getLogger("raymq.queue")

#: Fewest rows per shared batch, on average, for a delivery to be shared: single sends
#: make batches of one message, and a put and a reference each would cost more than one
#: batch made for the delivery.
SHARED_MIN_ROWS = 64


class QueueMemory:
    """The memory side of ``QueueCore`` (a base class of it: the attributes below are
    ``QueueCore``'s)."""

    name: str
    config: QueueConfig
    broker: BrokerConfig
    log: SegmentLog
    head_cache: HeadQueueCache
    memory_budget: int | None
    _counters: dict[str, int]
    _active_counters: tuple[int, int, int]
    _peak_transient: int
    _subscription_acks: SubscriptionAcks | None

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
        if self._subscription_acks is not None:  # (retained ones are not acked in the log)
            return self._subscription_acks.acked_by_all(start, end)
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
        acks = self._subscription_acks
        # What an address only retains (for replay) is not what it needs: not sized.
        retained = 0 if acks is None else acks.retained()[1]
        return QueueUsage(
            name=self.name,
            node_id=node_id,
            size_bytes=max(0, self.log.bytes_queued - retained),
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
