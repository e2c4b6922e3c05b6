"""The read cache: records read back from segment files, least recently used first out."""

from __future__ import annotations

from collections import OrderedDict

from raymq.batch import MessageBatch


class ReadCache:
    """Decoded records keyed by (segment base offset, record index), within a byte limit."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._records: OrderedDict[tuple[int, int], MessageBatch] = OrderedDict()
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[int, int]) -> MessageBatch | None:
        """The cached record, marked recently used; counts a hit or a miss."""
        rec = self._records.get(key)
        if rec is None:
            self.misses += 1
            return None
        self._records.move_to_end(key)
        self.hits += 1
        return rec

    def peek(self, key: tuple[int, int]) -> MessageBatch | None:
        """The cached record, if any, changing nothing."""
        return self._records.get(key)

    def put(self, key: tuple[int, int], rec: MessageBatch) -> None:
        """Cache a record, evicting the least recently used beyond the limit (the newest
        one always stays)."""
        self._records[key] = rec
        self.used_bytes += rec.nbytes
        while self.used_bytes > self.limit_bytes and len(self._records) > 1:
            self.used_bytes -= self._records.popitem(last=False)[1].nbytes

    def resize(self, limit_bytes: int) -> None:
        """Change the limit (bytes), evicting the least recently used beyond it."""
        self.limit_bytes = max(0, limit_bytes)
        while self.used_bytes > self.limit_bytes and self._records:
            self.used_bytes -= self._records.popitem(last=False)[1].nbytes

    def drop_segment(self, base_offset: int) -> None:
        """Forget every record of the segment at ``base_offset`` (deleted)."""
        for key in [k for k in self._records if k[0] == base_offset]:
            self.used_bytes -= self._records.pop(key).nbytes
