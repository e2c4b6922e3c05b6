"""TargetList: one consumer's direct references, its watermark and its PendingCache.

Entries up to the watermark are *direct references*: object-store references to
delivery batches the queue has already given this consumer (held against its
prefetch). Beyond the watermark the consumer's matching messages are CacheReferences
kept by the queue's TargetArea (an ``OffsetSet``: one bit per message, each offset
naming its segment and position). The eager loader (in the TargetList actor) raises the
watermark toward the high watermark, first from the PendingCache, then from the queue.
When the high watermark drops, direct entries above it move to the PendingCache; what
does not fit there is given back to the queue (as never received).

Plain Python, no Ray: references are opaque objects here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class DirectEntry:
    """Rows ``start:`` of one delivery batch held through a reference."""

    ref: object
    offsets: np.ndarray  # offset of every row, in row order
    nbytes: int  # bytes of the whole batch
    start: int = 0  # first row not yet handed out

    @property
    def remaining(self) -> int:
        """Rows not yet handed out."""
        return len(self.offsets) - self.start

    @property
    def remaining_bytes(self) -> int:
        """Approximate bytes of the rows not yet handed out."""
        return self.nbytes * self.remaining // max(len(self.offsets), 1)


def _messages(entries) -> int:
    return sum(e.remaining for e in entries)


def _bytes(entries) -> int:
    return sum(e.remaining_bytes for e in entries)


class TargetList:
    """Watermark accounting of one consumer (messages and bytes)."""

    def __init__(self, high_watermark: int, high_watermark_bytes: int, pending_cache_bytes: int):
        self.high_watermark = high_watermark
        #: The consumer's own caps (bytes); the MemoryGovernor's budget may lower them.
        self.max_high_watermark_bytes = high_watermark_bytes
        self.max_pending_cache_bytes = pending_cache_bytes
        self.budget: tuple[int, int] | None = None  # (direct, pending) from the governor
        self.high_watermark_bytes = high_watermark_bytes
        self.pending_cache_bytes = pending_cache_bytes
        self.direct: deque[DirectEntry] = deque()
        self.pending: deque[DirectEntry] = deque()  # the PendingCache
        self.pending_hits = 0
        self.pending_misses = 0  # loads from the QueueArea
        self.message_bytes = 0.0  # running average size of a delivered message (bytes)
        self.handed_out = 0

    # -- levels ------------------------------------------------------------------------

    @property
    def watermark(self) -> int:
        """Messages held as direct references, not yet handed to the application."""
        return _messages(self.direct)

    @property
    def direct_bytes(self) -> int:
        """Bytes of those messages."""
        return _bytes(self.direct)

    @property
    def pending_messages(self) -> int:
        """Messages in the PendingCache."""
        return _messages(self.pending)

    @property
    def pending_bytes(self) -> int:
        """Bytes in the PendingCache."""
        return _bytes(self.pending)

    def room(self) -> int:
        """Messages the eager loader may add below the high watermark (0 when full).

        An empty TargetList may always load one batch, however small its byte budget:
        a consumer is never starved by the governor, only kept shallow.
        """
        if self.direct and self.direct_bytes >= self.high_watermark_bytes:
            return 0
        return max(0, self.high_watermark - self.watermark)

    # -- loading -----------------------------------------------------------------------

    def load_from_pending(self) -> bool:
        """Move the oldest PendingCache entry up to the direct references (a hit)."""
        if not self.pending or self.room() <= 0:
            return False
        self.direct.append(self.pending.popleft())
        self.pending_hits += 1
        return True

    def loaded(self, entry: DirectEntry) -> None:
        """A batch came from the queue (a PendingCache miss)."""
        if len(entry.offsets):
            self.direct.append(entry)
            self.pending_misses += 1
            size = entry.nbytes / len(entry.offsets)
            self.message_bytes = (
                size if not self.message_bytes else 0.9 * self.message_bytes + 0.1 * size
            )

    # -- handing out -------------------------------------------------------------------

    def take(self, max_messages: int) -> list[tuple[object, int, int]]:
        """Hand out up to ``max_messages`` as (reference, first row, rows), in order."""
        out = []
        need = max_messages
        while need > 0 and self.direct:
            e = self.direct[0]
            n = min(need, e.remaining)
            out.append((e.ref, e.start, n))
            e.start += n
            need -= n
            if e.remaining == 0:
                self.direct.popleft()
        self.handed_out += max_messages - need
        return out

    # -- budgets -----------------------------------------------------------------------

    def set_high_watermark(self, messages: int, max_bytes: int) -> np.ndarray:
        """Lower or raise the high watermark; returns offsets to give back to the queue.

        Direct entries above the new high watermark move (newest first) to the
        PendingCache; what the PendingCache cannot hold is returned.
        """
        self.high_watermark, self.max_high_watermark_bytes = messages, max_bytes
        return self._apply_limits()

    def set_budget(self, direct_bytes: int, pending_bytes: int) -> np.ndarray:
        """Take the MemoryGovernor's budget (bytes of direct references and of the
        PendingCache); the consumer's own settings stay upper bounds. Returns offsets to
        give back to the queue, as ``set_high_watermark``."""
        self.budget = (max(0, direct_bytes), max(0, pending_bytes))
        return self._apply_limits()

    def usage(self) -> dict:
        """What the MemoryGovernor needs of this consumer (bytes). It wants direct
        references for ``high_watermark`` messages of the size seen so far, at most its
        ``high_watermark_bytes``: asking for the cap alone would starve the
        HeadQueueCache of memory the consumer never fills."""
        want = self.max_high_watermark_bytes
        if self.message_bytes:
            want = min(want, int(self.high_watermark * self.message_bytes * 1.25) + 1)
        return {
            "direct_bytes": self.direct_bytes,
            "pending_bytes": self.pending_bytes,
            "want_direct_bytes": want,
            "want_pending_bytes": self.max_pending_cache_bytes,
        }

    def _apply_limits(self) -> np.ndarray:
        """Set effective byte limits from settings and budget, evicting above them."""
        direct, pending = self.max_high_watermark_bytes, self.max_pending_cache_bytes
        if self.budget is not None:
            direct, pending = min(direct, self.budget[0]), min(pending, self.budget[1])
        self.high_watermark_bytes, self.pending_cache_bytes = direct, pending
        messages, max_bytes = self.high_watermark, direct
        while self.direct and (self.watermark > messages or self.direct_bytes > max_bytes):
            self.pending.appendleft(self.direct.pop())
        released = []
        while self.pending and self.pending_bytes > self.pending_cache_bytes:
            e = self.pending.pop()
            released.append(e.offsets[e.start :])
        return np.concatenate(released) if released else np.zeros(0, dtype=np.int64)

    def drain(self) -> np.ndarray:
        """Forget every entry not handed out; returns their offsets (for close)."""
        rest = [e.offsets[e.start :] for e in (*self.direct, *self.pending)]
        self.direct.clear()
        self.pending.clear()
        return np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)

    def stats(self) -> dict:
        """Levels and PendingCache counters (messages, bytes)."""
        return {
            "watermark": self.watermark,
            "high_watermark": self.high_watermark,
            "high_watermark_bytes": self.high_watermark_bytes,
            "direct_references": self.watermark,
            "direct_bytes": self.direct_bytes,
            "pending_cache_messages": self.pending_messages,
            "pending_cache_bytes": self.pending_bytes,
            "pending_cache_limit_bytes": self.pending_cache_bytes,
            "governor_budget": None if self.budget is None else list(self.budget),
            "pending_cache_hits": self.pending_hits,
            "pending_cache_misses": self.pending_misses,
            "handed_out": self.handed_out,
        }
