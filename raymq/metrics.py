"""RayMQ's metrics, exported through ``ray.util.metrics`` to each node's Prometheus endpoint.

Ray serves them on every node's ``--metrics-export-port`` (``ray.init(_metrics_export_port=)``)
with a ``ray_`` prefix: ``raymq_queue_depth`` is scraped as ``ray_raymq_queue_depth``. Every
metric carries the tag ``broker`` (the broker's Ray namespace, so two brokers on one
cluster never mix); all but the three broker-wide governor metrics carry ``node`` (a Ray
node id, hex); per-queue metrics add ``queue``, per-consumer ones ``queue`` and
``consumer``. Ray adds its own labels (``SessionName``, ``NodeAddress``, ``WorkerId``, ...).

Who exports what, every ``EXPORT_PERIOD_SECONDS`` (a loop of its own in each actor):

- each queue actor: ``raymq_queue_*`` from its ``QueueStats`` and ``raymq_consumer_lag``,
  ``_held``, ... from the queue side of each consumer (``node`` = the queue's node). Lag
  comes from here, where it is a local count, so no consumer is asked anything remotely;
- each TargetList actor: its levels, ``raymq_consumer_watermark``, ``_high_watermark``,
  ``_direct_bytes``, ``_pending_cache_bytes``, ... (``node`` = the consumer's node);
- the MemoryGovernor: ``raymq_governor_*`` from its last plan.

Cumulative counts (messages in, out, acked, ...) are Gauges holding the running total
since the exporting actor started, not Counters incremented by deltas: the actors keep
exact totals already, so a Gauge set from a snapshot shows exactly what ``stats()`` shows
and needs no bookkeeping of the last value sent; Ray would also rename a Counter
``<name>_total``. An actor restart starts the totals again from 0, which PromQL's
``rate()`` and ``increase()`` take as a counter reset, as they would for a Counter.

Ray's metrics agent forgets a series not recorded for a while (about 20 s, measured with
Ray 2.60 and ``metrics_report_interval_ms=1000``), so exporters set every value every
period, and the series of a closed consumer or a deleted queue disappear by themselves.

Exporting must never break an actor: wrap it in ``with guard("what"):``, which logs a
failure (with its traceback the first time, then once every ``LOG_EVERY`` failures) and
swallows it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("raymq.metrics")

#: How often the actors set their metrics (seconds).
EXPORT_PERIOD_SECONDS = 1.0
#: After the first failure of an exporter, log only every this many failures.
LOG_EVERY = 600

BROKER = ("broker",)
NODE = ("broker", "node")
QUEUE = ("broker", "queue", "node")
CONSUMER = ("broker", "queue", "consumer", "node")


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its name without Ray's ``ray_`` prefix, a description with
    its unit, its tag keys, and the field of the stats snapshot it is read from."""

    name: str
    description: str
    tags: tuple[str, ...]
    field: str


def _specs(prefix: str, tags: tuple[str, ...], rows: list[tuple[str, str, str]]) -> list:
    return [MetricSpec(prefix + name, text, tags, field) for name, field, text in rows]


#: From ``QueueStats`` (``raymq.core.queue``), by each queue actor.
QUEUE_METRICS: list[MetricSpec] = _specs(
    "raymq_queue_",
    QUEUE,
    [
        ("depth", "depth", "Messages stored and not acknowledged (messages)"),
        ("in_flight", "in_flight", "Messages delivered and not acknowledged (messages)"),
        ("consumers", "consumers", "Consumers registered (consumers)"),
        ("messages_in", "messages_in", "Messages stored since the actor started (messages)"),
        ("messages_out", "messages_out", "Messages delivered since the actor started (messages)"),
        ("messages_acked", "messages_acked", "Messages acknowledged since start (messages)"),
        (
            "messages_redelivered",
            "messages_redelivered",
            "Messages delivered again (nack, close, dead consumer) since start (messages)",
        ),
        (
            "stale_acks",
            "stale_acks",
            "Acks of stale copies (delivered by an earlier queue process) dropped (messages)",
        ),
        (
            "messages_dropped",
            "messages_dropped",
            "Messages dropped by address_full_policy=DROP since start (messages)",
        ),
        (
            "messages_dead_lettered",
            "messages_dead_lettered",
            "Messages moved to the dead-letter queue since start (messages)",
        ),
        (
            "messages_expired",
            "messages_expired",
            "Messages expired before delivery (moved to expiry_queue or dropped) (messages)",
        ),
        (
            "dead_letters_pending",
            "dead_letters_pending",
            "Messages waiting to be moved to the dead-letter queue (messages)",
        ),
        (
            "dead_letter_failures",
            "dead_letter_failures",
            "Failed moves to the dead-letter queue, retried, since start (attempts)",
        ),
        (
            "messages_flowed_to_disk",
            "messages_flowed_to_disk",
            "Transient messages written to segment files to free memory, since start (messages)",
        ),
        (
            "bytes_queued",
            "bytes_queued",
            "Unacknowledged messages, memory and disk, as max_size_bytes counts them (bytes)",
        ),
        (
            "max_size_bytes",
            "max_size_bytes",
            "The queue's max_size_bytes setting (bytes; -1: no limit)",
        ),
        (
            "bytes_in_memory",
            "bytes_in_memory",
            "Messages in the actor's memory: transient messages and read cache (bytes)",
        ),
        ("head_cache_bytes", "head_cache_bytes", "HeadQueueCache (bytes)"),
        ("head_cache_messages", "head_cache_messages", "HeadQueueCache (messages)"),
        ("read_cache_bytes", "read_cache_bytes", "Read cache of segment records (bytes)"),
        (
            "transient_bytes_in_memory",
            "transient_bytes_in_memory",
            "Transient (non-durable) messages held in memory (bytes)",
        ),
        (
            "index_bytes",
            "index_bytes",
            "Indexes and per-message metadata in memory (bytes)",
        ),
        ("bytes_on_disk", "bytes_on_disk", "Live segment files (bytes)"),
        ("segment_files", "segment_files", "Live segment files (files)"),
        (
            "memory_budget_bytes",
            "memory_budget",
            "The MemoryGovernor's budget for the actor's caches (bytes; -1: none yet)",
        ),
        (
            "flowing_to_disk",
            "flowing_to_disk",
            "1 while new transient messages flow to disk, else 0",
        ),
        (
            "blocked_producers",
            "blocked_producers",
            "Sends waiting for room under address_full_policy=BLOCK (sends)",
        ),
        (
            "blocked_seconds",
            "blocked_seconds",
            "How long the longest-waiting BLOCKed send has waited (seconds)",
        ),
        (
            "task_restarts",
            "task_restarts",
            "Internal tasks of the queue actor restarted after an error, since start (restarts)",
        ),
        (
            "internal_errors",
            "internal_errors",
            "Errors after durable commits, logged (the sends succeeded), since start (errors)",
        ),
        ("head_cache_hits", "head_cache_hits", "Deliveries from the HeadQueueCache (reads)"),
        ("head_cache_misses", "head_cache_misses", "Deliveries not in it (reads)"),
        (
            "head_cache_shared_batches",
            "head_cache_shared_batches",
            "Cached batches put in the object store once for every delivery of them (batches)",
        ),
        ("read_cache_hits", "read_cache_hits", "Segment reads from the read cache (reads)"),
        ("read_cache_misses", "read_cache_misses", "Segment reads from files (reads)"),
        ("bytes_in", "bytes_in", "Bytes of messages stored since the actor started (bytes)"),
        ("bytes_out", "bytes_out", "Bytes of messages delivered since the actor started (bytes)"),
        (
            "replicas_in_sync",
            "replicas_in_sync",
            "Replicas holding every answered send, the leader included; 1 if not replicated",
        ),
        (
            "replica_lag_messages",
            "replica_lag_messages",
            "Most messages a follower out of sync lacks (messages)",
        ),
        (
            "unreplicated_commits",
            "unreplicated_commits",
            "Commits refused for want of min_insync_replicas, since start (commits)",
        ),
    ],
)

#: From ``QueueCore.consumer_stats`` (the queue side of a consumer), by each queue actor.
CONSUMER_QUEUE_SIDE_METRICS: list[MetricSpec] = _specs(
    "raymq_consumer_",
    CONSUMER,
    [
        (
            "lag",
            "cache_references",
            "Messages the consumer could be given now and has not fetched (messages)",
        ),
        ("held", "held", "Messages delivered to the consumer, not acknowledged (messages)"),
        ("delivered", "delivered", "Messages delivered to it since it registered (messages)"),
        ("acked", "acked", "Messages it acknowledged since it registered (messages)"),
        (
            "cache_reference_bytes",
            "cache_reference_bytes",
            "Bytes of its matching-offsets index (selector consumers) (bytes)",
        ),
        (
            "scan_remaining",
            "scan_remaining",
            "Stored messages still to match for a late selector consumer (messages)",
        ),
    ],
)

#: From ``TargetList.stats`` (``raymq.core.target_list``), by each TargetList actor.
CONSUMER_METRICS: list[MetricSpec] = _specs(
    "raymq_consumer_",
    CONSUMER,
    [
        ("watermark", "watermark", "Messages held as direct references, not taken (messages)"),
        ("high_watermark", "high_watermark", "The eager loader's target (messages)"),
        (
            "high_watermark_bytes",
            "high_watermark_bytes",
            "Direct references allowed, settings and governor budget (bytes)",
        ),
        ("direct_bytes", "direct_bytes", "Direct references to delivery batches (bytes)"),
        ("pending_cache_messages", "pending_cache_messages", "PendingCache (messages)"),
        ("pending_cache_bytes", "pending_cache_bytes", "PendingCache (bytes)"),
        (
            "pending_cache_limit_bytes",
            "pending_cache_limit_bytes",
            "PendingCache allowed, settings and governor budget (bytes)",
        ),
        ("pending_cache_hits", "pending_cache_hits", "Loads from the PendingCache (loads)"),
        ("pending_cache_misses", "pending_cache_misses", "Loads from the queue (loads)"),
        ("handed_out", "handed_out", "Messages handed to the application (messages)"),
    ],
)

#: From the MemoryGovernor's stats and plan (``raymq.core.budget.Plan.to_dict``).
GOVERNOR_METRICS: list[MetricSpec] = [
    MetricSpec(
        "raymq_governor_threshold_bytes",
        "Broker-wide flow-to-disk threshold in effect (bytes)",
        BROKER,
        "threshold",
    ),
    MetricSpec("raymq_governor_rounds", "Rounds run since the governor started", BROKER, "rounds"),
    MetricSpec(
        "raymq_governor_round_seconds",
        "Duration of the last round (seconds)",
        BROKER,
        "round_seconds",
    ),
    MetricSpec(
        "raymq_governor_node_threshold_bytes",
        "The node's part of the threshold (bytes)",
        NODE,
        "node_thresholds",
    ),
    MetricSpec(
        "raymq_governor_node_budgeted_bytes",
        "Sum of the shares of the queues on the node (bytes)",
        NODE,
        "node_totals",
    ),
    MetricSpec(
        "raymq_governor_queue_share_bytes",
        "The queue's whole budget: indexes and all its caches (bytes)",
        QUEUE,
        "share",
    ),
    MetricSpec(
        "raymq_governor_queue_index_bytes",
        "Part of the share for indexes and per-message metadata (bytes)",
        QUEUE,
        "index_bytes",
    ),
    MetricSpec(
        "raymq_governor_queue_cache_bytes",
        "Part of the share for the queue actor: HeadQueueCache, read cache, transient (bytes)",
        QUEUE,
        "queue_bytes",
    ),
    MetricSpec(
        "raymq_governor_consumer_direct_bytes",
        "A consumer's budget for direct references (bytes; node: the queue's)",
        CONSUMER,
        "direct",
    ),
    MetricSpec(
        "raymq_governor_consumer_pending_bytes",
        "A consumer's budget for its PendingCache (bytes; node: the queue's)",
        CONSUMER,
        "pending",
    ),
]

#: Exported by the broker actor from its ``HibernationStats``.
HIBERNATION_METRICS: list[MetricSpec] = [
    MetricSpec(
        "raymq_broker_active_queues",
        "Queue actors running on the node (the rest hibernate; cap: max_active_queues)",
        NODE,
        "active",
    ),
    MetricSpec(
        "raymq_broker_hibernated_queues",
        "Queues whose actor is not running (files kept; started again on the next call)",
        BROKER,
        "hibernated",
    ),
    MetricSpec(
        "raymq_broker_hibernations",
        "Queue hibernations since the broker actor started (count)",
        BROKER,
        "hibernations",
    ),
    MetricSpec(
        "raymq_broker_revivals",
        "Hibernated queues started again since the broker actor started (count)",
        BROKER,
        "revivals",
    ),
]

ALL_METRICS: list[MetricSpec] = [
    *QUEUE_METRICS,
    *CONSUMER_QUEUE_SIDE_METRICS,
    *CONSUMER_METRICS,
    *GOVERNOR_METRICS,
    *HIBERNATION_METRICS,
]
#: Every metric RayMQ exports, as ``ray.util.metrics`` names (Prometheus adds ``ray_``).
METRIC_NAMES: list[str] = [m.name for m in ALL_METRICS]
_BY_NAME: dict[str, MetricSpec] = {m.name: m for m in ALL_METRICS}

_gauges: dict[str, Any] = {}
_gauges_lock = threading.Lock()
_failures: dict[str, int] = {}  # exporter -> failures so far, to keep the log quiet


def _gauge(name: str) -> Any:
    """The process's ``ray.util.metrics.Gauge`` for ``name``, made on first use (Ray must
    be initialised in the process, as it is in an actor)."""
    g = _gauges.get(name)
    if g is None:
        from ray.util.metrics import Gauge

        with _gauges_lock:
            g = _gauges.get(name)
            if g is None:
                spec = _BY_NAME[name]
                g = Gauge(spec.name, spec.description, tag_keys=spec.tags)
                _gauges[name] = g
    return g


def _set(name: str, value: object, tags: dict[str, str]) -> None:
    """Set one gauge; None (a missing field) is skipped, bools count as 0/1."""
    if value is None:
        return
    if isinstance(value, bool):
        value = int(value)
    if not isinstance(value, (int, float)):
        return  # not a number (a future field of another type): nothing to plot
    _gauge(name).set(value, tags=tags)


def _field(source: object, field: str) -> object:
    """``field`` of a dataclass snapshot or a dict, None when absent."""
    if isinstance(source, Mapping):
        return source.get(field)
    return getattr(source, field, None)


def _export(specs: list[MetricSpec], source: object, tags: dict[str, str]) -> None:
    for spec in specs:
        _set(spec.name, _field(source, spec.field), tags)


def export_queue(stats: object, node_id: str, broker: str) -> None:
    """Set the ``raymq_queue_*`` gauges of one queue from a ``QueueStats`` snapshot (or its
    ``to_dict()``)."""
    tags = {"broker": broker, "queue": str(_field(stats, "name")), "node": node_id}
    _export(QUEUE_METRICS, stats, tags)


def export_queue_consumers(
    queue: str, consumers: Mapping[str, Mapping], node_id: str, broker: str
) -> None:
    """Set lag, held, delivered, ... of a queue's consumers from the queue side:
    ``consumers`` maps consumer id to ``QueueCore.consumer_stats(consumer_id)``;
    ``node_id`` is the queue's node."""
    for consumer_id, stats in consumers.items():
        if stats:  # {} for a consumer closed meanwhile
            tags = {"broker": broker, "queue": queue, "consumer": consumer_id, "node": node_id}
            _export(CONSUMER_QUEUE_SIDE_METRICS, stats, tags)


def export_consumer(
    consumer_id: str, queue: str, stats: Mapping, node_id: str, broker: str
) -> None:
    """Set one consumer's TargetList levels from ``TargetList.stats()``; ``node_id`` is the
    TargetList actor's node."""
    tags = {"broker": broker, "queue": queue, "consumer": consumer_id, "node": node_id}
    _export(CONSUMER_METRICS, stats, tags)


def export_governor(stats: Mapping, broker: str) -> None:
    """Set the ``raymq_governor_*`` gauges from ``MemoryGovernorActor.stats()``: the
    threshold, each node's part and total, each queue's share and split, each consumer's
    budget. Nothing before the first plan but the round count."""
    plan = stats.get("plan")
    whole = {"broker": broker}
    _set("raymq_governor_rounds", stats.get("rounds"), whole)
    _set("raymq_governor_round_seconds", stats.get("round_seconds"), whole)
    if not plan:
        return
    _set("raymq_governor_threshold_bytes", plan.get("threshold"), whole)
    for node, value in plan.get("node_thresholds", {}).items():
        _set("raymq_governor_node_threshold_bytes", value, {"broker": broker, "node": node})
    for node, value in plan.get("node_totals", {}).items():
        _set("raymq_governor_node_budgeted_bytes", value, {"broker": broker, "node": node})
    for name, q in plan.get("queues", {}).items():
        tags = {"broker": broker, "queue": name, "node": q.get("node_id", "")}
        _set("raymq_governor_queue_share_bytes", q.get("share"), tags)
        _set("raymq_governor_queue_index_bytes", q.get("index_bytes"), tags)
        _set("raymq_governor_queue_cache_bytes", q.get("queue_bytes"), tags)
        for consumer_id, value in q.get("direct", {}).items():
            _set("raymq_governor_consumer_direct_bytes", value, {**tags, "consumer": consumer_id})
        for consumer_id, value in q.get("pending", {}).items():
            _set("raymq_governor_consumer_pending_bytes", value, {**tags, "consumer": consumer_id})


def export_hibernation(stats: object, broker: str) -> None:
    """Set the ``raymq_broker_*`` gauges from the broker actor's ``HibernationStats``:
    running queue actors per node, hibernated queues, hibernations and revivals."""
    whole = {"broker": broker}
    for node, count in (_field(stats, "active_per_node") or {}).items():
        _set("raymq_broker_active_queues", count, {"broker": broker, "node": node})
    _set("raymq_broker_hibernated_queues", len(_field(stats, "hibernated") or ()), whole)
    _set("raymq_broker_hibernations", _field(stats, "hibernations"), whole)
    _set("raymq_broker_revivals", _field(stats, "revivals"), whole)


def broker_of(actor_name: str, actor_id: str) -> str:
    """The broker (Ray namespace) of the named actor whose id is ``actor_id`` (hex).

    A broker's actors live in its namespace, but ``get_runtime_context().namespace`` in an
    actor is the namespace of the job that created it, which differs when the application
    called ``ray.init`` itself with another one. So the actor is looked for by name in
    every namespace; if it is not found, the job's namespace stands in. Blocking (two GCS
    calls or so): call it once, off the event loop.
    """
    import ray

    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("name") != actor_name:
            continue
        try:
            handle = ray.get_actor(actor_name, namespace=entry["namespace"])
        except ValueError:  # gone meanwhile
            continue
        if handle._actor_id.hex() == actor_id:
            return entry["namespace"]
    return ray.get_runtime_context().namespace


@contextlib.contextmanager
def guard(what: str) -> Iterator[None]:
    """Log and swallow any ``Exception`` of a metrics export, so that metrics never break
    the actor exporting them (``asyncio.CancelledError`` and the like still propagate).
    ``what`` names the exporter in the log."""
    try:
        yield
    except Exception as exc:
        n = _failures.get(what, 0) + 1
        _failures[what] = n
        if n == 1:
            log.warning("metrics export for %s failed", what, exc_info=exc)
        elif n % LOG_EVERY == 0:
            log.warning("metrics export for %s failed %d times: %r", what, n, exc)


__all__ = [
    "ALL_METRICS",
    "EXPORT_PERIOD_SECONDS",
    "METRIC_NAMES",
    "MetricSpec",
    "broker_of",
    "export_consumer",
    "export_governor",
    "export_hibernation",
    "export_queue",
    "export_queue_consumers",
    "guard",
]
