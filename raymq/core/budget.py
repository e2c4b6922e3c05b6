"""Memory budgets of the MemoryGovernor: one budget across nodes, queues and caches.

Plain arithmetic, no Ray: the governor gathers usage, calls ``BudgetPlanner.plan`` and
pushes the resulting budgets to the queue actors. All sizes are bytes (ints).

Vocabulary and rules:

* Qpid Broker-J "flow to disk": a broker-wide threshold (by default 75 % of the memory
  available for messages) is divided between queues in proportion to their current size
  (``size_bytes``, memory plus disk). Here each alive node has its own threshold, taken
  from its object store memory, and it is divided between the queues on that node.
* A guaranteed floor per queue (``floor_fraction`` of the node threshold, split evenly)
  so one huge queue cannot starve the others; idle queues get only the floor.
* A queue that delivered in the last period is also guaranteed its working set, up to an
  equal split (``working_set``): the slow-subscriber fix. Queues nobody takes from follow
  their size alone.
* Artemis ``max_size_bytes`` caps a queue's share; what it cannot use goes to the others.
* ActiveMQ linked caches: within a queue's share, indexes come first, then the consumers'
  direct references, then their PendingCaches, and the HeadQueueCache (with the read cache
  and transient messages) gets what is left, shrinking to zero under consumer demand.
* The queue actor's part (``QueueBudget.queue_bytes``) is split once more, by the queue
  itself, into its read cache and its HeadQueueCache or transient messages
  (``split_queue_bytes``): every split of the budget is in this module.

Usage travels as records: a queue actor reports a ``QueueUsage`` (``QueueCore.usage``),
a consumer's TargetList actor a ``ConsumerUsage`` (``TargetList.usage``).

Shares are computed exactly with ``Fraction`` (water-filling) and rounded down with a
largest-remainder pass, so rounding never pushes a total above its limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from raymq.errors import InvalidSetting

#: Default node threshold: this fraction of each node's object store memory (Qpid's 75 %).
DEFAULT_THRESHOLD_FRACTION = 0.75
#: Default part of a node's threshold reserved as guaranteed floors, split evenly between
#: the queues on that node.
DEFAULT_FLOOR_FRACTION = 0.25


def _is_int(value: object) -> bool:
    # bool is an int subclass; True bytes is always a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_bytes(what: str, value: object, error: type[ValueError] = ValueError) -> None:
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise error(f"{what}={value!r} must be an int >= 0 (bytes)")


def _check_fraction(setting: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or not 0 < value <= 1
    ):
        raise InvalidSetting(f"{setting}={value!r} must be a number in (0, 1]")
    return float(value)


@dataclass(frozen=True)
class ConsumerUsage:
    """What one consumer of a queue holds now and what its own settings let it hold.

    All fields but ``consumer_id`` are bytes: ``direct_bytes`` held now as direct
    references, ``pending_bytes`` in its PendingCache now, ``want_direct_bytes`` its
    ``high_watermark_bytes`` setting and ``want_pending_bytes`` its
    ``pending_cache_bytes`` setting. Raises ``ValueError`` for negative or non-int sizes
    (``InvalidSetting`` for the two settings).
    """

    consumer_id: str
    direct_bytes: int
    pending_bytes: int
    want_direct_bytes: int
    want_pending_bytes: int

    def __post_init__(self) -> None:
        _check_bytes("direct_bytes", self.direct_bytes)
        _check_bytes("pending_bytes", self.pending_bytes)
        _check_bytes("high_watermark_bytes", self.want_direct_bytes, InvalidSetting)
        _check_bytes("pending_cache_bytes", self.want_pending_bytes, InvalidSetting)


@dataclass(frozen=True)
class QueueUsage:
    """Usage of one queue as its actor reports it to the governor (all sizes in bytes).

    ``size_bytes`` counts unacknowledged messages in memory and on disk (Qpid's queue
    size, the weight of the proportional split); ``memory_bytes`` what the queue actor
    holds now; ``index_bytes`` its indexes and per-message metadata. ``active`` means it
    has consumers or had traffic in the last period; ``delivering`` that it delivered
    messages in the last period (its consumers keep taking). ``max_size_bytes`` > 0 caps the
    queue's share (Artemis per-queue limit); -1 (or any value <= 0) means no cap.
    ``consumers`` may be given as any iterable; it is stored as a tuple.
    ``transient_bytes`` is the most a non-durable queue held of its own messages over
    the last period: they are the queue's store, not a cache, and are budgeted before
    the caches (what does not fit flows to disk). ``shared_groups``: when deliveries
    are shared (an address's subscriptions), its consumers by subscription. Consumers
    of one subscription hold different messages; each subscription's hold references
    into the same shared batches as the others', so the groups are one copy, not one
    each.
    """

    name: str
    node_id: str
    size_bytes: int
    memory_bytes: int
    index_bytes: int
    active: bool
    max_size_bytes: int = -1
    consumers: tuple[ConsumerUsage, ...] = ()
    transient_bytes: int = 0
    delivering: bool = False
    shared_groups: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self) -> None:
        _check_bytes("size_bytes", self.size_bytes)
        _check_bytes("memory_bytes", self.memory_bytes)
        _check_bytes("index_bytes", self.index_bytes)
        _check_bytes("transient_bytes", self.transient_bytes)
        if not _is_int(self.max_size_bytes):
            raise InvalidSetting(f"max_size_bytes={self.max_size_bytes!r} must be an int")
        # Frozen: normalise a list to a tuple so the usage stays immutable and hashable.
        object.__setattr__(self, "consumers", tuple(self.consumers))
        object.__setattr__(self, "shared_groups", tuple(tuple(g) for g in self.shared_groups))
        ids = [c.consumer_id for c in self.consumers]
        if len(set(ids)) != len(ids):
            raise ValueError(f"queue {self.name!r} lists a consumer id twice: {ids!r}")

    def to_dict(self) -> dict[str, Any]:
        """The queue's own figures as plain strs, ints (bytes) and bools, for stats and
        JSON; its consumers are left out (the plan shows their budgets)."""
        return {
            "name": self.name,
            "node_id": self.node_id,
            "size_bytes": self.size_bytes,
            "memory_bytes": self.memory_bytes,
            "index_bytes": self.index_bytes,
            "transient_bytes": self.transient_bytes,
            "active": self.active,
            "delivering": self.delivering,
            "max_size_bytes": self.max_size_bytes,
            "shared_deliveries": bool(self.shared_groups),
        }


@dataclass(frozen=True)
class QueueBudget:
    """Memory one queue may hold, split into its linked caches (all values in bytes).

    ``share`` is the whole budget of the queue: indexes and all caches together.
    ``index_bytes`` is the part taken by indexes/metadata, ``direct`` and ``pending`` map
    consumer_id to its direct-reference (high watermark) and PendingCache allowances, and
    ``queue_bytes`` is what is left for the queue actor (HeadQueueCache, read cache and
    transient messages). ``index_bytes + sum(direct) + sum(pending) + queue_bytes <= share``.
    """

    name: str
    node_id: str
    share: int
    index_bytes: int
    direct: dict[str, int]
    pending: dict[str, int]
    queue_bytes: int

    def to_dict(self) -> dict[str, Any]:
        """This budget as plain dicts, strs and ints (bytes), for stats and JSON."""
        return {
            "name": self.name,
            "node_id": self.node_id,
            "share": self.share,
            "index_bytes": self.index_bytes,
            "direct": dict(self.direct),
            "pending": dict(self.pending),
            "queue_bytes": self.queue_bytes,
        }


@dataclass(frozen=True)
class Plan:
    """One planning round: node thresholds and per-queue budgets (bytes).

    ``threshold`` is the broker-wide flow-to-disk threshold in effect, the sum of the node
    thresholds (the configured threshold unless the alive nodes' stores together are
    smaller); ``node_thresholds`` maps each alive node to its
    budget; ``queues`` holds a ``QueueBudget`` per queue on an alive node (queues on
    unknown or dead nodes are absent).
    """

    threshold: int
    node_thresholds: dict[str, int]
    queues: dict[str, QueueBudget] = field(default_factory=dict)

    def node_total(self, node_id: str) -> int:
        """Sum of the shares (bytes) of the queues on ``node_id``; 0 for an unknown node."""
        return sum(b.share for b in self.queues.values() if b.node_id == node_id)

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain dicts, strs and ints (bytes), for stats and JSON."""
        return {
            "threshold": self.threshold,
            "node_thresholds": dict(self.node_thresholds),
            "node_totals": {n: self.node_total(n) for n in self.node_thresholds},
            "queues": {name: b.to_dict() for name, b in self.queues.items()},
        }


def _round_down(exact: Sequence[Fraction], total: int, keys: Sequence[str]) -> list[int]:
    """Round ``exact`` amounts to ints summing to at most ``total`` (bytes).

    Each amount is floored, then the bytes lost to flooring (up to ``total``) go one by
    one to the largest remainders, ties broken by key so plans are deterministic. An
    amount with a remainder is below the next int, so an int bound it respected still
    holds after +1.
    """
    ints = [math.floor(x) for x in exact]
    spare = min(total, math.floor(sum(exact, Fraction(0)))) - sum(ints)
    if spare > 0:
        order = sorted(
            (i for i, x in enumerate(exact) if x != ints[i]),
            key=lambda i: (-(exact[i] - ints[i]), keys[i]),
        )
        for i in order[:spare]:
            ints[i] += 1
    return ints


def water_fill(
    total: int,
    weights: Sequence[int],
    lows: Sequence[int],
    highs: Sequence[int | None],
    keys: Sequence[str],
) -> list[int]:
    """Split ``total`` bytes in proportion to ``weights`` within per-item bounds.

    Item ``i`` gets ``clamp(level * weights[i], lows[i], highs[i])`` with the one
    ``level`` at which the amounts sum to ``total`` (``highs[i]`` None = no cap): items
    whose proportional part falls below their low are fixed at it, items above their high
    at it, and the rest is re-split among the others. Items of weight 0 get their low.
    When even every item at its high cannot use ``total``, the rest stays unallocated;
    when the lows alone exceed ``total`` they are scaled down. Returns ints whose sum
    never exceeds ``total``; ``keys`` break rounding ties.
    """
    n = len(weights)
    lows_f = [Fraction(lo) for lo in lows]
    highs_f = [
        None if h is None else Fraction(max(h, lo)) for h, lo in zip(highs, lows, strict=True)
    ]
    low_sum = sum(lows_f, Fraction(0))
    if low_sum >= total:
        # Cannot happen with floor_fraction <= 1, but never give out more than total.
        scale = Fraction(total) / low_sum if low_sum else Fraction(0)
        return _round_down([lo * scale for lo in lows_f], total, keys)
    # Events of the sweep over the level: at lows[i]/w item i starts growing with slope w,
    # at highs[i]/w it stops. f(level) = const + level * slope between events.
    events: list[tuple[Fraction, int, int]] = []  # (level, 0=start/1=stop, item)
    for i in range(n):
        if weights[i] > 0:
            events.append((lows_f[i] / weights[i], 0, i))
            if highs_f[i] is not None:
                events.append((highs_f[i] / weights[i], 1, i))
    events.sort()
    const, slope, level = low_sum, 0, Fraction(0)
    found: Fraction | None = None
    for at, kind, i in events:
        if slope and const + at * slope >= total:
            found = (total - const) / slope
            break
        if kind == 0:
            const -= lows_f[i]
            slope += weights[i]
        else:
            slope -= weights[i]
            const += highs_f[i]  # type: ignore[operator]
        level = at
    if found is None:
        found = (total - const) / slope if slope else level
    exact = []
    for i in range(n):
        x = max(lows_f[i], found * weights[i])
        if highs_f[i] is not None:
            x = min(x, highs_f[i])
        exact.append(x)
    return _round_down(exact, total, keys)


def _proportional(total: int, wants: dict[str, int]) -> dict[str, int]:
    """Split ``min(total, sum(wants))`` bytes in proportion to ``wants``, each <= its want.

    Pure int arithmetic (floor, then largest remainder, ties by key): it runs for every
    queue in every round, where ``Fraction`` would be needlessly slow.
    """
    want_sum = sum(wants.values())
    if total >= want_sum:
        return dict(wants)  # every want fits
    out = {k: total * w // want_sum for k, w in wants.items()}
    spare = total - sum(out.values())
    # total < want_sum, so total * w / want_sum < w: +1 on a remainder keeps it <= w.
    order = sorted(wants, key=lambda k: (-(total * wants[k] % want_sum), k))
    for k in order[:spare]:
        out[k] += 1
    return out


#: Head-room on a working set: arrivals between two rounds, and the read cache's part.
WORKING_SET_SLACK = 2.0


def working_set(usage: QueueUsage) -> int:
    """Bytes a queue needs to serve from memory now, with ``WORKING_SET_SLACK``: its
    messages, indexes, its consumers' direct references at their high watermark and
    their PendingCaches."""
    need = (
        max(usage.size_bytes, usage.transient_bytes)
        + usage.index_bytes
        + sum(c.want_direct_bytes + c.pending_bytes for c in usage.consumers)
    )
    return int(need * WORKING_SET_SLACK)


def _split_consumers(
    consumers: list[ConsumerUsage], left: int
) -> tuple[dict[str, int], dict[str, int]]:
    """Direct references, then PendingCaches, of ``consumers`` out of ``left`` bytes
    (see ``split_share``)."""
    direct = _proportional(left, {c.consumer_id: c.want_direct_bytes for c in consumers})
    left -= sum(direct.values())
    pending = _proportional(
        left,
        {
            c.consumer_id: min(c.want_pending_bytes, c.pending_bytes + direct[c.consumer_id])
            for c in consumers
        },
    )
    return direct, pending


def split_share(usage: QueueUsage, share: int) -> QueueBudget:
    """Split one queue's ``share`` (bytes) into its linked caches, in priority order.

    Indexes/metadata first (they occupy memory whatever the budget says), then a
    non-durable queue's own messages (``transient_bytes``, with head-room), then the
    consumers' direct references up to their ``want_direct_bytes``, then their
    PendingCaches (each pool split in proportion to the wants), and the queue actor's
    HeadQueueCache gets what is left, down to zero.

    A PendingCache is linked to the HeadQueueCache as in ActiveMQ: it takes memory as
    it *grows*, so it is budgeted what it holds plus room for one more eviction of its
    direct references, at most ``want_pending_bytes``; its cap alone would take memory
    the queue needs for its own messages.

    With ``shared_groups`` (an address) each group (a subscription's consumers) is
    split as if it were alone, and only the largest group's charge is taken from the
    share: the groups' references point into the same shared batches. A group is
    charged what its consumers hold (twice), at most its budgets.
    """
    index = min(usage.index_bytes, share)
    left = share - index
    transient = min(left, int(usage.transient_bytes * WORKING_SET_SLACK))
    left -= transient
    by_id = {c.consumer_id: c for c in usage.consumers}
    groups = [[by_id[i] for i in g if i in by_id] for g in usage.shared_groups]
    grouped = {c.consumer_id for g in groups for c in g}
    groups.append([c for c in usage.consumers if c.consumer_id not in grouped])
    direct: dict[str, int] = {}
    pending: dict[str, int] = {}
    charged = 0
    for k, group in enumerate(groups):
        d, p = _split_consumers(group, left)
        direct.update(d)
        pending.update(p)
        budgeted = sum(d.values()) + sum(p.values())
        if k < len(usage.shared_groups):
            # References into shared batches cost memory of their own only once the
            # HeadQueueCache let go of those batches: a group is charged what it holds
            # (with slack), not what it may hold, so that when its consumers keep up
            # the cache keeps the memory. The next round sees what they took since.
            held = sum(c.direct_bytes + c.pending_bytes for c in group)
            budgeted = min(budgeted, int(held * WORKING_SET_SLACK))
        charged = max(charged, budgeted)
    left -= charged
    return QueueBudget(
        name=usage.name,
        node_id=usage.node_id,
        share=share,
        index_bytes=index,
        direct=direct,
        pending=pending,
        queue_bytes=transient + left,
    )


@dataclass(frozen=True)
class QueueMemory:
    """What a queue actor may hold in memory, by use (all values in bytes).

    ``read_cache_bytes`` for the log's read cache (records read back from segment files);
    ``head_cache_bytes`` for the HeadQueueCache of a durable queue (0 for a non-durable
    one); ``transient_bytes`` for a non-durable queue's own messages before they flow to
    disk (0 for a durable one). Their sum never exceeds what the queue was given.
    """

    read_cache_bytes: int
    head_cache_bytes: int
    transient_bytes: int


def split_queue_bytes(
    queue_bytes: int | None,
    *,
    durable: bool,
    read_cache_max_bytes: int,
    max_size_bytes: int,
    default_bytes: int,
    head_cache_want: int | None = None,
) -> QueueMemory:
    """Split a queue actor's part of its budget (``QueueBudget.queue_bytes``, bytes).

    The read cache gets at most a quarter of ``queue_bytes`` (an eighth for a non-durable
    queue, whose messages in memory matter more: it reads from files only what flowed)
    and at most ``read_cache_max_bytes`` (``page_max_cache_size`` pages); the
    HeadQueueCache (durable) or the transient messages (non-durable) get the rest.
    ``queue_bytes`` None means the governor has not spoken yet: the read cache gets
    ``read_cache_max_bytes`` and the rest ``default_bytes`` (the broker's
    ``head_cache_bytes``). ``max_size_bytes`` > 0 caps it all (Artemis: beyond it, the
    queue pages); <= 0 means no cap. ``head_cache_want`` (bytes, None: no bound) bounds
    the HeadQueueCache further (see ``head_cache_want``): the budget is an upper limit,
    not an amount to fill, and memory held beyond the consumers' reach only slows fills
    and restarts down. What it leaves unused stays unused (the next round's
    ``memory_bytes`` shows it).
    """
    cap = max_size_bytes if max_size_bytes > 0 else None
    if queue_bytes is None:
        read, rest = read_cache_max_bytes, default_bytes
        if cap is not None:
            read = min(read, cap // 4)
            rest = min(rest, cap - read)
    else:
        total = queue_bytes if cap is None else min(queue_bytes, cap)
        read = min(read_cache_max_bytes, total // (4 if durable else 8))
        rest = total - read
    head = rest if head_cache_want is None else min(rest, max(0, head_cache_want))
    return QueueMemory(
        read_cache_bytes=read,
        head_cache_bytes=head if durable else 0,
        transient_bytes=0 if durable else rest,
    )


def head_cache_want(prefetches: Iterable[int], message_bytes: float, margin_bytes: int) -> int:
    """Bytes a HeadQueueCache needs (bytes): the head its consumers can take at once
    (each one's ``prefetch``, in messages, at ``message_bytes`` each) plus
    ``margin_bytes`` (the broker's ``head_cache_bytes``: a first consumer's head, and
    arrivals between two rounds). ActiveMQ keeps the head a consumer's watermark can
    reach in memory and pages the rest; a deep backlog nobody will take soon is read
    from its segment files when it is wanted (the page cache keeps it warm)."""
    per_message = max(float(message_bytes), 1.0)
    return int(margin_bytes + sum(max(0, p) for p in prefetches) * per_message)


class PushedBudgets:
    """The (direct, pending) budgets last pushed to each consumer's TargetList, bytes.

    A round pushes a consumer's budget only when it differs from the one it took last:
    a TargetList never restarts (``max_restarts=0``), so what it took it keeps. With 16
    consumers, pushing every budget every second cost the governor about half its CPU
    and each idle TargetList a Ray call a second (measured)."""

    def __init__(self) -> None:
        self._pushed: dict[str, tuple[int, int]] = {}

    def due(self, consumer_id: str, budget: tuple[int, int]) -> bool:
        """True if ``budget`` is to be pushed to ``consumer_id`` (not its last one)."""
        return self._pushed.get(consumer_id) != budget

    def took(self, consumer_id: str, budget: tuple[int, int]) -> None:
        """``consumer_id``'s TargetList answered the push of ``budget``."""
        self._pushed[consumer_id] = budget

    def keep_only(self, consumer_ids: Iterable[str]) -> None:
        """Forget consumers not among ``consumer_ids`` (closed, or their queue's report
        is missing: they get their budget again once reported)."""
        live = set(consumer_ids)
        self._pushed = {c: b for c, b in self._pushed.items() if c in live}


class BudgetPlanner:
    """Computes node thresholds and per-queue memory budgets (bytes).

    ``threshold`` is the broker-wide flow-to-disk threshold in bytes, split between alive
    nodes in proportion to their object store memory (each capped at its own store); when
    None each node gets ``threshold_fraction`` of its own store. ``floor_fraction`` of
    each node threshold is reserved as guaranteed floors, split evenly between the queues
    on the node. Raises ``InvalidSetting`` for a threshold that is not a positive int or
    a fraction outside (0, 1].
    """

    def __init__(
        self,
        threshold: int | None = None,
        *,
        threshold_fraction: float = DEFAULT_THRESHOLD_FRACTION,
        floor_fraction: float = DEFAULT_FLOOR_FRACTION,
    ) -> None:
        if threshold is not None and (not _is_int(threshold) or threshold <= 0):
            raise InvalidSetting(
                f"flow_to_disk_threshold={threshold!r} must be a positive int (bytes) or None"
            )
        self.threshold = threshold
        self.threshold_fraction = _check_fraction("threshold_fraction", threshold_fraction)
        self.floor_fraction = _check_fraction("floor_fraction", floor_fraction)

    def node_thresholds(self, nodes: dict[str, int]) -> dict[str, int]:
        """Bytes budgeted on each alive node; ``nodes`` maps node_id -> object store bytes.

        With an explicit threshold a node leaving hands its part to the others (up to their
        own store size) and a node joining takes part of theirs. Raises ``ValueError`` for
        a negative or non-int store size.
        """
        for node_id, store in nodes.items():
            _check_bytes(f"object store memory of node {node_id!r}", store)
        if self.threshold is None:
            # min(): a float product must not round above the store itself.
            return {n: min(s, int(self.threshold_fraction * s)) for n, s in nodes.items()}
        keys = sorted(nodes)
        stores = [nodes[k] for k in keys]
        amounts = water_fill(self.threshold, stores, [0] * len(keys), stores, keys)
        return dict(zip(keys, amounts, strict=True))

    def plan(self, queues: Iterable[QueueUsage], nodes: dict[str, int]) -> Plan:
        """Budget every queue on an alive node; queues on other nodes are left out.

        Per node, the node threshold T is split between its queues in proportion to
        ``size_bytes``; each queue gets at least ``T * floor_fraction / n`` (n queues on
        the node) and one that is delivering at least its ``working_set`` up to ``T / n``,
        unless its ``max_size_bytes`` is lower; idle queues get only the floor;
        ``max_size_bytes`` caps a share and the rest goes to the others. A node's shares
        never sum above T. Raises ``ValueError`` for a queue name given twice.
        """
        thresholds = self.node_thresholds(nodes)
        by_node: dict[str, list[QueueUsage]] = {n: [] for n in thresholds}
        seen: set[str] = set()
        for q in queues:
            if q.name in seen:
                raise ValueError(f"queue {q.name!r} is listed twice")
            seen.add(q.name)
            if q.node_id in by_node:
                by_node[q.node_id].append(q)
        budgets: dict[str, QueueBudget] = {}
        for node_id, node_queues in by_node.items():
            if not node_queues:
                continue
            node_queues.sort(key=lambda q: q.name)  # deterministic rounding
            total = thresholds[node_id]
            # Exact floor, rounded down, so the floors together stay within the threshold.
            floor = math.floor(Fraction(self.floor_fraction) * total) // len(node_queues)
            fair = total // len(node_queues)
            weights, lows, highs = [], [], []
            for q in node_queues:
                cap = q.max_size_bytes if q.max_size_bytes > 0 else None
                low = floor
                if q.active and q.delivering:
                    # A queue whose consumers keep taking is also guaranteed its working
                    # set, up to an equal split: it holds little, and must keep it in
                    # memory however large a stopped neighbour grows (Artemis's
                    # slow-subscriber problem); proportional-to-size alone starves it.
                    # Queues nobody takes from now follow their size alone (Qpid).
                    low = max(floor, min(working_set(q), fair))
                low = low if cap is None else min(low, cap)
                weights.append(q.size_bytes if q.active else 0)
                lows.append(low)
                # An idle queue is held at its floor: the rest is reclaimed for active ones.
                highs.append(cap if q.active else low)
            shares = water_fill(total, weights, lows, highs, [q.name for q in node_queues])
            for q, share in zip(node_queues, shares, strict=True):
                budgets[q.name] = split_share(q, share)
        return Plan(
            # The threshold in effect: the configured one unless the alive stores are smaller.
            threshold=sum(thresholds.values()),
            node_thresholds=thresholds,
            queues=dict(sorted(budgets.items())),
        )
