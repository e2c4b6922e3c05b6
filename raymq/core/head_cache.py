"""HeadQueueCache: a memory-bounded FIFO of the oldest undelivered messages of a queue.

As in the ActiveMQ design it serves consumers arriving at a deep queue (and steady
dispatch, when consumers keep up) without reading the QueueArea. It covers one
contiguous offset range from the head; when full, newer batches are not added (the
newest are evicted first) and a refill from the log extends it once room returns.
"""

from __future__ import annotations

from collections import deque

from raymq.batch import MessageBatch


class HeadQueueCache:
    """Contiguous batches [start, end) from the queue's head, at most ``max_bytes``."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._batches: deque[MessageBatch] = deque()
        self.bytes = 0
        #: True when batches after ``end`` exist in the log but are not cached.
        self.behind = False
        self.hits = 0
        self.misses = 0

    @property
    def start(self) -> int:
        """First cached offset (-1 when empty)."""
        return self._batches[0].first_offset if self._batches else -1

    @property
    def end(self) -> int:
        """One past the last cached offset (-1 when empty)."""
        return self._batches[-1].end_offset if self._batches else -1

    @property
    def messages(self) -> int:
        """Messages cached."""
        return sum(len(b) for b in self._batches)

    def append(self, batch: MessageBatch) -> bool:
        """Cache a newly published batch if it continues the range and fits."""
        contiguous = not self._batches or batch.first_offset == self.end
        if self.behind or not contiguous or self.bytes + batch.nbytes > self.max_bytes:
            if self._batches or self.bytes + batch.nbytes > self.max_bytes:
                self.behind = True
            return False
        self._batches.append(batch)
        self.bytes += batch.nbytes
        return True

    def trim(self, head: int) -> None:
        """Drop batches wholly below ``head`` (delivered or acknowledged)."""
        while self._batches and self._batches[0].end_offset <= head:
            self.bytes -= self._batches.popleft().nbytes

    def resize(self, max_bytes: int) -> None:
        """Change the budget (bytes); evicts the newest batches until it fits."""
        self.max_bytes = max_bytes
        while self._batches and self.bytes > max_bytes:
            self.bytes -= self._batches.pop().nbytes
            self.behind = True

    def get(self, start: int, end: int) -> list[MessageBatch] | None:
        """Batches covering exactly [start, end) if all cached, else None (a miss)."""
        if not self._batches or start < self.start or end > self.end:
            self.misses += 1
            return None
        out = []
        for b in self._batches:
            if b.end_offset <= start:
                continue
            if b.first_offset >= end:
                break
            lo, hi = max(start, b.first_offset), min(end, b.end_offset)
            out.append(b.slice(lo - b.first_offset, hi - b.first_offset))
        self.hits += 1
        return out

    def refill(self, read, head: int, log_end: int) -> None:
        """Extend the cache with ``read(start, end)`` batches from the log while it has room.

        ``head`` is where the cache should start when empty; ``log_end`` the log's end.
        """
        if not self._batches:
            self.behind = head < log_end
            pos = head
        else:
            pos = self.end
        while self.behind and pos < log_end and self.bytes < self.max_bytes:
            chunk_end = min(log_end, pos + 4096)
            for b in read(pos, chunk_end):
                if self.bytes + b.nbytes > self.max_bytes:
                    return
                if self._batches and b.first_offset != self.end:
                    return  # a gap (acked or damaged records): the range must stay contiguous
                self._batches.append(b)
                self.bytes += b.nbytes
            pos = chunk_end
        if pos >= log_end:
            self.behind = False
