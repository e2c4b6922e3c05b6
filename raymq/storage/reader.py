"""Reading messages back: from memory, the read cache or the segment files.

A record that fails its checks is quarantined (``damage.Quarantine``) and skipped: the
caller gets every other message of the range, never the internal ``CorruptRecord``. A
file that cannot be read raises ``StorageError`` naming it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from raymq.batch import MessageBatch
from raymq.storage.damage import Quarantine
from raymq.storage.files import storage_error
from raymq.storage.read_cache import ReadCache
from raymq.storage.record import CorruptRecord
from raymq.storage.segment import Segment, Segments


class Reader:
    """Reads offset ranges of the live segments, whole records or properties only."""

    def __init__(self, queue: str, segments: Segments, cache: ReadCache, quarantine: Quarantine):
        self.queue = queue
        self.segments = segments
        self.cache = cache
        self.quarantine = quarantine

    def read(self, start: int, end: int, *, cache: bool = True) -> list[MessageBatch]:
        """Messages of offsets [start, end), all published, as batches in offset order.

        Offsets in gaps (deleted segments, damaged records) are skipped. ``cache`` False
        reads around the read cache (uses it, never fills it): for a reader that keeps
        what it reads itself (the HeadQueueCache), so no message is in both.
        """
        return self._collect(start, end, self._record if cache else self._record_uncached)

    def properties(self, start: int, end: int) -> list[MessageBatch]:
        """Like ``read`` but with empty bodies: timestamps and properties only.

        For a durable queue the bodies are not read from disk (unless cached already).
        """
        return self._collect(start, end, self._record_properties)

    def confirm(self, offsets: np.ndarray) -> np.ndarray:
        """Which of sorted ``offsets`` are in records that pass every check, for a
        decision taken on their properties alone (read without the payload CRC): each
        record on disk not in the read cache is read whole once and checked; one that
        fails is quarantined. Offsets in no live record are not confirmed."""
        ok = np.zeros(len(offsets), dtype=np.bool_)
        i = 0
        while i < len(offsets):
            offset = int(offsets[i])
            seg = self.segments.holding(offset)
            k = -1 if seg is None else seg.record_index(offset)
            if k < 0:
                i += 1
                continue
            end = seg.record_offsets(k)[1]
            j = i + int(np.searchsorted(offsets[i:], end))
            ok[i:j] = self._record_passes(seg, k)
            i = j
        return ok

    def _record_passes(self, seg: Segment, k: int) -> bool:
        if seg.is_damaged(k):
            return False
        if seg.fd is None or self.cache.peek((seg.base_offset, k)) is not None:
            return True  # in memory: written or read checked
        try:
            seg.verify_record(k)
        except CorruptRecord as exc:
            self.quarantine.take_out(seg, k, str(exc))
            return False
        except OSError as exc:
            raise storage_error(self.queue, "reading", seg.path, exc) from exc
        return True

    def _collect(
        self, start: int, end: int, reader: Callable[[Segment, int], MessageBatch | None]
    ) -> list[MessageBatch]:
        out: list[MessageBatch] = []
        i = self.segments.index_at(start)
        for seg in self.segments[i:]:
            if seg.base_offset >= end:
                break
            if seg.end_offset <= start:
                continue
            k = max(0, seg.record_index(start))
            damaged = seg.damaged_records
            while k < len(seg.firsts) and seg.firsts[k] < end:
                if damaged and k in damaged:
                    k += 1
                    continue
                try:
                    rec = reader(seg, k)
                except CorruptRecord as exc:
                    self.quarantine.take_out(seg, k, str(exc))
                    rec = None
                except OSError as exc:
                    raise storage_error(self.queue, "reading", seg.path, exc) from exc
                if rec is None:  # quarantined, or a transient record freed (all acked)
                    k += 1
                    continue
                lo, hi = max(start, rec.first_offset), min(end, rec.end_offset)
                if hi > lo:
                    out.append(rec.slice(lo - rec.first_offset, hi - rec.first_offset))
                k += 1
        return out

    def _record_properties(self, seg: Segment, k: int) -> MessageBatch | None:
        if seg.fd is None:
            return seg.batches[k]
        rec = self.cache.peek((seg.base_offset, k))
        return rec if rec is not None else seg.read_properties(k)

    def _record_uncached(self, seg: Segment, k: int) -> MessageBatch | None:
        if seg.fd is None:
            return seg.batches[k]
        rec = self.cache.peek((seg.base_offset, k))
        return rec if rec is not None else seg.read_record(k)

    def _record(self, seg: Segment, k: int) -> MessageBatch | None:
        if seg.fd is None:
            return seg.batches[k]
        key = (seg.base_offset, k)
        rec = self.cache.get(key)
        if rec is not None:
            return rec
        rec = seg.read_record(k)
        if rec is None:
            return None
        self.cache.put(key, rec)
        return rec
