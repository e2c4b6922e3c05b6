"""QueueStats: the frozen statistics record of one queue (Trio's ``statistics()``), and
the groups of its fields that each part of the queue reports.

``QueueCore.stats`` assembles one from the log, the HeadQueueCache, the subscriptions,
the replication leader and its own counters; each ``*_fields`` function here reads one
of those parts and returns its fields as a dict of ``QueueStats`` keyword arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from raymq.core.head_cache import HeadQueueCache
from raymq.core.replication import ReplicationLeader
from raymq.core.subscription import Subscription
from raymq.storage import SegmentLog


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
    #: Sends not stored because a message with their id was stored within
    #: ``dedup_window_s`` (answered with its offset), and the ids remembered.
    duplicates_dropped: int = 0
    duplicate_ids: int = 0
    #: Nacked messages waiting out a redelivery delay (``Consumer.nack(delay=)``).
    delayed_messages: int = 0
    #: Messages whose ``RayMQExpiration`` passed before delivery: moved to
    #: ``expiry_queue`` ("" : none, they were dropped); see ``raymq.core.expiry``.
    messages_expired: int = 0
    expiry_queue: str = ""
    #: Messages set aside until their delivery time (``send(deliver_at=)``) that the
    #: queue has found: after a restart, those its pass or its consumers met so far.
    scheduled: int = 0
    #: The queue's ``max_priority`` (0: none), and its unacknowledged messages of a
    #: priority above 0 that it has found (``raymq.core.priority``).
    max_priority: int = 0
    prioritized: int = 0
    #: An address that retains (``retention_s``, ``retention_bytes``): messages every
    #: subscription acknowledged that it keeps for replay, and those whose segment it
    #: let go since it started (``raymq.storage.retention``).
    retained: int = 0
    retention_deleted: int = 0

    def to_dict(self) -> dict:
        """The snapshot as a plain dict."""
        return asdict(self)


def counter_fields(counters: dict[str, int], start: dict[str, int], span: float) -> dict:
    """Message and byte counts (``counters``: "in", "out", "acked", "bytes_in",
    "bytes_out"), and rates per second since ``start``'s counts, ``span`` seconds ago."""
    return {
        "messages_in": counters["in"],
        "messages_out": counters["out"],
        "messages_acked": counters["acked"],
        "bytes_in": counters["bytes_in"],
        "bytes_out": counters["bytes_out"],
        "in_rate": (counters["in"] - start["in"]) / span,
        "out_rate": (counters["out"] - start["out"]) / span,
        "ack_rate": (counters["acked"] - start["acked"]) / span,
    }


def subscription_fields(subs: Sequence[Subscription]) -> dict:
    """Deliveries, consumers, HeadQueueCache hits and dead letters, summed over
    ``subs`` (the queue's own subscription, an address's, or one of them)."""
    return {
        "in_flight": sum(s.area.in_flight for s in subs),
        "consumers": sum(len(s.area.consumers) for s in subs),
        "messages_redelivered": sum(s.area.redelivered_total for s in subs),
        "stale_acks": sum(s.area.stale_acks for s in subs),
        "head_cache_hits": sum(s.head_cache_hits for s in subs),
        "head_cache_misses": sum(s.head_cache_misses for s in subs),
        "messages_dead_lettered": sum(s.dead_lettered for s in subs),
        "dead_letters_pending": sum(len(s.area.dead_letters) for s in subs),
        "dead_letter_failures": sum(s.dead_letter_failures for s in subs),
        "messages_expired": sum(s.messages_expired for s in subs),
        "scheduled": sum(s.area.scheduled.count for s in subs),
        "prioritized": sum(s.area.priorities.count for s in subs if s.area.priorities),
    }


def storage_fields(log: SegmentLog, head_cache: HeadQueueCache) -> dict:
    """The log's sizes, damage, scrub and read cache, and the HeadQueueCache's size (one
    for a queue or a whole address; sizes in bytes)."""
    return {
        "next_offset": log.next_offset,
        "bytes_in_memory": log.bytes_in_memory,
        "bytes_on_disk": log.bytes_on_disk,
        "segment_files": log.segment_files,
        "damaged_messages": log.damaged_messages,
        "storage_errors": log.storage_errors,
        "writable": log.writable,
        "scrubbed_bytes": log.scrubbed_bytes,
        "head_cache_bytes": head_cache.bytes,
        "head_cache_messages": head_cache.messages,
        "head_cache_shared_batches": head_cache.shared_batches,
        "read_cache_hits": log.cache_hits,
        "read_cache_misses": log.cache_misses,
        "read_cache_bytes": log.read_cache_used,
        "bytes_queued": log.bytes_queued,
        "transient_bytes_in_memory": log.transient_bytes,
        "flowing_to_disk": log.flowing,
        "messages_flowed_to_disk": log.flowed_messages,
    }


def replica_fields(replication: ReplicationLeader | None) -> dict:
    """A replicated queue's replicas, those in sync and the largest lag (messages);
    what an unreplicated queue reports otherwise."""
    replicas = replication.statuses() if replication else []
    return {
        "replicas": [r.to_dict() for r in replicas],
        "unreplicated_commits": replication.failed_commits if replication else 0,
        "replicas_in_sync": sum(r.in_sync for r in replicas) if replicas else 1,
        "replica_lag_messages": max((r.lag_messages for r in replicas), default=0),
    }


__all__ = [
    "QueueStats",
    "counter_fields",
    "replica_fields",
    "storage_fields",
    "subscription_fields",
]
